"""The FP8 weight gradients' operands as the sm90 kernel reads them
(`blockwise_contract_kernel.py`): K-major copies of the row-major block-scaled lhs (m, a)
and rhs (m, b), in which each group of 128 rows has 128 rows of its own.

Padded row p holds row `quantization.ragged.padded_sources`[p] (each group's 128 rows, in
order, gathered); the rows a partial group leaves are zeros, which add nothing to any sum. Each
expert's padded size is its size rounded up to 128, so its k-tiles are its groups and the
scales the primitive was given index them as they are. Rows owned by no expert are
copied too, past every expert's rows, where no expert reads them.

One custom call per operand makes each copy (`k_major_copy_kernel.py`), not XLA's
gather and transpose, which XLA:GPU wrote as one loop whose threads read across rows: the
FP8 step on the kernel is timed against it in docs/fp8-kernels.md. The tests hold the
kernel to XLA's copy byte for byte.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_dsrelu import groups
from jax_dsrelu.kernels.sm90.arch import ARCH
from jax_dsrelu.kernels.sm90.config import BLOCK
from jax_dsrelu.quantization import ragged


def padded_rows(num_rows: int, num_experts: int) -> int:
    """R: 128 rows for each of the most groups m rows of E experts make."""
    return BLOCK * ragged.max_groups(num_rows, num_experts, BLOCK)


def k_major_operands(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> dict[str, jax.Array]:
    """{lhs_k_major (a, R), rhs_k_major (b, R), padded_sizes (E,) int32} for the kernel
    (m > 0 rows)."""
    first_rows, padded_sizes = _groups(group_sizes, lhs.shape[0])
    copy = functools.partial(copy_by_kernel, first_rows=first_rows, num_experts=group_sizes.shape[0])

    def k_major(x: jax.Array) -> jax.Array:
        # Moved as bytes.
        return lax.bitcast_convert_type(copy(lax.bitcast_convert_type(x, jnp.uint8)), x.dtype)

    return dict(lhs_k_major=k_major(lhs), rhs_k_major=k_major(rhs), padded_sizes=padded_sizes)


def quantized_k_major_operands(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> dict[str, jax.Array]:
    """`k_major_operands` of lhs (m, a) and rhs (m, b) unquantized (16- or 32-bit), with
    lhs_scale (G, a) and rhs_scale (G, b): each side quantized in the groups of
    `ragged.quantize_ragged_rows` straight into its copy by one custom call
    (`k_major_quantize_kernel.py`; m > 0 rows)."""
    first_rows, padded_sizes = _groups(group_sizes, lhs.shape[0])
    (lhs_k_major, lhs_scale), (rhs_k_major, rhs_scale) = (
        quantize_by_kernel(side, first_rows, group_sizes.shape[0]) for side in (lhs, rhs))
    return dict(lhs_k_major=lhs_k_major, rhs_k_major=rhs_k_major, padded_sizes=padded_sizes, lhs_scale=lhs_scale,
                rhs_scale=rhs_scale)


def _groups(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(first_rows (G + 1,) of the groups of 128 rows (`ragged.group_first_rows`), each
    expert's rows rounded up to whole groups (E,) int32)."""
    first_rows = ragged.group_first_rows(group_sizes, num_rows, BLOCK)
    sizes = groups.clamped_group_sizes(group_sizes, num_rows)
    return first_rows, (-(-sizes // BLOCK) * BLOCK).astype(jnp.int32)


@functools.cache
def copy_kernel(n: int, num_experts: int):
    """The copy's kernel for an operand of width n (`k_major_copy_kernel.py`)."""
    from jax_dsrelu.kernels.sm90.k_major_copy_kernel import KMajorCopySm90  # CuTe DSL: the 'gpu' extra

    return KMajorCopySm90(n, num_experts)


def _compile_key(kind: str, n: int, outputs_in_place: bool, *static):
    # E sizes only run-time extents: one object code serves every expert count.
    return (f"jax_dsrelu.sm90_k_major_{kind}", n, *static, outputs_in_place)


def _compile(kernel, key, outputs_in_place: bool, keep: bool):
    """A pass's object code (compiled now, or found in the cache); keep=True also returns
    its PTX and cubin."""
    from jax_dsrelu.kernels import operands as kernel_operands  # CuTe DSL: the 'gpu' extra

    return kernel_operands.compile_kernel(kernel, key, kernel.operands(), arch=ARCH, outputs_in_place=outputs_in_place,
                                          keep=keep)


def _call(kernel, key, given: dict[str, jax.Array], num_rows: int, in_place: bool) -> dict[str, jax.Array]:
    """One custom call of a pass over m = num_rows rows; with in_place, `given` holds its
    outputs too, which the kernel writes into."""
    from jax_dsrelu.kernels import operands as kernel_operands  # CuTe DSL: the 'gpu' extra

    return kernel_operands.call(kernel, key, kernel.operands(), given, {kernel_operands.ROWS: num_rows}, arch=ARCH,
                                outputs_in_place=in_place)


def compile_copy_kernel(n: int, num_experts: int, *, outputs_in_place: bool = False, keep: bool = False):
    """The copy's object code (`_compile`)."""
    return _compile(copy_kernel(n, num_experts), _compile_key("copy", n, outputs_in_place), outputs_in_place, keep)


def copy_by_kernel(values: jax.Array, first_rows: jax.Array, num_experts: int, filled: jax.Array | None = None):
    """The copy as one custom call from the groups' first rows (`ragged.group_first_rows`),
    for m > 0 rows of n > 0 a multiple of 16 bytes; with `filled` ((n, G, 128) uint8) the
    kernel writes into that buffer (the tests poison it first)."""
    num_rows, n = values.shape
    if num_rows == 0 or n == 0 or n % 16:
        raise ValueError(f"the K-major copy kernel takes m > 0 rows of n > 0 a multiple of 16 bytes, got "
                         f"values.shape={tuple(values.shape)}")
    in_place = filled is not None
    given = dict(values=values, first_rows=first_rows.astype(jnp.int32), **({"k_major": filled} if in_place else {}))
    out = _call(copy_kernel(n, num_experts), _compile_key("copy", n, in_place), given, num_rows, in_place)
    return out["k_major"].reshape(n, -1)


@functools.cache
def quantize_kernel(n: int, num_experts: int, dtype):
    """The quantizing copy's kernel for an operand of width n and dtype
    (`k_major_quantize_kernel.py`)."""
    from jax_dsrelu.kernels.sm90.k_major_quantize_kernel import KMajorQuantizeSm90  # CuTe DSL: the 'gpu' extra

    return KMajorQuantizeSm90(n, num_experts, dtype)


def compile_quantize_kernel(n: int, num_experts: int, dtype, *, outputs_in_place: bool = False, keep: bool = False):
    """The quantizing copy's object code (`_compile`)."""
    key = _compile_key("quantize", n, outputs_in_place, np.dtype(dtype).name)
    return _compile(quantize_kernel(n, num_experts, np.dtype(dtype)), key, outputs_in_place, keep)


def quantize_by_kernel(x: jax.Array, first_rows: jax.Array, num_experts: int,
                       filled: dict[str, jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """(k_major (n, G * 128) e4m3, scales (G, n) float32): x (m, n) quantized in the groups
    of rows `first_rows` starts (`ragged.group_first_rows`) and copied K-major, as
    `ragged.quantize_ragged_rows` and `copy_by_kernel` make them, in one custom call; for
    m > 0 rows of n a positive multiple of 16. The kernel trusts first_rows to be
    `group_first_rows`' answer (non-decreasing from 0, at most 128 rows a group): it reads
    rows first_rows[g] to min(first_rows[g + 1], m) of each group g. With `filled` ({"k_major": (n, G, 128),
    "scales": (G, n)}) the kernel writes into those buffers (the tests poison them first)."""
    num_rows, n = x.shape
    if num_rows == 0 or n % 16 or n == 0:
        raise ValueError(f"the K-major quantizer takes m > 0 rows of n a positive multiple of 16, got "
                         f"x.shape={tuple(x.shape)}")
    dtype, in_place = np.dtype(x.dtype), filled is not None
    given = dict(x=x, first_rows=first_rows.astype(jnp.int32), **(filled or {}))
    out = _call(quantize_kernel(n, num_experts, dtype), _compile_key("quantize", n, in_place, dtype.name), given,
                num_rows, in_place)
    return out["k_major"].reshape(n, -1), out["scales"]

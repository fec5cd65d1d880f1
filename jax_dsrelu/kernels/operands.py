"""A kernel's operands, declared once, and the custom call that follows from the declaration.

A kernel declares its operands in the order its host function takes them (the sm90
family's `GemmSm90.operands`, the sm100 adapter's `Sm100Call.operands`): each one's name,
role, dtype, shape as stored (the extents that vary from call to call marked `Rows`: with
the row count m, or with a count of its own such as the tokens T of a source whose rows
are read through a row index), and the mode order in which the kernel sees it. From that
one list come the host function's unpacking by name (`by_name`), the custom call's inputs,
outputs and aliases (`call_layout`), the compile descriptions (`compile_kernel`) and the
call (`call`); no other list has to agree with it by position.

A buffer that is one of the primitive's operands or results is not described twice: the
kernel names it, and its shape comes from the primitive's schema (`Declaration`: the
schema's dimension letters at the kernel's static sizes, the row letters varying). The
kernel adds only what is its own: the buffer's place among its host function's
arguments, its role, the dtype it stores, and the order in which it sees the axes. Its
workspaces (slots, padded offsets) are KernelOperands of its own.

Roles:
    input       read only
    accumulate  zero-filled by XLA, added into in place by the kernel (atomics, or
                partials in single-writer slots), returned (aliased in and out)
    output      written by the kernels, workspaces included: no initialisation needed
"""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsrelu.ffi import cutlass_bridge
from jax_dsrelu.ffi.cutlass_bridge import Operand

ROLES = ("input", "accumulate", "output")

# The run-time counts an extent may vary with: the problem's rows m (a GEMM's rows, the
# rows a gather-and-sum reads), and the rows of the sources that rows are gathered from
# (the tokens T of x; U of dy, where a call gathers both sides).
ROWS = "m"
SOURCE_ROWS = "t"
OTHER_SOURCE_ROWS = "u"


@dataclasses.dataclass(frozen=True)
class Rows:
    """An extent that varies from call to call, ceil(count / per) * times + plus of the
    run-time count `of` (m itself by default): compiled as a run-time extent, so a new
    count never recompiles."""

    per: int = 1
    plus: int = 0
    of: str = ROWS
    times: int = 1

    def extent(self, counts: Mapping[str, int]) -> int:
        try:
            count = counts[self.of]
        except KeyError:
            raise ValueError(f"an extent varies with the count {self.of!r}, which the call does not give: "
                             f"{dict(counts)}") from None
        return -(-count // self.per) * self.times + self.plus


M = Rows()
T = Rows(of=SOURCE_ROWS)
U = Rows(of=OTHER_SOURCE_ROWS)
# Every count at 1: how the compile describes the varying extents (every count shares the code).
_EVERY_COUNT_ONE = collections.defaultdict(lambda: 1)


@dataclasses.dataclass(frozen=True)
class KernelOperand:
    """One buffer of a kernel's host function.

    `shape` is the array's as stored (row-major), with `Rows` for the extents that vary
    with m; `mode` the order in which the kernel sees the stored axes (kernel mode i is
    stored axis mode[i]): a view, never a copy. None keeps the stored order."""

    name: str
    role: str
    dtype: np.dtype
    shape: tuple[int | Rows, ...]
    mode: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"operand {self.name!r}: role must be one of {ROLES}, got {self.role!r}")
        if self.mode is not None and sorted(self.mode) != list(range(len(self.shape))):
            raise ValueError(f"operand {self.name!r}: mode must order the axes of shape {self.shape}, got {self.mode}")
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def operand(self) -> Operand:
        """How the bridge compiles and passes it: the varying extents at divisibility 1."""
        varying = tuple(axis for axis, extent in enumerate(self.shape) if isinstance(extent, Rows))
        return Operand(self.dtype, len(self.shape), varying=varying, mode=self.mode)

    def shape_for(self, counts: int | Mapping[str, int]) -> tuple[int, ...]:
        """The stored shape at the run-time counts ({count name: value}, or m alone)."""
        counts = _counts(counts)
        return tuple(extent.extent(counts) if isinstance(extent, Rows) else extent for extent in self.shape)

    @property
    def contiguous_mode(self) -> int:
        """The kernel's mode along which the stored array is contiguous (its last axis)."""
        last = len(self.shape) - 1
        return last if self.mode is None else self.mode.index(last)


# The schema's letters that vary from call to call (`jax_dsrelu.primitive_schema`), as
# kernel extents.
_VARYING_LETTERS = {ROWS: M, SOURCE_ROWS: T, OTHER_SOURCE_ROWS: U}


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A primitive's buffers as one kernel stores them, each made from the primitive's
    schema: `schema` (a `jax_dsrelu.primitive_schema.Schema`), the call's static
    `params` (which buffers are present, a layout parameter, which operands are read
    through a row index) and the kernel's static `sizes` of the schema's other letters.

    declare(name, role, dtype, mode) is the buffer `name` with the schema's shape. A name
    the schema lacks, a buffer absent under `params`, or a role that is not the field's
    kind (operands are inputs; results are outputs, or accumulators) is refused."""

    schema: Any
    params: Mapping[str, Any]
    sizes: Mapping[str, int]

    def __call__(self, name: str, role: str, dtype, mode: tuple[int, ...] | None = None) -> KernelOperand:
        field = self.schema.field(name)
        if not field.present(self.params):
            raise ValueError(f"{self.schema.name}'s {name!r} is absent under {dict(self.params)} "
                             f"(present only with {field.present_if}=True)")
        is_result = self.schema.is_result(name)
        if (role == "input") == is_result:
            kind = "a result" if is_result else "an operand"
            raise ValueError(f"{self.schema.name}'s {name!r} is {kind}; a kernel cannot declare it as {role!r}")
        letters = field.letters(self.params)
        missing = [letter for letter in letters if letter not in _VARYING_LETTERS and letter not in self.sizes]
        if missing:
            raise ValueError(f"{self.schema.name}'s {name!r} has dimensions {letters}; the kernel gives no size "
                             f"for {missing} (sizes {dict(self.sizes)})")
        shape = tuple(_VARYING_LETTERS.get(letter) or self.sizes[letter] for letter in letters)
        return KernelOperand(name, role, dtype, shape, mode)


def declaration(schema, request, sizes: Mapping[str, int], **params: Any) -> Declaration:
    """The `Declaration` of `schema`'s buffers for a kernel serving `request`, whose
    fields are the call's static parameters under the names the schema reads
    (with_dbias, rhs_layout, block_scaled, ...); `params` adds those a request does not
    carry (with_<operand>_index for an operand a kernel variant gathers)."""
    fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
    return Declaration(schema, {**fields, **params}, sizes)


def by_name(plan: Sequence[KernelOperand], tensors, owner: str):
    """The host function's tensors (in `plan` order) as attributes named by the plan."""
    names = [o.name for o in plan]
    if len(tensors) != len(names):
        raise ValueError(f"{owner} takes {names}, got {len(tensors)} tensors")
    return types.SimpleNamespace(**dict(zip(names, tensors)))


def _counts(counts: int | Mapping[str, int]) -> Mapping[str, int]:
    return {ROWS: counts} if isinstance(counts, int) else counts


def call_layout(
    plan: Sequence[KernelOperand], outputs_in_place: bool
) -> tuple[list[KernelOperand], list[KernelOperand], dict[int, int]]:
    """(custom-call inputs, custom-call outputs, input -> output aliases) of a plan.

    Accumulate buffers, and with outputs_in_place every output, are inputs aliased to
    outputs. The plan lists every input and accumulate buffer before every output, so the
    host function receives the buffers in plan order either way."""
    inputs, outputs, aliases = [], [], {}
    for operand in plan:
        if operand.role != "output" or outputs_in_place:
            if operand.role != "input":
                aliases[len(inputs)] = len(outputs)
            inputs.append(operand)
        if operand.role != "input":
            outputs.append(operand)
    return inputs, outputs, aliases


def compile_kernel(
    host_function: Callable[..., None],
    key: Hashable,
    plan: Sequence[KernelOperand],
    *,
    arch: str,
    outputs_in_place: bool = False,
    keep: bool = False,
) -> cutlass_bridge.Compiled:
    """The object code of `host_function` for `plan` (compiled now, or found in the cache):
    the varying extents are described at every count 1, as every count shares the code."""
    inputs, outputs, aliases = call_layout(plan, outputs_in_place)
    return cutlass_bridge.compile_function(
        host_function, key, [(o.operand, o.shape_for(_EVERY_COUNT_ONE)) for o in inputs],
        [(o.operand, o.shape_for(_EVERY_COUNT_ONE)) for o in outputs], aliases, arch=arch, keep=keep,
    )


def call(
    host_function: Callable[..., None],
    key: Hashable,
    plan: Sequence[KernelOperand],
    given: Mapping[str, jax.Array],
    counts: int | Mapping[str, int],
    *,
    arch: str,
    outputs_in_place: bool = False,
) -> dict[str, jax.Array]:
    """One custom call of `host_function` on the arrays `given` by name; returns its
    outputs by name, shaped at the run-time `counts` ({count name: value}, or m alone).
    Accumulate buffers not given start at zero; with outputs_in_place, `given` holds
    every output too, pre-filled, which the kernels update in place. Each array given
    must have its buffer's declared shape and dtype: a buffer bound to the wrong array
    is refused here, when the call is traced."""
    inputs, outputs, aliases = call_layout(plan, outputs_in_place)
    missing = [o.name for o in inputs if o.name not in given and o.role != "accumulate"]
    if missing:
        raise ValueError(f"the kernel's call needs {missing}; got {sorted(given)}")
    for o in inputs:
        if o.name in given:
            check_bound(o, given[o.name], counts)
    arrays = [
        given[o.name] if o.name in given else jnp.zeros(o.shape_for(counts), o.dtype) for o in inputs
    ]
    results = cutlass_bridge.call(
        host_function, key, [(o.operand, array) for o, array in zip(inputs, arrays)],
        [(o.operand, jax.ShapeDtypeStruct(o.shape_for(counts), o.dtype)) for o in outputs], aliases, arch=arch,
    )
    return {o.name: result for o, result in zip(outputs, results)}


def check_bound(operand: KernelOperand, array, counts: int | Mapping[str, int]) -> None:
    """Refuses an array (or aval) whose shape or dtype is not the buffer's declaration at
    the run-time `counts`."""
    expected = (operand.shape_for(counts), operand.dtype)
    seen = (tuple(array.shape), np.dtype(array.dtype))
    if seen != expected:
        raise ValueError(f"kernel buffer {operand.name!r} is declared {expected[0]} {expected[1].name}, "
                         f"but is bound to an array of shape {seen[0]} and dtype {seen[1].name}")


def source_rows(source, num_rows: int, name: str) -> int:
    """The rows of a source read through a row index of `num_rows` entries; refuses an
    empty source, from which no row can be read (as the primitives' own gather does)."""
    if source.shape[0] == 0:
        raise ValueError(f"{name} is read through a row index of {num_rows} rows, but has no rows: "
                         f"{name}.shape={tuple(source.shape)}")
    return source.shape[0]

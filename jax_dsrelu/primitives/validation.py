"""Trace-time checks of the grouped GEMMs' operands and options, and the helpers every
layer's checks are made of (`require_array` first of all).

Each error names the argument, the value seen and what was expected. Values that only
exist at run time (group sizes) are not checked here: see `jax_dsrelu.groups` for how
they are made safe, and `jax_dsrelu.ops.checks` for an opt-in runtime check. The MoE
layer's options and weights are checked beside it, in `jax_dsrelu.moe`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_dsrelu.quantization import mx
from jax_dsrelu.quantization.schema import FP8_BLOCKWISE, Recipe
from jax_dsrelu.kernels.registry import BACKEND_NAMES

# The floating dtypes of every operand, result and option that is not an MXFP8 operand.
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _names(dtypes) -> str:
    return ", ".join(np.dtype(d).name for d in dtypes)


def require_array(name: str, value: Any, layout: str | None = None) -> None:
    """The first check of every array argument of the public functions: a JAX or NumPy
    array (or a tracer of one), of a real dtype. A list, a Python scalar or None is refused
    here with its type, before anything reads its shape; so is a complex array, which no
    function of the library computes with (a cast to float32 would drop its imaginary
    part without a word). `layout`, e.g. "(m, d)", says what was expected."""
    expected = "" if layout is None else f": {name} is {layout}"
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        if isinstance(value, (list, tuple)):
            seen = f"{type(value).__name__} (wrap it in jnp.asarray)"
        elif isinstance(value, (bool, int, float, complex, np.generic)):
            seen = f"{type(value).__name__} {value!r}"
        else:
            seen = type(value).__name__
        raise TypeError(f"{name} must be a JAX or NumPy array, got {seen}{expected}")
    if _is_complex(value.dtype):
        raise TypeError(
            f"{name}.dtype must be a real type (complex numbers are not supported), "
            f"got {name}.dtype={np.dtype(value.dtype).name}{expected}"
        )


def _is_complex(dtype: Any) -> bool:
    try:
        return jnp.issubdtype(dtype, jnp.complexfloating)
    except TypeError:  # a dtype NumPy does not know (a torch tensor's): left to its conversion
        return False


def together(first: str, first_value: Any, second: str, second_value: Any) -> bool:
    """Whether both of two operands that come together (a pair of scales) are given; a
    ValueError naming them when only one is."""
    if (first_value is None) != (second_value is None):
        state = lambda value: "None" if value is None else "given"  # noqa: E731
        raise ValueError(f"{first} and {second} come together or not at all, got {first} {state(first_value)} "
                         f"and {second} {state(second_value)}")
    return first_value is not None


def require_bool(name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool, got {value!r} ({type(value).__name__})")


def require_int(name: str, value: Any) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int, got {value!r} ({type(value).__name__})")


def require_rank(name: str, array: Any, rank: int, layout: str) -> None:
    shape = np.shape(array)
    if len(shape) != rank:
        raise ValueError(f"{name} must be {layout}, got {name}.shape={shape}")


def require_dtype(name: str, array: Any, allowed) -> None:
    dtype = np.dtype(array.dtype)
    if dtype not in [np.dtype(d) for d in allowed]:
        raise TypeError(f"{name}.dtype must be one of {_names(allowed)}, got {name}.dtype={dtype.name}")


def require_integer(name: str, array: Any) -> None:
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise TypeError(f"{name}.dtype must be an integer type (int32), got {name}.dtype={np.dtype(array.dtype).name}")


def require_dim(name: str, array: Any, axis: int, expected: int, meaning: str) -> None:
    actual = array.shape[axis]
    if actual != expected:
        raise ValueError(
            f"{name}.shape[{axis}] must equal {meaning}={expected}, got {name}.shape={tuple(array.shape)}"
        )


def require_layouts(*specs: tuple[str, Any, str], experts: str) -> None:
    """Checks arrays against their layouts, each given as (name, array, "(m, k)"): every
    array's rank first, then that the array named `experts` has at least one expert
    along axis 0, then that a dimension named in several layouts has one size. The first
    array that names a dimension sets its size, and a mismatch names that array's axis
    ("must equal grad.shape[1] (k)=64")."""
    for name, array, layout in specs:
        require_array(name, array, layout)
        require_rank(name, array, len(_dims(layout)), layout)
    require_experts(experts, dict((name, array) for name, array, _ in specs)[experts])
    sizes: dict[str, int] = {}
    origins: dict[str, str] = {}
    for name, array, layout in specs:
        for axis, dim in enumerate(_dims(layout)):
            if dim in sizes:
                require_dim(name, array, axis, sizes[dim], f"{origins[dim]} ({dim})")
            else:
                sizes[dim] = array.shape[axis]
                origins[dim] = f"{name}.shape[{axis}]"


def _dims(layout: str) -> list[str]:
    """The dimension names of a layout: "(E, n, k)" -> ["E", "n", "k"], "(m,)" -> ["m"]."""
    return [dim.strip() for dim in layout.strip("()").split(",") if dim.strip()]


def group_sizes_array(group_sizes: Any) -> Any:
    """group_sizes as a JAX array, so that lists and NumPy arrays work as in lax.ragged_dot."""
    try:
        return jnp.asarray(group_sizes)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"group_sizes must be an array-like of E integers, got {group_sizes!r} "
            f"({type(group_sizes).__name__})"
        ) from error


def require_experts(name: str, array: Any) -> None:
    """An expert axis of extent 0 has no rows to own and no weights to multiply by."""
    if array.shape[0] == 0:
        raise ValueError(
            f"{name}.shape[0] is the number of experts E and must be at least 1, "
            f"got {name}.shape={tuple(array.shape)}"
        )


def dtype_option(name: str, value: Any, allowed) -> np.dtype:
    """A dtype given as an option (not an array's), one of `allowed`."""
    try:
        dtype = np.dtype(value)
    except TypeError as error:
        raise TypeError(f"{name} must be one of {_names(allowed)}, got {value!r}") from error
    if dtype not in [np.dtype(d) for d in allowed]:
        raise TypeError(f"{name} must be one of {_names(allowed)}, got {dtype.name}")
    return dtype


def out_dtype(value: Any, name: str = "out_dtype") -> np.dtype:
    return dtype_option(name, value, FLOAT_DTYPES)


def check_grouped_gemm_dsrelu(
    grad, weight, preact, prob, group_sizes, alpha, grad_scale=None, weight_scale=None
) -> Any:
    """Raises on a bad call; returns group_sizes as a JAX array."""
    group_sizes = group_sizes_array(group_sizes)
    layouts = [("grad", grad, "(m, k)"), ("weight", weight, "(E, n, k)"), ("preact", preact, "(m, n)"),
               ("prob", prob, "(m,)"), ("group_sizes", group_sizes, "(E,)")]
    if alpha is not None:
        layouts.append(("alpha", alpha, "(E,)"))
    require_layouts(*layouts, experts="weight")

    if grad_scale is None and weight_scale is None:
        if np.dtype(grad.dtype) in mx.ELEMENT_DTYPES:
            raise TypeError(
                f"grad.dtype={np.dtype(grad.dtype).name} is an MXFP8 element type: pass grad_scale "
                f"(m, k/32) and weight_scale (E, n, k/32) as float8_e8m0fnu, e.g. from "
                f"jax_dsrelu.quantize_mx"
            )
        require_dtype("grad", grad, FLOAT_DTYPES)
    else:
        check_block_scales(grad, weight, grad_scale, weight_scale)
    if np.dtype(weight.dtype) != np.dtype(grad.dtype):
        raise TypeError(
            f"weight.dtype must equal grad.dtype={np.dtype(grad.dtype).name}, "
            f"got weight.dtype={np.dtype(weight.dtype).name}"
        )
    require_dtype("preact", preact, FLOAT_DTYPES)
    require_dtype("prob", prob, FLOAT_DTYPES)
    require_integer("group_sizes", group_sizes)
    if alpha is not None:
        require_dtype("alpha", alpha, FLOAT_DTYPES)
    return group_sizes


def check_block_scales(grad, weight, grad_scale, weight_scale) -> None:
    """MXFP8 operands: float8 grad/weight with one float8_e8m0fnu scale per 32 along k."""
    for name, scale, other in (
        ("grad_scale", grad_scale, "weight_scale"),
        ("weight_scale", weight_scale, "grad_scale"),
    ):
        if scale is None:
            raise ValueError(
                f"{name} and {other} go together: got {other} but {name}=None"
            )
    require_array("grad_scale", grad_scale, "(m, k/32)")
    require_array("weight_scale", weight_scale, "(E, n, k/32)")
    require_dtype("grad", grad, mx.ELEMENT_DTYPES)
    num_rows, k = grad.shape
    num_experts, n, _ = weight.shape
    if k % mx.BLOCK_SIZE:
        raise ValueError(
            f"grad.shape[1] (k) must be a multiple of the MX block size {mx.BLOCK_SIZE} for "
            f"block-scaled operands, got grad.shape={tuple(grad.shape)}"
        )
    require_rank("grad_scale", grad_scale, 2, "(m, k/32)")
    require_dim("grad_scale", grad_scale, 0, num_rows, "grad.shape[0] (m)")
    require_dim("grad_scale", grad_scale, 1, k // mx.BLOCK_SIZE, "k/32")
    require_rank("weight_scale", weight_scale, 3, "(E, n, k/32)")
    require_dim("weight_scale", weight_scale, 0, num_experts, "weight.shape[0] (E)")
    require_dim("weight_scale", weight_scale, 1, n, "weight.shape[1] (n)")
    require_dim("weight_scale", weight_scale, 2, k // mx.BLOCK_SIZE, "k/32")
    require_dtype("grad_scale", grad_scale, (mx.SCALE_DTYPE,))
    require_dtype("weight_scale", weight_scale, (mx.SCALE_DTYPE,))


# The recipes the expert MLP runs (its `precision`), beside None: the operands' own dtype.
PRECISIONS = (FP8_BLOCKWISE,)


def precision(value: Any) -> Recipe | None:
    """The expert MLP's precision option: None, or one of PRECISIONS."""
    expected = "None or " + " or ".join(f"jax_dsrelu.quantization.{recipe.name}" for recipe in PRECISIONS)
    if value is None:
        return None
    if not isinstance(value, Recipe):
        raise TypeError(f"precision must be {expected} (a Recipe), got {value!r} ({type(value).__name__})")
    if value not in PRECISIONS:
        raise ValueError(
            f"precision must be {expected}, the recipes the experts run so far, got the recipe {value.name!r}"
        )
    return value


def backend_name(value: Any) -> str:
    if value not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKEND_NAMES))}, got {value!r}")
    return value

"""Trace-time checks of shapes, dtypes and options.

Each error names the argument, the value seen and what was expected. Values that only
exist at run time (group sizes) are not checked here: see `jax_dsrelu.groups` for how
they are made safe, and `jax_dsrelu.ops.checks` for an opt-in runtime check.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_dsrelu import mx
from jax_dsrelu.kernels.registry import BACKEND_NAMES

# The floating dtypes of every operand, result and option that is not an MXFP8 operand.
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# How a router's logits become scores (`route`'s `score`).
SCORES = ("softmax", "sigmoid")


def _names(dtypes) -> str:
    return ", ".join(np.dtype(d).name for d in dtypes)


def require_bool(name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool, got {value!r} ({type(value).__name__})")


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


def check_moe_mlp(x, w1, w2, prob, group_sizes, b1) -> Any:
    """Raises on a bad call; returns group_sizes as a JAX array."""
    group_sizes = group_sizes_array(group_sizes)
    layouts = [("x", x, "(m, d)"), ("w1", w1, "(E, d, f)"), ("w2", w2, "(E, f, d)"), ("prob", prob, "(m,)"),
               ("group_sizes", group_sizes, "(E,)")]
    if b1 is not None:
        layouts.append(("b1", b1, "(E, f)"))
    require_layouts(*layouts, experts="w1")
    require_dtype("x", x, FLOAT_DTYPES)
    for name, array in (("w1", w1), ("w2", w2)):
        if np.dtype(array.dtype) != np.dtype(x.dtype):
            raise TypeError(
                f"{name}.dtype must equal x.dtype={np.dtype(x.dtype).name}, "
                f"got {name}.dtype={np.dtype(array.dtype).name}"
            )
    require_dtype("prob", prob, FLOAT_DTYPES)
    require_integer("group_sizes", group_sizes)
    if b1 is not None:
        require_dtype("b1", b1, FLOAT_DTYPES)
    return group_sizes


def check_ragged_dot(lhs, rhs, group_sizes) -> Any:
    """Raises on a bad call; returns group_sizes as a JAX array."""
    group_sizes = group_sizes_array(group_sizes)
    require_layouts(("lhs", lhs, "(m, k)"), ("rhs", rhs, "(E, k, n)"), ("group_sizes", group_sizes, "(E,)"),
                    experts="rhs")
    require_dtype("lhs", lhs, FLOAT_DTYPES)
    if np.dtype(rhs.dtype) != np.dtype(lhs.dtype):
        raise TypeError(
            f"rhs.dtype must equal lhs.dtype={np.dtype(lhs.dtype).name}, "
            f"got rhs.dtype={np.dtype(rhs.dtype).name}"
        )
    require_integer("group_sizes", group_sizes)
    return group_sizes


def backend_name(value: Any) -> str:
    if value not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKEND_NAMES))}, got {value!r}")
    return value


def check_logits(logits) -> None:
    require_array("logits", logits)
    require_rank("logits", logits, 2, "(T, E)")
    require_dtype("logits", logits, FLOAT_DTYPES)
    if logits.shape[1] == 0:
        raise ValueError(f"logits must have at least one expert (T, E >= 1), got logits.shape={tuple(logits.shape)}")


def require_top_k(top_k: Any, num_experts: int) -> None:
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k must be a Python int, got {top_k!r} ({type(top_k).__name__})")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and the number of experts E={num_experts}, got top_k={top_k}")


def require_array(name: str, value: Any) -> None:
    """A JAX or NumPy array (or a tracer of one): what has a shape and a dtype."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise TypeError(
            f"{name} must be a JAX or NumPy array, got {type(value).__name__}"
            + ("" if value is None else " (wrap it in jnp.asarray)")
        )


def require_int(name: str, value: Any) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int, got {value!r} ({type(value).__name__})")


def check_routing(top_k, num_experts, score, expert_bias, num_groups, top_groups, normalize, scale) -> None:
    """The options of `route` (and of the layers that route), for E = num_experts."""
    require_top_k(top_k, num_experts)
    if score not in SCORES:
        raise ValueError(f"score must be {' or '.join(map(repr, SCORES))}, got {score!r}")
    require_bool("normalize", normalize)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a Python float, got {scale!r} ({type(scale).__name__})")
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite, got scale={scale!r}")
    require_int("num_groups", num_groups)
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"num_groups must be at least 1 and divide the number of experts E={num_experts}, "
            f"got num_groups={num_groups}"
        )
    if top_groups is not None:
        require_int("top_groups", top_groups)
        if not 1 <= top_groups <= num_groups:
            raise ValueError(
                f"top_groups must be None or between 1 and num_groups={num_groups}, got top_groups={top_groups}"
            )
        reachable = top_groups * (num_experts // num_groups)
        if top_k > reachable:
            raise ValueError(
                f"top_k must be at most the {reachable} experts that top_groups={top_groups} groups of "
                f"E/num_groups={num_experts // num_groups} hold, got top_k={top_k}"
            )
    if expert_bias is not None:
        require_array("expert_bias", expert_bias)
        if tuple(expert_bias.shape) != (num_experts,):
            raise ValueError(
                f"expert_bias must be (E,) with E={num_experts} experts, got expert_bias.shape={tuple(expert_bias.shape)}"
            )
        require_dtype("expert_bias", expert_bias, FLOAT_DTYPES)


def check_expert_bias_update(expert_bias, group_sizes, rate) -> None:
    require_array("expert_bias", expert_bias)
    require_array("group_sizes", group_sizes)
    require_rank("expert_bias", expert_bias, 1, "(E,)")
    require_dtype("expert_bias", expert_bias, FLOAT_DTYPES)
    require_rank("group_sizes", group_sizes, 1, "(E,)")
    require_integer("group_sizes", group_sizes)
    require_dim("group_sizes", group_sizes, 0, expert_bias.shape[0], "expert_bias.shape[0] (E)")
    # A traced rate (a schedule under jit) can only be checked for its shape and dtype.
    if isinstance(rate, (bool, np.bool_)) or not (
        isinstance(rate, (int, float, np.integer, np.floating))
        or (hasattr(rate, "shape") and rate.shape == () and jnp.issubdtype(rate.dtype, jnp.floating))
    ):
        raise TypeError(f"rate must be a float or a float scalar array, got {rate!r} ({type(rate).__name__})")
    if isinstance(rate, (int, float, np.integer, np.floating)) and not (np.isfinite(rate) and rate >= 0):
        raise ValueError(f"rate must be finite and >= 0, got {rate!r}")


def check_token_rows(name: str, array, expected_rows: int, meaning: str) -> None:
    require_array(name, array)
    require_rank(name, array, 2, "(rows, d)")
    require_dim(name, array, 0, expected_rows, meaning)


def check_moe_layer(x, router, w1, w2, b1, latent_in=None, latent_out=None, shared_w1=None, shared_w2=None) -> None:
    """The shapes of `moe_layer`, named as its docstring names them (l = d without latent)."""
    for name, array in (("x", x), ("router", router), ("w1", w1), ("w2", w2)):
        require_array(name, array)
    require_rank("x", x, 2, "(T, d)")
    require_rank("router", router, 2, "(d, E)")
    d = x.shape[1]
    require_dim("router", router, 0, d, "x.shape[1] (d)")
    latent, latent_name = d, "x.shape[1] (d)"
    if (latent_in is None) != (latent_out is None):
        given, missing = ("latent_in", "latent_out") if latent_out is None else ("latent_out", "latent_in")
        raise ValueError(f"latent_in and latent_out go together: got {given} but {missing}=None")
    if latent_in is not None:
        require_array("latent_in", latent_in)
        require_array("latent_out", latent_out)
        require_rank("latent_in", latent_in, 2, "(d, l)")
        require_rank("latent_out", latent_out, 2, "(l, d)")
        require_dim("latent_in", latent_in, 0, d, "x.shape[1] (d)")
        latent, latent_name = latent_in.shape[1], "latent_in.shape[1] (l)"
        require_dim("latent_out", latent_out, 0, latent, latent_name)
        require_dim("latent_out", latent_out, 1, d, "x.shape[1] (d)")
        require_dtype("latent_in", latent_in, FLOAT_DTYPES)
        require_dtype("latent_out", latent_out, FLOAT_DTYPES)
    width = "l" if latent_in is not None else "d"
    require_rank("w1", w1, 3, f"(E, {width}, f)")
    require_rank("w2", w2, 3, f"(E, f, {width})")
    num_experts, _, f = w1.shape
    require_dim("router", router, 1, num_experts, "w1.shape[0] (E)")
    require_dim("w1", w1, 1, latent, latent_name)
    require_dim("w2", w2, 0, num_experts, "w1.shape[0] (E)")
    require_dim("w2", w2, 1, f, "w1.shape[2] (f)")
    require_dim("w2", w2, 2, latent, latent_name)
    require_dtype("x", x, FLOAT_DTYPES)
    require_dtype("router", router, FLOAT_DTYPES)
    require_dtype("w1", w1, FLOAT_DTYPES)
    if np.dtype(w2.dtype) != np.dtype(w1.dtype):
        raise TypeError(
            f"w2.dtype must equal w1.dtype={np.dtype(w1.dtype).name}, got w2.dtype={np.dtype(w2.dtype).name}"
        )
    if b1 is not None:
        require_array("b1", b1)
        require_rank("b1", b1, 2, "(E, f)")
        require_dim("b1", b1, 0, num_experts, "w1.shape[0] (E)")
        require_dim("b1", b1, 1, f, "w1.shape[2] (f)")
        require_dtype("b1", b1, FLOAT_DTYPES)
    if (shared_w1 is None) != (shared_w2 is None):
        given, missing = ("shared_w1", "shared_w2") if shared_w2 is None else ("shared_w2", "shared_w1")
        raise ValueError(f"shared_w1 and shared_w2 go together: got {given} but {missing}=None")
    if shared_w1 is not None:
        require_array("shared_w1", shared_w1)
        require_array("shared_w2", shared_w2)
        require_rank("shared_w1", shared_w1, 2, "(d, fs)")
        require_rank("shared_w2", shared_w2, 2, "(fs, d)")
        require_dim("shared_w1", shared_w1, 0, d, "x.shape[1] (d)")
        require_dim("shared_w2", shared_w2, 0, shared_w1.shape[1], "shared_w1.shape[1] (fs)")
        require_dim("shared_w2", shared_w2, 1, d, "x.shape[1] (d)")
        require_dtype("shared_w1", shared_w1, FLOAT_DTYPES)
        if np.dtype(shared_w2.dtype) != np.dtype(shared_w1.dtype):
            raise TypeError(
                f"shared_w2.dtype must equal shared_w1.dtype={np.dtype(shared_w1.dtype).name}, "
                f"got shared_w2.dtype={np.dtype(shared_w2.dtype).name}"
            )

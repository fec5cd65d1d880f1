"""The `grouped_gemm_dsrelu` primitive: abstract evaluation, lowering per platform, batching.

Operands, in order: grad (m, k), weight (E, n, k), preact (m, n), prob (m,) float32,
group_sizes (E,) int32, alpha (E,) float32. Results, in order: dh, dprob, [dbias], [act],
amax, the bracketed ones only when asked for.

Every platform lowers "xla" (and "auto", off CUDA) through the reference. On CUDA the
backend is resolved when lowering, and a kernel backend's implementation is lowered in
its place: it emits one custom call that runs the kernel and, in deterministic mode, the
fixed-order reduction pass.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import batching, mlir

from jax_dsrelu import dispatch
from jax_dsrelu.reference import grouped_gemm_dsrelu_reference

grouped_gemm_dsrelu_p = jax.extend.core.Primitive("grouped_gemm_dsrelu")
grouped_gemm_dsrelu_p.multiple_results = True


def bind(
    grad: jax.Array,
    weight: jax.Array,
    preact: jax.Array,
    prob: jax.Array,
    group_sizes: jax.Array,
    alpha: jax.Array,
    *,
    with_dbias: bool,
    with_act: bool,
    out_dtype: np.dtype,
    deterministic: bool,
    backend: str,
) -> list[jax.Array]:
    return grouped_gemm_dsrelu_p.bind(
        grad,
        weight,
        preact,
        prob,
        group_sizes,
        alpha,
        with_dbias=with_dbias,
        with_act=with_act,
        out_dtype=np.dtype(out_dtype),
        deterministic=deterministic,
        backend=backend,
    )


def _abstract_eval(grad, weight, preact, prob, group_sizes, alpha, *, with_dbias, with_act, out_dtype, **_):
    num_rows, num_cols = preact.shape
    num_experts = weight.shape[0]
    results = [
        jax.core.ShapedArray((num_rows, num_cols), out_dtype),
        jax.core.ShapedArray((num_rows,), jnp.float32),
    ]
    if with_dbias:
        results.append(jax.core.ShapedArray((num_experts, num_cols), jnp.float32))
    if with_act:
        results.append(jax.core.ShapedArray((num_rows, num_cols), out_dtype))
    results.append(jax.core.ShapedArray((num_experts,), jnp.float32))
    return results


grouped_gemm_dsrelu_p.def_abstract_eval(_abstract_eval)


def _reference_impl(*operands, with_dbias, with_act, out_dtype, deterministic, backend):
    del deterministic, backend  # the reference is always deterministic
    return grouped_gemm_dsrelu_reference(
        *operands, with_dbias=with_dbias, with_act=with_act, out_dtype=out_dtype
    )


def _eager_impl(*operands, **params):
    # Outside jit, run the primitive as a one-equation computation so that eager calls
    # go through exactly the lowering a jitted call uses.
    return jax.jit(lambda *ops: grouped_gemm_dsrelu_p.bind(*ops, **params))(*operands)


grouped_gemm_dsrelu_p.def_impl(_eager_impl)

_lower_reference = mlir.lower_fun(_reference_impl, multiple_results=True)


def _lower_any_platform(ctx: mlir.LoweringRuleContext, *operands: Any, **params: Any) -> Sequence[Any]:
    if params["backend"] not in ("xla", "auto"):
        platforms = ", ".join(ctx.module_context.platforms)
        raise NotImplementedError(
            f"backend={params['backend']!r} runs only on CUDA GPUs, but this computation is "
            f"lowered for {platforms}. Use backend='xla' or 'auto' there."
        )
    return _lower_reference(ctx, *operands, **params)


def _lower_cuda(ctx: mlir.LoweringRuleContext, *operands: Any, **params: Any) -> Sequence[Any]:
    request = dispatch.request_from_avals(
        ctx.avals_in,
        out_dtype=params["out_dtype"],
        with_dbias=params["with_dbias"],
        with_act=params["with_act"],
        deterministic=params["deterministic"],
    )
    _, implementation = dispatch.cuda_implementation(params["backend"], request)
    if implementation is None:
        return _lower_reference(ctx, *operands, **params)
    return mlir.lower_fun(implementation, multiple_results=True)(ctx, *operands)


mlir.register_lowering(grouped_gemm_dsrelu_p, _lower_any_platform)
mlir.register_lowering(grouped_gemm_dsrelu_p, _lower_cuda, platform="cuda")


def _batch(batched_operands, batch_dims, **params):
    """vmap runs one grouped problem per batch element, in sequence.

    The experts of different batch elements cannot share one launch without a padding
    expert per element whose rows must still come out exactly 0, so a map is both the
    simple and the exact choice. Unbatched operands are closed over, not broadcast.
    """
    mapped = [
        jnp.moveaxis(operand, dim, 0)
        for operand, dim in zip(batched_operands, batch_dims)
        if dim is not None
    ]

    def one(slices):
        slices = iter(slices)
        operands = [
            operand if dim is None else next(slices)
            for operand, dim in zip(batched_operands, batch_dims)
        ]
        return tuple(grouped_gemm_dsrelu_p.bind(*operands, **params))

    results = lax.map(one, mapped)
    return list(results), [0] * len(results)


batching.primitive_batchers[grouped_gemm_dsrelu_p] = _batch

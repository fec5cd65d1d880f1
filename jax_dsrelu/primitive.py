"""The `grouped_gemm_dsrelu` primitive: abstract evaluation, lowering per platform, batching.

Operands, in order: grad (m, k), weight (E, n, k), preact (m, n), prob (m,) float32,
group_sizes (E,) int32, alpha (E,) float32, and for MXFP8 operands two more: grad_scale
(m, k/32) and weight_scale (E, n, k/32) float8_e8m0fnu. Results, in order: dh, dprob,
[dbias], [act], amax, the bracketed ones only when asked for.

Every platform lowers "xla" (and "auto", off CUDA) through the reference. On CUDA the
backend is resolved when lowering, and a kernel backend's implementation is lowered in
its place: it emits one custom call that runs the kernel and, in deterministic mode, the
fixed-order reduction pass. Either way the computation is wrapped for the SPMD
partitioner (`jax_dsrelu.sharding`), so sharded operands are not gathered.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import batching, mlir

from jax_dsrelu import backend_choice, jax_internals, sharding
from jax_dsrelu import request as request_facts
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
    grad_scale: jax.Array | None = None,
    weight_scale: jax.Array | None = None,
    *,
    with_dbias: bool,
    with_act: bool,
    out_dtype: np.dtype,
    deterministic: bool,
    backend: str,
) -> list[jax.Array]:
    scales = () if grad_scale is None else (grad_scale, weight_scale)
    return grouped_gemm_dsrelu_p.bind(
        grad,
        weight,
        preact,
        prob,
        group_sizes,
        alpha,
        *scales,
        with_dbias=with_dbias,
        with_act=with_act,
        out_dtype=np.dtype(out_dtype),
        deterministic=deterministic,
        backend=backend,
    )


def _abstract_eval(*operands, with_dbias, with_act, out_dtype, **_):
    num_rows, num_cols = operands[2].shape  # preact
    num_experts = operands[1].shape[0]  # weight

    def result(shape, dtype):
        return jax_internals.result_aval(shape, dtype, operands)

    results = [result((num_rows, num_cols), out_dtype), result((num_rows,), jnp.float32)]
    if with_dbias:
        results.append(result((num_experts, num_cols), jnp.float32))
    if with_act:
        results.append(result((num_rows, num_cols), out_dtype))
    results.append(result((num_experts,), jnp.float32))
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


def _local_implementation(platforms: Sequence[str], params: dict[str, Any]):
    """For operands of the given shapes on one device: the function computing the outputs."""

    def for_shapes(operand_avals):
        if "cuda" in platforms:
            request = request_facts.request_from_avals(
                operand_avals,
                block_scaled=len(operand_avals) > len(sharding.OPERAND_DIMS),
                out_dtype=params["out_dtype"],
                with_dbias=params["with_dbias"],
                with_act=params["with_act"],
                deterministic=params["deterministic"],
            )
            _, implementation = backend_choice.cuda_implementation(params["backend"], request)
            if implementation is not None:
                return implementation
        elif params["backend"] not in ("xla", "auto"):
            raise NotImplementedError(
                f"backend={params['backend']!r} runs only on CUDA GPUs, but this computation "
                f"is lowered for {', '.join(platforms)}. Use backend='xla' or 'auto' there."
            )
        return functools.partial(_reference_impl, **params)

    return for_shapes


def _lower(ctx: mlir.LoweringRuleContext, *operands: Any, platform: str | None, **params: Any):
    platforms = (platform,) if platform else tuple(ctx.module_context.platforms)
    computation = sharding.partitioned(
        _local_implementation(platforms, params),
        ctx.avals_in,
        with_dbias=params["with_dbias"],
        with_act=params["with_act"],
    )
    return mlir.lower_fun(computation, multiple_results=True)(ctx, *operands)


# The lowering wraps the computation in custom_partitioning, which needs the device
# assignment; JAX supplies it while lowering only to computations that contain a
# primitive in this set, and custom_partitioning's own equation appears only inside our
# lowering, too late to be seen.
jax_internals.require_devices_while_lowering(grouped_gemm_dsrelu_p)
mlir.register_lowering(grouped_gemm_dsrelu_p, functools.partial(_lower, platform=None))
mlir.register_lowering(grouped_gemm_dsrelu_p, functools.partial(_lower, platform="cuda"), platform="cuda")


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

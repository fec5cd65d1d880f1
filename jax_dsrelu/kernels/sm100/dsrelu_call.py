"""The sm100 implementation of the primitive: layout bridge in, one custom call, bridge out.

`implementation(request)` returns a function of the primitive's eight operands, by name,
that the primitive lowers for CUDA. Its HLO is gathers and pads (the layout bridge, `layout.py`),
one custom call running cuDNN's kernel and, in deterministic mode, the reduction pass
(`adapter.py`), then gathers back to the caller's rows. The custom call is compiled once
per static key (`adapter.KernelKey`): the padded row count, which follows m, is a dynamic
extent of the compiled code, so a new m does not recompile the kernel.

Compiled for sm_100a and lowered on machines without a Blackwell GPU; not executed there.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsrelu.kernels import operands as kernel_operands
from jax_dsrelu.kernels.request import Request
from jax_dsrelu.kernels.sm100 import adapter, layout
from jax_dsrelu.kernels.sm100.config import CONFIG

# tcgen05 and the block-scaled MMA exist only on the architecture-specific target.
ARCH = "sm_100a"

_F32 = np.dtype(np.float32)


def kernel_key(request: Request) -> adapter.KernelKey:
    # prob reaches the kernel as float32 whatever its dtype, so its dtype is no compile fact.
    return adapter.KernelKey(
        request=dataclasses.replace(request, prob_dtype=_F32),
        config=CONFIG,
        max_active_clusters=adapter.max_active_clusters(CONFIG),
    )


def implementation(request: Request) -> Callable[..., Mapping[str, jax.Array]]:
    """(grad=, weight=, preact=, prob=, group_sizes=, alpha=, grad_scale=, weight_scale=)
    -> {dh, dprob, [dbias], [act], amax}: the kernel's buffers carry the primitive's names,
    so the layout bridge's arrays pass to the call by name and its results come back by
    name, in the caller's rows."""
    key = kernel_key(request)
    host_function = adapter.Sm100Call(key)
    compile_key = ("jax_dsrelu.sm100", key)
    plan = host_function.operands()

    def run(*, grad, weight, preact, prob, group_sizes, alpha, grad_scale, weight_scale) -> dict[str, jax.Array]:
        if grad.shape[0] == 0:
            return _no_rows(request)
        ops, rows = layout.kernel_operands(
            grad, weight, preact, prob, group_sizes, alpha, grad_scale, weight_scale, CONFIG
        )
        # The rows extent of every row-space buffer is the padded row count, which follows
        # m: a run-time extent of the compiled code. The accumulators start at zero.
        named = kernel_operands.call(host_function, compile_key, plan, ops._asdict(), ops.grad.shape[0], arch=ARCH)
        results = dict(
            dh=layout.caller_rows(named["dh"], rows),
            dprob=layout.caller_rows(named["dprob"], rows),
            amax=named["amax"],
        )
        if request.with_dbias:
            # Added into in bfloat16 by the atomic mode; float32 from the reduction pass.
            results["dbias"] = named["dbias"].astype(_F32)
        if request.with_act:
            results["act"] = layout.caller_rows(named["act"], rows)
        return results

    return run


def _no_rows(request: Request) -> dict[str, jax.Array]:
    """m = 0 is static: nothing to launch. dbias sums and amax maxes over no rows are 0."""
    n, num_experts = request.n, request.num_experts
    results = dict(dh=jnp.zeros((0, n), request.out_dtype), dprob=jnp.zeros((0,), _F32),
                   amax=jnp.zeros((num_experts,), _F32))
    if request.with_dbias:
        results["dbias"] = jnp.zeros((num_experts, n), _F32)
    if request.with_act:
        results["act"] = jnp.zeros((0, n), request.out_dtype)
    return results

"""The sm100 implementation of the primitive: layout bridge in, one custom call, bridge out.

`implementation(request)` returns a function of the primitive's eight operands that the
primitive lowers for CUDA. Its HLO is gathers and pads (the layout bridge, `layout.py`),
one custom call running cuDNN's kernel and, in deterministic mode, the reduction pass
(`adapter.py`), then gathers back to the caller's rows. The custom call is compiled once
per static key (`adapter.KernelKey`): the padded row count, which follows m, is a dynamic
extent of the compiled code, so a new m does not recompile the kernel.

Compiled for sm_100a and lowered on machines without a Blackwell GPU; not executed there.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

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


def implementation(request: Request) -> Callable[..., tuple[jax.Array, ...]]:
    key = kernel_key(request)
    host_function = adapter.Sm100Call(key)
    compile_key = ("jax_dsrelu.sm100", key)
    plan = host_function.operands()

    def run(grad, weight, preact, prob, group_sizes, alpha, grad_scale, weight_scale):
        if grad.shape[0] == 0:
            return _no_rows(request)
        ops, rows = layout.kernel_operands(
            grad, weight, preact, prob, group_sizes, alpha, grad_scale, weight_scale, CONFIG
        )
        # The rows extent of every row-space buffer is the padded row count, which follows
        # m: a run-time extent of the compiled code. The accumulators start at zero.
        named = kernel_operands.call(host_function, compile_key, plan, ops._asdict(), ops.a.shape[0], arch=ARCH)
        if request.deterministic:
            dprob, dbias = named["dprob"], named.get("dbias")
        else:
            dprob = named["dprob_acc"]
            dbias = named["dbias_acc"].astype(_F32) if request.with_dbias else None
        outputs = [layout.caller_rows(named["d"], rows), layout.caller_rows(dprob, rows)]
        if request.with_dbias:
            outputs.append(dbias)
        if request.with_act:
            outputs.append(layout.caller_rows(named["act"], rows))
        outputs.append(named["amax"])
        return tuple(outputs)

    return run


def _no_rows(request: Request) -> tuple[jax.Array, ...]:
    """m = 0 is static: nothing to launch. dbias sums and amax maxes over no rows are 0."""
    n, num_experts = request.n, request.num_experts
    outputs = [jnp.zeros((0, n), request.out_dtype), jnp.zeros((0,), _F32)]
    if request.with_dbias:
        outputs.append(jnp.zeros((num_experts, n), _F32))
    if request.with_act:
        outputs.append(jnp.zeros((0, n), request.out_dtype))
    outputs.append(jnp.zeros((num_experts,), _F32))
    return tuple(outputs)

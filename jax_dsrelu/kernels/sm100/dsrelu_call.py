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

from jax_dsrelu.ffi import cutlass_bridge
from jax_dsrelu.kernels.sm100 import layout
from jax_dsrelu.ffi.cutlass_bridge import Operand
from jax_dsrelu.kernels.sm100 import adapter
from jax_dsrelu.kernels.sm100.config import CONFIG
from jax_dsrelu.kernels.request import Request

# tcgen05 and the block-scaled MMA exist only on the architecture-specific target.
ARCH = "sm_100a"

_F32, _I32, _BF16 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(jnp.bfloat16)
_SCALE = np.dtype(jnp.float8_e8m0fnu)


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
    num_experts, n = request.num_experts, request.n
    deterministic, with_dbias, with_act = request.deterministic, request.with_dbias, request.with_act
    operand_dtype, out_dtype = request.operand_dtype, request.out_dtype

    def run(grad, weight, preact, prob, group_sizes, alpha, grad_scale, weight_scale):
        if grad.shape[0] == 0:
            return _no_rows(request)
        ops, rows = layout.kernel_operands(
            grad, weight, preact, prob, group_sizes, alpha, grad_scale, weight_scale, CONFIG
        )
        num_padded = ops.a.shape[0]
        # Dimension 0 of every row-space buffer follows m: compiled as a dynamic extent.
        inputs = [
            (Operand(operand_dtype, 2, varying=(0,)), ops.a),
            (Operand(operand_dtype, 3), ops.b),
            (Operand(request.preact_dtype, 2, varying=(0,)), ops.c),
            (Operand(_SCALE, 1, varying=(0,)), ops.sfa),
            (Operand(_SCALE, 1), ops.sfb),
            (Operand(_I32, 1), ops.padded_offsets),
        ]
        if deterministic:
            inputs.append((Operand(_I32, 1), ops.padded_sizes))
            dprob_acc = jnp.zeros((num_padded, CONFIG.dprob_slots(n)), _F32)
            dbias_acc = jnp.zeros((CONFIG.dbias_slots(num_padded), n), _BF16)
            accumulators = [(Operand(_F32, 2, varying=(0,)), dprob_acc)]
            dbias_operand = Operand(_BF16, 2, varying=(0,))
        else:
            dprob_acc = jnp.zeros((num_padded,), _F32)
            dbias_acc = jnp.zeros((num_experts, n), _BF16)
            accumulators = [(Operand(_F32, 1, varying=(0,)), dprob_acc)]
            dbias_operand = Operand(_BF16, 2)
        inputs += [(Operand(_F32, 1), ops.alpha), (Operand(_F32, 1, varying=(0,)), ops.prob)]
        if with_dbias:
            accumulators.append((dbias_operand, dbias_acc))
        accumulators.append((Operand(_F32, 1), jnp.zeros((num_experts,), _F32)))  # amax

        def result(operand, shape, dtype):
            return operand, jax.ShapeDtypeStruct(shape, dtype)

        rows_out = Operand(out_dtype, 2, varying=(0,))
        outputs = [result(rows_out, (num_padded, n), out_dtype)]  # d
        if with_act:
            outputs.append(result(rows_out, (num_padded, n), out_dtype))
        if deterministic:
            outputs.append(result(Operand(_F32, 1, varying=(0,)), (num_padded,), _F32))
            if with_dbias:
                outputs.append(result(Operand(_F32, 2), (num_experts, n), _F32))
        # The accumulators are updated in place: inputs aliased to the last outputs.
        first_accumulator = len(inputs)
        aliases = {first_accumulator + i: len(outputs) + i for i in range(len(accumulators))}
        outputs += [(operand, jax.ShapeDtypeStruct(x.shape, x.dtype)) for operand, x in accumulators]
        results = cutlass_bridge.call(
            host_function, compile_key, inputs + accumulators, outputs, aliases, arch=ARCH
        )

        d = results[0]
        act = results[1] if with_act else None
        accumulated = results[len(results) - len(accumulators) :]  # dprob_acc, [dbias_acc], amax
        amax = accumulated[-1]
        if deterministic:
            reduced = results[2 if with_act else 1 :]
            dprob = reduced[0]
            dbias = reduced[1] if with_dbias else None
        else:
            dprob = accumulated[0]
            dbias = accumulated[1].astype(_F32) if with_dbias else None

        outputs = [layout.caller_rows(d, rows), layout.caller_rows(dprob, rows)]
        if with_dbias:
            outputs.append(dbias)
        if with_act:
            outputs.append(layout.caller_rows(act, rows))
        outputs.append(amax)
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

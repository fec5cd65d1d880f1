"""The sm90 backend's implementation of the primitive: one custom call per use.

`implementation(request)` returns a function of the primitive's operands that the
primitive's CUDA lowering lowers in its place. It casts prob to float32, passes
zero-filled buffers for the atomically updated outputs (aliased in and out, so XLA fills
them on the call's stream), and emits one custom call whose host function launches the
GEMM kernel and, in deterministic mode, the slot reduction. Compiles are keyed on the
static facts of the request and the tile configuration only (`cutlass_bridge`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_dsrelu.ffi import cutlass_bridge
from jax_dsrelu.ffi.cutlass_bridge import Operand
from jax_dsrelu.kernels.sm90 import config as sm90_config
from jax_dsrelu.kernels.request import Request
from jax_dsrelu.kernels.sm90.dsrelu_kernel import GroupedGemmDsreluSm90
from jax_dsrelu.kernels.sm90.mainloop import MAX_ROWS

# wgmma and setmaxnreg exist only on the architecture-specific sm_90a target.
ARCH = "sm_90a"

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)


def sm_count() -> int:
    """Multiprocessors of the visible GPU (the persistent grid size), or the H100/H200 count."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return sm90_config.DEFAULT_SM_COUNT
    return int(getattr(devices[0], "core_count", sm90_config.DEFAULT_SM_COUNT))


@functools.cache
def _kernel(request: Request, config: sm90_config.TileConfig) -> GroupedGemmDsreluSm90:
    return GroupedGemmDsreluSm90(config, request)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer of the kernel's host function, in the host function's order.

    role: "input" (read only), "accumulate" (zero-filled by XLA, updated in place by
    atomics, returned) or "output" (written by the kernels; workspaces included).
    """

    name: str
    operand: Operand
    shape: tuple[int, ...]
    role: str

    @property
    def dtype(self) -> np.dtype:
        return self.operand.dtype


def buffer_plan(
    request: Request, config: sm90_config.TileConfig, num_rows: int
) -> list[Buffer]:
    """The host function's buffers in its order (dsrelu_kernel.py `__call__`): every input and
    accumulate buffer before every output, as the JAX bridge passes them."""
    e, n, k = request.num_experts, request.n, request.k
    rows = lambda dtype, *cols: Operand(np.dtype(dtype), 1 + len(cols), varying=(0,))  # noqa: E731
    plan = [
        Buffer("grad", rows(request.operand_dtype, k), (num_rows, k), "input"),
        # The kernel sees weight (E, n, k) as (n, k, E): a mode permutation, not a copy.
        Buffer("weight", Operand(request.operand_dtype, 3, mode=(1, 2, 0)), (e, n, k), "input"),
        Buffer("preact", rows(request.preact_dtype, n), (num_rows, n), "input"),
        Buffer("prob", rows(_F32), (num_rows,), "input"),
        Buffer("group_sizes", Operand(_I32, 1), (e,), "input"),
        Buffer("alpha", Operand(_F32, 1), (e,), "input"),
        # amax as int32 bits: the kernel's atomic max is on the bit pattern.
        Buffer("amax", Operand(_I32, 1), (e,), "accumulate"),
    ]
    if not request.deterministic:
        plan.append(Buffer("dprob", rows(_F32), (num_rows,), "accumulate"))
        if request.with_dbias:
            plan.append(Buffer("dbias", Operand(_F32, 2), (e, n), "accumulate"))
    plan.append(Buffer("dh", rows(request.out_dtype, n), (num_rows, n), "output"))
    if request.with_act:
        plan.append(Buffer("act", rows(request.out_dtype, n), (num_rows, n), "output"))
    if request.deterministic:
        # dprob and dbias are written whole by the reduction pass; the slots are written
        # wherever the reduction reads them. None needs initialising.
        plan.append(Buffer("dprob", rows(_F32), (num_rows,), "output"))
        if request.with_dbias:
            plan.append(Buffer("dbias", Operand(_F32, 2), (e, n), "output"))
        plan.append(
            Buffer(
                "dprob_slots",
                Operand(_F32, 2, varying=(1,)),
                (sm90_config.num_n_tiles(n, config), num_rows),
                "output",
            )
        )
        if request.with_dbias:
            plan.append(
                Buffer(
                    "dbias_slots",
                    rows(_F32, n),
                    (sm90_config.max_m_tiles(num_rows, e, config.tile_m), n),
                    "output",
                )
            )
    return plan


def kernel_request(request: Request) -> Request:
    """The request as the kernel sees it: prob arrives as float32 whatever its dtype, so
    prob's dtype is not a compile fact."""
    return dataclasses.replace(request, prob_dtype=_F32)


def _compile_key(request: Request, config: sm90_config.TileConfig, outputs_in_place: bool):
    return ("jax_dsrelu.sm90", request, config, outputs_in_place)


def compile_kernel(
    request: Request,
    config: sm90_config.TileConfig,
    *,
    outputs_in_place: bool = False,
    keep: bool = False,
) -> cutlass_bridge.Compiled:
    """The object code `implementation` runs for this request and config (compiled now,
    or found in the cache). keep=True also returns its PTX and cubin."""
    request = kernel_request(request)
    inputs, outputs, aliases = call_layout(buffer_plan(request, config, 1), outputs_in_place)
    return cutlass_bridge.compile_function(
        _kernel(request, config),
        _compile_key(request, config, outputs_in_place),
        [(b.operand, b.shape) for b in inputs],
        [(b.operand, b.shape) for b in outputs],
        aliases,
        arch=ARCH,
        keep=keep,
    )


def call_layout(
    plan: list[Buffer], outputs_in_place: bool
) -> tuple[list[Buffer], list[Buffer], dict[int, int]]:
    """(custom-call inputs, custom-call outputs, input -> output aliases) for a plan.

    Accumulate buffers, and with outputs_in_place every output buffer, are inputs aliased
    to outputs; the host function then receives the buffers in plan order either way."""
    inputs, outputs, aliases = [], [], {}
    for buffer in plan:
        if buffer.role != "output" or outputs_in_place:
            if buffer.role != "input":
                aliases[len(inputs)] = len(outputs)
            inputs.append(buffer)
        if buffer.role != "input":
            outputs.append(buffer)
    return inputs, outputs, aliases


def implementation(
    request: Request,
    config: sm90_config.TileConfig | None = None,
    *,
    outputs_in_place: bool = False,
) -> Callable[..., tuple[jax.Array, ...]]:
    """(grad, weight, preact, prob, group_sizes, alpha) -> (dh, dprob, [dbias], [act], amax).

    With outputs_in_place=True the function takes one more argument, a dict of
    pre-filled output buffers by name (dh, act, and in deterministic mode dprob, dbias
    and the slot workspaces), which the kernels update in place and return. Tests fill
    them with NaN to show that the kernels write every element they own.
    """
    reason = sm90_config.cannot_implement(request)
    if reason is not None:
        raise NotImplementedError(f"backend='sm90' cannot serve this call: {reason}")
    request = kernel_request(request)
    if config is None:
        config = sm90_config.choose_config(request, sm_count())
    config.check_fits(request.num_experts, request.with_act, request.with_dbias)
    kernel = _kernel(request, config)
    key = _compile_key(request, config, outputs_in_place)

    def run(grad, weight, preact, prob, group_sizes, alpha, filled=None):
        num_rows = grad.shape[0]
        if num_rows > MAX_ROWS:
            raise NotImplementedError(
                f"backend='sm90' takes at most {MAX_ROWS} rows, got grad.shape={grad.shape}"
            )
        if num_rows == 0:
            return _no_rows(request)
        given = dict(
            grad=grad,
            weight=weight,
            preact=preact,
            prob=prob.astype(jnp.float32),
            group_sizes=group_sizes,
            alpha=alpha.astype(jnp.float32),
        )
        if outputs_in_place:
            given.update(filled)
        inputs, outputs, aliases = call_layout(buffer_plan(request, config, num_rows), outputs_in_place)
        results = cutlass_bridge.call(
            kernel,
            key,
            [
                (b.operand, given[b.name] if b.name in given else jnp.zeros(b.shape, b.dtype))
                for b in inputs
            ],
            [(b.operand, jax.ShapeDtypeStruct(b.shape, b.dtype)) for b in outputs],
            aliases,
            arch=ARCH,
        )
        named = {buffer.name: result for buffer, result in zip(outputs, results)}
        amax = lax.bitcast_convert_type(named["amax"], jnp.float32)
        return _ordered(
            request, named["dh"], named["dprob"], named.get("dbias"), named.get("act"), amax
        )

    return run


def _ordered(request: Request, dh, dprob, dbias, act, amax) -> tuple[jax.Array, ...]:
    outputs = [dh, dprob]
    if request.with_dbias:
        outputs.append(dbias)
    if request.with_act:
        outputs.append(act)
    outputs.append(amax)
    return tuple(outputs)


def _no_rows(request: Request) -> tuple[jax.Array, ...]:
    """m = 0 is static: no rows, so no expert owns any, and nothing needs a kernel."""
    n = request.n
    empty = jnp.zeros((0, n), request.out_dtype)
    return _ordered(
        request,
        empty,
        jnp.zeros((0,), jnp.float32),
        jnp.zeros((request.num_experts, n), jnp.float32),
        empty,
        jnp.zeros((request.num_experts,), jnp.float32),
    )

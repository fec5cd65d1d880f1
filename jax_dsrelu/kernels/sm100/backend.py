"""How the sm100 backend presents itself to the registry. Imports neither CuTe DSL nor cuDNN."""

from __future__ import annotations

from typing import Callable, Mapping

import jax

from jax_dsrelu.kernels import software
from jax_dsrelu.kernels.request import AnyRequest, Request

NAME = "sm100"
DEVICE_DESCRIPTION = "Blackwell GPUs of compute capability 10.0 (B200, GB200)"
# Only the fused dsReLU backward has a Blackwell kernel; the plain grouped GEMMs run on XLA there.
REQUEST_KINDS = (Request,)


def software_missing() -> str | None:
    return software.missing("cutlass", "sm100") or software.missing("cudnn", "sm100")


def supports_compute_capability(capability: tuple[int, int]) -> bool:
    # The kernel is compiled for sm_100a (tcgen05 block-scaled MMA, 2-SM clusters), and
    # architecture-specific object code loads on exactly that compute capability: not on
    # 10.3 (B300), nor on 11.x or 12.x, where the load would fail at run time.
    return capability == (10, 0)


def cannot_implement(request: AnyRequest) -> str | None:
    if not isinstance(request, REQUEST_KINDS):
        return "the sm100 backend has a kernel for grouped_gemm_dsrelu only"
    from jax_dsrelu.kernels.sm100 import config

    return config.cannot_implement(request)


def gathers_rows(request: AnyRequest) -> frozenset[str]:
    """The operands of `request`'s primitive whose rows the kernels read through a row
    index themselves (e.g. "lhs" of a ragged matmul); the primitives gather the others
    before calling `implementation` (see `jax_dsrelu.primitives.base`).
    None: cuDNN's kernel loads every operand in place."""
    return frozenset()


def implementation(request: AnyRequest) -> Callable[..., Mapping[str, jax.Array]]:
    from jax_dsrelu.kernels.sm100 import dsrelu_call

    return dsrelu_call.implementation(request)

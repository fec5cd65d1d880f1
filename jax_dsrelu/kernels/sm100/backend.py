"""How the sm100 backend presents itself to backend_choice. Imports neither CuTe DSL nor cuDNN."""

from __future__ import annotations

from typing import Callable

import jax

from jax_dsrelu.kernels import software
from jax_dsrelu.request import AnyRequest, Request

NAME = "sm100"
DEVICE_DESCRIPTION = "Blackwell GPUs (compute capability 10.0 and newer: B200, GB200)"


def software_missing() -> str | None:
    return software.missing("cutlass", "sm100") or software.missing("cudnn", "sm100")


def supports_compute_capability(capability: tuple[int, int]) -> bool:
    # tcgen05 block-scaled MMA and 2-SM clusters exist from SM100 on.
    return capability >= (10, 0)


def cannot_implement(request: AnyRequest) -> str | None:
    if not isinstance(request, Request):
        # Only the fused dsReLU backward has a Blackwell kernel; the plain grouped GEMMs
        # run on XLA there.
        return "the sm100 backend has a kernel for grouped_gemm_dsrelu only"
    from jax_dsrelu.kernels.sm100 import config

    return config.cannot_implement(request)


def implementation(request: AnyRequest) -> Callable[..., tuple[jax.Array, ...]]:
    from jax_dsrelu.ffi import sm100 as lowering

    return lowering.implementation(request)

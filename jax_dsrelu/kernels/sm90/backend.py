"""How the sm90 backend presents itself to backend_choice. Imports no CuTe DSL."""

from __future__ import annotations

from typing import Callable

import jax

from jax_dsrelu.kernels import software
from jax_dsrelu.request import AnyRequest, Request

NAME = "sm90"
DEVICE_DESCRIPTION = "Hopper GPUs (compute capability 9.0: H100, H200)"



def software_missing() -> str | None:
    return software.missing("cutlass", "gpu")


def supports_compute_capability(capability: tuple[int, int]) -> bool:
    # wgmma and the sm_90a features the kernel uses exist on 9.0 only.
    return capability == (9, 0)


def cannot_implement(request: AnyRequest) -> str | None:
    if not isinstance(request, Request):
        return "the sm90 grouped-GEMM kernels for this request are not built yet"
    from jax_dsrelu.kernels.sm90 import config

    return config.cannot_implement(request)


def implementation(request: AnyRequest) -> Callable[..., tuple[jax.Array, ...]]:
    from jax_dsrelu.ffi import sm90 as lowering

    return lowering.implementation(request)

"""How the sm90 backend presents itself to the registry. Imports no CuTe DSL."""

from __future__ import annotations

from typing import Callable

import jax

from jax_dsrelu.kernels import software
from jax_dsrelu.kernels.request import AnyRequest, RaggedContractRequest, RaggedMatmulRequest, Request

NAME = "sm90"
DEVICE_DESCRIPTION = "Hopper GPUs (compute capability 9.0: H100, H200)"
REQUEST_KINDS = (Request, RaggedMatmulRequest, RaggedContractRequest)


def software_missing() -> str | None:
    return software.missing("cutlass", "gpu")


def supports_compute_capability(capability: tuple[int, int]) -> bool:
    # wgmma and the sm_90a features the kernel uses exist on 9.0 only.
    return capability == (9, 0)


def cannot_implement(request: AnyRequest) -> str | None:
    from jax_dsrelu.kernels.sm90 import config

    if isinstance(request, RaggedMatmulRequest):
        return config.cannot_implement_gemm(request)
    if isinstance(request, RaggedContractRequest):
        return config.cannot_implement_contract(request)
    return config.cannot_implement(request)


def implementation(request: AnyRequest) -> Callable[..., tuple[jax.Array, ...]]:
    if isinstance(request, Request):
        from jax_dsrelu.kernels.sm90 import dsrelu_call

        return dsrelu_call.implementation(request)
    from jax_dsrelu.kernels.sm90 import ragged_call

    return ragged_call.implementation(request)

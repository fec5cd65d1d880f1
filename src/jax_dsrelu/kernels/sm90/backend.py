"""How the sm90 backend presents itself to dispatch. Imports no CuTe DSL."""

from __future__ import annotations

from typing import Callable

import jax

from jax_dsrelu.dispatch import Request
from jax_dsrelu.kernels import software

NAME = "sm90"
DEVICE_DESCRIPTION = "Hopper GPUs (compute capability 9.0: H100, H200)"



def software_missing() -> str | None:
    return software.missing("cutlass", "gpu")


def supports_compute_capability(capability: tuple[int, int]) -> bool:
    # wgmma and the sm_90a features the kernel uses exist on 9.0 only.
    return capability == (9, 0)


def cannot_implement(request: Request) -> str | None:
    from jax_dsrelu.kernels.sm90 import config

    return config.cannot_implement(request)


def implementation(request: Request) -> Callable[..., tuple[jax.Array, ...]]:
    from jax_dsrelu.kernels.sm90 import lowering

    return lowering.implementation(request)

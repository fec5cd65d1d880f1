"""How the sm100 backend presents itself to dispatch. Imports neither CuTe DSL nor cuDNN."""

from __future__ import annotations

from typing import Callable

import jax

from jax_dsrelu.dispatch import Request
from jax_dsrelu.kernels import software

NAME = "sm100"
DEVICE_DESCRIPTION = "Blackwell GPUs (compute capability 10.0 and newer: B200, GB200)"


def software_missing() -> str | None:
    return software.missing("cutlass", "sm100") or software.missing("cudnn", "sm100")


def supports_compute_capability(capability: tuple[int, int]) -> bool:
    # tcgen05 block-scaled MMA and 2-SM clusters exist from SM100 on.
    return capability >= (10, 0)


def cannot_implement(request: Request) -> str | None:
    from jax_dsrelu.kernels.sm100 import config

    return config.cannot_implement(request)


def implementation(request: Request) -> Callable[..., tuple[jax.Array, ...]]:
    from jax_dsrelu.kernels.sm100 import lowering

    return lowering.implementation(request)

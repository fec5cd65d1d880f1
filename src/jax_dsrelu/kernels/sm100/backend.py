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
    return capability >= (10, 0)


def cannot_implement(request: Request) -> str | None:
    if not request.block_scaled:
        return "cuDNN's Blackwell kernel takes MXFP8 (block-scaled float8) operands only"
    return "the sm100 adapter is not part of this build"


def implementation(request: Request) -> Callable[..., tuple[jax.Array, ...]]:
    raise NotImplementedError(cannot_implement(request))

"""The facts of the Hopper target that the sm90 backend's calls share. Imports no CuTe DSL."""

from __future__ import annotations

import jax

from jax_dsrelu.kernels.sm90.config import DEFAULT_SM_COUNT

# wgmma and setmaxnreg exist only on the architecture-specific sm_90a target.
ARCH = "sm_90a"


def sm_count() -> int:
    """Multiprocessors of the visible GPU (the persistent grid size), or the H100/H200 count."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return DEFAULT_SM_COUNT
    return int(getattr(devices[0], "core_count", DEFAULT_SM_COUNT))

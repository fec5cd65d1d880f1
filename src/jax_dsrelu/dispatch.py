"""Which backend serves a request, on which platform, and why the others cannot.

A backend is named by a string: "xla" (the reference, runs anywhere), "sm90" (our CuTe DSL
kernel for Hopper) and "sm100" (cuDNN's Blackwell kernel). "auto" is resolved when the
primitive is lowered, because only then is the target platform known; on a CUDA device it
takes the fastest backend that can serve the request and falls back to "xla".

GPU backends describe themselves through a small module that imports nothing heavy
(`jax_dsrelu.kernels.<name>.backend`), so asking about them never loads CuTe DSL.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Protocol

import jax
import numpy as np

BACKEND_NAMES = ("auto", "xla", "sm90", "sm100")
# Preference order for "auto" on a CUDA device; "xla" is always last.
_KERNEL_BACKENDS = ("sm100", "sm90")


@dataclasses.dataclass(frozen=True)
class Request:
    """The static facts of one call: everything a backend may decide on, nothing dynamic.

    The row count m and the group sizes are deliberately absent: they may change from
    step to step without changing which backend serves the call or what it compiles.
    """

    num_experts: int
    n: int
    k: int
    operand_dtype: np.dtype
    preact_dtype: np.dtype
    prob_dtype: np.dtype
    out_dtype: np.dtype
    with_dbias: bool
    with_act: bool
    deterministic: bool
    block_scaled: bool = False


class KernelBackend(Protocol):
    """What `jax_dsrelu.kernels.<name>.backend` provides."""

    NAME: str
    DEVICE_DESCRIPTION: str  # which GPUs it runs on, in words

    def software_missing(self) -> str | None:
        """Why the backend's packages cannot be imported here, or None."""

    def supports_compute_capability(self, capability: tuple[int, int]) -> bool:
        """Whether the kernel runs on a device of this compute capability."""

    def cannot_implement(self, request: Request) -> str | None:
        """Why this request is outside the kernel's constraints, or None."""

    def implementation(self, request: Request) -> Callable[..., tuple[jax.Array, ...]]:
        """A function of the primitive's operands returning its outputs, for lowering."""


@functools.cache
def kernel_backend(name: str) -> KernelBackend:
    return importlib.import_module(f"jax_dsrelu.kernels.{name}.backend")


@functools.cache
def cuda_compute_capability() -> tuple[int, int] | None:
    """Compute capability of the first visible CUDA device, None when there is none."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    if not devices:
        return None
    major, minor = str(devices[0].compute_capability).split(".")
    return int(major), int(minor)


def check_explicit_backend(name: str, request: Request) -> None:
    """Raises NotImplementedError, at trace time, when an explicit backend cannot serve.

    Whether the target platform has the right GPU is known only when lowering, so that
    part is checked there (`cuda_implementation`).
    """
    if name in ("auto", "xla"):
        return
    backend = kernel_backend(name)
    reason = backend.software_missing() or backend.cannot_implement(request)
    if reason is not None:
        raise NotImplementedError(
            f"backend={name!r} cannot serve this call: {reason}. "
            f"{_who_can(request, exclude=name)}"
        )


def cuda_implementation(
    name: str, request: Request
) -> tuple[str, Callable[..., tuple[jax.Array, ...]] | None]:
    """(resolved backend name, its implementation) for lowering on CUDA.

    The implementation is None for "xla": the caller lowers the reference. An explicit
    kernel backend is refused when the visible GPU is of another generation; with no GPU
    visible it is still lowered, which is how the kernels are compiled and lowered on a
    machine without one.
    """
    if name == "xla":
        return "xla", None
    capability = cuda_compute_capability()
    if name != "auto":
        backend = kernel_backend(name)
        if capability is not None and not backend.supports_compute_capability(capability):
            raise NotImplementedError(
                f"backend={name!r} runs on {backend.DEVICE_DESCRIPTION}; the visible GPU has "
                f"compute capability {capability[0]}.{capability[1]}. {_who_can(request, exclude=name)}"
            )
        return name, backend.implementation(request)
    for candidate in _KERNEL_BACKENDS:
        if capability is None:
            break
        backend = kernel_backend(candidate)
        if (
            backend.supports_compute_capability(capability)
            and backend.software_missing() is None
            and backend.cannot_implement(request) is None
        ):
            return candidate, backend.implementation(request)
    return "xla", None


def _who_can(request: Request, exclude: str) -> str:
    able = [
        name
        for name in _KERNEL_BACKENDS
        if name != exclude and kernel_backend(name).cannot_implement(request) is None
    ]
    able.append("xla")
    return "Backends that can: " + ", ".join(repr(name) for name in able) + "."


@dataclasses.dataclass(frozen=True)
class BackendStatus:
    name: str
    usable_here: bool
    detail: str


def backends() -> list[BackendStatus]:
    """What each backend can do on this machine, and why not where it cannot."""
    capability = cuda_compute_capability()
    statuses = [BackendStatus("xla", True, "XLA reference: runs on every JAX platform")]
    for name in reversed(_KERNEL_BACKENDS):
        backend = kernel_backend(name)
        missing = backend.software_missing()
        if missing is not None:
            statuses.append(BackendStatus(name, False, missing))
        elif capability is None:
            statuses.append(
                BackendStatus(
                    name,
                    False,
                    "no CUDA device visible; kernels can still be compiled and lowered "
                    "for the cuda platform here",
                )
            )
        elif not backend.supports_compute_capability(capability):
            statuses.append(
                BackendStatus(
                    name,
                    False,
                    f"the visible GPU has compute capability {capability[0]}.{capability[1]}, "
                    f"{backend.DEVICE_DESCRIPTION}",
                )
            )
        else:
            statuses.append(BackendStatus(name, True, backend.DEVICE_DESCRIPTION))
    return statuses


def describe(statuses: list[BackendStatus] | None = None) -> str:
    """backends() as a short table, for humans."""
    rows = statuses if statuses is not None else backends()
    return "\n".join(
        f"{s.name:6} {'yes' if s.usable_here else 'no ':3}  {s.detail}" for s in rows
    )


def request_from_avals(avals: Any, *, block_scaled: bool = False, **params: Any) -> Request:
    grad, weight, preact, prob = avals[:4]
    return Request(
        num_experts=weight.shape[0],
        n=weight.shape[1],
        k=weight.shape[2],
        operand_dtype=np.dtype(grad.dtype),
        preact_dtype=np.dtype(preact.dtype),
        prob_dtype=np.dtype(prob.dtype),
        block_scaled=block_scaled,
        **params,
    )

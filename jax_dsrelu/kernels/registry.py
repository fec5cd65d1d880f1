"""The registry of backends: which one serves a request, on which platform, and why the others cannot.

A backend is named by a string: "xla" (the reference, runs anywhere), "sm90" (our CuTe DSL
kernel for Hopper) and "sm100" (cuDNN's Blackwell kernel). "auto" is resolved when the
primitive is lowered, because only then is the target platform known; on a CUDA device it
takes the fastest backend that can serve the request and falls back to "xla".

Each kernel backend describes itself through a small module that imports nothing heavy
(`jax_dsrelu.kernels.<name>.backend`, listed below), so asking about it never loads CuTe DSL
or cuDNN; its kernels are imported only when a call is lowered for it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax

from jax_dsrelu.kernels.request import (
    AnyRequest,
    KernelBackend,
    RaggedContractRequest,
    RaggedMatmulRequest,
    Request,
    cuda_compute_capability,
)
from jax_dsrelu.kernels.sm90 import backend as sm90
from jax_dsrelu.kernels.sm100 import backend as sm100

# The kernel backends in "auto"'s order of preference on a CUDA device; "xla" is always last.
KERNEL_BACKENDS: dict[str, KernelBackend] = {sm100.NAME: sm100, sm90.NAME: sm90}
BACKEND_NAMES = ("auto", "xla", *reversed(KERNEL_BACKENDS))
_KERNEL_BACKENDS = tuple(KERNEL_BACKENDS)


def kernel_backend(name: str) -> KernelBackend:
    return KERNEL_BACKENDS[name]


@dataclasses.dataclass(frozen=True)
class LayerBackends:
    """The backend a layer asks for each kind of step it runs, from the one name its user
    gave: the fused dsReLU backward (`Request`), the ragged-M matmuls, the ragged
    contractions and the ordered gather-and-sum (`gather_sum`) that combines rows by token."""

    dsrelu: str
    matmul: str
    contract: str
    gather_sum: str


def check_precision(name: str, precision) -> None:
    """Raises NotImplementedError when backend `name` cannot run the experts at
    `precision` (a `quantization.schema.Recipe`, or None for the operands' own dtype): a
    recipe's step is not one backend's but a choice per GEMM and per quantizing pass;
    "xla" runs it as quantize-dequantize arithmetic, and "auto" runs each GEMM and pass on
    a kernel where one serves it (on Hopper, sm90's FP8 kernels), else on that path."""
    if precision is not None and name in KERNEL_BACKENDS:
        raise NotImplementedError(
            f"backend={name!r} does not take precision={precision.name}: backend='auto' runs each GEMM of the step "
            f"on a kernel where one serves it (on Hopper, sm90's FP8 kernels), else as backend='xla' does, as "
            f"quantize-dequantize arithmetic (docs/fp8.md)"
        )


def layer_backends(name: str, precision=None) -> LayerBackends:
    """Which backend serves each step of a layer whose user asked for `name`.

    Under a precision (an FP8 recipe) every GEMM of the step is a block-scaled call that
    goes to the name asked ("auto": the FP8 kernel where one serves, else XLA); a kernel
    backend named explicitly is refused (`check_precision`). The gather-and-sum reads no
    quantized operand and is chosen as without a precision.

    A kernel backend serves the kinds of request it has kernels for and lets "auto" pick
    for the rest: the sm100 backend has a kernel for the fused dsReLU backward only, so a
    moe_mlp on it runs its plain GEMMs on what "auto" picks on Blackwell (XLA). The
    gather-and-sum is left to "auto" under every kernel backend: a kernel serves it where
    one can, XLA where none can, and the layer is never refused for it. "auto" and "xla"
    pass through: "auto" is resolved per call when it is lowered.
    """
    check_precision(name, precision)
    if precision is not None:
        # Block-scaled calls that "auto" resolves per call: a kernel where one serves them
        # (sm90's on Hopper), else XLA.
        return LayerBackends(dsrelu=name, matmul=name, contract=name, gather_sum=name)
    backend = KERNEL_BACKENDS.get(name)

    def for_kind(kind: type) -> str:
        return "auto" if backend is not None and kind not in backend.REQUEST_KINDS else name

    return LayerBackends(
        dsrelu=for_kind(Request),
        matmul=for_kind(RaggedMatmulRequest),
        contract=for_kind(RaggedContractRequest),
        gather_sum="auto" if backend is not None else name,
    )


def gathered_reads(name: str, request: AnyRequest) -> frozenset[str]:
    """The operands of a call that kernel backend `name` reads through their row index
    itself (its kernels load the rows source[index] in place); the primitives gather the
    others before its implementation runs (see `jax_dsrelu.primitives.base`)."""
    return frozenset(kernel_backend(name).gathers_rows(request))


def check_explicit_backend(name: str, request: AnyRequest) -> None:
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
    name: str, request: AnyRequest
) -> tuple[str, Callable[..., Mapping[str, jax.Array]] | None]:
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


def _who_can(request: AnyRequest, exclude: str) -> str:
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


def describe_backends(statuses: list[BackendStatus] | None = None) -> str:
    """backends() as a short table, for humans."""
    rows = statuses if statuses is not None else backends()
    return "\n".join(
        f"{s.name:6} {'yes' if s.usable_here else 'no ':3}  {s.detail}" for s in rows
    )

"""jax-dsrelu: the fused grouped-GEMM squared-ReLU backward for JAX mixture-of-experts layers.

Public API:
    grouped_gemm_dsrelu, DsreluOutputs   the primitive (see its docstring for the contract)
    moe_mlp                              the differentiable expert MLP built on it
    backends                             what each backend can do on this machine
    check_group_sizes                    opt-in runtime check, under checkify
"""

from jax_dsrelu.api import DsreluOutputs, grouped_gemm_dsrelu
from jax_dsrelu.checks import check_group_sizes
from jax_dsrelu.dispatch import BackendStatus, backends
from jax_dsrelu.layer import moe_mlp

__all__ = [
    "BackendStatus",
    "DsreluOutputs",
    "backends",
    "check_group_sizes",
    "grouped_gemm_dsrelu",
    "moe_mlp",
]

__version__ = "0.1.0"

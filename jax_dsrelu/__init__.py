"""jax-dsrelu: the fused grouped-GEMM squared-ReLU backward for JAX mixture-of-experts layers.

Public API:
    grouped_gemm_dsrelu, DsreluOutputs   the primitive (see its docstring for the contract)
    moe_mlp                              the differentiable expert MLP built on it
    ragged_dot                           a drop-in for jax.lax.ragged_dot on the grouped GEMMs
    backends                             what each backend can do on this machine
    check_group_sizes                    opt-in runtime check, under checkify
    quantize_mx, dequantize_mx           MXFP8 block scaling of operands (OCP MX v1.0)
"""

# First, so that an unsupported JAX is refused with its own message before anything else fails.
from jax_dsrelu import jax_internals  # noqa: F401
from jax_dsrelu.api import DsreluOutputs, grouped_gemm_dsrelu
from jax_dsrelu.checks import check_group_sizes
from jax_dsrelu.backend_choice import BackendStatus, backends, describe_backends
from jax_dsrelu.layer import moe_mlp
from jax_dsrelu.mx import dequantize_mx, quantize_mx
from jax_dsrelu.ragged_dot import ragged_dot

__all__ = [
    "BackendStatus",
    "DsreluOutputs",
    "backends",
    "describe_backends",
    "check_group_sizes",
    "dequantize_mx",
    "grouped_gemm_dsrelu",
    "moe_mlp",
    "quantize_mx",
    "ragged_dot",
]

__version__ = "0.1.0"

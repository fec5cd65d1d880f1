"""jax-dsrelu: the fused grouped-GEMM squared-ReLU backward for JAX mixture-of-experts layers.

Public API:
    grouped_gemm_dsrelu, DsreluOutputs   the primitive (see its docstring for the contract)
    moe_mlp                              the differentiable expert MLP built on it
    ragged_dot                           a drop-in for jax.lax.ragged_dot on the grouped GEMMs
    moe_layer, MoEAux                    a top-k MoE layer, dropless unless round_to: route, dispatch, moe_mlp, combine
    MoEOptions                           the layer's options as one frozen object (routing, round_to, capacity_factor,
                                         determinism, backend, precision: FP8_BLOCKWISE from jax_dsrelu.quantization)
    MoEWeights                           the layer's weights as one pytree
    moe_layer_expert_parallel            the same layer with experts split over a mesh axis (capacity_factor bounds
                                         what each device sends)
    route, RoutingPlan, dispatch, combine  the layer's routing steps, for custom layers
    update_expert_bias                   the auxiliary-loss-free balancing step for sigmoid routing
    params_from_hf_nemotron_h            a Hugging Face NemotronHMoE block's tensors as moe_layer arguments
    backends                             what each backend can do on this machine
    check_group_sizes                    opt-in runtime check, under checkify
    quantize_mx, dequantize_mx           MXFP8 block scaling of operands (OCP MX v1.0)
    quantize_expert_weights, QuantizedExpertWeights  the expert weights quantized once by an FP8 recipe, for
                                         moe_mlp's quantized_weights (reused over gradient accumulation)
"""

# First, so that an unsupported JAX is refused with its own message before anything else fails.
from jax_dsrelu import jax_internals  # noqa: F401
from jax_dsrelu.ops.grouped_gemm_dsrelu import DsreluOutputs, grouped_gemm_dsrelu
from jax_dsrelu.kernels.registry import BackendStatus, backends, describe_backends
from jax_dsrelu.ops.checks import check_group_sizes
from jax_dsrelu.moe.expert_parallel import moe_layer_expert_parallel
from jax_dsrelu.moe.hf_nemotron import params_from_hf_nemotron_h
from jax_dsrelu.ops.moe_mlp import moe_mlp
from jax_dsrelu.ops.quantized_expert_mlp import QuantizedExpertWeights, quantize_expert_weights
from jax_dsrelu.moe.layer import MoEAux, moe_layer
from jax_dsrelu.moe.options import MoEOptions
from jax_dsrelu.moe.weights import MoEWeights
from jax_dsrelu.quantization.mx import dequantize_mx, quantize_mx
from jax_dsrelu.ops.ragged_dot import ragged_dot
from jax_dsrelu.moe.routing import RoutingPlan, combine, dispatch, route, update_expert_bias

__all__ = [
    "BackendStatus",
    "DsreluOutputs",
    "MoEAux",
    "MoEOptions",
    "MoEWeights",
    "QuantizedExpertWeights",
    "RoutingPlan",
    "backends",
    "check_group_sizes",
    "combine",
    "dequantize_mx",
    "describe_backends",
    "dispatch",
    "grouped_gemm_dsrelu",
    "moe_layer",
    "moe_layer_expert_parallel",
    "moe_mlp",
    "params_from_hf_nemotron_h",
    "quantize_expert_weights",
    "quantize_mx",
    "ragged_dot",
    "route",
    "update_expert_bias",
]

__version__ = "0.1.0"

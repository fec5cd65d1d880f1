"""`MoE`: `jax_dsrelu.moe_layer` as a Flax NNX module (needs the `flax` extra).

    from jax_dsrelu.flax import MoE
    layer = MoE(d_model=256, d_ff=512, num_experts=8, top_k=2, rngs=nnx.Rngs(0))
    y = layer(x)                             # x (..., d_model) -> (..., d_model)
    y, aux = layer(x, return_aux=True)       # aux: jax_dsrelu.MoEAux (losses, group sizes)

A Nemotron-style block (sigmoid routing with a balancing bias, a shared expert, experts
in a latent width):

    layer = MoE(2688, 1856, 128, top_k=6, score="sigmoid", normalize=True, scale=2.5,
                shared_d_ff=3712, rngs=nnx.Rngs(0))
    y, aux = layer(x, return_aux=True)
    layer.update_expert_bias(aux.group_sizes, 1e-3)   # once per step, outside the gradient

A Hugging Face NemotronHMoE block's weights, loaded in one call (the tensors under the
block's own names, as `jax_dsrelu.params_from_hf_nemotron_h` takes them):

    layer = MoE.from_hf_nemotron_h(tensors, top_k=6, normalize=True, scale=2.5)

The options may also be one object, shared with `jax_dsrelu.moe_layer`:

    options = jax_dsrelu.MoEOptions(top_k=6, score="sigmoid", normalize=True, scale=2.5)
    layer = MoE.from_hf_nemotron_h(tensors, options=options)

With a mesh, the module is `jax_dsrelu.moe_layer_expert_parallel` instead: its experts
split over mesh axis expert_axis, its tokens over data_axis and expert_axis; a module
built eagerly places its experts' parameters split over expert_axis and the others
replicated:

    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layer = MoE(256, 512, 8, top_k=2, mesh=mesh, data_axis="data", rngs=nnx.Rngs(0))

It works with `nnx.jit`, `nnx.value_and_grad` and `nnx.Optimizer` over optax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

try:
    from flax import nnx
except ImportError as error:  # flax is an optional extra
    raise ImportError(
        "jax_dsrelu.flax needs Flax: pip install 'jax-dsrelu[flax]' (or pip install flax)"
    ) from error

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jax_dsrelu.moe import expert_parallel, layer
from jax_dsrelu.moe.entry_points import UNSET, entry_point
from jax_dsrelu.moe.hf_nemotron import params_from_hf_nemotron_h
from jax_dsrelu.moe.layer import MoEAux
from jax_dsrelu.moe.options import MoEOptions
from jax_dsrelu.moe.routing import update_expert_bias
from jax_dsrelu.moe.weights import MoEWeights
from jax_dsrelu.ops import quantized_expert_mlp
from jax_dsrelu.ops.quantized_expert_mlp import QuantizedExpertWeights
from jax_dsrelu.primitives import validation
from jax_dsrelu.quantization.schema import Recipe

# Fan-in scaling per expert: the expert axis 0 is a batch of independent matrices.
_EXPERT_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
# Fan-in scaling of the router and the dense (shared, latent) weights: the router's logits
# are then of order 1 at the start, so routing is neither uniform (where every tie would go
# to the lowest experts) nor saturated.
_DENSE_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class ExpertBias(nnx.Variable):
    """The selection bias of sigmoid routing: state that `MoE.update_expert_bias` moves,
    not a parameter (it is not an nnx.Param, so `nnx.grad` and `nnx.Optimizer(wrt=nnx.Param)`
    leave it alone)."""


class MoE(nnx.Module):
    """A top-k mixture of squared-ReLU experts (`jax_dsrelu.moe_layer`; with a mesh,
    `jax_dsrelu.moe_layer_expert_parallel`), dropless unless round_to or capacity_factor.

    Parameters (nnx.Param), with l = latent_dim (d_model without it):
    router (d_model, E) float32; w1 (E, l, d_ff) and w2 (E, d_ff, l) in param_dtype;
    b1 (E, d_ff) float32 when use_bias; shared_w1 (d_model, shared_d_ff) and shared_w2
    (shared_d_ff, d_model) when shared_d_ff; latent_in (d_model, l) and latent_out
    (l, d_model) when latent_dim; all in param_dtype but the router and b1.
    State (not trained): expert_bias (E,) float32, an `ExpertBias`, when score="sigmoid";
    zeros at first, moved by `update_expert_bias`.

    The options are `moe_layer`'s: one `jax_dsrelu.MoEOptions` as options=, or its
    fields as keywords (see `__init__`). With mesh= the module computes
    `moe_layer_expert_parallel` over that mesh (expert_axis, data_axis as it takes them),
    which also takes capacity_factor and recompute_exchanged; without, `moe_layer`, which
    refuses them; with round_to the module is no longer dropless
    (token rounding). The experts compute in `dtype` (param_dtype when None): bfloat16
    there, with float32 parameters, is the usual mixed precision for the GPU kernels.
    precision=jax_dsrelu.quantization.FP8_BLOCKWISE runs the experts' GEMMs on FP8
    operands (docs/fp8.md); the parameters stay in param_dtype.
    Every setting is checked here, when the module is built; the options are kept as
    `options` (an `MoEOptions`, static), which every call uses as it is.
    `MoE.from_hf_nemotron_h` builds the module from a Hugging Face NemotronHMoE block's
    weights.
    """

    @entry_point
    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        *,
        options: MoEOptions | None = None,
        top_k: int = UNSET,
        score: str = UNSET,
        num_groups: int = UNSET,
        top_groups: int | None = UNSET,
        normalize: bool = UNSET,
        scale: float = UNSET,
        round_to: int | None = UNSET,
        capacity_factor: float | None = UNSET,
        recompute_exchanged: bool = UNSET,
        shared_d_ff: int | None = None,
        latent_dim: int | None = None,
        use_bias: bool = True,
        deterministic: bool = UNSET,
        backend: str = UNSET,
        precision: Recipe | None = UNSET,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        router_init=_DENSE_INIT,
        kernel_init=_EXPERT_INIT,
        dense_init=_DENSE_INIT,
        mesh: jax.sharding.Mesh | None = None,
        expert_axis: str = "expert",
        data_axis: str | tuple[str, ...] | None = None,
        rngs: nnx.Rngs,
    ):
        """A module of num_experts experts of width d_model -> d_ff -> d_model, drawn from rngs;
        with mesh, its experts split over mesh axis expert_axis (`moe_layer_expert_parallel`).

        {MoEOptions}
        """
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(
                f"rngs must be an nnx.Rngs (e.g. nnx.Rngs(0)), got {rngs!r} ({type(rngs).__name__})"
            )
        for name, size in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts)):
            _require_size(name, size)
        for name, size in (("shared_d_ff", shared_d_ff), ("latent_dim", latent_dim)):
            if size is not None:
                _require_size(name, size)
        if mesh is None:
            if expert_axis != "expert" or data_axis is not None:
                raise ValueError(
                    f"expert_axis and data_axis name axes of a mesh, and mesh is None: got "
                    f"expert_axis={expert_axis!r}, data_axis={data_axis!r}")
            options.check_experts(num_experts)
            layer.check_one_device(options)
            data_axes = None
        else:
            # Kept as a tuple: the module's static state is hashed (a list would not be).
            data_axes = expert_parallel.check_mesh(mesh, expert_axis, data_axis, num_experts, options)[:-1]
        validation.require_bool("use_bias", use_bias)
        param_dtype = validation.dtype_option("param_dtype", param_dtype, validation.FLOAT_DTYPES)
        dtype = param_dtype if dtype is None else validation.dtype_option("dtype", dtype, validation.FLOAT_DTYPES)

        width = d_model if latent_dim is None else latent_dim
        self.router = nnx.Param(router_init(rngs.params(), (d_model, num_experts), jnp.float32))
        self.w1 = nnx.Param(kernel_init(rngs.params(), (num_experts, width, d_ff), param_dtype))
        self.b1 = nnx.Param(jnp.zeros((num_experts, d_ff), jnp.float32)) if use_bias else None
        self.w2 = nnx.Param(kernel_init(rngs.params(), (num_experts, d_ff, width), param_dtype))
        dense = lambda n, m: nnx.Param(dense_init(rngs.params(), (n, m), param_dtype))  # noqa: E731
        self.shared_w1 = None if shared_d_ff is None else dense(d_model, shared_d_ff)
        self.shared_w2 = None if shared_d_ff is None else dense(shared_d_ff, d_model)
        self.latent_in = None if latent_dim is None else dense(d_model, latent_dim)
        self.latent_out = None if latent_dim is None else dense(latent_dim, d_model)
        self.expert_bias = ExpertBias(jnp.zeros((num_experts,), jnp.float32)) if options.score == "sigmoid" else None
        self.d_model = d_model
        self.options = options
        self.dtype = dtype
        self.mesh, self.expert_axis, self.data_axis = mesh, expert_axis, data_axes
        self._place_on_mesh()

    def _place_on_mesh(self) -> None:
        """With a mesh, the experts' parameters split over expert_axis and every other one
        replicated, as each call takes them; left as they are when traced (a module built
        under jit or eval_shape: its caller places them)."""
        if self.mesh is None:
            return
        for field in dataclasses.fields(MoEWeights):  # the module's parameters are the block's weights
            variable = getattr(self, field.name)
            if variable is None or isinstance(variable[...], jax.core.Tracer):
                continue
            spec = PartitionSpec(self.expert_axis) if field.name in MoEWeights.PER_EXPERT else PartitionSpec()
            variable[...] = jax.device_put(variable[...], NamedSharding(self.mesh, spec))

    @classmethod
    @entry_point(fixed_options={"score": "sigmoid"}, required_options=("top_k",))
    def from_hf_nemotron_h(
        cls,
        tensors: Mapping[str, Any],
        *,
        options: MoEOptions | None = None,
        top_k: int = UNSET,
        num_groups: int = UNSET,
        top_groups: int | None = UNSET,
        normalize: bool = UNSET,
        scale: float = UNSET,
        round_to: int | None = UNSET,
        capacity_factor: float | None = UNSET,
        recompute_exchanged: bool = UNSET,
        deterministic: bool = UNSET,
        backend: str = UNSET,
        precision: Recipe | None = UNSET,
        dtype: Any = None,
        param_dtype: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        expert_axis: str = "expert",
        data_axis: str | tuple[str, ...] | None = None,
    ) -> MoE:
        """A Hugging Face NemotronHMoE block as a module, its weights loaded.

        tensors: the block's own names (no module prefix) -> arrays, as
        `jax_dsrelu.params_from_hf_nemotron_h` takes them, which checks them against each
        other. The options are the model config's (`num_experts_per_tok` as top_k,
        `n_group`, `topk_group`, `norm_topk_prob`, `routed_scaling_factor`; round_to, token
        rounding, is this library's and off by default): as keywords, or one MoEOptions
        with score="sigmoid" as options=. The scores
        are sigmoid, the block has no b1 (use_bias=False), and d_model, d_ff, num_experts,
        shared_d_ff and latent_dim come from the tensors' shapes. param_dtype=None keeps
        the experts' dtype of the checkpoint, and dtype=None computes in param_dtype, so
        that the module computes what `moe_layer(x, **params, ...)` does on the converted
        tensors; param_dtype=jnp.float32 with dtype=jnp.bfloat16 gives float32 parameters
        for training with bfloat16 experts. The router and expert_bias are float32, as in
        every MoE module. Nothing is drawn at random: no rngs is needed. mesh, expert_axis
        and data_axis are `__init__`'s.

        {MoEOptions}
        """
        params = params_from_hf_nemotron_h(tensors)
        d_model, num_experts = params["router"].shape
        shared, latent = params.get("shared_w1"), params.get("latent_in")
        param_dtype = params["w1"].dtype if param_dtype is None else param_dtype
        # Built with zeros (no random draws), then given the checkpoint's values.
        zeros = nnx.initializers.zeros
        module = cls(
            d_model, params["w1"].shape[2], num_experts, options=options,
            shared_d_ff=None if shared is None else shared.shape[1],
            latent_dim=None if latent is None else latent.shape[1], use_bias=False,
            dtype=dtype, param_dtype=param_dtype,
            router_init=zeros, kernel_init=zeros, dense_init=zeros, mesh=mesh, expert_axis=expert_axis,
            data_axis=data_axis, rngs=nnx.Rngs(0),
        )
        for name, value in params.items():
            variable = getattr(module, name)
            variable[...] = jnp.asarray(value, variable[...].dtype)
        module._place_on_mesh()
        return module

    def quantize_weights(self) -> QuantizedExpertWeights:
        """The routed experts' w1 and w2, in the compute dtype, quantized by the module's
        precision: made once where the weights are updated and passed to every micro-step's
        call (`quantized_weights=`), which then reads no weight in its GEMMs."""
        if self.options.precision is None:
            raise ValueError("quantize_weights needs a module built with precision= (an FP8 recipe), got None")
        return quantized_expert_mlp.quantize_expert_weights(
            self.w1[...].astype(self.dtype), self.w2[...].astype(self.dtype), self.options.precision,
            backend="xla" if self.options.backend == "xla" else "auto")

    def __call__(
        self, x: jax.Array, *, return_aux: bool = False, quantized_weights: QuantizedExpertWeights | None = None
    ) -> jax.Array | tuple[jax.Array, MoEAux]:
        """x (..., d_model) -> (..., d_model) in x.dtype; every leading axis is tokens (with a
        mesh, a multiple of the token shards in all). quantized_weights: `quantize_weights()`'s,
        read instead of quantizing w1 and w2 again."""
        validation.require_array("x", x, "(..., d_model)")
        if x.ndim < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x.shape[-1] must equal d_model={self.d_model}, got x.shape={tuple(x.shape)}")
        tokens = x.reshape(-1, x.shape[-1])
        value = lambda param: None if param is None else param[...]  # noqa: E731
        compute = lambda param: None if param is None else param[...].astype(self.dtype)  # noqa: E731
        weights = MoEWeights(
            router=self.router[...],
            w1=compute(self.w1),
            w2=compute(self.w2),
            b1=value(self.b1),
            expert_bias=value(self.expert_bias),
            shared_w1=compute(self.shared_w1),
            shared_w2=compute(self.shared_w2),
            latent_in=compute(self.latent_in),
            latent_out=compute(self.latent_out),
        )
        if self.mesh is not None:
            out = expert_parallel.moe_layer_expert_parallel(
                tokens, weights=weights, options=self.options, mesh=self.mesh, expert_axis=self.expert_axis,
                data_axis=self.data_axis, return_aux=return_aux, quantized_weights=quantized_weights)
        else:
            weights.check(tokens)
            quantized_expert_mlp.check_quantized_weights(quantized_weights, weights.w1, weights.w2,
                                                         self.options.precision)
            out = layer.apply(tokens, weights, self.options, return_aux, quantized_weights)
        if return_aux:
            out, aux = out
            return out.reshape(x.shape), aux
        return out.reshape(x.shape)

    def update_expert_bias(self, group_sizes: jax.Array, rate: float | jax.Array) -> None:
        """expert_bias += rate * sign(mean(group_sizes) - group_sizes) (`jax_dsrelu.update_expert_bias`).

        group_sizes (E,): the step's assignments per expert over all its tokens, e.g.
        `aux.group_sizes` from `layer(x, return_aux=True)` (global ones under data
        parallelism: see `jax_dsrelu.update_expert_bias`). Works inside `nnx.jit`.
        """
        if self.expert_bias is None:
            raise ValueError(
                f"update_expert_bias needs score='sigmoid' "
                f"(the module has score={self.options.score!r} and no expert_bias)"
            )
        self.expert_bias[...] = update_expert_bias(self.expert_bias[...], group_sizes, rate)


def _require_size(name: str, value: Any) -> None:
    validation.require_int(name, value)
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {name}={value}")


"""`MoE`: `jax_dsrelu.moe_layer` as a Flax NNX module (needs the `flax` extra).

    from jax_dsrelu.flax import MoE
    layer = MoE(d_model=256, d_ff=512, num_experts=8, top_k=2, rngs=nnx.Rngs(0))
    y = layer(x)                             # x (..., d_model) -> (..., d_model)
    y, aux = layer(x, return_aux=True)       # aux: jax_dsrelu.MoEAux (losses, group sizes)

It works with `nnx.jit`, `nnx.value_and_grad` and `nnx.Optimizer` over optax.
"""

from __future__ import annotations

from typing import Any

try:
    from flax import nnx
except ImportError as error:  # flax is an optional extra
    raise ImportError(
        "jax_dsrelu.flax needs Flax: pip install 'jax-dsrelu[flax]' (or pip install flax)"
    ) from error

import jax
import jax.numpy as jnp

from jax_dsrelu.moe.layer import MoEAux, moe_layer

# Fan-in scaling per expert: the expert axis 0 is a batch of independent matrices.
_EXPERT_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
# Logits of order 1 at the start: routing is then neither uniform (where every tie would
# go to the lowest experts) nor saturated.
_ROUTER_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class MoE(nnx.Module):
    """A dropless top-k mixture of squared-ReLU experts.

    Parameters (nnx.Param): router (d_model, E) float32; w1 (E, d_model, d_ff) and
    w2 (E, d_ff, d_model) in param_dtype; b1 (E, d_ff) float32 when use_bias.
    The experts compute in `dtype` (param_dtype when None): bfloat16 there, with float32
    parameters, is the usual mixed precision for the GPU kernels.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        *,
        top_k: int = 2,
        normalize: bool = False,
        use_bias: bool = True,
        deterministic: bool = False,
        backend: str = "auto",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        router_init=_ROUTER_INIT,
        kernel_init=_EXPERT_INIT,
        rngs: nnx.Rngs,
    ):
        self.router = nnx.Param(router_init(rngs.params(), (d_model, num_experts), jnp.float32))
        self.w1 = nnx.Param(kernel_init(rngs.params(), (num_experts, d_model, d_ff), param_dtype))
        self.b1 = nnx.Param(jnp.zeros((num_experts, d_ff), jnp.float32)) if use_bias else None
        self.w2 = nnx.Param(kernel_init(rngs.params(), (num_experts, d_ff, d_model), param_dtype))
        self.top_k = top_k
        self.normalize = normalize
        self.deterministic = deterministic
        self.backend = backend
        self.dtype = param_dtype if dtype is None else dtype

    def __call__(self, x: jax.Array, *, return_aux: bool = False) -> jax.Array | tuple[jax.Array, MoEAux]:
        """x (..., d_model) -> (..., d_model) in x.dtype; every leading axis is tokens."""
        tokens = x.reshape(-1, x.shape[-1])
        out = moe_layer(
            tokens,
            self.router[...],
            self.w1[...].astype(self.dtype),
            self.w2[...].astype(self.dtype),
            b1=None if self.b1 is None else self.b1[...],
            top_k=self.top_k,
            normalize=self.normalize,
            deterministic=self.deterministic,
            backend=self.backend,
            return_aux=return_aux,
        )
        if return_aux:
            out, aux = out
            return out.reshape(x.shape), aux
        return out.reshape(x.shape)

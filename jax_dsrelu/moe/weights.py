"""`MoEWeights`: the arrays of one MoE block, checked against each other and its tokens.

One pytree for what `moe_layer`, `moe_layer_expert_parallel` and `jax_dsrelu.flax.MoE`
multiply by: the entry points take it whole (weights=) or build it from their arrays,
the steps of the layer take it whole, and expert parallelism places it on a mesh field by
field. Shapes are named as `moe_layer`'s docstring names them, with l the experts' width
(l = d without latent projections).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import numpy as np

from jax_dsrelu.moe import routing
from jax_dsrelu.primitives import validation


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "router", "w1", "w2", "b1", "expert_bias", "shared_w1", "shared_w2", "latent_in", "latent_out",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class MoEWeights:
    """An MoE block's weights; the optional ones are None when the block has none.

    A pytree of its arrays (a None weight has no leaf), so it passes whole through
    `jax.jit`, and `jax.grad` of a function of it returns the gradients as an MoEWeights:

        weights = MoEWeights(router, w1, w2, b1=b1)       # or MoEWeights(**params_from_hf_nemotron_h(tensors))
        out = moe_layer(x, weights=weights, options=MoEOptions(top_k=6))
        grads = jax.grad(lambda w: loss(moe_layer(x, weights=w)))(weights)
    """

    router: jax.Array  # (d, E)
    w1: jax.Array  # (E, l, f)
    w2: jax.Array  # (E, f, l)
    b1: jax.Array | None = None  # (E, f)
    expert_bias: jax.Array | None = None  # (E,) selection bias, no gradient
    shared_w1: jax.Array | None = None  # (d, fs)
    shared_w2: jax.Array | None = None  # (fs, d)
    latent_in: jax.Array | None = None  # (d, l)
    latent_out: jax.Array | None = None  # (l, d)

    # The weights whose axis 0 is the expert axis: what expert parallelism splits.
    PER_EXPERT: ClassVar[tuple[str, ...]] = ("w1", "w2", "b1")

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def check(self, x) -> None:
        """Raises unless x (T, d) and the weights fit together; each error names the
        argument, its shape and the size it must have."""
        router, w1, w2, b1 = self.router, self.w1, self.w2, self.b1
        for name, array, layout in (("x", x, "(T, d)"), ("router", router, "(d, E)")):
            validation.require_array(name, array, layout)
            validation.require_rank(name, array, 2, layout)
        d = x.shape[1]
        validation.require_dim("router", router, 0, d, "x.shape[1] (d)")
        latent, latent_name = d, "x.shape[1] (d)"
        _require_pair("latent_in", self.latent_in, "latent_out", self.latent_out)
        if self.latent_in is not None:
            _check_projections(d, "latent_in", self.latent_in, "latent_out", self.latent_out, "l", same_dtype=False)
            latent, latent_name = self.latent_in.shape[1], "latent_in.shape[1] (l)"
        width = "l" if self.latent_in is not None else "d"
        for name, array, layout in (("w1", w1, f"(E, {width}, f)"), ("w2", w2, f"(E, f, {width})")):
            validation.require_array(name, array, layout)
            validation.require_rank(name, array, 3, layout)
        validation.require_experts("w1", w1)
        num_experts, _, f = w1.shape
        validation.require_dim("router", router, 1, num_experts, "w1.shape[0] (E)")
        validation.require_dim("w1", w1, 1, latent, latent_name)
        validation.require_dim("w2", w2, 0, num_experts, "w1.shape[0] (E)")
        validation.require_dim("w2", w2, 1, f, "w1.shape[2] (f)")
        validation.require_dim("w2", w2, 2, latent, latent_name)
        validation.require_dtype("x", x, validation.FLOAT_DTYPES)
        validation.require_dtype("router", router, validation.FLOAT_DTYPES)
        validation.require_dtype("w1", w1, validation.FLOAT_DTYPES)
        _require_same_dtype("w2", w2, "w1", w1)
        if b1 is not None:
            validation.require_array("b1", b1, "(E, f)")
            validation.require_rank("b1", b1, 2, "(E, f)")
            validation.require_dim("b1", b1, 0, num_experts, "w1.shape[0] (E)")
            validation.require_dim("b1", b1, 1, f, "w1.shape[2] (f)")
            validation.require_dtype("b1", b1, validation.FLOAT_DTYPES)
        routing.check_expert_bias(self.expert_bias, num_experts)
        _require_pair("shared_w1", self.shared_w1, "shared_w2", self.shared_w2)
        if self.shared_w1 is not None:
            _check_projections(d, "shared_w1", self.shared_w1, "shared_w2", self.shared_w2, "fs", same_dtype=True)


def _check_projections(d: int, first: str, first_array, second: str, second_array, inner: str,
                       same_dtype: bool) -> None:
    """A pair of projections out of the tokens' width d and back, (d, inner) then
    (inner, d): the latent projections, or the shared expert's two weights (which must
    share a dtype, as one `moe_mlp` runs them)."""
    for name, array, layout in ((first, first_array, f"(d, {inner})"), (second, second_array, f"({inner}, d)")):
        validation.require_array(name, array, layout)
        validation.require_rank(name, array, 2, layout)
    validation.require_dim(first, first_array, 0, d, "x.shape[1] (d)")
    validation.require_dim(second, second_array, 0, first_array.shape[1], f"{first}.shape[1] ({inner})")
    validation.require_dim(second, second_array, 1, d, "x.shape[1] (d)")
    validation.require_dtype(first, first_array, validation.FLOAT_DTYPES)
    if same_dtype:
        _require_same_dtype(second, second_array, first, first_array)
    else:
        validation.require_dtype(second, second_array, validation.FLOAT_DTYPES)


def _require_pair(first: str, first_value, second: str, second_value) -> None:
    if (first_value is None) != (second_value is None):
        given, missing = (first, second) if second_value is None else (second, first)
        raise ValueError(f"{first} and {second} go together: got {given} but {missing}=None")


def _require_same_dtype(name: str, array, other_name: str, other) -> None:
    if np.dtype(array.dtype) != np.dtype(other.dtype):
        raise TypeError(
            f"{name}.dtype must equal {other_name}.dtype={np.dtype(other.dtype).name}, "
            f"got {name}.dtype={np.dtype(array.dtype).name}"
        )

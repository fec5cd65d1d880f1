"""`params_from_hf_nemotron_h`: a Hugging Face NemotronHMoE block's tensors as `moe_layer` arguments.

Hugging Face's NemotronHMoE (transformers' `modeling_nemotron_h.py`) stores every weight
as torch's Linear does, (out, in), and applies it as `x @ weight.T`; `moe_layer` takes
(in, out). So each weight is transposed here, once:

    HF name (shape)                                   moe_layer argument (shape)
    gate.weight (E, d)                                router (d, E)
    gate.e_score_correction_bias (E,)                 expert_bias (E,) float32
    experts.up_proj (E, f, l)                         w1 (E, l, f)
    experts.down_proj (E, l, f)                       w2 (E, f, l)
    shared_experts.up_proj.weight (fs, d)             shared_w1 (d, fs)
    shared_experts.down_proj.weight (d, fs)           shared_w2 (fs, d)
    fc1_latent_proj.weight (l, d)                     latent_in (d, l)
    fc2_latent_proj.weight (d, l)                     latent_out (l, d)

Checkpoints that keep one module per expert (`experts.{e}.up_proj.weight` (f, l) and
`experts.{e}.down_proj.weight` (l, f), e = 0..E-1) are accepted too and stacked.

The block's options come from the model's config, not from the tensors: with
`num_experts_per_tok` as top_k, `n_group` and `topk_group` as num_groups and
top_groups, `norm_topk_prob` as normalize and `routed_scaling_factor` as scale,

    moe_layer(x, **params, top_k=6, score="sigmoid", normalize=True, scale=2.5)

is the block's forward (Nemotron 3 Nano's settings). Where Hugging Face's code has no
answer, the library's is: ties in the selection go to the lower expert index
(torch.topk's order among ties is unspecified), and a group of one expert scores that
expert (Hugging Face's top-2 within a group needs two). The routing weight multiplies
the activation before the down-projection, where Hugging Face multiplies the expert's
output: the same in exact arithmetic, other roundings in bfloat16. Latent projections
and shared experts with a bias (`mlp_bias=True`) are not supported.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

# HF name -> (moe_layer argument, the rank HF stores it with, its layout there).
_TRANSPOSED = {
    "gate.weight": ("router", 2, "(E, d)"),
    "shared_experts.up_proj.weight": ("shared_w1", 2, "(fs, d)"),
    "shared_experts.down_proj.weight": ("shared_w2", 2, "(d, fs)"),
    "fc1_latent_proj.weight": ("latent_in", 2, "(l, d)"),
    "fc2_latent_proj.weight": ("latent_out", 2, "(d, l)"),
    "experts.up_proj": ("w1", 3, "(E, f, l)"),
    "experts.down_proj": ("w2", 3, "(E, l, f)"),
}
_BIAS = "gate.e_score_correction_bias"
_PER_EXPERT = re.compile(r"experts\.(\d+)\.(up_proj|down_proj)\.weight")


def params_from_hf_nemotron_h(tensors: Mapping[str, Any]) -> dict[str, jax.Array]:
    """tensors: the block's own names (no module prefix such as `backbone.layers.3.mixer.`)
    -> NumPy or JAX arrays. Returns {router, w1, w2, expert_bias[, shared_w1, shared_w2]
    [, latent_in, latent_out]}: `moe_layer` keyword arguments (see the module docstring),
    each transposed to (in, out) and in the dtype it came in (expert_bias in float32).

    Load the arrays as NumPy or JAX arrays, e.g. with safetensors'
    `safe_open(path, framework="flax")`; torch tensors in bfloat16 do not convert.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping from names to arrays, got {type(tensors).__name__}")
    tensors = _stack_per_expert(dict(tensors))
    unknown = sorted(set(tensors) - set(_TRANSPOSED) - {_BIAS})
    if unknown:
        raise ValueError(
            f"tensors has names that are not a NemotronHMoE block's: {unknown}; expected the block's own "
            f"names without a module prefix: {sorted([*_TRANSPOSED, _BIAS])}"
        )
    for name in ("gate.weight", _BIAS, "experts.up_proj", "experts.down_proj"):
        if name not in tensors:
            raise ValueError(f"tensors lacks {name!r}, which every NemotronHMoE block has")
    params = {}
    for name, (argument, rank, layout) in _TRANSPOSED.items():
        if name not in tensors:
            continue
        array = jnp.asarray(tensors[name])
        if array.ndim != rank:
            raise ValueError(f"tensors[{name!r}] must be {layout}, got shape {tuple(array.shape)}")
        params[argument] = jnp.swapaxes(array, -1, -2)
    bias = jnp.asarray(tensors[_BIAS])
    num_experts = params["router"].shape[1]
    if bias.shape != (num_experts,):
        raise ValueError(
            f"tensors[{_BIAS!r}] must be (E,) with E={num_experts} (gate.weight.shape[0]), got shape {tuple(bias.shape)}"
        )
    # Hugging Face keeps this bias in float32 whatever the model's dtype.
    params["expert_bias"] = bias.astype(jnp.float32)
    for pair in (
        ("shared_experts.up_proj.weight", "shared_experts.down_proj.weight"),
        ("fc1_latent_proj.weight", "fc2_latent_proj.weight"),
    ):
        if (pair[0] in tensors) != (pair[1] in tensors):
            given, missing = pair if pair[0] in tensors else pair[::-1]
            raise ValueError(f"tensors has {given!r} but not {missing!r}: the block needs both or neither")
    # The shapes against each other are checked by moe_layer, which names the arguments.
    return params


def _stack_per_expert(tensors: dict[str, Any]) -> dict[str, Any]:
    """`experts.{e}.up_proj.weight` (f, l) and `.down_proj.weight` (l, f) stacked into the
    fused `experts.up_proj` (E, f, l) and `experts.down_proj` (E, l, f)."""
    found: dict[str, dict[int, Any]] = {"up_proj": {}, "down_proj": {}}
    for name in list(tensors):
        match = _PER_EXPERT.fullmatch(name)
        if match:
            found[match.group(2)][int(match.group(1))] = tensors.pop(name)
    for projection, experts in found.items():
        if not experts:
            continue
        fused = f"experts.{projection}"
        if fused in tensors:
            raise ValueError(f"tensors has both {fused!r} and per-expert experts.{{e}}.{projection}.weight")
        if sorted(experts) != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise ValueError(f"tensors lacks experts.{{e}}.{projection}.weight for e in {missing}")
        tensors[fused] = jnp.stack([jnp.asarray(experts[e]) for e in range(len(experts))])
    return tensors

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
`experts.{e}.down_proj.weight` (l, f), e = 0..E-1) are accepted too, and stacked by the
expert number e in each name.

`jax_dsrelu.flax.MoE.from_hf_nemotron_h(tensors, top_k=...)` builds a Flax module from
the same tensors.

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
import numpy as np

from jax_dsrelu.primitives import validation

# HF name -> (moe_layer argument, its layout as HF stores it, (out, in)). Dimensions named
# alike must agree across the tensors; the first tensor in this order that has a dimension
# sets its size. Without latent projections the experts run in width l = d.
_TENSORS = {
    "gate.weight": ("router", "(E, d)"),
    "experts.up_proj": ("w1", "(E, f, l)"),
    "experts.down_proj": ("w2", "(E, l, f)"),
    "gate.e_score_correction_bias": ("expert_bias", "(E,)"),
    "fc1_latent_proj.weight": ("latent_in", "(l, d)"),
    "fc2_latent_proj.weight": ("latent_out", "(d, l)"),
    "shared_experts.up_proj.weight": ("shared_w1", "(fs, d)"),
    "shared_experts.down_proj.weight": ("shared_w2", "(d, fs)"),
}
_BIAS = "gate.e_score_correction_bias"
_REQUIRED = ("gate.weight", _BIAS, "experts.up_proj", "experts.down_proj")
# Tensors that come together, and whose dtypes must agree.
_PAIRS = (
    ("experts.up_proj", "experts.down_proj"),
    ("shared_experts.up_proj.weight", "shared_experts.down_proj.weight"),
    ("fc1_latent_proj.weight", "fc2_latent_proj.weight"),
)
_PER_EXPERT = re.compile(r"experts\.(\d+)\.(up_proj|down_proj)\.weight")


def params_from_hf_nemotron_h(tensors: Mapping[str, Any]) -> dict[str, jax.Array]:
    """tensors: the block's own names (no module prefix such as `backbone.layers.3.mixer.`)
    -> NumPy or JAX arrays. Returns {router, w1, w2, expert_bias[, shared_w1, shared_w2]
    [, latent_in, latent_out]}: `moe_layer` keyword arguments (see the module docstring),
    each transposed to (in, out) and in the dtype it came in (expert_bias in float32).

    The tensors are checked against each other here, and every error names the tensor by
    its Hugging Face name: an expert count that differs from gate.weight's, up and down
    projections of different widths, latent or shared projections that do not fit d.

    Load the arrays as NumPy or JAX arrays, e.g. with safetensors'
    `safe_open(path, framework="flax")`; torch tensors in bfloat16 do not convert.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping from names to arrays, got {type(tensors).__name__}")
    tensors = _stack_per_expert(dict(tensors))
    unknown = sorted(set(tensors) - set(_TENSORS))
    if unknown:
        raise ValueError(
            f"tensors has names that are not a NemotronHMoE block's: {unknown}; expected the block's own "
            f"names without a module prefix: {sorted(_TENSORS)}"
        )
    for name in _REQUIRED:
        if name not in tensors:
            raise ValueError(f"tensors lacks {name!r}, which every NemotronHMoE block has")
    for pair in _PAIRS:
        if (pair[0] in tensors) != (pair[1] in tensors):
            given, missing = pair if pair[0] in tensors else pair[::-1]
            raise ValueError(f"tensors has {given!r} but not {missing!r}: the block needs both or neither")
    arrays = {name: _array(name, tensors[name], _TENSORS[name][1]) for name in _TENSORS if name in tensors}
    _check_shapes(arrays)
    for first, second in _PAIRS:
        if first in arrays and arrays[first].dtype != arrays[second].dtype:
            raise TypeError(
                f"tensors[{second!r}].dtype must equal tensors[{first!r}].dtype={np.dtype(arrays[first].dtype).name}, "
                f"got {np.dtype(arrays[second].dtype).name}"
            )
    params = {_TENSORS[name][0]: jnp.swapaxes(array, -1, -2) for name, array in arrays.items() if name != _BIAS}
    # Hugging Face keeps this bias in float32 whatever the model's dtype.
    params["expert_bias"] = arrays[_BIAS].astype(jnp.float32)
    return params


def _array(name: str, value: Any, layout: str) -> jax.Array:
    """tensors[name] as a JAX array of its layout's rank and a float dtype."""
    label = f"tensors[{name!r}]"
    validation.require_array(label, value, layout)
    array = jnp.asarray(value)
    if array.ndim != len(_dims(layout)):
        raise ValueError(f"{label} must be {layout}, got shape {tuple(array.shape)}")
    validation.require_dtype(label, array, validation.FLOAT_DTYPES)
    return array


def _check_shapes(arrays: dict[str, jax.Array]) -> None:
    """Every dimension named in several layouts has one size ("E" in gate.weight and the
    experts, "f" in up_proj and down_proj, ...); an error names the tensor and where the
    size it must have came from."""
    sizes: dict[str, tuple[int, str]] = {}
    if "fc1_latent_proj.weight" not in arrays:
        # The experts then run in the model's width: l is gate.weight's d.
        sizes["l"] = (arrays["gate.weight"].shape[1], "gate.weight.shape[1], d: the block has no latent projections")
    for name, array in arrays.items():
        layout = _TENSORS[name][1]
        for axis, dim in enumerate(_dims(layout)):
            if dim not in sizes:
                sizes[dim] = (array.shape[axis], f"{name}.shape[{axis}]")
            elif array.shape[axis] != sizes[dim][0]:
                size, origin = sizes[dim]
                raise ValueError(
                    f"tensors[{name!r}] must be {layout} with {dim}={size} ({origin}), got shape {tuple(array.shape)}"
                )
    if sizes["E"][0] == 0:
        raise ValueError(f"tensors['gate.weight'] must have at least one expert, got shape {tuple(arrays['gate.weight'].shape)}")


def _dims(layout: str) -> list[str]:
    """The dimension names of a layout: "(E, f, l)" -> ["E", "f", "l"]."""
    return [dim.strip() for dim in layout.strip("()").split(",") if dim.strip()]


def _stack_per_expert(tensors: dict[str, Any]) -> dict[str, Any]:
    """`experts.{e}.up_proj.weight` (f, l) and `.down_proj.weight` (l, f) stacked into the
    fused `experts.up_proj` (E, f, l) and `experts.down_proj` (E, l, f), expert e at index
    e: by the number in the name, not by the mapping's order, which in a checkpoint is
    the names' text order (experts.10 before experts.2)."""
    found: dict[str, dict[int, tuple[str, Any]]] = {"up_proj": {}, "down_proj": {}}
    for name in list(tensors):
        match = _PER_EXPERT.fullmatch(name)
        if match:
            found[match.group(2)][int(match.group(1))] = (name, tensors.pop(name))
    for projection, experts in found.items():
        if not experts:
            continue
        fused = f"experts.{projection}"
        if fused in tensors:
            raise ValueError(f"tensors has both {fused!r} and per-expert experts.{{e}}.{projection}.weight")
        if sorted(experts) != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise ValueError(f"tensors lacks experts.{{e}}.{projection}.weight for e in {missing}")
        layout = "(f, l)" if projection == "up_proj" else "(l, f)"
        first_name, first = experts[0]
        for e in range(len(experts)):
            name, value = experts[e]
            validation.require_array(f"tensors[{name!r}]", value, layout)
            if tuple(value.shape) != tuple(first.shape):
                raise ValueError(
                    f"tensors[{name!r}] must have the shape of {first_name}, {tuple(first.shape)}, "
                    f"got shape {tuple(value.shape)}"
                )
        tensors[fused] = jnp.stack([jnp.asarray(experts[e][1]) for e in range(len(experts))])
    return tensors

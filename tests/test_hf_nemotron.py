"""params_from_hf_nemotron_h on synthetic tensors under Hugging Face's NemotronHMoE names.

That the converted block computes Hugging Face's forward is shown in test_moe_block.py;
here: the names, the transposes, the per-expert checkpoint form and the errors.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax_dsrelu

E, D, F, L, FS = 6, 10, 7, 4, 9


def tensors(latent=True, shared=True, dtype=np.float32):
    rng = np.random.default_rng(0)
    out = {
        "gate.weight": rng.standard_normal((E, D)),
        "gate.e_score_correction_bias": rng.standard_normal(E),
        "experts.up_proj": rng.standard_normal((E, F, L if latent else D)),
        "experts.down_proj": rng.standard_normal((E, L if latent else D, F)),
    }
    if shared:
        out["shared_experts.up_proj.weight"] = rng.standard_normal((FS, D))
        out["shared_experts.down_proj.weight"] = rng.standard_normal((D, FS))
    if latent:
        out["fc1_latent_proj.weight"] = rng.standard_normal((L, D))
        out["fc2_latent_proj.weight"] = rng.standard_normal((D, L))
    return {name: array.astype(dtype) for name, array in out.items()}


def test_names_and_transposes():
    hf = tensors()
    params = jax_dsrelu.params_from_hf_nemotron_h(hf)
    assert set(params) == {"router", "w1", "w2", "expert_bias", "shared_w1", "shared_w2", "latent_in", "latent_out"}
    np.testing.assert_array_equal(params["router"], hf["gate.weight"].T)
    np.testing.assert_array_equal(params["expert_bias"], hf["gate.e_score_correction_bias"])
    # Expert e's up-projection is x @ up_proj[e].T: w1[e] = up_proj[e].T.
    for e in range(E):
        np.testing.assert_array_equal(params["w1"][e], hf["experts.up_proj"][e].T)
        np.testing.assert_array_equal(params["w2"][e], hf["experts.down_proj"][e].T)
    np.testing.assert_array_equal(params["shared_w1"], hf["shared_experts.up_proj.weight"].T)
    np.testing.assert_array_equal(params["shared_w2"], hf["shared_experts.down_proj.weight"].T)
    np.testing.assert_array_equal(params["latent_in"], hf["fc1_latent_proj.weight"].T)
    np.testing.assert_array_equal(params["latent_out"], hf["fc2_latent_proj.weight"].T)
    assert {name: tuple(array.shape) for name, array in params.items()} == {
        "router": (D, E), "w1": (E, L, F), "w2": (E, F, L), "expert_bias": (E,),
        "shared_w1": (D, FS), "shared_w2": (FS, D), "latent_in": (D, L), "latent_out": (L, D),
    }


def test_dtypes_are_kept_but_the_bias_is_float32():
    import ml_dtypes

    params = jax_dsrelu.params_from_hf_nemotron_h(tensors(dtype=ml_dtypes.bfloat16))
    assert params["w1"].dtype == ml_dtypes.bfloat16 and params["router"].dtype == ml_dtypes.bfloat16
    assert params["expert_bias"].dtype == np.float32


def test_without_shared_expert_or_latent_and_the_block_runs():
    import jax.numpy as jnp

    params = jax_dsrelu.params_from_hf_nemotron_h(tensors(latent=False, shared=False))
    assert set(params) == {"router", "w1", "w2", "expert_bias"}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, D)), jnp.float32)
    out = jax_dsrelu.moe_layer(x, **params, top_k=2, score="sigmoid", normalize=True, scale=2.5)
    assert out.shape == (8, D)


def test_per_expert_checkpoints_are_stacked():
    hf = tensors()
    per_expert = {name: array for name, array in hf.items() if not name.startswith("experts.")}
    for e in range(E):
        per_expert[f"experts.{e}.up_proj.weight"] = hf["experts.up_proj"][e]
        per_expert[f"experts.{e}.down_proj.weight"] = hf["experts.down_proj"][e]
    fused, stacked = jax_dsrelu.params_from_hf_nemotron_h(hf), jax_dsrelu.params_from_hf_nemotron_h(per_expert)
    for name in fused:
        np.testing.assert_array_equal(stacked[name], fused[name], err_msg=name)
    del per_expert["experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"tensors lacks experts.\{e\}.up_proj.weight for e in \[3\]"):
        jax_dsrelu.params_from_hf_nemotron_h(per_expert)


def test_errors_name_the_tensor():
    convert = jax_dsrelu.params_from_hf_nemotron_h
    hf = tensors()
    with pytest.raises(ValueError, match=r"names that are not a NemotronHMoE block's: \['backbone.layers.1.mixer.gate.weight'\]"):
        convert({**{k: v for k, v in hf.items() if k != "gate.weight"}, "backbone.layers.1.mixer.gate.weight": hf["gate.weight"]})
    with pytest.raises(ValueError, match="tensors lacks 'gate.e_score_correction_bias'"):
        convert({k: v for k, v in hf.items() if k != "gate.e_score_correction_bias"})
    with pytest.raises(ValueError, match=r"tensors\['experts.up_proj'\] must be \(E, f, l\), got shape \(6, 7\)"):
        convert({**hf, "experts.up_proj": hf["experts.up_proj"][:, :, 0]})
    with pytest.raises(ValueError, match=r"must be \(E,\) with E=6 \(gate.weight.shape\[0\]\), got shape \(5,\)"):
        convert({**hf, "gate.e_score_correction_bias": hf["gate.e_score_correction_bias"][:5]})
    with pytest.raises(ValueError, match="tensors has 'shared_experts.up_proj.weight' but not 'shared_experts.down_proj.weight': the block needs both or neither"):
        convert({k: v for k, v in hf.items() if k != "shared_experts.down_proj.weight"})
    with pytest.raises(TypeError, match="tensors must be a mapping from names to arrays, got list"):
        convert(list(hf.values()))


def test_per_expert_tensors_are_stacked_by_expert_number_not_by_the_mappings_order():
    # A checkpoint lists its tensors in the text order of their names, experts.10 before
    # experts.2: stacking in the mapping's order would give expert 2 the weights of 10.
    num_experts = 12
    rng = np.random.default_rng(5)
    up = rng.standard_normal((num_experts, F, D)).astype(np.float32)
    down = rng.standard_normal((num_experts, D, F)).astype(np.float32)
    per_expert = {}
    for e in range(num_experts):
        per_expert[f"experts.{e}.up_proj.weight"] = up[e]
        per_expert[f"experts.{e}.down_proj.weight"] = down[e]
    listed = {
        "gate.weight": rng.standard_normal((num_experts, D)).astype(np.float32),
        "gate.e_score_correction_bias": np.zeros(num_experts, np.float32),
        **{name: per_expert[name] for name in sorted(per_expert)},
    }
    names = list(listed)
    assert names.index("experts.10.up_proj.weight") < names.index("experts.2.up_proj.weight")
    params = jax_dsrelu.params_from_hf_nemotron_h(listed)
    for e in range(num_experts):
        np.testing.assert_array_equal(params["w1"][e], up[e].T, err_msg=f"w1[{e}]")
        np.testing.assert_array_equal(params["w2"][e], down[e].T, err_msg=f"w2[{e}]")


# (HF name, how it is made wrong, the words of the error): each tensor against the others.
MISMATCHES = [
    ("experts.up_proj", lambda t: t[:5],
     "tensors['experts.up_proj'] must be (E, f, l) with E=6 (gate.weight.shape[0]), got shape (5, 7, 4)"),
    ("experts.down_proj", lambda t: t[:5],
     "tensors['experts.down_proj'] must be (E, l, f) with E=6 (gate.weight.shape[0]), got shape (5, 4, 7)"),
    ("experts.down_proj", lambda t: t[:, :, :5],
     "tensors['experts.down_proj'] must be (E, l, f) with f=7 (experts.up_proj.shape[1]), got shape (6, 4, 5)"),
    ("experts.down_proj", lambda t: t[:, :3],
     "tensors['experts.down_proj'] must be (E, l, f) with l=4 (experts.up_proj.shape[2]), got shape (6, 3, 7)"),
    ("gate.e_score_correction_bias", lambda t: np.zeros(7, np.float32),
     "tensors['gate.e_score_correction_bias'] must be (E,) with E=6 (gate.weight.shape[0]), got shape (7,)"),
    ("fc1_latent_proj.weight", lambda t: t[:3],
     "tensors['fc1_latent_proj.weight'] must be (l, d) with l=4 (experts.up_proj.shape[2]), got shape (3, 10)"),
    ("fc1_latent_proj.weight", lambda t: t[:, :9],
     "tensors['fc1_latent_proj.weight'] must be (l, d) with d=10 (gate.weight.shape[1]), got shape (4, 9)"),
    ("fc2_latent_proj.weight", lambda t: t[:9],
     "tensors['fc2_latent_proj.weight'] must be (d, l) with d=10 (gate.weight.shape[1]), got shape (9, 4)"),
    ("fc2_latent_proj.weight", lambda t: t[:, :3],
     "tensors['fc2_latent_proj.weight'] must be (d, l) with l=4 (experts.up_proj.shape[2]), got shape (10, 3)"),
    ("shared_experts.up_proj.weight", lambda t: t[:, :9],
     "tensors['shared_experts.up_proj.weight'] must be (fs, d) with d=10 (gate.weight.shape[1]), got shape (9, 9)"),
    ("shared_experts.down_proj.weight", lambda t: t[:, :8],
     "tensors['shared_experts.down_proj.weight'] must be (d, fs) with fs=9 (shared_experts.up_proj.weight.shape[0]), got shape (10, 8)"),
    ("shared_experts.down_proj.weight", lambda t: t[:9],
     "tensors['shared_experts.down_proj.weight'] must be (d, fs) with d=10 (gate.weight.shape[1]), got shape (9, 9)"),
    ("experts.down_proj", lambda t: t.astype(np.float16),
     "tensors['experts.down_proj'].dtype must equal tensors['experts.up_proj'].dtype=float32, got float16"),
    ("shared_experts.down_proj.weight", lambda t: t.astype(np.float16),
     "tensors['shared_experts.down_proj.weight'].dtype must equal tensors['shared_experts.up_proj.weight'].dtype=float32, got float16"),
    ("gate.weight", lambda t: t.astype(np.int32),
     "tensors['gate.weight'].dtype must be one of bfloat16, float16, float32, got tensors['gate.weight'].dtype=int32"),
]


@pytest.mark.parametrize("name, change, words", MISMATCHES)
def test_tensors_are_checked_against_each_other_and_named(name, change, words):
    hf = tensors()
    hf[name] = change(hf[name])
    with pytest.raises((ValueError, TypeError)) as caught:
        jax_dsrelu.params_from_hf_nemotron_h(hf)
    assert str(caught.value) == words


def test_without_latent_projections_the_experts_must_run_in_width_d():
    hf = tensors(latent=False)
    hf["experts.up_proj"], hf["experts.down_proj"] = hf["experts.up_proj"][:, :, :4], hf["experts.down_proj"][:, :4]
    with pytest.raises(ValueError) as caught:
        jax_dsrelu.params_from_hf_nemotron_h(hf)
    assert str(caught.value) == (
        "tensors['experts.up_proj'] must be (E, f, l) with l=10 (gate.weight.shape[1], d: the block has no "
        "latent projections), got shape (6, 7, 4)"
    )

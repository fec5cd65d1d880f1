"""The Nemotron-H / DeepSeek-V3 style MoE block (sigmoid routing, selection bias, groups,
scaled weights, shared expert, latent projections) against Hugging Face's NemotronHMoE.

Values: `moe_layer` on the converted weights against a float64 NumPy transcription of
NemotronHMoE's forward, written here from its definition. Gradients: against `jax.grad`
of a per-token jnp block with the same selection, in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_search import scatter_adds

import jax_dsrelu

U = 2.0**-24  # float32 unit roundoff


# ---- Hugging Face's NemotronHMoE forward, in float64 NumPy, in its own (out, in) layout ----


def hf_route(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor, score="sigmoid"):
    """(T, E) float64 logits -> (chosen (T, top_k), weights (T, top_k)).

    NemotronHTopkRouter and NemotronHMoE.route_tokens_to_experts: sigmoid scores, bias
    for the choice, groups scored by the sum of their top two (top one for one-expert
    groups, which Hugging Face cannot take), dropped groups at -inf, the weights the
    unbiased scores, divided by their sum + 1e-20, times the scaling factor. Softmax is
    the library's other score, with no epsilon. Ties to the lower index (stable sorts).
    """
    if score == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores /= scores.sum(axis=1, keepdims=True)
    choice = scores + (0.0 if bias is None else bias)
    num_tokens, num_experts = logits.shape
    grouped = choice.reshape(num_tokens, n_group, num_experts // n_group)
    top_two = -np.sort(-grouped, axis=-1)[..., :2]
    group_scores = top_two.sum(axis=-1)
    kept = np.argsort(-group_scores, axis=1, kind="stable")[:, :topk_group]
    group_mask = np.zeros((num_tokens, n_group), bool)
    np.put_along_axis(group_mask, kept, True, axis=1)
    choice = np.where(np.repeat(group_mask, num_experts // n_group, axis=1), choice, -np.inf)
    chosen = np.argsort(-choice, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, chosen, axis=1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=1, keepdims=True) + (1e-20 if score == "sigmoid" else 0.0))
    return chosen, weights * routed_scaling_factor, choice


def hf_block(tensors, x, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor, score="sigmoid", b1=None):
    """NemotronHMoE.forward on (T, d) tokens: every weight applied as x @ W.T; b1 (E, f),
    which Hugging Face's block lacks, added to the up-projection when given."""
    t = {name: np.asarray(array, np.float64) for name, array in tensors.items()}
    logits = x @ t["gate.weight"].T
    chosen, weights, _ = hf_route(
        logits, t.get("gate.e_score_correction_bias"), top_k, n_group, topk_group, norm_topk_prob,
        routed_scaling_factor, score,
    )
    hidden = x @ t["fc1_latent_proj.weight"].T if "fc1_latent_proj.weight" in t else x
    routed = np.zeros_like(hidden)
    for token in range(x.shape[0]):
        for slot in range(top_k):
            e = chosen[token, slot]
            up = hidden[token] @ t["experts.up_proj"][e].T + (0.0 if b1 is None else b1[e])
            routed[token] += weights[token, slot] * (np.maximum(up, 0.0) ** 2 @ t["experts.down_proj"][e].T)
    out = routed @ t["fc2_latent_proj.weight"].T if "fc2_latent_proj.weight" in t else routed
    if "shared_experts.up_proj.weight" in t:
        shared = np.maximum(x @ t["shared_experts.up_proj.weight"].T, 0.0) ** 2
        out = out + shared @ t["shared_experts.down_proj.weight"].T
    return out, chosen


# ---- the same block per token in jnp, for jax.grad, in moe_layer's (in, out) layout ----


def plain_block(params, x, chosen, *, score, normalize, scale, held=False):
    """Each token with its own chosen experts' weights: no sort, no group sizes, no
    kernels. The selection `chosen` (T, top_k) is fixed, as it is piecewise constant.
    held=True is a wrong block, for showing that a test fails: the normalization's
    denominator passes no gradient."""
    logits = x @ params["router"]
    scores = jax.nn.sigmoid(logits) if score == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    weights = jnp.take_along_axis(scores, chosen, axis=1)
    if normalize:
        total = jnp.sum(weights, axis=1, keepdims=True)
        total = jax.lax.stop_gradient(total) if held else total
        weights = weights / (total + (1e-20 if score == "sigmoid" else 0.0))
    weights = weights * scale
    z = x @ params["latent_in"] if "latent_in" in params else x
    h = jnp.einsum("tl,tslf->tsf", z, params["w1"][chosen])
    if "b1" in params:
        h = h + params["b1"][chosen]
    y = jnp.einsum("tsf,tsfl->tsl", jnp.maximum(h, 0.0) ** 2, params["w2"][chosen])
    out = jnp.sum(weights[:, :, None] * y, axis=1)
    if "latent_out" in params:
        out = out @ params["latent_out"]
    if "shared_w1" in params:
        out = out + jnp.maximum(x @ params["shared_w1"], 0.0) ** 2 @ params["shared_w2"]
    return out


def hf_tensors(rng, num_experts, d, f, latent=None, shared=None, bias_scale=0.05):
    """Random weights under the Hugging Face names and shapes, scaled for O(1) outputs.
    The last expert's bias is -10: never chosen, an empty expert in every case."""
    width = d if latent is None else latent
    normal = lambda *shape: rng.standard_normal(shape) / np.sqrt(shape[-1])  # noqa: E731
    tensors = {
        "gate.weight": normal(num_experts, d),
        "gate.e_score_correction_bias": bias_scale * rng.standard_normal(num_experts),
        "experts.up_proj": normal(num_experts, f, width),
        "experts.down_proj": normal(num_experts, width, f),
    }
    tensors["gate.e_score_correction_bias"][-1] = -10.0
    if shared is not None:
        tensors["shared_experts.up_proj.weight"] = normal(shared, d)
        tensors["shared_experts.down_proj.weight"] = normal(d, shared)
    if latent is not None:
        tensors["fc1_latent_proj.weight"] = normal(latent, d)
        tensors["fc2_latent_proj.weight"] = normal(d, latent)
    return {name: np.asarray(array, np.float32) for name, array in tensors.items()}


def tolerance(*lengths: int) -> float:
    """Error bound relative to the output's largest magnitude, for float32 in place of
    float64: each stage adds at most its contraction length times u of its operands'
    scale (a dot product's worst-case bound), and the stages add up (each is O(1) with
    these weights). A factor 4 covers the elementwise steps (sigmoid, division, square)."""
    return 4 * U * sum(lengths)


def assert_close(got, want, atol, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(want)) + 1e-30
    np.testing.assert_allclose(got / scale, want / scale, rtol=0, atol=atol, err_msg=name)


# (E, d, f, latent, shared, top_k, num_groups, top_groups, normalize, scale, score, b1, bias)
CASES = {
    "nano": (16, 12, 10, None, 14, 6, 1, None, True, 2.5, "sigmoid", False, True),
    "groups_latent_shared_b1": (16, 12, 10, 6, 9, 3, 4, 2, True, 2.0, "sigmoid", True, True),
    "sigmoid_top1_unnormalized": (8, 12, 10, None, None, 1, 1, None, False, 1.0, "sigmoid", False, False),
    "one_expert_groups": (8, 10, 6, None, None, 2, 8, 3, False, 1.5, "sigmoid", False, True),
    "softmax_with_bias_and_groups": (12, 10, 8, 5, 7, 2, 3, 2, True, 1.0, "softmax", True, True),
    "e512": (512, 8, 4, 6, 5, 8, 8, 4, True, 2.5, "sigmoid", False, True),
}


def block_case(name, seed):
    """The case's weights, tokens, b1 and options, from the first seed from `seed` on
    whose selection has no near tie (see `selection_margin`)."""
    for attempt in range(seed, seed + 50):
        case = _block_case(name, attempt)
        if selection_margin(case[0], case[1], case[3]) > 1e-5:
            return case
    raise AssertionError(f"no seed without a near tie for {name}")


def _block_case(name, seed):
    E, d, f, latent, shared, top_k, num_groups, top_groups, normalize, scale, score, with_b1, with_bias = CASES[name]
    rng = np.random.default_rng(seed)
    num_tokens = 24
    tensors = hf_tensors(rng, E, d, f, latent, shared)
    if not with_bias:
        tensors["gate.e_score_correction_bias"][:] = 0.0
        # No bias to empty an expert: the router holds the last one off through the
        # tokens' constant feature instead.
        tensors["gate.weight"][-1, 0] = -10.0
    x = rng.standard_normal((num_tokens, d)).astype(np.float32)
    x[:, 0] = 3.0  # a constant feature, through which the router can hold an expert off
    b1 = (0.1 * rng.standard_normal((E, f))).astype(np.float32) if with_b1 else None
    options = dict(top_k=top_k, num_groups=num_groups, top_groups=top_groups, normalize=normalize, scale=scale, score=score)
    return tensors, x, b1, options, (d, f, latent or d, shared or 0, num_tokens)


def hf_options(options):
    return dict(
        top_k=options["top_k"], n_group=options["num_groups"], topk_group=options["top_groups"] or options["num_groups"],
        norm_topk_prob=options["normalize"], routed_scaling_factor=options["scale"], score=options["score"],
    )


def library_params(tensors, b1):
    params = jax_dsrelu.params_from_hf_nemotron_h(tensors)
    if b1 is not None:
        params["b1"] = jnp.asarray(b1)
    return params


def selection_margin(tensors, x, options):
    """The float64 gap between the last chosen and the first unchosen biased score: a
    float32 computation picks the same experts when it is well above float32 rounding."""
    logits = np.asarray(x, np.float64) @ np.asarray(tensors["gate.weight"], np.float64).T
    bias = np.asarray(tensors["gate.e_score_correction_bias"], np.float64)
    hf = hf_options(options)
    _, _, choice = hf_route(logits, bias, hf["top_k"], hf["n_group"], hf["topk_group"], True, 1.0, hf["score"])
    ordered = -np.sort(-choice, axis=1)
    return np.min(ordered[:, hf["top_k"] - 1] - ordered[:, hf["top_k"]])


@pytest.mark.parametrize("name", list(CASES))
def test_values_match_hugging_face_and_gradients_match_a_per_token_block(name):
    tensors, x, b1, options, (d, f, latent, shared, num_tokens) = block_case(name, seed=len(name))
    want, chosen = hf_block(tensors, np.asarray(x, np.float64), **hf_options(options), b1=b1)
    sizes = np.bincount(chosen.reshape(-1), minlength=CASES[name][0])
    assert sizes[-1] == 0 and len(set(sizes.tolist())) > 1  # ragged, with an empty expert

    params = library_params(tensors, b1)
    cotangent = jnp.asarray(np.random.default_rng(1).standard_normal((num_tokens, d)), jnp.float32)
    differentiable = {key: value for key, value in params.items() if key != "expert_bias"}

    def layer(params, x, expert_bias):
        return jax_dsrelu.moe_layer(x, **params, expert_bias=expert_bias, deterministic=True, **options)

    @jax.jit
    def value_and_grads(differentiable, x, expert_bias):
        out, pullback = jax.vjp(layer, differentiable, x, expert_bias)
        return out, pullback(cotangent)

    out, (grads, dx, dbias) = value_and_grads(differentiable, jnp.asarray(x), params["expert_bias"])
    tol = tolerance(d, latent, f, shared, latent)
    assert out.dtype == jnp.float32 and out.shape == (num_tokens, d)
    assert_close(out, want, tol, "out")

    reference = lambda p, x: plain_block(p, x, jnp.asarray(chosen), score=options["score"],  # noqa: E731
                                         normalize=options["normalize"], scale=options["scale"])
    want_grads, want_dx = jax.jit(jax.grad(lambda p, x: jnp.sum(reference(p, x) * cotangent), argnums=(0, 1)))(
        differentiable, jnp.asarray(x)
    )
    # Gradients chain the forward's stages and the backward's: twice the forward's bound,
    # plus the contraction over tokens of the weight gradients.
    grad_tol = 2 * tol + tolerance(num_tokens)
    assert_close(dx, want_dx, grad_tol, "dx")
    for key in differentiable:
        if key == "router" and options["top_k"] == 1 and options["normalize"]:
            continue  # every weight is s / s: no gradient but rounding noise
        assert_close(grads[key], want_grads[key], grad_tol, f"d{key}")
    np.testing.assert_array_equal(dbias, 0.0)  # the bias chooses, and takes no gradient
    np.testing.assert_array_equal(grads["w1"][-1], 0.0)  # the empty expert
    np.testing.assert_array_equal(grads["w2"][-1], 0.0)


def test_the_tolerance_catches_a_wrong_block():
    """Plausible mistakes, each a small change: each fails the comparison above."""
    tensors, x, b1, options, (d, f, latent, shared, _) = block_case("groups_latent_shared_b1", seed=3)
    tol = tolerance(d, latent, f, shared, latent)
    params = library_params(tensors, b1)
    out = jax.jit(lambda x, params: jax_dsrelu.moe_layer(x, **params, **options))(jnp.asarray(x), params)
    want, _ = hf_block(tensors, np.asarray(x, np.float64), **hf_options(options), b1=b1)
    assert_close(out, want, tol, "out")
    x64 = np.asarray(x, np.float64)
    without_shared = {name: array for name, array in tensors.items() if not name.startswith("shared_experts")}
    wrong = {
        "no scaling factor": hf_block(tensors, x64, **{**hf_options(options), "routed_scaling_factor": 1.0}, b1=b1)[0],
        "no shared expert": hf_block(without_shared, x64, **hf_options(options), b1=b1)[0],
        "no b1": hf_block(tensors, x64, **hf_options(options))[0],
        "every value 1e-4 off": want * (1 + 1e-4),
    }
    assert tol < 1e-4 / 4, tol
    for mistake, answer in wrong.items():
        with pytest.raises(AssertionError):
            assert_close(out, answer, tol, mistake)

    # The gradients' bound catches a reference without the normalization's gradient (the
    # weights' denominator held fixed): a small change to every router gradient.
    differentiable = {key: value for key, value in params.items() if key != "expert_bias"}
    chosen = jnp.asarray(hf_block(tensors, x64, **hf_options(options), b1=b1)[1])
    grad_tol = 2 * tol + tolerance(x.shape[0])

    def router_grad(held):
        def block(router):
            p = {**differentiable, "router": router}
            return jnp.sum(plain_block(p, jnp.asarray(x), chosen, score="sigmoid", normalize=True,
                                       scale=options["scale"], held=held) ** 2)

        return jax.jit(jax.grad(block))(differentiable["router"])

    got = jax.jit(jax.grad(lambda r: jnp.sum(jax_dsrelu.moe_layer(
        jnp.asarray(x), **{**params, "router": r}, **options) ** 2)))(params["router"])
    assert_close(got, router_grad(held=False), grad_tol, "drouter")
    with pytest.raises(AssertionError):
        assert_close(got, router_grad(held=True), grad_tol, "drouter, denominator held")


def test_every_gradient_bitwise_repeats_and_no_scatter_add():
    tensors, x, b1, options, _ = block_case("groups_latent_shared_b1", seed=4)
    params = library_params(tensors, b1)
    bias = params.pop("expert_bias")

    def loss(params, x):
        out, aux = jax_dsrelu.moe_layer(x, **params, expert_bias=bias, deterministic=True, return_aux=True, **options)
        return jnp.sum(out**2) + aux.load_balancing_loss + aux.router_z_loss

    grad = jax.grad(loss, argnums=(0, 1))
    assert not list(scatter_adds(jax.make_jaxpr(grad)(params, jnp.asarray(x)).jaxpr))
    hlo = jax.jit(grad).lower(params, jnp.asarray(x)).as_text()
    assert "scatter" not in hlo
    first = jax.device_get(jax.jit(grad)(params, jnp.asarray(x)))
    again = jax.device_get(jax.jit(grad)(params, jnp.asarray(x)))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_the_scatter_check_can_fail():
    # The naive per-token block picks its experts' weights with a gather, whose gradient
    # is a scatter-add into the weights: the check sees it.
    tensors, x, b1, options, _ = block_case("nano", seed=5)
    params = {k: v for k, v in library_params(tensors, b1).items() if k != "expert_bias"}
    chosen = jnp.asarray(hf_block(tensors, np.asarray(x, np.float64), **hf_options(options))[1])
    grad = jax.grad(lambda p: jnp.sum(plain_block(p, jnp.asarray(x), chosen, score="sigmoid", normalize=True, scale=2.5)))
    assert list(scatter_adds(jax.make_jaxpr(grad)(params).jaxpr))


def test_defaults_are_the_softmax_layer_bit_for_bit():
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((20, 8)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((8, 5)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((5, 8, 6)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((5, 6, 8)), jnp.float32)
    for normalize in (False, True):
        explicit = jax.jit(lambda *a: jax_dsrelu.moe_layer(
            *a, normalize=normalize, score="softmax", expert_bias=None, num_groups=1,
            top_groups=None, scale=1.0, shared_w1=None, shared_w2=None, latent_in=None, latent_out=None,
        ))(x, router, w1, w2)

        @jax.jit
        def composed(x, router, w1, w2):  # the layer as it was before these options
            plan = jax_dsrelu.route(x @ router, 2, normalize=normalize)
            y = jax_dsrelu.moe_mlp(jax_dsrelu.dispatch(x, plan), w1, w2, plan.row_prob, plan.group_sizes)
            return jax_dsrelu.combine(y, plan)

        np.testing.assert_array_equal(explicit, composed(x, router, w1, w2))
        # Keeping every group, here one expert each, changes nothing either.
        grouped = jax.jit(lambda *a: jax_dsrelu.moe_layer(*a, normalize=normalize, num_groups=5, top_groups=5))
        np.testing.assert_array_equal(grouped(x, router, w1, w2), explicit)


def test_bad_block_arguments_raise_naming_them():
    tensors, x, b1, options, _ = block_case("groups_latent_shared_b1", seed=7)
    params = library_params(tensors, b1)
    x = jnp.asarray(x)
    layer = jax_dsrelu.moe_layer

    def call(**changes):
        return layer(x, **{**params, **changes}, **options)

    with pytest.raises(ValueError, match=r"shared_w1.shape\[0\] must equal x.shape\[1\] \(d\)=12, got shared_w1.shape=\(11, 9\)"):
        call(shared_w1=params["shared_w1"][:11])
    with pytest.raises(ValueError, match=r"shared_w2.shape\[0\] must equal shared_w1.shape\[1\] \(fs\)=9, got shared_w2.shape=\(8, 12\)"):
        call(shared_w2=params["shared_w2"][:8])
    with pytest.raises(ValueError, match="shared_w1 and shared_w2 go together: got shared_w1 but shared_w2=None"):
        call(shared_w2=None)
    with pytest.raises(TypeError, match="shared_w2.dtype must equal shared_w1.dtype=float32, got shared_w2.dtype=bfloat16"):
        call(shared_w2=params["shared_w2"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"latent_in.shape\[0\] must equal x.shape\[1\] \(d\)=12, got latent_in.shape=\(6, 6\)"):
        call(latent_in=params["latent_in"][:6])
    with pytest.raises(ValueError, match=r"latent_out.shape\[0\] must equal latent_in.shape\[1\] \(l\)=6, got latent_out.shape=\(5, 12\)"):
        call(latent_out=params["latent_out"][:5])
    with pytest.raises(ValueError, match="latent_in and latent_out go together: got latent_in but latent_out=None"):
        call(latent_out=None)
    with pytest.raises(ValueError, match=r"w1.shape\[1\] must equal latent_in.shape\[1\] \(l\)=6, got w1.shape=\(16, 12, 10\)"):
        call(w1=jnp.zeros((16, 12, 10)))
    with pytest.raises(ValueError, match=r"w1 must be \(E, l, f\), got w1.shape=\(16, 6\)"):
        call(w1=params["w1"][:, :, 0])
    with pytest.raises(ValueError, match=r"expert_bias must be \(E,\) with E=16 experts, got expert_bias.shape=\(15,\)"):
        call(expert_bias=params["expert_bias"][:15])
    with pytest.raises(ValueError, match="score must be 'softmax' or 'sigmoid', got 'Sigmoid'"):
        layer(x, **params, **{**options, "score": "Sigmoid"})
    with pytest.raises(ValueError, match="num_groups must be at least 1 and divide the number of experts E=16, got num_groups=5"):
        layer(x, **params, **{**options, "num_groups": 5})
    with pytest.raises(ValueError, match="top_k must be at most the 8 experts that top_groups=2 groups"):
        layer(x, **params, **{**options, "top_k": 9})
    with pytest.raises(TypeError, match="x must be a JAX or NumPy array, got list"):
        layer(x.tolist(), **params, **options)
    with pytest.raises(TypeError, match="router must be a JAX or NumPy array, got NoneType"):
        call(router=None)
    plan = jax_dsrelu.route(x @ params["router"], 2)
    with pytest.raises(TypeError, match=r"plan must be a RoutingPlan \(from jax_dsrelu.route\), got None"):
        jax_dsrelu.dispatch(x, None)
    with pytest.raises(TypeError, match="x must be a JAX or NumPy array, got list"):
        jax_dsrelu.dispatch(x.tolist(), plan)
    with pytest.raises(TypeError, match="plan must be a RoutingPlan"):
        jax_dsrelu.combine(jnp.zeros((48, 12)), "plan")


def test_latent_out_that_does_not_come_back_to_d_is_refused():
    # Without a shared expert nothing else would notice: routed @ latent_out would be a
    # (T, 13) output of a (T, 12) block.
    tensors, x, b1, options, (d, _, latent, _, _) = block_case("groups_latent_shared_b1", seed=8)
    params = {k: v for k, v in library_params(tensors, b1).items() if not k.startswith("shared")}
    wide = jnp.zeros((latent, d + 1), jnp.float32)
    words = rf"latent_out.shape\[1\] must equal x.shape\[1\] \(d\)={d}, got latent_out.shape=\({latent}, {d + 1}\)"
    with pytest.raises(ValueError, match=words):
        jax_dsrelu.moe_layer(jnp.asarray(x), **{**params, "latent_out": wide}, **options)
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=words):
        jax_dsrelu.moe_layer_expert_parallel(jnp.asarray(x), **{**params, "latent_out": wide}, **options, mesh=mesh)

"""moe_mlp end to end on the sm90 kernel family: every GEMM of a training step on our kernels.

Compile tier (marked `compile`, no GPU): a whole `value_and_grad` step of moe_mlp with
backend="sm90", lowered for the cuda platform, is six custom calls (up-projection with its
activation, down-projection, the fused dsReLU backward, dx, dW1, dW2) and contains no XLA
ragged dot, no dot at all, no scatter and no transpose of a weight.

GPU tier (marked `gpu`): values and every gradient through the kernels against a float64
NumPy computation of the same layer and against the XLA backend, bf16 and fp16, ragged and
empty experts and rows owned by no expert, with and without b1; with deterministic=True
every gradient bitwise identical over 20 runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import re  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")

import jax_dsrelu  # noqa: E402

CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @(\w+)")
KERNEL_TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"
GRAD_NAMES = ("x", "w1", "w2", "prob", "b1")

# (m, d, f, sizes): ragged, two empty experts, 96 rows owned by no expert.
LAYER = (4288, 256, 512, [700, 0, 1300, 48, 2048, 0, 1, 95])


def layer_inputs(dtype, with_b1, seed):
    m, d, f, sizes = LAYER
    rng = np.random.default_rng(seed)
    num_experts = len(sizes)
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    w1 = jnp.asarray(rng.standard_normal((num_experts, d, f)) / np.sqrt(d), dtype)
    w2 = jnp.asarray(rng.standard_normal((num_experts, f, d)) / np.sqrt(f), dtype)
    prob = jnp.asarray(rng.uniform(0.05, 1.0, m), jnp.float32)
    b1 = jnp.asarray(0.3 * rng.standard_normal((num_experts, f)), dtype) if with_b1 else None
    cotangent = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    return (x, w1, w2, prob, b1), jnp.asarray(sizes, jnp.int32), cotangent


def step(backend, deterministic, group_sizes, cotangent, with_b1):
    """jit(value_and_grad) of sum(moe_mlp(...) * cotangent) in every differentiable input."""

    def loss(x, w1, w2, prob, b1):
        y = jax_dsrelu.moe_mlp(
            x, w1, w2, prob, group_sizes, b1=b1, deterministic=deterministic, backend=backend
        )
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    argnums = (0, 1, 2, 3, 4) if with_b1 else (0, 1, 2, 3)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def lowered_text(dtype=jnp.bfloat16, deterministic=True, with_b1=True):
    inputs, group_sizes, cotangent = layer_inputs(dtype, with_b1, 0)
    fn = step("sm90", deterministic, group_sizes, cotangent, with_b1)
    return fn.trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()


# ------------------------------------------------------------------------- compile tier


@pytest.mark.compile
@pytest.mark.parametrize("deterministic", [False, True])
def test_training_step_runs_every_gemm_on_the_kernels(deterministic):
    text = lowered_text(deterministic=deterministic)
    assert CUSTOM_CALL.findall(text).count(KERNEL_TARGET) == 6
    assert_no_xla_gemm(text)


# The fine-grained benchmark shapes (m, d, f, E): Nemotron-3 Nano's and the 256-expert one.
FINE_GRAINED = [(49152, 2688, 1856, 128), (65536, 2048, 768, 256)]


@pytest.mark.compile
@pytest.mark.parametrize("shape", FINE_GRAINED, ids=lambda s: "x".join(map(str, s)))
def test_fine_grained_training_step_runs_every_gemm_on_the_kernels(shape):
    m, d, f, num_experts = shape
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16

    def loss(x, w1, w2, prob, b1, group_sizes, cotangent):
        y = jax_dsrelu.moe_mlp(x, w1, w2, prob, group_sizes, b1=b1, deterministic=True, backend="sm90")
        return jnp.sum(y.astype(jnp.float32) * cotangent)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    text = fn.trace(
        s((m, d), bf16), s((num_experts, d, f), bf16), s((num_experts, f, d), bf16), s((m,), jnp.float32),
        s((num_experts, f), bf16), s((num_experts,), jnp.int32), s((m, d), jnp.float32),
    ).lower(lowering_platforms=("cuda",)).as_text()
    assert CUSTOM_CALL.findall(text).count(KERNEL_TARGET) == 6
    assert_no_xla_gemm(text, num_experts)


def assert_no_xla_gemm(text: str, num_experts: int = len(LAYER[3])) -> None:
    # The ops outside the custom calls (whose attributes hold the kernels' object code).
    ops = "\n".join(line for line in text.splitlines() if "stablehlo.custom_call" not in line)
    assert not re.search(r"\b(stablehlo|chlo|mhlo)\.ragged", ops), "an XLA ragged dot is left"
    # No layer-sized GEMM left to XLA: no dot at all, and nothing scattered.
    assert not re.search(r"\bstablehlo\.(dot|dot_general)\b", ops), "an XLA dot is left"
    assert not re.search(r"\bstablehlo\.scatter\b", ops), "a scatter is left"
    # Weights are read in place: no transpose of a 3-D (expert) tensor.
    assert not re.search(rf"stablehlo\.transpose[^\n]*tensor<{num_experts}x", ops), "a weight is transposed"


@pytest.mark.compile
def test_the_checks_catch_the_xla_step():
    inputs, group_sizes, cotangent = layer_inputs(jnp.bfloat16, True, 0)
    fn = step("xla", True, group_sizes, cotangent, True)
    text = fn.trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(AssertionError, match="XLA dot"):
        assert_no_xla_gemm(text)


# ----------------------------------------------------------------------------- GPU tier


def float64_layer(inputs, sizes, cotangent, round_to):
    """The layer and its gradients in float64 NumPy, from the contract's formulas, rounding
    h, act and dh to the operand dtype where the layer stores them (`round_to`)."""
    x, w1, w2, prob, b1 = (None if a is None else np.asarray(a, np.float64) for a in inputs)
    # The cotangent of y reaches the backward in y's dtype.
    g = round_to(cotangent)
    m, d = x.shape
    out = {name: np.zeros_like(value) for name, value in zip(GRAD_NAMES, (x, w1, w2, prob, b1)) if value is not None}
    y = np.zeros((m, d))
    # Magnitudes for the error bounds: the same sums with absolute values.
    mag = {name: np.zeros_like(value) for name, value in out.items()}
    floor = {name: np.zeros_like(value) for name, value in out.items()}
    y_mag = np.zeros((m, d))
    y_floor = np.zeros((m, d))
    end = 0
    for e, size in enumerate(sizes):
        start, end = end, min(end + max(size, 0), m)
        if end == start:
            continue
        rows = slice(start, end)
        xe, pe = x[rows], prob[rows][:, None]
        h = round_to(xe @ w1[e] + (0.0 if b1 is None else b1[e]))
        r = np.maximum(h, 0.0)
        act = round_to(r * r * pe)
        y[rows] = act @ w2[e]
        y_mag[rows] = np.abs(act) @ np.abs(w2[e])
        y_floor[rows] = np.abs(w2[e]).sum(axis=0)
        da = g[rows] @ w2[e].T
        da_mag = np.abs(g[rows]) @ np.abs(w2[e].T)
        dh = round_to(2.0 * r * da * pe)
        dh_mag = 2.0 * r * da_mag * pe
        out["prob"][rows] = np.sum(r * r * da, axis=1)
        mag["prob"][rows] = np.sum(r * r * da_mag, axis=1)
        out["w2"][e] = act.T @ g[rows]
        mag["w2"][e] = np.abs(act.T) @ np.abs(g[rows])
        floor["w2"][e] = np.abs(g[rows]).sum(axis=0)[None, :]
        out["w1"][e] = xe.T @ dh
        mag["w1"][e] = np.abs(xe.T) @ dh_mag
        floor["w1"][e] = np.abs(xe).sum(axis=0)[:, None]
        out["x"][rows] = dh @ w1[e].T
        mag["x"][rows] = dh_mag @ np.abs(w1[e].T)
        floor["x"][rows] = np.abs(w1[e]).sum(axis=1)[None, :]
        if b1 is not None:
            out["b1"][e] = dh.sum(axis=0)
            mag["b1"][e] = dh_mag.sum(axis=0)
            floor["b1"][e] = end - start
    return y, (y_mag, y_floor), out, mag, floor


def assert_close(name, got, ref, mag, floor, dtype):
    """Two checks of one output of the layer against float64.

    Entry by entry, a sound worst-case bound: each gradient is a GEMM over operands the
    layer rounded to dtype once (h, act, dh), so it carries about two roundings of its
    inputs and one of its output relative to the magnitude of the terms it sums (`mag`;
    4 units leave room for the float32 sums inside); near zero a rounding errs by up to
    half the subnormal step instead, once per term (`floor`). It catches a wrong or missing
    value but is loose where sums cancel. So also, per row (per expert for the weights):
    the relative error in norm at most 4 units. Rounding errors of independent terms add
    like a random walk, so a normwise error stays near one unit with overwhelming
    probability (Higham and Mary's probabilistic rounding analysis); the XLA backend,
    which rounds the same intermediates, meets it with a wide margin.
    """
    is_bf16 = np.dtype(dtype) == np.dtype(jnp.bfloat16)
    unit = 2.0**-8 if is_bf16 else 2.0**-11
    step = 2.0**-133 if is_bf16 else float(np.finfo(np.float16).smallest_subnormal)
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), f"{name}: not finite"
    bound = 4 * unit * (mag + np.abs(ref)) + 4 * step * (floor + 1.0)
    worst = np.max(np.abs(got - ref) - bound)
    assert worst <= 0, f"{name}: beyond the entry bound by {worst}"
    axes = tuple(range(1, ref.ndim)) if ref.ndim > 1 else None
    error = np.sqrt(np.sum((got - ref) ** 2, axis=axes))
    size = np.sqrt(np.sum(ref**2, axis=axes))
    limit = 4 * unit * size + 4 * step * np.sqrt(np.sum((floor + 1.0) ** 2, axis=axes))
    excess = np.max(error - limit)
    assert excess <= 0, f"{name}: normwise error beyond {4 * unit:.2g} relative by {excess}"


@pytest.mark.gpu
@pytest.mark.parametrize("with_b1", [False, True], ids=["no_b1", "b1"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_step_matches_float64_and_xla(hopper, dtype, with_b1, deterministic):
    inputs, group_sizes, cotangent = layer_inputs(dtype, with_b1, zlib.crc32(f"{dtype}{with_b1}{deterministic}".encode()))
    args = inputs if with_b1 else inputs[:4] + (None,)
    (_, y), grads = step("sm90", deterministic, group_sizes, cotangent, with_b1)(*args)
    (_, y_xla), grads_xla = step("xla", deterministic, group_sizes, cotangent, with_b1)(*args)

    def round_to(value):
        return np.asarray(jnp.asarray(value, dtype), np.float64)

    y_ref, (y_mag, y_floor), ref, mag, floor = float64_layer(inputs, LAYER[3], cotangent, round_to)
    assert_close("y", y, y_ref, y_mag, y_floor, dtype)
    assert_close("y (xla)", y_xla, y_ref, y_mag, y_floor, dtype)
    for name, ours, theirs in zip(GRAD_NAMES, grads, grads_xla):
        assert_close(name, ours, ref[name], mag[name], floor[name], dtype)
        assert_close(f"{name} (xla)", theirs, ref[name], mag[name], floor[name], dtype)
    # Rows owned by no expert: output and every row gradient exactly 0.
    owned = int(np.clip(np.asarray(LAYER[3]), 0, None).sum())
    assert (np.asarray(y[owned:]) == 0).all()
    assert (np.asarray(grads[0][owned:]) == 0).all() and (np.asarray(grads[3][owned:]) == 0).all()


@pytest.mark.gpu
def test_deterministic_step_is_bitwise_stable(hopper):
    inputs, group_sizes, cotangent = layer_inputs(jnp.bfloat16, True, 7)
    fn = step("sm90", True, group_sizes, cotangent, True)
    first = jax.tree.map(np.asarray, fn(*inputs))
    for _ in range(19):
        again = jax.tree.map(np.asarray, fn(*inputs))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
            assert np.array_equal(a, b)


def test_layer_bound_accepts_the_xla_backend_and_rejects_wrong_gradients():
    """The bound of the GPU tier, on the CPU: the XLA backend's gradients pass it, and
    plausible kernel mistakes do not."""
    dtype = jnp.bfloat16
    inputs, group_sizes, cotangent = layer_inputs(dtype, True, 3)
    (_, y), grads = step("xla", True, group_sizes, cotangent, True)(*inputs)

    def round_to(value):
        return np.asarray(jnp.asarray(value, dtype), np.float64)

    y_ref, (y_mag, y_floor), ref, mag, floor = float64_layer(inputs, LAYER[3], cotangent, round_to)
    assert_close("y", y, y_ref, y_mag, y_floor, dtype)
    grads = dict(zip(GRAD_NAMES, (np.asarray(g, np.float64) for g in grads)))
    for name in GRAD_NAMES:
        assert_close(name, grads[name], ref[name], mag[name], floor[name], dtype)
    w1_swapped = grads["w1"].copy()
    w1_swapped[[0, 2]] = w1_swapped[[2, 0]]
    x_scaled = grads["x"] * 1.03
    x_dropped_row = grads["x"].copy()
    x_dropped_row[1000] = 0.0
    b1_swapped = grads["b1"].copy()
    b1_swapped[[2, 4]] = b1_swapped[[4, 2]]
    prob_shifted = np.roll(grads["prob"], 1)
    w2_transposed_expert = grads["w2"].copy()
    w2_transposed_expert[4, :256, :] = grads["w2"][4, :256, :].T
    wrong = [
        ("w1", w1_swapped), ("x", x_scaled), ("x", x_dropped_row), ("b1", b1_swapped),
        ("prob", prob_shifted), ("w2", w2_transposed_expert),
    ]
    for name, value in wrong:
        with pytest.raises(AssertionError, match=name):
            assert_close(name, value, ref[name], mag[name], floor[name], dtype)

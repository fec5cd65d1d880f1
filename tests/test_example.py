"""The examples: train_moe.py learns and is reproducible with --deterministic; train_lm.py
learns the standard library's text and draws its curve."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest
from jaxpr_search import scatter_adds

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, cwd=None) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True, text=True, timeout=900, check=True, cwd=cwd,
    )
    return result.stdout


def test_loss_decreases_and_deterministic_digest_repeats():
    args = ("--steps", "80", "--tokens", "512", "--deterministic")
    first, second = run_example("train_moe.py", *args), run_example("train_moe.py", *args)
    start, end = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", first).groups())
    assert end < 0.6 * start, first
    digests = [re.search(r"parameter digest: ([0-9a-f]{64})", out).group(1) for out in (first, second)]
    assert digests[0] == digests[1]


@pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs Flax (pip install 'jax-dsrelu[examples]')")
def test_language_model_learns_and_plots_and_learns_as_well_with_fp8_experts(tmp_path):
    """The example learns and plots; and with --fp8 (the experts' six GEMMs on FP8 operands,
    DeepSeek-V3's blockwise recipe, here the XLA path's quantize-dequantize arithmetic) it
    learns as the float32 run does: the held-out loss after the same steps within 2%."""
    plot = tmp_path / "curve.png"
    flags = ("--steps", "60", "--batch", "8", "--seq-len", "32", "--eval-every", "30", "--sample", "16",
             "--deterministic")
    out = run_example("train_lm.py", *flags, "--plot", str(plot), cwd=tmp_path)
    # Bytes start near log(256) = 5.5 nats; a model that learned nothing stays there.
    start, end = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert start > 5.0 and end < 3.5, out
    assert re.search(r"[\d,]+ tokens/s", out), out
    assert re.search(r"parameter digest: [0-9a-f]{64}", out), out
    assert "fp8: False" in out, out
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in out
    fp8 = run_example("train_lm.py", *flags, "--plot", "", "--fp8", cwd=tmp_path)
    assert "fp8: True" in fp8, fp8
    fp8_start, fp8_end = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", fp8).groups())
    assert fp8_start > 5.0 and abs(fp8_end - end) <= 0.02 * end, (end, fp8_end)


@pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs Flax (pip install 'jax-dsrelu[examples]')")
def test_language_model_with_nemotron_style_blocks_learns_and_moves_the_bias(tmp_path):
    """Its steps in two micro-batches, whose expert loads are summed for the bias update."""
    out = run_example(
        "train_lm.py", "--steps", "40", "--batch", "8", "--seq-len", "32", "--eval-every", "20", "--sample", "0",
        "--plot", "", "--router", "sigmoid", "--normalize", "--routed-scale", "2.5", "--experts", "8", "--top-k", "3",
        "--num-groups", "4", "--top-groups", "2", "--shared-d-ff", "64", "--latent-dim", "32", "--bias-rate", "1e-2",
        "--micro-batches", "2", cwd=tmp_path,
    )
    start, end = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert start > 5.0 and end < 3.5, out
    # 40 updates of +-0.01 (or 0) each: the bias moved, within its bound.
    for low, high in re.findall(r"expert bias: min ([-+\d.]+) max ([-+\d.]+)", out):
        assert float(high) > float(low) and max(abs(float(low)), abs(float(high))) <= 0.4, out
    assert len(re.findall("expert bias", out)) == 2, out


NEMOTRON_STYLE_FLAGS = [
    "--router", "sigmoid", "--normalize", "--num-groups", "2", "--top-groups", "1", "--shared-d-ff", "32", "--latent-dim", "16",
]


@pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs Flax (pip install 'jax-dsrelu[examples]')")
@pytest.mark.parametrize("flags", [[], NEMOTRON_STYLE_FLAGS], ids=["softmax", "nemotron_style"])
def test_language_model_gradient_adds_no_two_tokens_into_one_place(monkeypatch, flags):
    """--deterministic on a GPU needs every sum over tokens in a fixed order. A scatter-add
    runs there with atomics, so the only ones allowed are those within one token's own row
    (the cross-entropy's label pick: one value per place); a table lookup's gradient, which
    adds every token into the embedding table, would break it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(sys, "argv", ["train_lm.py", "--deterministic", *flags])
    import train_lm

    args = train_lm.arguments()
    graphdef, state = nnx.split(train_lm.LanguageModel(args, nnx.Rngs(0)))
    tokens = jnp.zeros((2, args.seq_len), jnp.int32)

    def loss(state, tokens):
        return train_lm.loss_fn(nnx.merge(graphdef, state), tokens, tokens, args)[0]

    shapes = list(scatter_adds(jax.make_jaxpr(jax.grad(loss))(state, tokens).jaxpr))
    assert shapes, "the cross-entropy's label pick was expected as a scatter-add: has the check gone blind?"
    assert all(shape[:2] == tokens.shape for shape in shapes), shapes


@pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs Flax (pip install 'jax-dsrelu[examples]')")
def test_language_model_micro_batches_read_the_weights_quantized_once(monkeypatch):
    """--fp8 --micro-batches 2: the experts' weights quantized once for the step and read by
    both parts give the gradients of each part quantizing its own, bit for bit, and those
    are the mean of the two parts' gradients, each part's own (neither alone)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(sys, "argv", ["train_lm.py", "--fp8", "--micro-batches", "2", "--batch", "4", "--seq-len", "16",
                                      "--d-model", "32", "--d-ff", "64", "--deterministic"])
    import train_lm

    args = train_lm.arguments()
    model = train_lm.LanguageModel(args, nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, train_lm.VOCAB, (args.batch, args.seq_len)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)

    @nnx.jit
    def gradients(model, tokens, targets):
        def part(rows):
            return nnx.grad(train_lm.loss_fn, has_aux=True)(model, tokens[rows], targets[rows], args)
        once = train_lm.accumulated_gradients(model, tokens, targets, args, train_lm.quantized_experts(model, args))
        each = train_lm.accumulated_gradients(model, tokens, targets, args)
        return once[2], each[2], part(slice(0, 2)), part(slice(2, 4))

    once, each, first, second = (jax.tree.leaves(g) for g in gradients(model, tokens, targets))
    assert all(np.array_equal(a, b) for a, b in zip(once, each))
    assert all(np.array_equal(a, (b + c) / 2) for a, b, c in zip(once, second, first))
    assert not all(np.array_equal(a, b) for a, b in zip(once, first))

"""The examples: train_moe.py learns and is reproducible with --deterministic; train_lm.py
learns the standard library's text and draws its curve."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

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
def test_language_model_learns_and_plots(tmp_path):
    plot = tmp_path / "curve.png"
    out = run_example(
        "train_lm.py", "--steps", "60", "--batch", "8", "--seq-len", "32", "--eval-every", "30",
        "--sample", "16", "--deterministic", "--plot", str(plot), cwd=tmp_path,
    )
    # Bytes start near log(256) = 5.5 nats; a model that learned nothing stays there.
    start, end = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert start > 5.0 and end < 3.5, out
    assert re.search(r"[\d,]+ tokens/s", out), out
    assert re.search(r"parameter digest: [0-9a-f]{64}", out), out
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in out

"""The main job, examples/train_moe.py, learns and is reproducible with --deterministic."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_moe.py"


def run_example(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=600, check=True
    )
    return result.stdout


def test_loss_decreases_and_deterministic_digest_repeats():
    args = ("--steps", "80", "--tokens", "512", "--deterministic")
    first, second = run_example(*args), run_example(*args)
    start, end = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", first).groups())
    assert end < 0.6 * start, first
    digests = [re.search(r"parameter digest: ([0-9a-f]{64})", out).group(1) for out in (first, second)]
    assert digests[0] == digests[1]

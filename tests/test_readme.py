"""The README: its benchmark figures are those recorded in benchmarks/results, and the
code of "Build an MoE model" runs."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_results_match_the_recorded_json():
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), "--check"], check=True
    )


def readme_section_code(title: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_build_an_moe_model_section_runs():
    """The section's code blocks, run in order in one namespace, as a reader would."""
    blocks = readme_section_code("Build an MoE model")
    assert len(blocks) == 4
    namespace: dict = {}
    for block in blocks:
        if "from flax import nnx" in block and importlib.util.find_spec("flax") is None:
            continue
        exec(compile(block, "README.md", "exec"), namespace)
    x, out, grads = namespace["x"], namespace["out"], namespace["grads"]
    assert out.shape == x.shape and np.all(np.isfinite(np.asarray(out)))
    # The last `out` is the expert-parallel one: it equals moe_layer up to float32 rounding.
    layer_out = namespace["jax_dsrelu"].moe_layer(x, *(namespace[n] for n in ("router", "w1", "w2")))
    np.testing.assert_allclose(out, layer_out, rtol=1e-5, atol=1e-5)
    assert [g.shape for g in grads] == [namespace[n].shape for n in ("router", "w1", "w2")]

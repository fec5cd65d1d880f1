"""The README's benchmark figures are those recorded in benchmarks/results."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_results_match_the_recorded_json():
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), "--check"], check=True
    )

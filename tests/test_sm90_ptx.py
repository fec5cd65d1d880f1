"""The PTX of a few sm90 kernels, byte for byte, against tests/ptx_digests.json (compile tier).

A change to the kernels' Python that means to leave the GPU's code alone (a
restructure, a rename) must leave these digests alone; one that means to change the
kernels rewrites the table (tests/ptx_digests.py's docstring says how), and its new code
is then the GPU tier's to check. tests/ptx_digests.py compares every kernel the project
builds in the same way.
"""

from __future__ import annotations

import os

# Before anything imports CuTe DSL: on a machine without a GPU it cannot detect one.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import json  # noqa: E402

import ptx_digests  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")

with open(ptx_digests.PINNED_TABLE) as file:
    TABLE = json.load(file)


def test_the_table_holds_every_pinned_case():
    assert sorted(TABLE) == sorted(case.name for case in ptx_digests.pinned_cases())


@pytest.mark.compile
@pytest.mark.parametrize("case", ptx_digests.pinned_cases(), ids=lambda case: case.name)
def test_ptx_is_the_recorded_one(case):
    assert ptx_digests.digest(ptx_digests.ptx(case)) == TABLE[case.name]["sha256"], (
        f"the PTX of {case.name} changed; if that is meant, rewrite tests/ptx_digests.json "
        "(tests/ptx_digests.py --pinned) and have the GPU tier check the new code"
    )

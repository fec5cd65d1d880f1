"""The CUDA toolkit's ptxas on a kernel's PTX, for what only the assembler reports.

CuTe DSL assembles PTX in-process and keeps ptxas's remarks to itself, among them the one
that costs most: C7520, "wgmma.mma_async instructions are serialized" (a wgmma under a
run-time branch, for one, makes ptxas wait for every wgmma before the next). The compile
tier assembles the kernels' PTX again with the toolkit's ptxas, where one is installed,
and reads its verbose log.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile

import pytest


def find_ptxas() -> str | None:
    def version(path):
        return [int(part) for part in re.findall(r"\d+", path)]

    candidates = [shutil.which("ptxas")] + sorted(glob.glob("/usr/local/cuda*/bin/ptxas"), key=version, reverse=True)
    return next((path for path in candidates if path and os.access(path, os.X_OK)), None)


def assemble(ptx: str, arch: str = "sm_90a") -> str:
    """ptxas -v's log for `ptx`; skips the test where no ptxas is installed. PTX newer
    than the installed ptxas reads is declared at the version it reads (the kernels use
    no instruction newer than sm_90a's)."""
    ptxas = find_ptxas()
    if ptxas is None:
        pytest.skip("no ptxas installed (the CUDA toolkit's): the assembler's remarks are not checked here")
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        for _ in range(2):
            with open(source, "w") as file:
                file.write(ptx)
            result = subprocess.run([ptxas, f"-arch={arch}", "-v", source, "-o", os.path.join(folder, "kernel.cubin")],
                                    capture_output=True, text=True)
            newest = re.search(r"Unsupported \.version \d+\.\d+; current version is '(\d+\.\d+)'", result.stderr)
            if result.returncode == 0 or newest is None:
                break
            ptx = re.sub(r"^\.version \d+\.\d+", f".version {newest.group(1)}", ptx, count=1, flags=re.M)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stderr


def check_assembly(ptx: str) -> None:
    """No serialized wgmma, no register spills."""
    log = assemble(ptx)
    assert "C7520" not in log and "serialized" not in log, log[-2000:]
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert found and all(stores == loads == "0" for stores, loads in found), log[-2000:]

"""The JAX and CuTe DSL versions the library knows: the same as pyproject's, and refused outside.

The internals of JAX (`jax_dsrelu.jax_internals`) and of cutlass.jax
(`jax_dsrelu.ffi.cutlass_bridge`) are read at import time; a version they were not checked
against must be refused then, with a message saying what to install.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import jax
import pytest

from jax_dsrelu import jax_internals
from jax_dsrelu.kernels import software

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_installed_jax_is_in_the_known_range():
    major, minor = jax.__version_info__[:2]
    assert jax_internals.OLDEST_KNOWN_JAX <= (major, minor) <= jax_internals.NEWEST_KNOWN_JAX


def test_pyproject_requires_exactly_the_known_jax_range():
    (requirement,) = [r for r in PROJECT["dependencies"] if re.match(r"jax\b", r)]
    oldest = "{}.{}".format(*jax_internals.OLDEST_KNOWN_JAX)
    past_newest = "{}.{}".format(jax_internals.NEWEST_KNOWN_JAX[0], jax_internals.NEWEST_KNOWN_JAX[1] + 1)
    assert requirement == f"jax>={oldest},<{past_newest}"


@pytest.mark.parametrize("version", ["0.10.0", "0.10.2", "0.11.2", "0.12.0", "0.12.0.1", "0.12.1.dev20260101"])
def test_known_jax_versions_are_accepted(version):
    jax_internals.check_jax_version(version)


@pytest.mark.parametrize("version", ["0.9.2", "0.13.0", "1.0.0", "unknown"])
def test_unknown_jax_versions_are_refused_with_what_to_install(version):
    words = (
        f"knows for jax 0.10 through 0.12, but jax=={version} is installed. "
        "Install a supported JAX: pip install 'jax>=0.10,<0.13'"
    )
    with pytest.raises(ImportError, match=re.escape(words)):
        jax_internals.check_jax_version(version)


def test_import_refuses_an_unknown_jax_before_touching_its_internals():
    # A child process whose jax claims a release from the future: importing the library
    # must fail with the version message, not an AttributeError from jax._src.
    script = "import jax; jax.__version__ = '0.13.0'; import jax_dsrelu"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "ImportError: jax_dsrelu relies on JAX internals that it knows for jax 0.10 through 0.12, but jax==0.13.0" in done.stderr


def _cutlass_bridge_probe() -> dict:
    """In a child (CuTe DSL's target architecture is fixed when cutlass is first imported)."""
    script = """
import json
from jax_dsrelu.ffi import cutlass_bridge
try:
    cutlass_bridge.check_cutlass_dsl_version("4.9.0")
    refusal = None
except ImportError as error:
    refusal = str(error)
import cutlass
print(json.dumps(dict(known=cutlass_bridge.KNOWN_CUTLASS_DSL_VERSION, installed=cutlass.__version__, refusal=refusal)))
"""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(software.missing("cutlass", "gpu") is not None, reason="CuTe DSL (the 'gpu' extra) is not installed")
def test_cutlass_bridge_knows_the_pinned_cute_dsl_and_refuses_another():
    probe = _cutlass_bridge_probe()
    assert probe["installed"] == probe["known"]
    for extra in ("gpu", "sm100"):
        assert f"nvidia-cutlass-dsl[cu13]=={probe['known']}" in PROJECT["optional-dependencies"][extra]
    assert probe["refusal"] == (
        f"jax_dsrelu's kernel bridge relies on internals of cutlass.jax that it knows for "
        f"nvidia-cutlass-dsl {probe['known']} only, but 4.9.0 is installed. Install that version: "
        f"pip install 'nvidia-cutlass-dsl[cu13]=={probe['known']}' (what jax-dsrelu's gpu extra "
        f"pins), or use backend='xla'."
    )

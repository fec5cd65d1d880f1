"""Test tiers: CPU tests always run; tests marked `gpu` need a CUDA device.

A `gpu` test is skipped only when JAX sees no CUDA device; any other failure is a failure.
`python -m pytest -rs` lists every skip with its reason, so a skip never passes for a run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os

# Eight host devices, so that sharded computations run on a CPU-only machine. It must be
# set before JAX starts its CPU backend; unsharded tests simply use the first device.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
# Under pytest-xdist (the README's `-n auto`) several processes share a GPU where there is
# one: each takes what it uses instead of JAX's default share of the whole card.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest


@functools.cache
def cuda_devices() -> list:
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


def pytest_collection_modifyitems(config, items):
    if cuda_devices():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; JAX sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drops every compiled program after each test module, and hands the freed C heap back.

    JAX keeps each jitted program for the life of the process; a module's programs are
    rarely wanted by the next module, and keeping all of them made the suite's memory
    the sum of its modules' rather than the largest one's.
    """
    yield
    jax.clear_caches()
    gc.collect()
    _return_freed_heap()


def _return_freed_heap() -> None:
    """Hands the C heap's free pages back to the system (glibc only): what a module freed
    stays in the process's resident set otherwise, and the suite's peak is its baseline
    plus the largest module's."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


@pytest.fixture(scope="module")
def hopper():
    """Skips a module's GPU tests unless the visible GPU is a Hopper (compute capability
    9.0), the only one the sm90 kernels run on."""
    from jax_dsrelu.kernels import registry

    capability = registry.cuda_compute_capability()
    if capability != (9, 0):
        pytest.skip(f"the sm90 kernels run on compute capability 9.0; this GPU has {capability}")


@pytest.fixture
def decide(monkeypatch):
    """decide(name, value): the sm90 tuning table's decision `name` reads `value` for the
    rest of the test, every other decision as the table has it."""
    from jax_dsrelu.kernels.sm90 import tuning

    table = tuning.value

    def set_decision(name, value):
        monkeypatch.setattr(tuning, "value", lambda asked: value if asked == name else table(asked))

    return set_decision

"""The kernels' disk cache under concurrent processes (`ffi/cutlass_bridge.py`).

The README's test command runs pytest-xdist workers, and the GPU runs several processes
at once, all compiling into one JAX_DSRELU_KERNEL_CACHE. A process must never read another's
half-written object: each writes a file of its own and renames it into place, which is
atomic. Here a writer stops half-way through its write until a reader process has looked
the key up; compiling is replaced by a fixed module in both, so only the cache is tested.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Both processes: the bridge with compiling replaced by a fixed 1 MiB module.
_COMMON = """
import hashlib, os, sys, time
from jax_dsrelu.ffi import cutlass_bridge as bridge
MODULE = bytes(range(256)) * 4096
bridge._function_spec = lambda *args: None
bridge._compile = lambda fn, spec, keep: bridge.Compiled(module=MODULE, fingerprint=hashlib.sha256(MODULE).digest())
signal = sys.argv[1]
def host():
    pass
def wait_for(path):
    deadline = time.time() + 60
    while not os.path.exists(path):
        assert time.time() < deadline, f"no {path} within 60 s"
        time.sleep(0.02)
"""

# The writer writes half of the module, signals, and waits for the reader before the rest.
_WRITER = _COMMON + """
real_open = open
class HalfThenWait:
    def __init__(self, file):
        self.file = file
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.file.close()
    def write(self, data):
        self.file.write(data[:len(data) // 2])
        self.file.flush()
        real_open(signal + ".half", "w").close()
        wait_for(signal + ".read")
        self.file.write(data[len(data) // 2:])
def half_then_wait(path, mode="r", *args, **kwargs):
    if "w" not in mode:
        return real_open(path, mode, *args, **kwargs)
    if in_place:  # the planted bug: the cache file written where readers look, no rename
        path, bridge.os.replace = path.rsplit(".", 1)[0], lambda source, target: None
    return HalfThenWait(real_open(path, mode, *args, **kwargs))
in_place = sys.argv[2:] == ["in place"]
bridge.open = half_then_wait
bridge.compile_function(host, ("cache race",), [], [], {}, arch="sm_90a")
print("written")
"""

# The reader looks the key up while the writer is half-way, and must get the whole module.
_READER = _COMMON + """
wait_for(signal + ".half")
got = bridge.compile_function(host, ("cache race",), [], [], {}, arch="sm_90a").module
open(signal + ".read", "w").close()
assert got == MODULE, f"read {len(got)} bytes of another process's object, expected {len(MODULE)}"
print("read whole")
"""


def _start(script: str, cache: str, signal: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_DSRELU_KERNEL_CACHE=cache, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), signal, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _race(tmp_path, in_place: bool = False):
    cache, signal = str(tmp_path / "cache"), str(tmp_path / "signal")
    processes = [_start(_WRITER, cache, signal, *(["in place"] if in_place else [])), _start(_READER, cache, signal)]
    outputs = [process.communicate(timeout=240) for process in processes]
    return cache, [(process.returncode, out, err) for process, (out, err) in zip(processes, outputs)]


def test_a_process_never_reads_another_processs_half_written_kernel(tmp_path):
    cache, results = _race(tmp_path)
    assert [(code, out.strip()) for code, out, _ in results] == [(0, "written"), (0, "read whole")], results
    # One object, whole; no file of a write in progress left behind.
    (name,) = os.listdir(cache)
    assert name.endswith(".o")
    with open(os.path.join(cache, name), "rb") as file:
        assert file.read() == bytes(range(256)) * 4096


def test_the_race_catches_a_cache_written_in_place(tmp_path):
    # The same race against a bridge that writes the cache file itself instead of a file of
    # its own renamed into place: the reader gets half a module.
    _, results = _race(tmp_path, in_place=True)
    reader_code, _, reader_err = results[1]
    assert reader_code != 0 and "read 524288 bytes of another process's object" in reader_err, results

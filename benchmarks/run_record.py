"""What every benchmark record says about its run, how one failing variant is recorded,
and where the record goes.

A variant that fails (a kernel not built yet, a block configuration that does not fit,
a result that disagrees with the reference) becomes an entry {"error": ...} in the JSON
and the script goes on with the next one. A benchmark's record is the current one: the
next run of the same benchmark (and --label) overwrites it; its history is git's.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import subprocess
import sys
import traceback

import jax

# Enough of a message to say what failed; whole tracebacks go to the log.
ERROR_CHARS = 600


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def header(commit: str | None, timing: str) -> dict:
    """Device, versions, commit and command of this run."""
    first = jax.devices()[0]
    return dict(device=getattr(first, "device_kind", str(first)), platform=jax.default_backend(),
                commit=commit or git_commit(), command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                jax=jax.__version__, python=platform.python_version(), timing=timing)


def error_entry(error: BaseException, stage: str) -> dict:
    """The JSON entry of a variant that failed at `stage`; the traceback goes to stderr."""
    traceback.print_exception(error, file=sys.stderr)
    message = f"{type(error).__name__}: {error}"
    print(f"  {stage} failed: {message[:200]}", flush=True)
    return dict(error=message[:ERROR_CHARS], stage=stage)


def best_of(tried: list[dict]) -> dict:
    """The entry of a variant tried in several configurations (each entry with its
    "config"): the fastest timed one, or the first failure if none was timed, with every
    configuration's time or error under "configs"."""
    timed = [entry for entry in tried if "ms" in entry]
    best = min(timed, key=lambda entry: entry["ms"]) if timed else tried[0]
    return dict(best, configs=[
        {"config": e["config"], **({"ms": e["ms"]} if "ms" in e else {"error": e["error"]})} for e in tried
    ])


# A record above this size is written gzipped (.json.gz): a step on XLA's own path launches
# hundreds of kernels at the fine-grained shapes, and every launch is recorded.
GZIP_BYTES = 256 * 1024


def write_json(result: dict, directory: str, name: str) -> str:
    """Writes `result` as directory/name without whitespace (the records are committed:
    an indented record is 60% larger), gzipped as name + ".gz" where it is large; the
    other form of the same record, left by an earlier run, is removed."""
    os.makedirs(directory, exist_ok=True)
    data = json.dumps(result, separators=(",", ":")).encode()
    path = os.path.join(directory, name)
    if len(data) > GZIP_BYTES:
        path, stale, data = path + ".gz", path, gzip.compress(data, mtime=0)
    else:
        stale = path + ".gz"
    with open(path, "wb") as file:
        file.write(data)
    if os.path.exists(stale):
        os.remove(stale)
    return path


def load(path) -> dict:
    """A record written by write_json, gzipped or not."""
    with open(path, "rb") as file:
        data = file.read()
    return json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)

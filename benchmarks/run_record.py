"""What every benchmark record says about its run, how one failing variant is recorded
({"error": ..., "stage": ...}, and the script goes on), and where the record goes: the
current one, which the next run of the same benchmark (and --label) overwrites.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import platform
import subprocess
import sys
import traceback

import jax

# Enough of a message to say what failed; whole tracebacks go to the log.
ERROR_CHARS = 600
# A record above this size is written gzipped (.json.gz): XLA's own path records hundreds of launches.
GZIP_BYTES = 256 * 1024


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def header(commit: str | None, timing: str) -> dict:
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
    """A variant tried in several "config"s: the fastest timed entry, or the first failure; each one's under "configs"."""
    timed = [entry for entry in tried if "ms" in entry]
    best = min(timed, key=lambda entry: entry["ms"]) if timed else tried[0]
    return dict(best, configs=[{"config": e["config"], **({"ms": e["ms"]} if "ms" in e else {"error": e["error"]})}
                               for e in tried])


def write_json(result: dict, directory: str, name: str) -> str:
    """Writes `result` as directory/name without whitespace (committed records: indented is 60%
    larger), gzipped as name + ".gz" where large; the record's other form is removed."""
    os.makedirs(directory, exist_ok=True)
    data = json.dumps(result, separators=(",", ":")).encode()
    path = stale = os.path.join(directory, name)
    if len(data) > GZIP_BYTES:
        path, data = path + ".gz", gzip.compress(data, mtime=0)
    else:
        stale += ".gz"
    pathlib.Path(path).write_bytes(data)
    pathlib.Path(stale).unlink(missing_ok=True)
    return path


def load(path) -> dict:
    """A record written by write_json, gzipped or not."""
    data = pathlib.Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)

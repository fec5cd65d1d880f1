"""What every benchmark JSON says about its run, and how one failing variant is recorded.

A variant that fails (a kernel not built yet, a block configuration that does not fit,
a result that disagrees with the reference) becomes an entry {"error": ...} in the JSON
and the script goes on with the next one.
"""

from __future__ import annotations

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
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def header(commit: str | None, timing: str, device: str | None = None) -> dict:
    """Device, versions, commit and command of this run. A given `device` spares asking
    JAX, which would initialise the GPU (and take most of its memory) in this process."""
    platform_name = None
    if device is None:
        first = jax.devices()[0]
        device, platform_name = getattr(first, "device_kind", str(first)), jax.default_backend()
    return dict(
        device=device,
        platform=platform_name or "as the processes saw it",
        commit=commit or git_commit(),
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        jax=jax.__version__,
        python=platform.python_version(),
        timing=timing,
    )


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


def write_json(result: dict, directory: str, name: str) -> str:
    """Writes `result` without whitespace, as every benchmark script does: the records are
    committed, and compact records keep the repository small (an indented record is 60%
    larger)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as file:
        json.dump(result, file, separators=(",", ":"))
    return path

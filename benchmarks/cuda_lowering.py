"""Prebuilding kernels on a machine without a GPU: lower each jitted function for cuda.

Lowering a function for the cuda platform compiles every CuTe DSL kernel it calls (the
sm90 backend compiles while lowering) and, with JAX_DSRELU_KERNEL_CACHE set, writes the
object code to that directory, where the GPU machine finds it instead of compiling. The
compile keys hold static facts only (dtypes, n, k, E, flags, tile configuration; never m
or the group sizes), so lowering at the shapes a script will run builds exactly the
kernels it will ask for. Shapes are jax.ShapeDtypeStruct: nothing large is allocated.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

import jax

from jax_dsrelu.kernels import registry as backend_choice

# The H200's compute capability: backend="auto" resolves to the kernels it would pick there.
HOPPER = (9, 0)
CACHE_VARIABLE = "JAX_DSRELU_KERNEL_CACHE"


def prepare() -> str:
    """Checks that compiled kernels will be kept, and targets sm_90a; returns the cache path.

    CuTe DSL reads its target architecture when it is first imported, so this runs before
    anything lowers for cuda.
    """
    directory = os.environ.get(CACHE_VARIABLE)
    if not directory:
        raise SystemExit(f"--prebuild needs {CACHE_VARIABLE} set to the kernel cache directory")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    return directory


@contextlib.contextmanager
def as_on_hopper() -> Iterator[None]:
    """backend="auto" resolves as on a Hopper GPU while lowering here.

    With no GPU visible, "auto" lowers the XLA reference (backend_choice), so the kernels
    an H200 would run are only built when the visible device is taken to be one.
    """
    original = backend_choice.cuda_compute_capability
    backend_choice.cuda_compute_capability = lambda: HOPPER
    try:
        yield
    finally:
        backend_choice.cuda_compute_capability = original


def lower_for_cuda(name: str, fn: Callable, *shapes) -> bool:
    """Lowers fn at these shapes for cuda; prints and returns whether it lowered.

    A kernel that its backend does not serve yet is reported and skipped, so one missing
    kernel does not stop the others from being built.
    """
    # A function jitted already keeps its own jit options (compiler options may only sit
    # on the outermost jit), so it is lowered as it is.
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    try:
        with as_on_hopper():
            jitted.trace(*shapes).lower(lowering_platforms=("cuda",))
    except NotImplementedError as error:
        print(f"prebuild {name}: not built ({str(error)[:200]})", flush=True)
        return False
    print(f"prebuild {name}: lowered", flush=True)
    return True


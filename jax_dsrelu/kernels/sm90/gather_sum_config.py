"""The sm90 gather-and-sum's constraints and launch shape. Imports no CuTe DSL: backend
choice asks `cannot_implement` without loading the kernel."""

from __future__ import annotations

import numpy as np

from jax_dsrelu.kernels.request import GatherSumRequest

# Every slot's 16-byte chunk is held in registers before the first addition (4 registers
# a slot), so that all of a token's loads are in flight at once.
MAX_SLOTS = 32
# Threads per CTA; a CTA takes THREADS // lanes tokens (`token_lanes`).
THREADS = 128
VECTOR_BYTES = 16
_FLOAT_DTYPES = (np.dtype("bfloat16"), np.dtype("float16"), np.dtype("float32"))


def vector_elements(dtype) -> int:
    """Elements of `dtype` in one 16-byte load."""
    return VECTOR_BYTES // np.dtype(dtype).itemsize


def token_lanes(request: GatherSumRequest) -> int:
    """Threads per token: enough for a row's 16-byte chunks, up to the CTA's threads, in a
    power of two, so that a CTA's threads divide evenly among its tokens."""
    chunks = request.n // vector_elements(request.rows_dtype)
    lanes = 1
    while lanes < min(chunks, THREADS):
        lanes *= 2
    return lanes


def cannot_implement(request: GatherSumRequest) -> str | None:
    """Why the sm90 gather-and-sum cannot serve `request`, or None when it can."""
    dtype = np.dtype(request.rows_dtype)
    if dtype not in _FLOAT_DTYPES:
        return f"the sm90 gather-and-sum reads bfloat16, float16 or float32 rows, got {dtype.name}"
    vector = vector_elements(dtype)
    if request.n < vector or request.n % vector:
        return (f"the sm90 gather-and-sum needs n to be a positive multiple of {vector} (16-byte rows of "
                f"{dtype.name}), got n={request.n}")
    if not 1 <= request.slots <= MAX_SLOTS:
        return f"the sm90 gather-and-sum takes 1 to {MAX_SLOTS} slots per token, got slots={request.slots}"
    return None

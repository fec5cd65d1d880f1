"""The named barriers of the sm90 kernels: one hardware barrier id per purpose.

Id 0 is `__syncthreads` (every thread of the CTA). The others synchronize only the consumer
warpgroups, so the producer warps run on; two purposes sharing an id could let one's
arrivals release the other's waiters.
"""

from __future__ import annotations

import enum


class NamedBarrier(enum.IntEnum):
    EPILOGUE = 1  # consumers around a shared-memory epilogue buffer (epilogue_store.py)
    DBIAS = 2  # consumers around the dbias partials in shared memory (dsrelu_kernel.py)

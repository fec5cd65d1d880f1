"""Storing an epilogue subtile, shared by the Hopper ragged-M kernels.

Each (tile_m x epi_n) subtile is rounded once to the output dtype in registers, written
to a shared-memory buffer with stmatrix, and stored with one TMA box through the ragged
row view (`mainloop.ragged_view`), which clips it at the expert's last row. The buffers
form a ring of `store_stages`; before a buffer is reused, the store that read it must be
done (`producer_acquire`), so the epilogue of one subtile overlaps the store of the last.
One or two outputs (dh and act, or h and act) go out together.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from jax_dsrelu.kernels.sm90 import mainloop

EPILOGUE_BARRIER = 1  # named barrier of the consumer warpgroups (0 is __syncthreads)


def store_view(tensor: cute.Tensor, offset: Int32, length: Int32, local_tile: Int32,
               tile_m: int, epi_n: int) -> cute.Tensor:
    """(tile_m, epi_n, n / epi_n) store view of rows [offset, offset + length), tile
    `local_tile` of them, clipped at offset + length."""
    rows = mainloop.expert_rows(tensor, 0, offset, length)
    return cute.local_tile(rows, (tile_m, epi_n), (local_tile, None))


@cute.jit
def store_subtile(
    tiled_r2s: cute.TiledCopy,
    outputs,  # one or two (registers f32, registers out dtype, smem partition, TMA atom, gmem view, smem)
    store_pipeline,
    store_count: Int32,
    column_block: Int32,
    ctid: Int32,
    store_stages: cutlass.Constexpr,
    consumer_threads: cutlass.Constexpr,
):
    """Rounds the subtile once, stages it in shared memory, and stores it with TMA."""
    buffer = store_count % store_stages
    for i in cutlass.range_constexpr(len(outputs)):
        rF, rOut, tRS_s, _, _, _ = outputs[i]
        rOut.store(rF.load().to(rOut.element_type))
        cute.copy(tiled_r2s, rOut, tRS_s[None, None, None, buffer])
    # stmatrix writes are generic-proxy; the TMA engine reads through the async proxy.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=consumer_threads)
    if ctid == 0:
        for i in cutlass.range_constexpr(len(outputs)):
            _, _, _, tma, gmem, smem = outputs[i]
            bSG_s, bSG_g = mainloop.tma_partition(tma, smem, gmem)
            cute.copy(tma, bSG_s[None, buffer], bSG_g[None, column_block])
        store_pipeline.producer_commit()
        # The next subtile reuses buffer + 1: wait until its store has read it.
        store_pipeline.producer_acquire()
    cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=consumer_threads)

"""Storing an epilogue's subtiles by TMA, shared by the Hopper kernels of the family.

Each (tile_m x epi_n) subtile is rounded once to the output dtype in registers, written
to a shared-memory buffer (stmatrix; plain stores for float32), and stored with one TMA
box, which the hardware clips at the tensor's extent (the ragged row view of
`mainloop.ragged_view` clips it at the expert's last row).

`store_subtile`: the buffers form a ring of `store_stages`; before a buffer is reused, the
store that read it must be done (`producer_acquire`), so the epilogue of one subtile
overlaps the store of the last. One or two outputs (dh and act, or h and act) go out
together. `store_tile`: a buffer per subtile of the tile, one barrier for all of them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from jax_dsrelu.kernels.sm90 import mainloop
from jax_dsrelu.kernels.sm90.barriers import NamedBarrier



def store_view(tensor: cute.Tensor, offset: Int32, length: Int32, local_tile: Int32,
               tile_m: int, epi_n: int) -> cute.Tensor:
    """(tile_m, epi_n, n / epi_n) store view of rows [offset, offset + length), tile
    `local_tile` of them, clipped at offset + length."""
    rows = mainloop.expert_rows(tensor, 0, offset, length)
    return cute.local_tile(rows, (tile_m, epi_n), (local_tile, None))


@cute.jit
def store_subtile(
    tiled_r2s: cute.TiledCopy,
    outputs,  # one or two `StoredOutput`s, each with its work item's gmem view
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
        output = outputs[i]
        output.rounded.store(output.registers.load().to(output.rounded.element_type))
        cute.copy(tiled_r2s, output.rounded, output.partition[None, None, None, buffer])
    # stmatrix writes are generic-proxy; the TMA engine reads through the async proxy.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=consumer_threads)
    if ctid == 0:
        for i in cutlass.range_constexpr(len(outputs)):
            output = outputs[i]
            bSG_s, bSG_g = mainloop.tma_partition(output.tma, output.smem, output.gmem)
            cute.copy(output.tma, bSG_s[None, buffer], bSG_g[None, column_block])
        store_pipeline.producer_commit()
        # The next subtile reuses buffer + 1: wait until its store has read it.
        store_pipeline.producer_acquire()
    cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=consumer_threads)


@cute.jit
def store_tile(
    visit,  # visit(subtile): the subtile's values into each output's float32 registers (traced)
    tiled_r2s: cute.TiledCopy,
    outputs,  # the `StoredOutput`s, each with its work item's gmem view and a shared buffer per subtile
    store_pipeline,  # PipelineTmaStore of one stage: one bulk group per tile
    first_block: Int32,
    ctid: Int32,
    subtiles: cutlass.Constexpr,
    consumer_threads: cutlass.Constexpr,
):
    """A whole tile at once: every subtile made by `visit`, rounded and staged in its own
    buffer, then one barrier and the TMA stores as one bulk group.

    Where shared memory holds a whole tile, this costs two barriers and one proxy fence
    per tile instead of two barriers and a fence per subtile (`store_subtile`), and the
    wait for the buffers is for the previous tile's stores, issued a whole mainloop ago.
    """
    if ctid == 0:
        store_pipeline.producer_acquire()
    cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=consumer_threads)
    for subtile in cutlass.range_constexpr(subtiles):
        visit(subtile)
        for i in cutlass.range_constexpr(len(outputs)):
            output = outputs[i]
            output.rounded.store(output.registers.load().to(output.rounded.element_type))
            cute.copy(tiled_r2s, output.rounded, output.partition[None, None, None, subtile])
    # stmatrix writes are generic-proxy; the TMA engine reads through the async proxy.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=consumer_threads)
    if ctid == 0:
        for i in cutlass.range_constexpr(len(outputs)):
            output = outputs[i]
            bSG_s, bSG_g = mainloop.tma_partition(output.tma, output.smem, output.gmem)
            for subtile in cutlass.range_constexpr(subtiles):
                cute.copy(output.tma, bSG_s[None, subtile], bSG_g[None, first_block + subtile])
        store_pipeline.producer_commit()

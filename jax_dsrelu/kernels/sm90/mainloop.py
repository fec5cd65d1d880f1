"""The pieces every Hopper kernel of the family shares: the TMA/wgmma mainloop and ragged views.

Mainloop. A producer warp streams k-tiles of A (tile_m x tile_k) and B (tile_n x tile_k)
into a multi-stage shared-memory ring (`load_k_tiles`); the consumer warpgroups wait for
each stage, issue its wgmma batch, keep one batch in flight and release a stage one batch
late (`mma_k_tiles`). Both take the k-tile count at run time, so the same code serves a
fixed K (the ragged-M kernels) and an expert's row count (the ragged contraction). The
pipeline states are passed in and returned, as the DSL carries them through loops.

Ragged views. For a tensor whose mode `ragged_mode` is a row index (expert e's rows
[offset, offset + length) of an (m, x) array), `ragged_view` presents it as a tensor with
two more modes, and `expert_rows` slices expert e out of it: rows past the expert's last
row have a coordinate >= 2^30, outside the first mode's extent, so a TMA box that reaches
them is clipped (stores write nothing there, loads read zeros), with one descriptor for
every expert. Element arithmetic of row coordinate 2^30 - length + r, with the fixed
coordinates (2^30, offset + length) in the two extra modes and row stride s:

    (2^30 - length + r) s + 2^30 (2^34 - s) + (offset + length) s = (offset + r) s + 2^64,

and 64-bit address arithmetic drops the 2^64 (the construction of Triton's ragged TMA and
of QuACK). The extents are run-time values: a static layout of this size overflows the
DSL's static size arithmetic.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

RAGGED_ROWS = 2**30
_RAGGED_EXTRA = 2**31 - 1
_WRAP_STRIDE = 2**64 // RAGGED_ROWS  # 2^34: 2^30 of these steps wrap 64-bit addresses
# Row coordinates stay below 2^30 + 2^30: int32.
MAX_ROWS = RAGGED_ROWS - 1


def ragged_view(tensor: cute.Tensor, ragged_mode: int) -> cute.Tensor:
    """`tensor` (rank 2) with its row mode `ragged_mode` made ragged (see the module doc)."""
    row_stride = tensor.stride[ragged_mode]  # 64-bit: the wrapping stride needs the width
    other = 1 - ragged_mode
    shape = [None, None]
    stride = [None, None]
    shape[ragged_mode] = Int32(RAGGED_ROWS)
    stride[ragged_mode] = row_stride
    shape[other] = tensor.shape[other]
    stride[other] = tensor.stride[other]
    return cute.make_tensor(
        tensor.iterator,
        cute.make_layout(
            (shape[0], shape[1], Int32(_RAGGED_EXTRA), Int32(_RAGGED_EXTRA)),
            stride=(stride[0], stride[1], _WRAP_STRIDE - row_stride, row_stride),
        ),
    )


def expert_rows(view: cute.Tensor, ragged_mode: int, offset: Int32, length: Int32) -> cute.Tensor:
    """Rows [offset, offset + length) of a `ragged_view`, as a rank-2 tensor whose row
    mode ends at the expert's last row."""
    rows = view[None, None, RAGGED_ROWS, offset + length]
    start = [0, 0]
    start[ragged_mode] = RAGGED_ROWS - length
    return cute.domain_offset((start[0], start[1]), rows)


@cute.jit
def load_k_tiles(
    tma_a: cute.CopyAtom,
    tAgA: cute.Tensor,  # (TMA box, k-tiles) of A in global memory
    tAsA: cute.Tensor,  # (TMA box, stages) in shared memory
    tma_b: cute.CopyAtom,
    tBgB: cute.Tensor,
    tBsB: cute.Tensor,
    ab_pipeline: pipeline.PipelineTmaAsync,
    state: pipeline.PipelineState,
    k_tiles: Int32,
    a_multicast: cutlass.Constexpr = 1,
    staged: list = (),
) -> pipeline.PipelineState:
    """Producer: k-tiles 0 .. k_tiles - 1 of one work tile into the ring, in order. With
    `a_multicast` CTAs in the cluster, this CTA's slice of each A box (`tma_partition`
    with its rank) goes to all of them. `staged`: (TMA atom, global k-tile runs, shared
    ring) of each input loaded beside A and B under the stage's barrier."""
    for k_tile in range(k_tiles):
        ab_pipeline.producer_acquire(state)
        barrier = ab_pipeline.producer_get_barrier(state)
        if cutlass.const_expr(a_multicast > 1):
            cute.copy(tma_a, tAgA[None, k_tile], tAsA[None, state.index], tma_bar_ptr=barrier,
                      mcast_mask=cutlass.Int16((1 << a_multicast) - 1))
        else:
            cute.copy(tma_a, tAgA[None, k_tile], tAsA[None, state.index], tma_bar_ptr=barrier)
        cute.copy(tma_b, tBgB[None, k_tile], tBsB[None, state.index], tma_bar_ptr=barrier)
        for atom, runs, ring in staged:
            cute.copy(atom, runs[None, k_tile], ring[None, state.index], tma_bar_ptr=barrier)
        ab_pipeline.producer_commit(state)
        state.advance()
    return state


@cute.jit
def mma_k_tiles(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    ab_pipeline: pipeline.PipelineTmaAsync,
    read_state: pipeline.PipelineState,
    release_state: pipeline.PipelineState,
    k_tiles: Int32,
    active=None,
    operands_written_by_generic_proxy: cutlass.Constexpr = False,
):
    """Consumers: acc = sum over the tile's k-tiles of A B^T (acc = 0 for none).

    One wgmma batch stays in flight; a stage is released once the batch after the one
    reading it has been issued, so the producer refills it while the tensor cores work.
    Returns (read_state, release_state).

    `active` (`warpgroup_active`, or None for always): 0 when none of this warpgroup's
    rows of the tile is stored (an expert's last tile with 64 rows or fewer left). Such a
    warpgroup issues no wgmma: it waits for and releases every stage in step with the
    other, its accumulator stays 0, and the other warpgroup has the tensor cores to
    itself. What that saves depends on the kernel: 1-2% of the fused dsReLU kernel's time
    on the H200, while the ragged-M GEMM ran slower with it (docs/sm90.md, the last-tile
    section). The branch is taken once per tile, around two whole loops: a wgmma under a
    run-time branch inside the loop made ptxas serialize every wgmma of the kernel (C7520:
    the steps ran 10-19% slower on the H200), or, behind a warp-uniform flag, slowed the
    steps by 3-4%. The compile tier fails on serialization (tests/ptxas.py).

    `operands_written_by_generic_proxy`: the ring's stages are written by cp.async (a
    gathered operand, `gather_a.py`), that is through the generic proxy, which wgmma's
    async-proxy reads of shared memory do not see without a proxy fence. The writers
    signal completion on the stage's barrier and cannot fence after their copies land,
    so each consumer thread fences (fence.proxy.async.shared::cta) between its wait for
    a stage and the wgmma batch that reads it. A stage filled by TMA alone needs none."""
    if cutlass.const_expr(active is None):
        read_state, release_state = _wgmma_k_tiles(tiled_mma, acc, tCrA, tCrB, ab_pipeline, read_state,
                                                   release_state, k_tiles, operands_written_by_generic_proxy)
    else:
        if active != 0:
            read_state, release_state = _wgmma_k_tiles(tiled_mma, acc, tCrA, tCrB, ab_pipeline, read_state,
                                                       release_state, k_tiles, operands_written_by_generic_proxy)
        else:
            acc.fill(0.0)
            for _ in range(k_tiles):
                ab_pipeline.consumer_wait(read_state)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                read_state.advance()
    return read_state, release_state


@cute.jit
def _wgmma_k_tiles(tiled_mma, acc, tCrA, tCrB, ab_pipeline, read_state, release_state, k_tiles: Int32,
                   operands_written_by_generic_proxy: cutlass.Constexpr):
    """`mma_k_tiles`' loop of wgmma batches. The accumulator is zeroed and fenced here,
    past the caller's branch: a register write between the fence and the first wgmma
    makes ptxas fence every wgmma batch itself (C7519)."""
    k_blocks = cute.size(tCrA, mode=[2])
    acc.fill(0.0)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.fence()
    if k_tiles > 0:
        _wgmma_k_tile(tiled_mma, acc, tCrA, tCrB, k_blocks, ab_pipeline, read_state, operands_written_by_generic_proxy)
        read_state.advance()
        for k_tile in range(1, k_tiles):
            _wgmma_k_tile(tiled_mma, acc, tCrA, tCrB, k_blocks, ab_pipeline, read_state,
                          operands_written_by_generic_proxy)
            warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        warpgroup.wait_group(0)
        ab_pipeline.consumer_release(release_state)
        release_state.advance()
    return read_state, release_state


@cute.jit
def _fence_generic_writes(operands_written_by_generic_proxy: cutlass.Constexpr):
    """Makes a stage's generic-proxy writes (cp.async) visible to wgmma's async-proxy
    reads, after the wait on its barrier (see `mma_k_tiles`); nothing for a TMA ring."""
    if cutlass.const_expr(operands_written_by_generic_proxy):
        cute.arch.fence_proxy("async.shared", space="cta")


def warpgroup_active(first_row_of_warpgroup: Int32, rows_stored: Int32) -> Int32:
    """1 if the warpgroup whose rows start at `first_row_of_warpgroup` in the tile holds
    any of the tile's first `rows_stored` rows, else 0; marked warp-uniform (a
    warpgroup's four warps share it)."""
    return cute.arch.make_warp_uniform(
        Int32(cutlass.select_(first_row_of_warpgroup < rows_stored, Int32(1), Int32(0)))
    )


def tma_partition(tma: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor, rank=0, ctas: int = 1):
    """(shared, global) TMA partitions of a tile-by-tile copy: of the whole box, or, for a
    box multicast by `ctas` CTAs, of the slice that CTA `rank` of them loads."""
    return cpasync.tma_partition(
        tma, rank, cute.make_layout(ctas), cute.group_modes(smem, 0, 2), cute.group_modes(gmem, 0, 2)
    )


@cute.jit
def _wgmma_k_tile(tiled_mma, acc, tCrA, tCrB, k_blocks: cutlass.Constexpr, ab_pipeline, read_state,
                  operands_written_by_generic_proxy: cutlass.Constexpr):
    """One k-tile's wgmma batch, once its stage has landed."""
    ab_pipeline.consumer_wait(read_state)
    _fence_generic_writes(operands_written_by_generic_proxy)
    for k_block in cutlass.range_constexpr(k_blocks):
        coord = (None, None, k_block, read_state.index)
        cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
    warpgroup.commit_group()

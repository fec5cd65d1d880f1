"""The consumers' mainloop for block-scaled FP8 operands: each K block's partial sum
promoted to float32 and scaled before it joins the total.

Hopper's FP8 wgmma sums e4m3 products in an accumulator that keeps about 14 bits, so a
long K loop in it loses the low bits of every partial sum. With FP8_BLOCKWISE operands
(`jax_dsrelu.quantization`), a k-tile is one K block of 128: its wgmma batch starts a
fresh accumulator (`acc_block`), and once the batch has landed each thread adds it to the
float32 total, value by value, times the block's two scales:

    acc[r, c] += acc_block[r, c] * (lhs_scale[row r, block] * rhs_scale[expert, n block, block])

the order `quantization.emulation.blockwise_matmul` writes, the kernels' oracle. In the
waited mainloops (`mma_k_tiles_promoted`, `mma_k_tiles_promoted_by_column`) the batch is
waited for before the promotion reads it, so one batch of a warpgroup is in flight at a
time; the other consumer warpgroup's batch keeps the tensor cores busy meanwhile, and the
scales of a k-tile are loaded before its stage is waited for, so their latency hides
behind the wait. The overlapped ones (`*_overlapped`) promote k-tile t while the batch of
k-tile t + 1 runs, in a second partial-sum buffer. A stage is released as soon as its
batch has landed.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from jax_dsrelu.kernels.sm90 import fragment


@cute.jit
def mma_k_tiles_promoted_overlapped(
    ctx,  # the consumer's context: its tiled_mma, acc (the float32 total), tCrA, tCrB and ab_pipeline
    acc_blocks: list,  # two partial-sum buffers, written by wgmma only, used in turn
    read_state: pipeline.PipelineState,
    release_state: pipeline.PipelineState,
    k_tiles: cutlass.Constexpr,
    lhs_scale: cute.Tensor,
    rows: list,
    rhs_scale: cute.Tensor,
    expert: Int32,
    n_block: Int32,
):
    """`mma_k_tiles_promoted` with the promotion of k-tile t beside the wgmma batch of
    k-tile t + 1: the batches go to the two buffers in turn, each promoted once the batch
    after it has been issued (wait_group(1)). k_tiles is static (the ragged-M kernels'
    K), and the k-tiles are unrolled: a buffer is a set of registers, chosen at trace
    time, and the wgmma's accumulate flag may not be set inside a run-time loop whose
    wgmma after it reads the flag."""
    ctx.acc.fill(0.0)
    if cutlass.const_expr(k_tiles > 0):
        read_state = _issue_block(ctx, acc_blocks[0], read_state)
        for k_tile in cutlass.range_constexpr(1, k_tiles):
            read_state, release_state = _issue_and_promote(
                ctx, acc_blocks[k_tile % 2], acc_blocks[(k_tile - 1) % 2], read_state, release_state, k_tile - 1,
                lhs_scale, rows, rhs_scale, expert, n_block)
        scales = _block_scales(lhs_scale, rows, rhs_scale, expert, n_block, k_tiles - 1)
        warpgroup.wait_group(0)
        ctx.ab_pipeline.consumer_release(release_state)
        release_state.advance()
        _promote(ctx.acc, acc_blocks[(k_tiles - 1) % 2], scales)
    return read_state, release_state


@cute.jit
def _wgmma_batch(ctx, acc_block, read_state):
    """The k-tile of read_state's stage into a fresh `acc_block`: once the stage has
    landed, its wgmma batch issued and committed (not waited for)."""
    ctx.ab_pipeline.consumer_wait(read_state)
    # Orders the previous promotion's reads of acc_block before wgmma writes it again.
    warpgroup.fence()
    # Each `set` makes a new value of the MMA atom from the last one; the batch hands back
    # the atom as it found it, so that a batch issued in one loop or branch leaves no value
    # of its own for a batch in another (values must dominate their uses), and every batch
    # sets the accumulate flag of each of its wgmma itself. (`_trait.value` is CuTe DSL's
    # atom state at the pinned version.)
    atom = ctx.tiled_mma._trait.value
    for k_block in cutlass.range_constexpr(cute.size(ctx.tCrA, mode=[2])):
        ctx.tiled_mma.set(warpgroup.Field.ACCUMULATE, k_block != 0)
        coord = (None, None, k_block, read_state.index)
        cute.gemm(ctx.tiled_mma, acc_block, ctx.tCrA[coord], ctx.tCrB[coord], acc_block)
    ctx.tiled_mma._trait.value = atom
    warpgroup.commit_group()


@cute.jit
def _issue_block(ctx, acc_block, read_state):
    """The next k-tile's wgmma batch into a fresh `acc_block`, once its stage has landed."""
    _wgmma_batch(ctx, acc_block, read_state)
    read_state.advance()
    return read_state


@cute.jit
def _issue_and_promote(ctx, issued, promoted, read_state, release_state, promoted_tile: cutlass.Constexpr,
                       lhs_scale, rows, rhs_scale, expert, n_block):
    """Issues the next k-tile into `issued`, then promotes k-tile `promoted_tile` from
    `promoted` once its batch has landed, and releases its stage."""
    scales = _block_scales(lhs_scale, rows, rhs_scale, expert, n_block, promoted_tile)
    read_state = _issue_block(ctx, issued, read_state)
    warpgroup.wait_group(1)
    ctx.ab_pipeline.consumer_release(release_state)
    release_state.advance()
    _promote(ctx.acc, promoted, scales)
    return read_state, release_state


@cute.jit
def _block_scales(lhs_scale, rows, rhs_scale, expert, n_block, k_tile):
    """This thread's two rows' scale products for k-tile `k_tile`."""
    block_scale = Float32(rhs_scale[expert, n_block, k_tile])
    return [Float32(lhs_scale[row, k_tile]) * block_scale for row in rows]


@cute.jit
def _promote(acc, acc_block, scales):
    for v in cutlass.range_constexpr(cute.size(acc)):
        acc[v] = acc[v] + acc_block[v] * scales[fragment.row_half(v)]


@cute.jit
def mma_k_tiles_promoted(
    ctx,  # the consumer's context: its tiled_mma, acc (the float32 total), tCrA, tCrB and ab_pipeline
    acc_block: cute.Tensor,  # one K block's partial sum, written by wgmma only
    read_state: pipeline.PipelineState,
    release_state: pipeline.PipelineState,
    k_tiles: Int32,
    lhs_scale: cute.Tensor,  # (m, K blocks) float32
    rows: list,  # this thread's two rows of lhs (in bounds)
    rhs_scale: cute.Tensor,  # (E, N blocks, K blocks) float32
    expert: Int32,
    n_block: Int32,
):
    """acc = sum over the tile's k-tiles of (A B^T over the k-tile) times its scales
    (acc = 0 for none). Returns (read_state, release_state), each advanced k_tiles times.
    Not with `_issue_block` and `_promote`: their order of the state advances gives other
    PTX than the code that passed its GPU tier (tests/ptx_digests.json)."""
    acc = ctx.acc
    acc.fill(0.0)
    for k_tile in range(k_tiles):
        row_scales = [Float32(lhs_scale[row, k_tile]) for row in rows]
        block_scale = Float32(rhs_scale[expert, n_block, k_tile])
        read_state, release_state = _landed_block(ctx, acc_block, read_state, release_state)
        scales = [scale * block_scale for scale in row_scales]
        for v in cutlass.range_constexpr(cute.size(acc)):
            acc[v] = acc[v] + acc_block[v] * scales[fragment.row_half(v)]
    return read_state, release_state


@cute.jit
def _landed_block(ctx, acc_block, read_state, release_state):
    """The next k-tile's wgmma batch into a fresh `acc_block`, waited for, its stage
    released: one batch in flight, then the states advanced (release first)."""
    _wgmma_batch(ctx, acc_block, read_state)
    warpgroup.wait_group(0)
    ctx.ab_pipeline.consumer_release(release_state)
    release_state.advance()
    read_state.advance()
    return read_state, release_state


@cute.jit
def mma_k_tiles_promoted_by_column(
    ctx,  # the consumer's context: its tiled_mma, acc (the float32 total), tCrA, tCrB and ab_pipeline
    acc_block: cute.Tensor,  # one K block's partial sum, written by wgmma only
    read_state: pipeline.PipelineState,
    release_state: pipeline.PipelineState,
    k_tiles: Int32,
    lhs_scale: cute.Tensor,  # (K blocks, rows of A) float32
    rows: list,  # this thread's two rows of A (in bounds)
    rhs_scale: cute.Tensor,  # (K blocks, rows of B) float32
    columns: list,  # this thread's rows of B, one per column slot of its accumulator (in bounds)
    first_block: Int32,  # the K block of the first k-tile
):
    """`mma_k_tiles_promoted` with a scale per row of A and per row of B (the tile's
    columns) in each K block, as the weight gradients' operands are scaled along their
    K, the tokens: acc[r, c] += acc_block[r, c] * (lhs_scale[b, row r] * rhs_scale[b,
    column c]). The scales of a k-tile are loaded before its stage is waited for."""
    acc = ctx.acc
    acc.fill(0.0)
    for k_tile in range(k_tiles):
        block = first_block + k_tile
        row_scales = [Float32(lhs_scale[block, row]) for row in rows]
        column_scales = [Float32(rhs_scale[block, column]) for column in columns]
        read_state, release_state = _landed_block(ctx, acc_block, read_state, release_state)
        for v in cutlass.range_constexpr(cute.size(acc)):
            scale = row_scales[fragment.row_half(v)] * column_scales[fragment.column_slot(v)]
            acc[v] = acc[v] + acc_block[v] * scale
    return read_state, release_state


@cute.jit
def mma_k_tiles_promoted_by_column_overlapped(
    ctx,  # the consumer's context: its tiled_mma, acc (the float32 total), tCrA, tCrB and ab_pipeline
    acc_blocks: list,  # two partial-sum buffers, written by wgmma only, used in turn
    read_state: pipeline.PipelineState,
    release_state: pipeline.PipelineState,
    k_tiles: Int32,
    lhs_scale: cute.Tensor,  # (K blocks, rows of A) float32
    rows: list,  # this thread's two rows of A (in bounds)
    rhs_scale: cute.Tensor,  # (K blocks, rows of B) float32
    first_column: Int32,  # this thread's first row of B (its column slot 0, `fragment.column_offset`)
    last_column: Int32,  # the last row of B: a column past it reads its scales (never stored)
    first_block: Int32,  # the K block of the first k-tile
):
    """`mma_k_tiles_promoted_by_column` with the promotion of k-tile t beside the wgmma
    batch of k-tile t + 1, as `mma_k_tiles_promoted_overlapped` does for a static K: here
    K (an expert's groups) is known at run time only, so the k-tiles go by pairs, the
    first of a pair into acc_blocks[1] and the second into acc_blocks[0] (each buffer a
    set of registers, chosen at trace time), and a tail of one or two k-tiles follows.
    The two buffers and the total take 3 x tile_n / 2 registers a thread, so no list of
    column indices or scales is held across the loop: a column's scale is loaded where its
    values are promoted, from an index made there (`ContractConfig` allows tile_n 64)."""
    ctx.acc.fill(0.0)
    columns = (first_column, last_column)
    if k_tiles > 0:
        read_state = _issue_block(ctx, acc_blocks[0], read_state)
        # k-tile 0 is in flight in acc_blocks[0]; each pair issues 2p + 1 and 2p + 2.
        for pair in range((k_tiles - 1) // 2):
            tile = 2 * pair + 1
            read_state, release_state = _issue_and_promote_by_column(
                ctx, acc_blocks[1], acc_blocks[0], read_state, release_state, lhs_scale, rows, rhs_scale, columns,
                first_block + tile - 1)
            read_state, release_state = _issue_and_promote_by_column(
                ctx, acc_blocks[0], acc_blocks[1], read_state, release_state, lhs_scale, rows, rhs_scale, columns,
                first_block + tile)
        last = first_block + k_tiles - 1
        if (k_tiles - 1) % 2 == 1:  # k-tile k_tiles - 1 not issued yet: into acc_blocks[1]
            read_state, release_state = _issue_and_promote_by_column(
                ctx, acc_blocks[1], acc_blocks[0], read_state, release_state, lhs_scale, rows, rhs_scale, columns,
                last - 1)
            release_state = _promote_last_by_column(ctx, acc_blocks[1], release_state, lhs_scale, rows, rhs_scale,
                                                    columns, last)
        else:
            release_state = _promote_last_by_column(ctx, acc_blocks[0], release_state, lhs_scale, rows, rhs_scale,
                                                    columns, last)
    return read_state, release_state


@cute.jit
def _issue_and_promote_by_column(ctx, issued, promoted, read_state, release_state, lhs_scale, rows, rhs_scale,
                                 columns, promoted_block):
    """Issues the next k-tile into `issued`, then promotes K block `promoted_block` from
    `promoted` once its batch has landed (wait_group(1)), and releases its stage."""
    read_state = _issue_block(ctx, issued, read_state)
    warpgroup.wait_group(1)
    ctx.ab_pipeline.consumer_release(release_state)
    release_state.advance()
    _promote_loading_column_scales(ctx.acc, promoted, lhs_scale, rows, rhs_scale, columns, promoted_block)
    return read_state, release_state


@cute.jit
def _promote_last_by_column(ctx, acc_block, release_state, lhs_scale, rows, rhs_scale, columns, block):
    """The last k-tile: waited for (wait_group(0)), its stage released, promoted."""
    warpgroup.wait_group(0)
    ctx.ab_pipeline.consumer_release(release_state)
    release_state.advance()
    _promote_loading_column_scales(ctx.acc, acc_block, lhs_scale, rows, rhs_scale, columns, block)
    return release_state


@cute.jit
def _promote_loading_column_scales(acc, acc_block, lhs_scale, rows, rhs_scale, columns, block):
    """acc += acc_block * (row scale * column scale), the scales of K block `block`, each
    column's index and scale made where its two values are promoted."""
    first_column, last_column = columns
    row_scales = [Float32(lhs_scale[block, row]) for row in rows]
    for slot in cutlass.range_constexpr(cute.size(acc) // 2):
        column = cutlass.min(first_column + fragment.column_offset(slot), last_column)
        column_scale = Float32(rhs_scale[block, column])
        for v in cutlass.range_constexpr(cute.size(acc)):
            if cutlass.const_expr(fragment.column_slot(v) == slot):
                acc[v] = acc[v] + acc_block[v] * (row_scales[fragment.row_half(v)] * column_scale)

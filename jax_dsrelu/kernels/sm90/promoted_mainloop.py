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
time: the tensor cores idle during a promotion unless the other consumer warpgroup's batch
is running then (both consume the same stages, so they may well promote at the same time;
not profiled). The scales of a k-tile are loaded before its stage is waited for, so their
latency hides behind the wait. The contraction's (`mma_k_tiles_promoted_by_column`), whose
k-tile needs 34 scales a thread, reads them from the k-tile's stage, where the producer
staged them by TMA with its operands. The overlapped one (`mma_k_tiles_promoted_overlapped`)
promotes k-tile t while the batch of k-tile t + 1 runs, in a second partial-sum buffer.
The two by column halves (`mma_k_tiles_promoted_in_halves` for a static K,
`mma_k_tiles_promoted_by_column_in_halves` for the contraction's run-time K) split each
k-tile's batch by columns and promote one half while a batch of the other runs, in the
waited form's registers (`ColumnHalves`). A stage is released as soon as its batches have
landed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_dsrelu.kernels.sm90 import fragment


class ColumnHalves(NamedTuple):
    """The wgmma over half a tile's columns, for the promotions by column halves."""

    mma: Any  # the tiled MMA of tile_n / 2 columns, two 64-row warpgroups
    tCrA: Any  # the warpgroup's fragments of the A ring
    tCrB: list  # of the B ring, one per half of the tile's columns
    shape: Any  # a half's accumulator register shape


def column_halves(kernel, ctid, sA, sB) -> ColumnHalves:
    """`kernel`'s wgmma over half its tile's columns and this consumer thread's fragments
    of the rings sA and sB, B's split into the tile's two column halves (called in the
    kernel, from `mainloop_setup`)."""
    half_n = kernel.tile_n // 2
    mma = sm90_utils.make_trivial_tiled_mma(
        kernel.ab_dtype, kernel.ab_dtype, kernel.major(kernel.operand_a).sm90_mma_major_mode(),
        kernel.major(kernel.operand_b).sm90_mma_major_mode(), Float32, (2, 1, 1), tiler_mn=(64, half_n))
    warpgroup_mma = mma.get_slice(cute.make_layout(2, stride=128)(ctid // 128))
    halves_of_b = [cute.local_tile(sB, (half_n, kernel.tile_k, kernel.config.ab_stages), (half, 0, 0))
                   for half in range(2)]
    return ColumnHalves(
        mma=mma, tCrA=mma.make_fragment_A(warpgroup_mma.partition_A(sA)),
        tCrB=[mma.make_fragment_B(warpgroup_mma.partition_B(half)) for half in halves_of_b],
        shape=mma.get_slice(ctid).partition_C(cute.make_identity_tensor((kernel.tile_m, half_n))).shape)


@cute.jit
def mma_k_tiles_promoted_in_halves(
    ctx,  # the consumer's context: acc (the float32 total), ab_pipeline and column_halves (`ColumnHalves`)
    half_blocks: list,  # two partial-sum buffers, one per half of the tile's columns, written by wgmma only
    read_state: pipeline.PipelineState,
    release_state: pipeline.PipelineState,
    k_tiles: cutlass.Constexpr,
    lhs_scale: cute.Tensor,
    rows: list,
    rhs_scale: cute.Tensor,
    expert: Int32,
    n_block: Int32,
    wide=None,  # for a tile of 192 columns, as `mma_k_tiles_promoted` takes it
):
    """`mma_k_tiles_promoted` with every promotion beside a wgmma batch, for a static K:
    each k-tile is two batches, one per half of the tile's columns, into the half's own
    buffer, and each half is promoted while the next batch runs:

        issue half 0 of k-tile 0
        for each k-tile t: issue half 1 of t | wait for half 0 of t, promote it
                           issue half 0 of t + 1 | wait for half 1 of t, release t's stage, promote it

    (the last k-tile's half 1 waited for alone). The two buffers hold the waited form's
    one, beside the total; each value's sum is the waited form's, term for term (value v of
    half h is the total's value v + size(half) h). The k-tiles are unrolled, as in
    `mma_k_tiles_promoted_overlapped`, so that ptxas sees which batch each wait_group(1)
    leaves in flight (across a run-time loop's back edge it cannot, and serializes every
    wgmma: `mma_k_tiles_promoted_by_column_in_halves`).

    Given `wide`, a tile of 192 columns in halves of 96: each value takes the scale
    products of its 64-column segment (`_segment_scales`), as in the waited form, so the
    promotion in halves holds the waited wide form's registers and sums.

    The scales of k-tile t + 1 are loaded as k-tile t's products are formed, so that their
    latency passes behind t's waits and promotions (loaded just before the first wait
    that needs them, it would stall the promotion)."""
    ctx.acc.fill(0.0)
    if cutlass.const_expr(k_tiles > 0):
        loaded = _loaded_scales(lhs_scale, rows, rhs_scale, expert, n_block, 0, wide)
        ctx.ab_pipeline.consumer_wait(read_state)
        _wgmma_half(ctx, half_blocks[0], 0, read_state.index)
        for k_tile in cutlass.range_constexpr(k_tiles):
            _wgmma_half(ctx, half_blocks[1], 1, read_state.index)
            read_state.advance()
            scales = _segment_scales(*loaded, wide)
            if cutlass.const_expr(k_tile + 1 < k_tiles):
                loaded = _loaded_scales(lhs_scale, rows, rhs_scale, expert, n_block, k_tile + 1, wide)
            warpgroup.wait_group(1)
            _promote_half_by_row(ctx.acc, half_blocks[0], scales, 0)
            if cutlass.const_expr(k_tile + 1 < k_tiles):
                ctx.ab_pipeline.consumer_wait(read_state)
                _wgmma_half(ctx, half_blocks[0], 0, read_state.index)
                warpgroup.wait_group(1)
            else:
                warpgroup.wait_group(0)
            ctx.ab_pipeline.consumer_release(release_state)
            release_state.advance()
            _promote_half_by_row(ctx.acc, half_blocks[1], scales, 1)
    return read_state, release_state


@cute.jit
def _promote_half_by_row(acc, half_block, segments, half: cutlass.Constexpr):
    """acc's values of half `half` += half_block * its row's scale product in its
    64-column segment (`_segment_scales`; one segment for a tile of at most 128 columns)."""
    size = cute.size(half_block)
    for v in cutlass.range_constexpr(size):
        # Half h's fragment starts at the tile's column 2 size h (a half of 2 size columns).
        scales = segments[fragment.segment(v, half * 2 * size) if len(segments) > 1 else 0]
        acc[half * size + v] = acc[half * size + v] + _fence_operand(half_block[v]) * scales[fragment.row_half(v)]


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
    wide=None,  # for a tile of 192 columns: (its second N block of rhs, whether columns [64, 128) lie in it)
):
    """acc = sum over the tile's k-tiles of (A B^T over the k-tile) times its scales
    (acc = 0 for none). Returns (read_state, release_state), each advanced k_tiles times.
    Not with `_issue_block` and `_promote`: their order of the state advances gives other
    PTX than the code that passed its GPU tier (tests/ptx_digests.json).

    A tile of 192 columns (`config.WIDE_TILE_N`, given `wide`) spans two N blocks of
    rhs: its columns [0, 64) lie in n_block, [128, 192) in the second, and [64, 128) in
    n_block where the tile starts on a block's edge, else in the second. Value v of the
    fragment lies at column 8 (v // 4) + (0 .. 7), in the 64-column segment v // 32; each
    segment's scale products are chosen once a k-tile, so each value's product and sum are
    the 128-column tile's."""
    acc = ctx.acc
    acc.fill(0.0)
    for k_tile in range(k_tiles):
        row_scales = [Float32(lhs_scale[row, k_tile]) for row in rows]
        block_scale = Float32(rhs_scale[expert, n_block, k_tile])
        if cutlass.const_expr(wide is not None):
            second_scale = Float32(rhs_scale[expert, wide[0], k_tile])
        read_state, release_state = _landed_block(ctx, acc_block, read_state, release_state)
        segments = _segment_scales(row_scales, block_scale, second_scale if wide is not None else None, wide)
        for v in cutlass.range_constexpr(cute.size(acc)):
            acc[v] = acc[v] + acc_block[v] * segments[fragment.segment(v) if wide is not None else 0][fragment.row_half(v)]
    return read_state, release_state


def _loaded_scales(lhs_scale, rows, rhs_scale, expert, n_block, k_tile, wide) -> tuple:
    """(this thread's rows' scales, the tile's weight block scale, the second block's
    given `wide` else None) of k-tile `k_tile`, as loaded: `_segment_scales`' operands."""
    row_scales = [Float32(lhs_scale[row, k_tile]) for row in rows]
    second = Float32(rhs_scale[expert, wide[0], k_tile]) if wide is not None else None
    return row_scales, Float32(rhs_scale[expert, n_block, k_tile]), second


def _segment_scales(row_scales: list, block_scale, second_scale, wide) -> list:
    """The scale products of a k-tile per 64-column segment of the tile, each a list of
    this thread's two rows' (row scale * the segment's weight block scale): one segment
    without `wide`; given it, the first block's, the middle segment's (the second block's
    where `wide[1]` says its columns lie there) and the second block's."""
    scales = [scale * block_scale for scale in row_scales]
    if wide is None:
        return [scales]
    second = [scale * second_scale for scale in row_scales]
    return [scales, [Float32(cutlass.select_(wide[1], b, a)) for a, b in zip(scales, second)], second]


@cute.jit
def _landed_block(ctx, acc_block, read_state, release_state, while_it_runs=None):
    """The next k-tile's wgmma batch into a fresh `acc_block`, waited for, its stage
    released: one batch in flight, then the states advanced (release first).
    `while_it_runs` (traced code, or None) goes between the issue and the wait."""
    _wgmma_batch(ctx, acc_block, read_state)
    if cutlass.const_expr(while_it_runs is not None):
        while_it_runs()
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
    row_scales: cute.Tensor,  # (tile_m, 1, stages) float32: each stage's K block's scales of the tile's rows of A
    rows: list,  # this thread's two rows of the tile
    column_scales: cute.Tensor,  # (tile_n, 1, stages) float32: of the tile's rows of B (its columns)
    columns: list,  # this thread's column of the tile in each column slot of its accumulator
):
    """`mma_k_tiles_promoted` with a scale per row of A and per row of B (the tile's
    columns) in each K block, as the weight gradients' operands are scaled along their
    K, the tokens: acc[r, c] += acc_block[r, c] * (row scale r * column scale c). The
    scales come staged in the k-tile's stage (`GemmSm90.staged_inputs`), loaded by TMA
    with its operands; each thread reads its own from there while the k-tile's batch runs,
    then fences the proxies before the stage goes back to the producer, whose next TMA
    write there (the async proxy) the mbarrier alone does not order after those reads.

    Both warpgroups issue as soon as their stage has landed (no turns: the turns paid only
    beside the global scale loads' L1 prefetch, which the staged scales replaced)."""
    acc = ctx.acc
    acc.fill(0.0)
    # The thread's two row scales, then one per column slot.
    scales = cute.make_rmem_tensor(len(rows) + len(columns), Float32)
    for k_tile in range(k_tiles):
        stage = read_state.index
        read_state, release_state = _landed_block(
            ctx, acc_block, read_state, release_state,
            lambda: _read_staged_scales(scales, row_scales, rows, column_scales, columns, stage))
        for v in cutlass.range_constexpr(cute.size(acc)):
            scale = scales[fragment.row_half(v)] * scales[len(rows) + fragment.column_slot(v)]
            acc[v] = acc[v] + acc_block[v] * scale
    return read_state, release_state


@cute.jit
def _read_staged_scales(scales, row_scales, rows, column_scales, columns, stage):
    """scales = the staged scales of `rows`, then of `columns`, in ring stage `stage`;
    then the proxy fence that lets the producer's TMA write the stage again."""
    for h in cutlass.range_constexpr(len(rows)):
        scales[h] = row_scales[rows[h], 0, stage]
    for slot in cutlass.range_constexpr(len(columns)):
        scales[len(rows) + slot] = column_scales[columns[slot], 0, stage]
    cute.arch.fence_proxy("async.shared", space="cta")


@cute.jit
def mma_k_tiles_promoted_by_column_in_halves(
    ctx,  # the consumer's context: acc (the float32 total), ab_pipeline and column_halves (`ColumnHalves`)
    half_blocks: list,  # two partial-sum buffers, one per half of the tile's columns, written by wgmma only
    scales: list,  # two float32 register tensors: a half's two row scales, then one per column slot
    read_state: pipeline.PipelineState,
    release_state: pipeline.PipelineState,
    k_tiles: Int32,
    row_scales: cute.Tensor,  # (tile_m, 1, stages) float32, staged as `mma_k_tiles_promoted_by_column` reads them
    rows: list,  # this thread's two rows of the tile
    column_scales: cute.Tensor,  # (tile_n, 1, stages) float32
    first_column: Int32,  # this thread's first column of the tile (its column slot 0, `fragment.column_offset`)
):
    """`mma_k_tiles_promoted_by_column` with half of each promotion beside a wgmma batch:
    each k-tile is two batches, one per half of the tile's columns (a wgmma of tile_n / 2),
    into the half's own buffer, and half 0 is promoted while half 1's batch runs:

        issue half 0, issue half 1, read the scales | wait for half 0, promote it |
        wait for half 1, release the stage, promote it

    The buffers take the registers of the waited form's one (tile_n / 2 a thread, beside
    the total's tile_n / 2). Each value's sum is the waited form's, term for term: value v
    of half h is the total's value v + size(half) h (`fragment`: the column slots of a half
    are consecutive), promoted k-tile after k-tile with the same scale product. No batch
    stays in flight from one k-tile to the next: ptxas (CUDA 13.0) cannot tell which
    batch a wait_group(1) leaves in flight across the loop's back edge, and serializes
    every wgmma if a promotion follows one (C7514)."""
    ctx.acc.fill(0.0)
    for k_tile in range(k_tiles):
        read_state, release_state = _promoted_k_tile(ctx, half_blocks, scales, read_state, release_state, row_scales,
                                                     rows, column_scales, first_column)
    return read_state, release_state


@cute.jit
def _promoted_k_tile(ctx, half_blocks, scales, read_state, release_state, row_scales, rows, column_scales,
                     first_column):
    """The k-tile's two half batches, each promoted once it has landed, the stage
    released once both have; the staged scales read while they run."""
    ctx.ab_pipeline.consumer_wait(read_state)
    stage = read_state.index
    for half in cutlass.range_constexpr(2):
        _wgmma_half(ctx, half_blocks[half], half, stage)
    for half in cutlass.range_constexpr(2):
        slots = cute.size(scales[half]) - 2
        columns = [first_column + fragment.column_offset(half * slots + slot) for slot in range(slots)]
        _read_staged_scales(scales[half], row_scales, rows, column_scales, columns, stage)
    read_state.advance()
    warpgroup.wait_group(1)
    _promote_half_by_column(ctx.acc, half_blocks[0], scales[0], 0)
    warpgroup.wait_group(0)
    ctx.ab_pipeline.consumer_release(release_state)
    release_state.advance()
    _promote_half_by_column(ctx.acc, half_blocks[1], scales[1], 1)
    return read_state, release_state


@cute.jit
def _wgmma_half(ctx, half_block, half: cutlass.Constexpr, stage):
    """The wgmma batch of half `half` of the tile's columns over the k-tile in `stage`,
    into a fresh `half_block`, committed (not waited for); the atom handed back as found
    (see `_wgmma_batch`)."""
    # Orders the last promotion's reads of half_block before wgmma writes it again.
    warpgroup.fence()
    mma = ctx.column_halves.mma
    atom = mma._trait.value
    for k_block in cutlass.range_constexpr(cute.size(ctx.column_halves.tCrA, mode=[2])):
        mma.set(warpgroup.Field.ACCUMULATE, k_block != 0)
        coord = (None, None, k_block, stage)
        cute.gemm(mma, half_block, ctx.column_halves.tCrA[coord], ctx.column_halves.tCrB[half][coord], half_block)
    mma._trait.value = atom
    warpgroup.commit_group()


@cute.jit
def _promote_half_by_column(acc, half_block, scales, half: cutlass.Constexpr):
    """acc's values of half `half` += half_block * (row scale * column scale), each
    value of half_block read through `_fence_operand` (the promotion follows a wait_group)."""
    size = cute.size(half_block)
    for v in cutlass.range_constexpr(size):
        scale = scales[fragment.row_half(v)] * scales[2 + fragment.column_slot(v)]
        acc[half * size + v] = acc[half * size + v] + _fence_operand(half_block[v]) * scale


@dsl_user_op
def _fence_operand(value: Float32, *, loc=None, ip=None) -> Float32:
    """`value`, a wgmma accumulator register, through an empty asm statement with side
    effects, CUTLASS's `warpgroup_fence_operand`. wgmma writes its accumulators
    asynchronously, which the compiler does not see: the promotion's arithmetic has no
    operand but registers, so without this LLVM hoists it above the wait_group that
    makes them valid (ptxas then serializes every wgmma, C7514). The asm is ordered
    after the wait_group, as both have side effects, and the arithmetic reads its result."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(value).ir_value(loc=loc, ip=ip)], "", "=f,0",
                                   has_side_effects=True, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))

"""Device-side expert tables built from `group_sizes`, shared by the kernels.

Every CTA that needs to know which rows and tiles belong to which expert builds two
exclusive prefix sums in shared memory at its start, from the sizes in device memory (no
host synchronisation):

    row_start[e]  first row of expert e;  row_start[E] = rows owned by any expert
    tile_start[e] first M-tile of expert e in the scheduler's tile order;
                  tile_start[E] = number of M-tiles, sum_e ceil(size_e / tile_m)

Sizes are clamped exactly as `jax_dsrelu.groups` clamps them: a negative size counts as 0
and the running row count stops at num_rows. That clamp is the whole out-of-bounds story
for bad group sizes: no tile built from these tables reaches a row at or past num_rows.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def build_expert_tables(
    group_sizes: cute.Tensor,  # (E,) int32, global memory
    num_rows: Int32,
    row_start: cute.Tensor,  # (E + 1,) int32, shared memory
    tile_start: cute.Tensor,  # (E + 1,) int32, shared memory
    num_experts: cutlass.Constexpr,
    tile_m: cutlass.Constexpr,
):
    """Fills row_start and tile_start. Called by all 32 lanes of one warp; the caller
    synchronises before other warps read the tables.

    Lane l owns experts [l * c, l * c + c) with c = ceil(E / 32): it clamps and sums its
    sizes, a warp scan gives each lane the rows before its experts, and each lane then
    writes its own experts' entries. min(a + b, m) is associative for non-negative terms,
    so the scan gives the same clamped ends as the sequential definition, and every
    partial sum stays at most 2 * num_rows (no int32 overflow).
    """
    lane = cute.arch.lane_idx()
    per_lane = (num_experts + 31) // 32

    sizes = []
    lane_rows = Int32(0)
    for c in cutlass.range_constexpr(per_lane):
        expert = lane * per_lane + c
        size = Int32(0)
        if expert < num_experts:
            size = cutlass.min(cutlass.max(group_sizes[expert], Int32(0)), num_rows)
        sizes.append(size)
        lane_rows = cutlass.min(lane_rows + size, num_rows)

    rows_through_lane = lane_rows
    for offset in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(rows_through_lane, offset=1 << offset)
        if lane >= (1 << offset):
            rows_through_lane = cutlass.min(rows_through_lane + other, num_rows)
    rows_before_lane = cute.arch.shuffle_sync_up(rows_through_lane, offset=1)
    if lane == 0:
        rows_before_lane = Int32(0)

    lane_tiles = Int32(0)
    end = rows_before_lane
    for c in cutlass.range_constexpr(per_lane):
        start = end
        end = cutlass.min(end + sizes[c], num_rows)
        lane_tiles = lane_tiles + (end - start + (tile_m - 1)) // tile_m

    tiles_through_lane = lane_tiles
    for offset in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(tiles_through_lane, offset=1 << offset)
        if lane >= (1 << offset):
            tiles_through_lane = tiles_through_lane + other
    tiles_before_lane = cute.arch.shuffle_sync_up(tiles_through_lane, offset=1)
    if lane == 0:
        tiles_before_lane = Int32(0)
        row_start[0] = Int32(0)
        tile_start[0] = Int32(0)

    end = rows_before_lane
    tiles = tiles_before_lane
    for c in cutlass.range_constexpr(per_lane):
        expert = lane * per_lane + c
        start = end
        end = cutlass.min(end + sizes[c], num_rows)
        tiles = tiles + (end - start + (tile_m - 1)) // tile_m
        if expert < num_experts:
            row_start[expert + 1] = end
            tile_start[expert + 1] = tiles

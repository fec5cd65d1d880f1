"""The ragged tile schedule of the Hopper ragged-M kernels, walked by every warp role.

Work items, for a persistent CTA b of a grid of G: w = b, b + G, b + 2G, ...

    w < expert_work = tile_start[E] * n_tiles     an expert tile: M-tile w // n_tiles (in
                                                  the order of `group_tables`), N-tile
                                                  w % n_tiles; N fastest, so the CTAs in
                                                  flight share A tiles in L2
    expert_work <= w < all_work                   a tile of the rows owned by no expert
                                                  ([row_start[E], m)), stored as zeros

M-tiles never mix experts: expert e's rows [row_start[e], row_start[e + 1]) are cut into
ceil(size_e / tile_m) tiles, the last one partial. Every role (TMA producers, consumer
warpgroups) asks `locate` for the same w in the same order, so producers and consumers
cannot disagree about a tile; each keeps its own expert cursor, which only moves forward
because w does. (Free functions over the shared-memory tables rather than an object: the
DSL carries only its own values through a run-time loop.)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def expert_work(tile_start: cute.Tensor, num_experts: int, n_tiles: int) -> Int32:
    return tile_start[num_experts] * n_tiles


def all_work(row_start: cute.Tensor, tile_start: cute.Tensor, num_rows: Int32, num_experts: int,
             n_tiles: int, tile_m: int) -> Int32:
    """Expert tiles, then the tiles of the rows owned by no expert."""
    unowned = num_rows - row_start[num_experts]
    return expert_work(tile_start, num_experts, n_tiles) + (unowned + (tile_m - 1)) // tile_m * n_tiles


@cute.jit
def locate(row_start: cute.Tensor, tile_start: cute.Tensor, work: Int32, expert: Int32,
           n_tiles: cutlass.Constexpr):
    """The expert tile of work item `work` (< expert_work), moving the cursor `expert`.

    Returns (expert, m_tile, n_tile, local_tile, first_row, expert_rows): the global
    M-tile index (the dbias slot row), the tile's index within its expert, and the
    expert's first row and row count.
    """
    m_tile = work // n_tiles
    n_tile = work - m_tile * n_tiles
    while tile_start[expert + 1] <= m_tile:
        expert = expert + 1
    local_tile = m_tile - tile_start[expert]
    first_row = row_start[expert]
    expert_rows = row_start[expert + 1] - first_row
    return expert, m_tile, n_tile, local_tile, first_row, expert_rows


def locate_unowned(row_start: cute.Tensor, tile_start: cute.Tensor, work: Int32, num_rows: Int32,
                   num_experts: int, n_tiles: int):
    """(tile index within the unowned rows, N-tile, first unowned row, unowned row count)
    of a work item at or past expert_work."""
    rest = work - expert_work(tile_start, num_experts, n_tiles)
    tile = rest // n_tiles
    n_tile = rest - tile * n_tiles
    first_row = row_start[num_experts]
    return tile, n_tile, first_row, num_rows - first_row

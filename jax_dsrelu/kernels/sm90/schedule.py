"""The tile schedules of the Hopper kernels, walked by every warp role: the ragged-M
walk below (free functions), and `ContractSchedule`, the ragged contraction's walk.

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
because w does. (Free functions: an object passes through a run-time loop only as a DSL
value, with `__extract_mlir_values__`, as `ContractSchedule` does; the ragged-M walk
predates it.)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values


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


class ContractSchedule:
    """The persistent work walk of the ragged contraction, asked by every warp role.

    A work item is one output tile (expert, a-block, b-block); every expert has the same
    a_tiles * b_tiles of them, so item w is tile w % per_expert of the expert ranked
    w // per_expert, with the b-block fastest (the CTAs in flight share the expert's
    lhs block in L2). Experts are ranked by clamped size, largest first (ties to the
    lower index): the longest tiles are taken first and the short ones fill the tail.
    Persistent CTA c of G takes w = c, c + G, c + 2G, ... Every output element belongs
    to one work item, hence to one CTA: one writer.

    Each role makes its own copy at the same start and advances it once per item, so
    the producer and the consumers visit the same items in the same order. A DSL value:
    the loops carry the work index and stride; the shared-memory tables it reads stay
    fixed during the walk.
    """

    def __init__(self, row_start: cute.Tensor, expert_order: cute.Tensor, num_experts: int,
                 a_tiles: int, b_tiles: int, work: Int32, stride: Int32):
        self.row_start = row_start
        self.expert_order = expert_order
        self.num_experts = num_experts
        self.a_tiles = a_tiles
        self.b_tiles = b_tiles
        self.per_expert = a_tiles * b_tiles
        self.total = num_experts * self.per_expert
        self.work = work
        self.stride = stride

    def __extract_mlir_values__(self):
        return extract_mlir_values(self.work) + extract_mlir_values(self.stride)

    def __new_from_mlir_values__(self, values):
        return ContractSchedule(
            self.row_start, self.expert_order, self.num_experts, self.a_tiles, self.b_tiles,
            new_from_mlir_values(self.work, [values[0]]), new_from_mlir_values(self.stride, [values[1]]),
        )

    def valid(self):
        return self.work < self.total

    def advance(self) -> None:
        self.work = self.work + self.stride

    def locate(self):
        """(expert, a_tile, b_tile, first_row, expert_rows) of the current work item."""
        rank = self.work // self.per_expert
        tile = self.work - rank * self.per_expert
        a_tile = tile // self.b_tiles
        b_tile = tile - a_tile * self.b_tiles
        expert = self.expert_order[rank]
        first_row = self.row_start[expert]
        return expert, a_tile, b_tile, first_row, self.row_start[expert + 1] - first_row


@cute.jit
def rank_experts_by_size(row_start: cute.Tensor, expert_order: cute.Tensor, tidx: Int32,
                         num_experts: cutlass.Constexpr):
    """expert_order[r] = the expert of r-th largest clamped size, ties to the lower
    index. Thread t < E ranks expert t against every other; the caller synchronises
    before the order is read."""
    if tidx < num_experts:
        size = row_start[tidx + 1] - row_start[tidx]
        rank = Int32(0)
        for other in range(num_experts):
            other_size = row_start[other + 1] - row_start[other]
            if other_size > size or (other_size == size and other < tidx):
                rank = rank + 1
        expert_order[rank] = tidx

"""The tile schedulers of the Hopper kernels: objects that every warp role asks for its
next work item, so that the producers and the consumers visit the same items in the same
order and cannot disagree about a tile.

Both are persistent walks: CTA b of a grid of G takes work items w = b, b + G, b + 2G, ...
Each role makes its own copy at the same start and advances it once per item. They are
DSL values (`__extract_mlir_values__`): a loop carries the work index (and the ragged-M
walk's expert cursor); the shared-memory tables they read stay fixed during the walk.

`RaggedMSchedule`, the ragged-M GEMMs (the fused dsReLU kernel and the plain and
squared-ReLU GEMMs), over output tiles of rows:

    w < expert_work = tile_start[E] * n_tiles     an expert tile: M-tile w // n_tiles (in
                                                  the order of `group_tables`), N-tile
                                                  w % n_tiles; N fastest, so the CTAs in
                                                  flight share A tiles in L2
    expert_work <= w < expert_work                a tile of the rows owned by no expert
        + ceil((m - row_start[E]) / tile_m)       ([row_start[E], m)), stored as zeros
          * n_tiles

M-tiles never mix experts: expert e's rows [row_start[e], row_start[e + 1]) are cut into
ceil(size_e / tile_m) tiles, the last one partial. The expert cursor only moves forward,
because w does. In clusters of cluster_n CTAs along N the walk is the clusters': w counts
(M-tile, group of cluster_n neighbouring N-tiles) with cluster c of C taking w = c, c + C,
..., and the CTA of rank r in it the group's N-tile r.

`ContractSchedule`, the ragged contraction, over output tiles of weights (below).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values


class ExpertTile(NamedTuple):
    """A ragged-M work item owned by an expert."""

    expert: Int32
    m_tile: Int32  # global M-tile index: the dbias slot row
    n_tile: Int32
    local_tile: Int32  # the tile's index within its expert
    first_row: Int32  # the expert's first row
    rows: Int32  # the expert's row count


class ContractTile(NamedTuple):
    """A work item of the contraction: one output tile of out[expert] (a, b)."""

    expert: Int32
    m_tile: Int32  # the a-block
    n_tile: Int32  # the b-block
    first_row: Int32  # the expert's first row
    rows: Int32  # the expert's row count: the contraction's extent


@cute.jit
def _seek_expert(tile_start: cute.Tensor, m_tile: Int32, expert: Int32) -> Int32:
    """The expert owning M-tile `m_tile`, searched forward from `expert` (empty experts
    own no tile and are passed over)."""
    while tile_start[expert + 1] <= m_tile:
        expert = expert + 1
    return expert


class _PersistentWalk:
    """What both walks hold: the experts' first rows, the work index and its stride (what
    a loop carries), and the CTA's place in its cluster."""

    def __init__(self, row_start: cute.Tensor, num_experts: int, work: Int32, stride: Int32, cluster_n: int,
                 rank: Int32):
        self.row_start = row_start
        self.num_experts = num_experts
        self.work = work
        self.stride = stride
        self.cluster_n = cluster_n
        self.rank = rank  # this CTA's rank in its cluster: its tile of each group

    def advance(self) -> None:
        self.work = self.work + self.stride


class RaggedMSchedule(_PersistentWalk):
    """The persistent walk of the ragged-M kernels (see the module doc)."""

    def __init__(self, row_start: cute.Tensor, tile_start: cute.Tensor, num_rows: Int32,
                 num_experts: int, n_tiles: int, tile_m: int, work: Int32, stride: Int32,
                 expert: Int32, cluster_n: int, rank: Int32):
        super().__init__(row_start, num_experts, work, stride, cluster_n, rank)
        self.tile_start = tile_start
        self.num_rows = num_rows
        self.n_tiles = n_tiles
        self.tile_m = tile_m
        self.expert = expert
        self.n_groups = n_tiles // cluster_n  # work items per M-tile

    @staticmethod
    def start(row_start, tile_start, num_rows: Int32, num_experts: int, n_tiles: int, tile_m: int,
              first: Int32, stride: Int32, cluster_n: int, rank) -> "RaggedMSchedule":
        """The walk from work item `first` by `stride` (in clusters when cluster_n > 1)."""
        return RaggedMSchedule(row_start, tile_start, num_rows, num_experts, n_tiles, tile_m,
                               first, stride, Int32(0), cluster_n, Int32(rank))

    def _copy(self, work, stride, expert) -> "RaggedMSchedule":
        return RaggedMSchedule(self.row_start, self.tile_start, self.num_rows, self.num_experts, self.n_tiles,
                               self.tile_m, work, stride, expert, self.cluster_n, self.rank)

    def __extract_mlir_values__(self):
        return extract_mlir_values(self.work) + extract_mlir_values(self.stride) + extract_mlir_values(self.expert)

    def __new_from_mlir_values__(self, values):
        return self._copy(
            new_from_mlir_values(self.work, [values[0]]), new_from_mlir_values(self.stride, [values[1]]),
            new_from_mlir_values(self.expert, [values[2]]),
        )

    def _expert_work(self) -> Int32:
        return self.tile_start[self.num_experts] * self.n_groups

    def _n_tile(self, group: Int32) -> Int32:
        return group * self.cluster_n + self.rank

    def owned(self):
        """Whether the current item is an expert tile (they come first)."""
        return self.work < self._expert_work()

    def valid(self):
        """Whether the current item exists: an expert tile or an unowned-rows tile."""
        unowned = self.num_rows - self.row_start[self.num_experts]
        unowned_tiles = (unowned + (self.tile_m - 1)) // self.tile_m
        return self.work < self._expert_work() + unowned_tiles * self.n_groups

    def located(self):
        """(the current expert tile, this walk with its cursor at that tile's expert); for
        an `owned` item. The caller rebinds its walk to the second: a loop or a branch
        carries the cursor by name (the seek sits where the tile is needed, not in
        `advance`, which keeps the producers' loop free of local-memory traffic)."""
        m_tile = self.work // self.n_groups
        expert = _seek_expert(self.tile_start, m_tile, self.expert)
        walk = self._copy(self.work, self.stride, expert)
        first_row = self.row_start[expert]
        return ExpertTile(
            expert=expert,
            m_tile=m_tile,
            n_tile=self._n_tile(self.work - m_tile * self.n_groups),
            local_tile=m_tile - self.tile_start[expert],
            first_row=first_row,
            rows=self.row_start[expert + 1] - first_row,
        ), walk

    def unowned_tile(self):
        """(tile index within the unowned rows, N-tile, first unowned row, unowned row
        count) of the current item, at or past the expert tiles."""
        rest = self.work - self._expert_work()
        tile = rest // self.n_groups
        first_row = self.row_start[self.num_experts]
        return tile, self._n_tile(rest - tile * self.n_groups), first_row, self.num_rows - first_row


class ContractSchedule(_PersistentWalk):
    """The persistent work walk of the ragged contraction, asked by every warp role.

    A work item is one output tile (expert, a-block, b-block); every expert has the same
    a_tiles * b_tiles of them, so item w is tile w % per_expert of the expert ranked
    w // per_expert, with the b-block fastest (the CTAs in flight share the expert's
    lhs block in L2), or the a-block where a_fastest (they share its rhs block).
    Experts are ranked by clamped size, largest first (ties to the lower index): the
    longest tiles are taken first and the short ones fill the tail.
    Persistent CTA c of G takes w = c, c + G, c + 2G, ... Every output element belongs
    to one work item, hence to one CTA: one writer. In clusters of cluster_n CTAs along b,
    a work item is a group of cluster_n neighbouring b-blocks, walked by the clusters as
    the CTAs walk single blocks, and the CTA of rank r takes the group's b-block r.
    """

    def __init__(self, row_start: cute.Tensor, expert_order: cute.Tensor, num_experts: int,
                 a_tiles: int, b_tiles: int, work: Int32, stride: Int32, cluster_n: int, rank,
                 a_fastest: bool = False):
        super().__init__(row_start, num_experts, work, stride, cluster_n, Int32(rank))
        self.expert_order = expert_order
        self.a_tiles = a_tiles
        self.b_tiles = b_tiles
        self.b_groups = b_tiles // cluster_n
        self.per_expert = a_tiles * self.b_groups
        self.total = num_experts * self.per_expert
        self.a_fastest = a_fastest

    def __extract_mlir_values__(self):
        return extract_mlir_values(self.work) + extract_mlir_values(self.stride)

    def __new_from_mlir_values__(self, values):
        return ContractSchedule(
            self.row_start, self.expert_order, self.num_experts, self.a_tiles, self.b_tiles,
            new_from_mlir_values(self.work, [values[0]]), new_from_mlir_values(self.stride, [values[1]]),
            self.cluster_n, self.rank, self.a_fastest,
        )

    def valid(self):
        return self.work < self.total

    def tile(self) -> ContractTile:
        """The current work item."""
        size_rank = self.work // self.per_expert
        tile = self.work - size_rank * self.per_expert
        if self.a_fastest:  # a Python bool: one of the two walks is traced
            b_group = tile // self.a_tiles
            a_tile = tile - b_group * self.a_tiles
        else:
            a_tile = tile // self.b_groups
            b_group = tile - a_tile * self.b_groups
        b_tile = b_group * self.cluster_n + self.rank
        expert = self.expert_order[size_rank]
        first_row = self.row_start[expert]
        return ContractTile(expert, a_tile, b_tile, first_row, self.row_start[expert + 1] - first_row)


@cute.jit
def rank_experts_by_size(row_start: cute.Tensor, expert_order: cute.Tensor, tidx: Int32,
                         num_experts: cutlass.Constexpr, threads: cutlass.Constexpr):
    """expert_order[r] = the expert of r-th largest clamped size, ties to the lower
    index. Thread t ranks experts t, t + threads, ... against every other; the caller
    synchronises before the order is read."""
    for expert in range(tidx, num_experts, threads):
        size = row_start[expert + 1] - row_start[expert]
        rank = Int32(0)
        for other in range(num_experts):
            other_size = row_start[other + 1] - row_start[other]
            if other_size > size or (other_size == size and other < expert):
                rank = rank + 1
        expert_order[rank] = expert

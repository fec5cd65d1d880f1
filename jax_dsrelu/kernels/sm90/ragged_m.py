"""The ragged-M work schedule: the hooks of `gemm_base.GemmSm90` that the fused dsReLU kernel
and the ragged-M GEMM share.

Output rows are cut per expert into tile_m tiles (`schedule.RaggedMSchedule`), over n in
tile_n tiles; K = k is fixed. A is (m, k) row-major, its rows at the tile's first row; B
per expert as (n, k, E); the epilogue input's rows as A's. The stored outputs are
ragged row views (`mainloop.ragged_view`), whose TMA boxes are clipped at the expert's
last row; the tiles of rows owned by no expert are stored as zeros.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from jax_dsrelu.kernels.sm90 import epilogue_store, mainloop, schedule
from jax_dsrelu.kernels.sm90.gemm_base import GemmSm90


class RaggedMGemmSm90(GemmSm90):
    """The ragged-M work decomposition (see the module doc); the kernel's parameters hold
    group_sizes."""

    walk_rebinds = True

    def __init__(self, config, num_experts: int, n: int, k: int):
        super().__init__(config, num_experts)
        self.n = n
        self.k = k
        self.n_tiles = (n + config.tile_n - 1) // config.tile_n
        self.k_tiles = (k + config.tile_k - 1) // config.tile_k
        self._check_pairs_up(self.n_tiles, f"n={n}")

    # ------------------------------------------------------------------ host side

    def store_view(self, tensor: cute.Tensor) -> cute.Tensor:
        return mainloop.ragged_view(tensor, 0)

    def grid(self, t) -> Int32:
        """Persistent CTAs, whole clusters, no more than there are work items: expert tiles
        number at most m_tiles + E and the zero tiles at most m_tiles, per group of
        cluster_n N-tiles."""
        num_rows = self.host_rows(t)
        m_tiles = (num_rows + (self.tile_m - 1)) // self.tile_m
        cluster_n = self.config.cluster_n
        clusters = cutlass.min((2 * m_tiles + self.num_experts) * (self.n_tiles // cluster_n),
                               Int32(self.config.max_ctas // cluster_n))
        return clusters * cluster_n

    def host_rows(self, t) -> Int32:
        """The row count m, on the host: A's rows (a variant reading A through a row index
        counts the index's)."""
        return cute.size(getattr(t, self.operand_a), mode=[0])

    # ---------------------------------------------------------------- device side

    def publish_schedule(self, storage, params, num_rows: Int32, tidx: Int32):
        """(row_start, tile_start): the expert tables of tile_m-row tiles."""
        return self._publish_tables(storage, params.group_sizes, num_rows, self.tile_m)

    def make_schedule(self, tables, num_rows: Int32) -> schedule.RaggedMSchedule:
        """A role's own walk of the work items (`_cluster_walk`)."""
        row_start, tile_start = tables
        first, stride, rank = self._cluster_walk()
        return schedule.RaggedMSchedule.start(
            row_start, tile_start, num_rows, self.num_experts, self.n_tiles, self.tile_m,
            first, stride, self.config.cluster_n, rank,
        )

    def a_tiles(self, mA: cute.Tensor, tile: schedule.ExpertTile, params) -> cute.Tensor:
        """(tile_m, tile_k, k-tiles) of the tile's rows of A. Rows past the expert are
        loaded and never stored; rows past m read as zeros."""
        row0 = tile.first_row + tile.local_tile * self.tile_m
        return cute.local_tile(cute.domain_offset((row0, 0), mA), (self.tile_m, self.tile_k), (0, None))

    def b_tiles(self, mB: cute.Tensor, tile: schedule.ExpertTile, params) -> cute.Tensor:
        """(tile_n, tile_k, k-tiles) of the expert's B at the tile's N-tile."""
        return cute.local_tile(mB[None, None, tile.expert], (self.tile_n, self.tile_k), (tile.n_tile, None))

    def c_tiles(self, mC: cute.Tensor, tile: schedule.ExpertTile) -> cute.Tensor:
        """(tile_m, epi_n, n / epi_n) of the tile's rows of the epilogue input: subtile s
        of N-tile t is column block t * subtiles + s."""
        row0 = tile.first_row + tile.local_tile * self.tile_m
        return cute.local_tile(cute.domain_offset((row0, 0), mC), (self.tile_m, self.epi_n), (0, None))

    def k_tile_count(self, tile) -> int:
        return self.k_tiles

    def store_views(self, outputs, tile: schedule.ExpertTile):
        return self._stores(outputs, tile.first_row, tile.rows, tile.local_tile)

    @staticmethod
    def _warpgroup_active(ctid: Int32, rows_valid: Int32) -> Int32:
        """`mainloop.warpgroup_active` for this consumer thread's warpgroup, whose 64 rows
        of the tile start at 64 (ctid // 128)."""
        return mainloop.warpgroup_active((ctid // 128) * 64, rows_valid)

    def _tile_rows(self, tile: schedule.ExpertTile):
        """(the tile's first row, how many of its rows belong to the expert: may exceed
        tile_m, may be below)."""
        return tile.first_row + tile.local_tile * self.tile_m, tile.rows - tile.local_tile * self.tile_m

    @staticmethod
    def _row_probs(mProb: cute.Tensor, tile_row, row0: Int32, rows_valid: Int32):
        """(valid, prob) of this thread's rows `tile_row` of the tile: whether each
        belongs to the expert, and its prob, 0 where it does not (such a row may be past
        m: row 0 is read for it instead). Loaded before the mainloop, so that the load's
        latency hides behind it."""
        valid = [row < rows_valid for row in tile_row]
        prob = []
        for h in range(len(tile_row)):
            safe_row = Int32(cutlass.select_(valid[h], row0 + tile_row[h], Int32(0)))
            prob.append(Float32(cutlass.select_(valid[h], mProb[safe_row], Float32(0.0))))
        return valid, prob

    def _stores(self, outputs, offset: Int32, length: Int32, local_tile: Int32):
        """What `epilogue_store.store_subtile` stores for tile `local_tile` of rows
        [offset, offset + length): each `StoredOutput` with its global tensor as the tile's
        store view, clipped at offset + length."""
        return [
            output._replace(gmem=epilogue_store.store_view(output.gmem, offset, length, local_tile, self.tile_m,
                                                           self.epi_n))
            for output in outputs
        ]

    @cute.jit
    def store_zero_tile(self, work_schedule, tiled_r2s, outputs, store_pipeline, store_count: Int32, ctid: Int32):
        """A tile of the rows owned by no expert: every output stored as zeros. Returns
        the store count."""
        tile, n_tile, first_row, rows = work_schedule.unowned_tile()
        stores = self._stores(outputs, first_row, rows, tile)
        for i in cutlass.range_constexpr(len(outputs)):
            outputs[i].registers.fill(0.0)
        if cutlass.const_expr(self.whole_tile):
            # As the expert tiles store: a ring store would write a buffer that the last
            # tile's bulk group may still be reading.
            epilogue_store.store_tile(lambda subtile: None, tiled_r2s, stores, store_pipeline, n_tile * self.subtiles,
                                      ctid, self.subtiles, self.consumer_threads)
        else:
            for subtile in cutlass.range_constexpr(self.subtiles):
                store_count = self._store_subtile(tiled_r2s, stores, store_pipeline, store_count, n_tile, subtile,
                                                  ctid)
        return store_count

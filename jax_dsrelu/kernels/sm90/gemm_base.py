"""The base of the Hopper kernel family: what every kernel is made of, written once.

Every kernel of the family is a persistent, warp-specialized GEMM, one CTA per
multiprocessor, 384 threads:

    warpgroup 0       producers: warp 0 streams A and B k-tiles by TMA into the operand
                      ring (`mainloop.load_k_tiles`); a variant may give warp 1 a load of
                      its own (the dsReLU kernel's preact)
    warpgroups 1, 2   consumers, cooperative: 64 rows of the 128-row tile each, wgmma into
                      float32 accumulators (`mainloop.mma_k_tiles`), then the variant's
                      epilogue, stored through shared memory by TMA (`epilogue_store`)

Work items come from a tile scheduler that every role asks in the same order
(`schedule.RaggedMSchedule`, `schedule.ContractSchedule`).

`GemmSm90` holds what every variant shares: the warp roles and their registers, the
tiled MMA and the operand rings' shared layouts, the TMA atoms, the shared-storage struct
(a variant adds its buffers), the kernel's prologue (descriptor prefetch, the operand
pipeline, the expert tables and the barrier that publishes them) and the consumers'
fragments and store copies. `RaggedMGemmSm90` adds the ragged-M work decomposition that
the fused dsReLU kernel and the ragged-M GEMM share: the row schedule, the operand
producer, the store views of an expert's rows and the zero tiles of rows owned by no
expert. A variant writes its host function (`__call__`), its `kernel`, and its epilogue.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.tensor_utils import LayoutEnum

from jax_dsrelu.kernels.group_tables import build_expert_tables
from jax_dsrelu.kernels.sm90 import epilogue_store, mainloop, schedule


class GemmSm90:
    """The family's base for one static configuration (see the module doc)."""

    producer_warps = 4  # warpgroup 0
    consumer_warps = 8  # warpgroups 1 and 2
    threads = 128 * 3
    consumer_threads = 32 * consumer_warps
    producer_registers = 40
    consumer_registers = 232
    # The per-CTA expert tables in shared memory, E + 1 int32 each.
    tables = ("row_start", "tile_start")

    def __init__(self, config, num_experts: int):
        self.config = config
        self.num_experts = num_experts
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.tile_k = config.tile_k
        self.epi_n = config.epi_n
        self.subtiles = config.subtiles

    # ------------------------------------------------------------------ host side

    def _mma(self, ab_dtype, a_major: LayoutEnum, b_major: LayoutEnum):
        """(tiled MMA, A ring layout, B ring layout): two 64-row warpgroups over a
        tile_m x tile_n tile, operands in shared memory in the given majorness
        (ROW_MAJOR: K-major, COL_MAJOR: MN-major)."""
        self.ab_dtype = ab_dtype
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            ab_dtype, ab_dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(), Float32,
            (2, 1, 1), tiler_mn=(64, self.tile_n),
        )
        tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        stages = self.config.ab_stages
        a_layout = sm90_utils.make_smem_layout_a(a_major, tile_mnk, ab_dtype, stages)
        b_layout = sm90_utils.make_smem_layout_b(b_major, tile_mnk, ab_dtype, stages)
        return tiled_mma, a_layout, b_layout

    def _epi_layout(self, dtype, stages: int):
        """`stages` row-major (tile_m x epi_n) subtile buffers."""
        return sm90_utils.make_smem_layout_epi(dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, self.epi_n), stages)

    @staticmethod
    def _tma_load(tensor: cute.Tensor, layout, box, multicast: int = 1):
        """(atom, TMA tensor) loading `box` tiles of `tensor` into one stage of `layout`;
        with `multicast` > 1 each of that many CTAs loads its slice of the box into all of
        them."""
        op = cpasync.CopyBulkTensorTileG2SMulticastOp() if multicast > 1 else cpasync.CopyBulkTensorTileG2SOp()
        return cpasync.make_tiled_tma_atom(op, tensor, cute.slice_(layout, (None, None, 0)), box, num_multicast=multicast)

    def _tma_store(self, tensor: cute.Tensor, layout):
        """(atom, TMA tensor) storing one subtile buffer of `layout` to `tensor`."""
        return cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), tensor, cute.slice_(layout, (None, None, 0)),
            (self.tile_m, self.epi_n),
        )

    def _shared_storage(self, a_layout, b_layout, barriers: dict, buffers: dict):
        """The kernel's shared-memory struct: the operand ring's barriers, then the
        variant's `barriers` ({name: stages}), the expert tables, the operand ring, then
        the variant's `buffers` ({name: (dtype, elements)}), each 1024-byte aligned (the
        swizzled layouts' requirement)."""
        experts = self.num_experts + 1
        fields = {"ab_barriers": cute.struct.MemRange[cutlass.Int64, self.config.ab_stages * 2]}
        for name, stages in barriers.items():
            fields[name] = cute.struct.MemRange[cutlass.Int64, stages * 2]
        for name in self.tables:
            fields[name] = cute.struct.MemRange[Int32, experts]
        buffers = {"sA": (self.ab_dtype, cute.cosize(a_layout)), "sB": (self.ab_dtype, cute.cosize(b_layout)),
                   **buffers}
        for name, (dtype, elements) in buffers.items():
            fields[name] = cute.struct.Align[cute.struct.MemRange[dtype, elements], 1024]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _launch(self, kernel, grid, stream) -> None:
        """A cluster launch only for clusters of more than one CTA: launched with a cluster
        shape of 1x1x1, kernels that run alone took up to 4.8% more time in the layer step on
        the H200 (docs/sm90.md, cluster pairs)."""
        cluster = [self.config.cluster_n, 1, 1] if self.config.cluster_n > 1 else None
        kernel.launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], cluster=cluster, min_blocks_per_mp=1,
                      stream=stream)

    def _check_pairs_up(self, n_tiles: int, extent: str) -> None:
        """Refuses a cluster size that does not divide the N-tiles (`extent` names the
        width, "n=1856"): a cluster takes neighbouring N-tiles of the same rows."""
        if n_tiles % self.config.cluster_n:
            raise ValueError(
                f"cluster_n={self.config.cluster_n} must divide the {n_tiles} N-tiles of {extent} with "
                f"tile_n={self.config.tile_n} (a cluster takes neighbouring N-tiles of the same rows)"
            )

    def _cluster_walk(self):
        """(first work item, stride, rank) of this CTA's walk: the items are its cluster's,
        every CTA of a cluster walks the same ones, and `rank` says which N-tile of each
        is this CTA's."""
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        cluster_n = self.config.cluster_n
        return bidx // cluster_n, grid // cluster_n, bidx % cluster_n

    # ---------------------------------------------------------------- device side

    def _operand_pipeline(self, storage, a_layout, b_layout) -> pipeline.PipelineTmaAsync:
        """The A/B ring: warp 0 produces, the 8 consumer warps release. In a cluster along
        N a stage's A tile is written by every CTA of the cluster, so each consumer warp
        releases the stage in every CTA (one lane per CTA)."""
        return self._tma_pipeline(
            storage.ab_barriers, self.config.ab_stages,
            cute.size_in_bytes(self.ab_dtype, cute.slice_(a_layout, (None, None, 0)))
            + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_layout, (None, None, 0))),
            self.config.cluster_n,
        )

    def _tma_pipeline(self, barriers, stages: int, stage_bytes, multicast: int = 1) -> pipeline.PipelineTmaAsync:
        """A ring filled by one TMA-issuing thread and released by the consumer warps,
        of the `multicast` CTAs of a cluster along N that write into it. Its barriers are
        published by `_publish_tables`."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers.data_ptr(),
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, multicast, 1)),
            mcast_mode_mn=(1, 0),
            enable_multicast_signaling=True,
            defer_sync=True,
        )

    @cute.jit
    def _prefetch(self, atoms):
        """Warp 0 prefetches the TMA descriptors."""
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
            for i in cutlass.range_constexpr(len(atoms)):
                cpasync.prefetch_descriptor(atoms[i])

    def _table(self, storage, name: str) -> cute.Tensor:
        return getattr(storage, name).get_tensor(cute.make_layout(self.num_experts + 1))

    @cute.jit
    def _publish_tables(self, storage, group_sizes: cute.Tensor, num_rows: Int32, tile_rows: cutlass.Constexpr):
        """The first consumer warp builds the expert tables (`group_tables`, tiles of
        `tile_rows`); one barrier then publishes them and every pipeline's barrier
        initialisation to every warp: of the CTA, or of the cluster, whose CTAs arrive on
        each other's barriers. Returns (row_start, tile_start)."""
        row_start = self._table(storage, "row_start")
        tile_start = self._table(storage, "tile_start")
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == self.producer_warps:
            build_expert_tables(group_sizes, num_rows, row_start, tile_start, self.num_experts, tile_rows)
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.config.cluster_n > 1):
            # Release and acquire: the tables are ordered as by sync_threads.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        return row_start, tile_start

    @staticmethod
    def _smem(buffer, layout) -> cute.Tensor:
        return buffer.get_tensor(layout.outer, swizzle=layout.inner)

    def _mma_fragments(self, tiled_mma, sA, sB, ctid: Int32):
        """(tCrA, tCrB, tCcAcc, acc): the warpgroup's wgmma fragments of the rings, the
        (tile_m, tile_n) coordinates of this thread's accumulator values, and the
        accumulator."""
        # wgmma fragments are per warpgroup: slice the tiled MMA by warpgroup for A/B.
        thr_mma_wg = tiled_mma.get_slice(cute.make_layout(2, stride=128)(ctid // 128))
        tCrA = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sB))
        tCcAcc = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        return tCrA, tCrB, tCcAcc, cute.make_rmem_tensor(tCcAcc.shape, Float32)

    def _store_copy(self, tiled_mma, out_dtype, ctid: Int32):
        """(tiled_copy_c, tiled_r2s, thr_r2s, subtile register shape): stmatrix for 16-bit
        outputs, plain shared-memory stores for float32, in the accumulator's thread layout,
        so that subtile s is accumulator values [s v, (s + 1) v) of v per subtile."""
        tiled_copy_c = cute.make_tiled_copy_C_atom(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), out_dtype), tiled_mma
        )
        tiled_r2s = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, out_dtype, Float32), tiled_copy_c
        )
        thr_r2s = tiled_r2s.get_slice(ctid)
        sub_shape = thr_r2s.partition_S(cute.make_identity_tensor((self.tile_m, self.epi_n))).shape
        return tiled_copy_c, tiled_r2s, thr_r2s, sub_shape

    @cute.jit
    def _store_subtile(self, tiled_r2s, stores, store_pipeline, store_count: Int32, n_tile: Int32,
                       subtile: cutlass.Constexpr, ctid: Int32):
        """Stores subtile `subtile` of N-tile `n_tile` (`epilogue_store.store_subtile`
        through the ring of store_stages buffers); returns the store count."""
        epilogue_store.store_subtile(
            tiled_r2s, stores, store_pipeline, store_count, n_tile * self.subtiles + subtile, ctid,
            self.config.store_stages, self.consumer_threads,
        )
        return store_count + 1

    def _store_pipeline(self, stages: int):
        return pipeline.PipelineTmaStore.create(
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads),
        )

    @staticmethod
    def _producer_state(stages: int):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)

    def _consumer_states(self):
        """(read, release) states of the operand ring, both at its start."""
        make = lambda: pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.ab_stages)  # noqa: E731
        return make(), make()


class RaggedMGemmSm90(GemmSm90):
    """The ragged-M work decomposition: output rows cut per expert into tile_m tiles,
    over n in tile_n tiles; K = k fixed. A (m, k) row-major; B per expert as (n, k, E)."""

    def __init__(self, config, num_experts: int, n: int, k: int):
        super().__init__(config, num_experts)
        self.n = n
        self.k = k
        self.n_tiles = (n + config.tile_n - 1) // config.tile_n
        self.k_tiles = (k + config.tile_k - 1) // config.tile_k
        self._check_pairs_up(self.n_tiles, f"n={n}")

    def _grid(self, num_rows: Int32) -> Int32:
        """Persistent CTAs, whole clusters, no more than there are work items: expert tiles
        number at most m_tiles + E and the zero tiles at most m_tiles, per group of
        cluster_n N-tiles."""
        m_tiles = (num_rows + (self.tile_m - 1)) // self.tile_m
        cluster_n = self.config.cluster_n
        clusters = cutlass.min((2 * m_tiles + self.num_experts) * (self.n_tiles // cluster_n),
                               Int32(self.config.max_ctas // cluster_n))
        return clusters * cluster_n

    def _schedule(self, row_start, tile_start, num_rows: Int32) -> schedule.RaggedMSchedule:
        """A role's own walk of the work items (`_cluster_walk`)."""
        first, stride, rank = self._cluster_walk()
        return schedule.RaggedMSchedule.start(
            row_start, tile_start, num_rows, self.num_experts, self.n_tiles, self.tile_m,
            first, stride, self.config.cluster_n, rank,
        )

    @cute.jit
    def load_operands(self, tma_a, mA, tma_b, mB, sA, sB, ab_pipeline, work_schedule):
        """Warp 0: the A/B k-tiles of every expert tile, in schedule order."""
        state = self._producer_state(self.config.ab_stages)
        while work_schedule.owned():
            tile, work_schedule = work_schedule.located()
            row0 = tile.first_row + tile.local_tile * self.tile_m
            # Rows past the expert are loaded and never stored; rows past m read as zeros.
            gA = cute.local_tile(cute.domain_offset((row0, 0), mA), (self.tile_m, self.tile_k), (0, None))
            gB = cute.local_tile(mB[None, None, tile.expert], (self.tile_n, self.tile_k), (tile.n_tile, None))
            # The CTAs of a cluster share the rows: each loads its slice of A for all.
            tAsA, tAgA = mainloop.tma_partition(tma_a, sA, gA, work_schedule.rank, self.config.cluster_n)
            tBsB, tBgB = mainloop.tma_partition(tma_b, sB, gB)
            state = mainloop.load_k_tiles(tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, self.k_tiles,
                                          self.config.cluster_n)
            work_schedule.advance()
        ab_pipeline.producer_tail(state)

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

    def _epilogue_outputs(self, thr_r2s, sub_shape, tensors):
        """The stored outputs as `_stores` and `_store_zero_tile` take them: for each
        (float32 registers, shared buffers, TMA atom, global tensor) of `tensors`, the
        registers, a copy of them in the output dtype, this thread's partition of the
        buffers, the atom, the tensor and the buffers."""
        return [
            (rF, cute.make_rmem_tensor(sub_shape, self.out_dtype), thr_r2s.partition_D(smem), tma, tensor, smem)
            for rF, smem, tma, tensor in tensors
        ]

    def _stores(self, outputs, offset: Int32, length: Int32, local_tile: Int32):
        """What `epilogue_store.store_subtile` stores for tile `local_tile` of rows
        [offset, offset + length): each output (registers f32, registers out dtype, smem
        partition, TMA atom, global tensor, smem) with its global tensor as the tile's
        store view, clipped at offset + length."""
        return [
            (rF, rOut, tRS_s, tma, epilogue_store.store_view(tensor, offset, length, local_tile, self.tile_m, self.epi_n), smem)
            for rF, rOut, tRS_s, tma, tensor, smem in outputs
        ]

    @cute.jit
    def _store_zero_tile(self, work_schedule, tiled_r2s, outputs, store_pipeline, store_count: Int32, ctid: Int32):
        """A tile of the rows owned by no expert: every output stored as zeros. Returns
        the store count."""
        tile, n_tile, first_row, rows = work_schedule.unowned_tile()
        stores = self._stores(outputs, first_row, rows, tile)
        for i in cutlass.range_constexpr(len(outputs)):
            outputs[i][0].fill(0.0)
        for subtile in cutlass.range_constexpr(self.subtiles):
            store_count = self._store_subtile(tiled_r2s, stores, store_pipeline, store_count, n_tile, subtile, ctid)
        return store_count

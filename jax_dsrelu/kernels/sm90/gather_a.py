"""An operand's rows read through a row index: the operand-load hooks of `gemm_base.GemmSm90`
for a variant whose A (or, in the contraction, B) is source[index], with no copy of the
gathered rows in memory.

Hopper's TMA loads boxes of a tensor and cannot gather rows, so the gathered operand comes
by cp.async: 16-byte copies from the source rows straight into the swizzled shared layout
that TMA would fill and wgmma reads, while the other operand still comes by TMA into the
same ring stage.

    producer warps   `a_load_warps` of warpgroup 0 (all four; warp 3 alone where warp 1
                     streams the epilogue input). Per k-tile each waits for the stage to
                     be free, copies its chunks of the gathered operand (cp.async, 16
                     bytes each) and arrives on the stage's full barrier when they have
                     landed (cp.async.mbarrier.arrive.noinc). The first of them also takes
                     the stage for the other operand: its elected thread arrives with
                     that operand's byte count and issues its TMA load.
    full barrier     1 + 32 len(a_load_warps) arrivals and the TMA bytes: a stage is full
                     when the TMA box and every thread's chunks have landed.
    consumers        wait, fence.proxy.async.shared::cta, wgmma, release
                     (`operands_written_by_generic_proxy`): cp.async writes shared
                     memory through the generic proxy, wgmma reads it through the
                     async proxy, and PTX orders the two only across a proxy fence. The
                     writers signal the barrier and cannot fence after their copies
                     land, so the readers fence after their wait.

Neighbouring threads copy neighbouring 16-byte chunks of a row, 32 bytes or more of it
per copy instruction: whole L2 sectors. Every row index is clamped into the source, as
the primitives clamp theirs. Each CTA loads its own A: no cluster multicast.

Two geometries:
    `GatheredRowsA`  the ragged-M GEMMs (A K-major, its rows the tile's M): a thread's
                     rows are fixed for the work item, their source rows read once per
                     item and kept in registers; a row past the expert reads source row
                     0 (loaded, never stored); chunks past k are zero-filled (a source
                     size of 0), as TMA fills them.
    `GatheredRowsK`  the contraction (A and B MN-major, their rows the k of the GEMM),
                     either operand gathered: every k-tile has rows of its own, read from
                     the index per k-tile; a row past the expert, or a chunk past the
                     operand's width, is zero-filled, so the last k-tile adds nothing
                     beyond the expert's rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import numpy as np
from cutlass import Boolean, Int32
from cutlass.cute.nvgpu import cpasync

from jax_dsrelu.kernels.operands import KernelOperand

_COPY_BITS = 128


# What a gathering producer carries from one step of its walk to the next: trace-time
# records of DSL values (tensors, registers, tiled copies), never arguments of a kernel.


@dataclasses.dataclass(frozen=True)
class TileRows:
    """A ragged-M tile's rows: source[index[row0 + r]] for r < rows_valid."""

    source: Any  # (T, k) cute.Tensor
    index: Any  # (m,) int32 cute.Tensor
    row0: Any  # Int32: the tile's first row of the index
    rows_valid: Any  # Int32: the rows of the tile the expert owns


@dataclasses.dataclass(frozen=True)
class RowCopies:
    """One thread's part of copying a ragged-M tile: its source row of each pass, its
    columns of a k-tile, its slice of the tiled copy."""

    k_tiles: Any  # the source in k-tiles
    sources: Any  # (passes,) Int32 registers: the source row of each pass
    columns: Any  # its columns' coordinates in a k-tile
    thr: Any  # its slice of the tiled copy
    tiled: Any  # the tiled copy
    passes: int
    rows_per_pass: int


@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """A contraction work item's rows: source[:, index[first_row + r]] for r < rows,
    from column column0 of the width."""

    source: Any  # (width, T) cute.Tensor
    index: Any  # (m,) int32 cute.Tensor
    first_row: Any  # Int32: the expert's first row
    rows: Any  # Int32: the expert's row count
    column0: Any  # Int32: the block's first column, a multiple of 64


@dataclasses.dataclass(frozen=True)
class ColumnCopies:
    """One thread's part of copying a contraction k-tile: the item, its rows'
    coordinates in a k-tile, which of its chunks lie within the width, its slice of the
    tiled copy."""

    item: ExpertRows
    rows: Any
    in_width: Any  # (chunks,) Boolean registers
    thr: Any
    tiled: Any
_I32 = np.dtype(np.int32)


class GatheredA:
    """What both geometries share. A mixin, before the variant in the bases: the gathered
    operand (A, or B where `gathered` says "b") is declared as its source (T, ...) and
    read through `row_index` (m,) int32, which the variant passes among its kernel
    parameters under that name."""

    row_index: str  # the declared name of the gathered operand's row index
    gathered = "a"  # which operand of the GEMM is gathered: "a" or "b"
    operands_written_by_generic_proxy = True  # cp.async: the consumers fence (see the module doc)

    def __init__(self, config, request):
        if config.cluster_n != 1:
            raise ValueError(f"a gathered operand is loaded by each CTA alone: cluster_n must be 1, got {config.cluster_n}")
        super().__init__(config, request)

    @property
    def a_load_warps(self) -> tuple[int, ...]:
        """The producer warps that gather, the first of which loads the other operand too:
        all four, or where warp 1 streams the epilogue input, warp 3 alone (the fused
        dsReLU kernel's producers spilled registers with warps 2 and 3 gathering, or with
        warp 0 alone, in their 40 registers: ptxas's report at Nemotron-3 Nano's shape)."""
        return (0, 1, 2, 3) if self.epilogue_input is None else (3,)

    @property
    def gathered_name(self) -> str:
        """The declared name of the gathered operand."""
        return self.operand_a if self.gathered == "a" else self.operand_b

    def index_params(self) -> dict[str, bool]:
        # The schema then gives the gathered operand its source's rows (T, ...).
        return dict(super().index_params(), **{f"with_{self.gathered_name}_index": True})

    def operands(self) -> list[KernelOperand]:
        """The variant's declaration, the gathered operand's rows those of its source,
        with its row index (m,) int32 right after it."""
        plan = []
        for operand in super().operands():
            plan.append(operand)
            if operand.name == self.gathered_name:
                plan.append(self.declare(self.row_index, "input", _I32))
        return plan

    # ------------------------------------------------------------------ host side

    def _gather_source(self, t):
        """A cp.async atom of 16-byte copies, and the gathered operand's source itself."""
        source = getattr(t, self.gathered_name)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), source.element_type,
                                   num_bits_per_copy=_COPY_BITS)
        return atom, source

    def a_source(self, t, a_layout):
        return self._gather_source(t) if self.gathered == "a" else super().a_source(t, a_layout)

    def b_source(self, t, b_layout):
        return self._gather_source(t) if self.gathered == "b" else super().b_source(t, b_layout)

    # ---------------------------------------------------------------- device side

    def descriptors(self, copy_a, tma_b, args) -> list:
        """The TMA operand's descriptor and the epilogue's: the gathered operand has none."""
        tma = [tma_b] if self.gathered == "a" else [copy_a]
        return tma + ([args.c[0]] if self.epilogue_input is not None else []) + [atom for atom, _ in args.stored]

    def loads_operands(self, warp_idx):
        """The gathering warps (the caller asks producer warps only)."""
        if self.a_load_warps[0] == 0:
            return True
        return warp_idx >= self.a_load_warps[0]

    def operand_pipeline(self, storage, a_layout, b_layout) -> pipeline.PipelineTmaAsync:
        """The ring: full when the TMA operand's bytes and every gathering thread's
        arrival are in."""
        tma_layout = b_layout if self.gathered == "a" else a_layout
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.config.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + 32 * len(self.a_load_warps)),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads),
            tx_count=cute.size_in_bytes(self.ab_dtype, cute.slice_(tma_layout, (None, None, 0))),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            mcast_mode_mn=(1, 0),
            enable_multicast_signaling=True,
            defer_sync=True,
        )

    def a_tiles(self, mA, tile, params):
        return self._gathered_tiles(mA, tile, params) if self.gathered == "a" else super().a_tiles(mA, tile, params)

    def b_tiles(self, mB, tile, params):
        return self._gathered_tiles(mB, tile, params) if self.gathered == "b" else super().b_tiles(mB, tile, params)

    def partition_a(self, copy_a, sA, gA, rank):
        return self._gathered_partition(copy_a, sA, gA) if self.gathered == "a" else super().partition_a(
            copy_a, sA, gA, rank)

    def partition_b(self, tma_b, sB, gB):
        return self._gathered_partition(tma_b, sB, gB) if self.gathered == "b" else super().partition_b(tma_b, sB, gB)

    @cute.jit
    def load_k_tiles(self, copy_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, k_tiles, staged):
        """Per k-tile: every gathering warp waits for the stage (the first arrives with
        the TMA operand's bytes and loads its box), copies its chunks of the gathered
        operand, and arrives when they land. A gathered kernel stages no inputs."""
        if cutlass.const_expr(len(staged) > 0):
            raise NotImplementedError(f"{type(self).__name__} gathers an operand and cannot stage inputs beside it")
        tma, tma_global, tma_shared = (tma_b, tBgB, tBsB) if self.gathered == "a" else (copy_a, tAgA, tAsA)
        gathered, gathered_shared = (tAgA, tAsA) if self.gathered == "a" else (tBgB, tBsB)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        for k_tile in range(k_tiles):
            if warp_idx == self.a_load_warps[0]:
                ab_pipeline.producer_acquire(state)
                cute.copy(tma, tma_global[None, k_tile], tma_shared[None, state.index],
                          tma_bar_ptr=ab_pipeline.producer_get_barrier(state))
            else:
                ab_pipeline.sync_object_empty.wait(state.index, state.phase)
            self._copy_k_tile(gathered, gathered_shared, k_tile, state.index)
            self.signal_copies_landed(ab_pipeline, state)
            state.advance()
        return state

    @staticmethod
    def signal_copies_landed(ab_pipeline, state) -> None:
        """A gathering thread's arrival on the stage's full barrier, which completes once
        its copies have landed (cp.async.mbarrier.arrive.noinc): it need not wait for them."""
        cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipeline.producer_get_barrier(state))

    def _gather_thread(self, tiled):
        """This thread's slice of a tiled copy of the gathering threads."""
        return tiled.get_slice(cute.arch.thread_idx()[0] - 32 * self.a_load_warps[0])

    @staticmethod
    def _clamped(entry: Int32, last_row: Int32) -> Int32:
        return cutlass.max(Int32(0), cutlass.min(entry, last_row))


class GatheredRowsA(GatheredA):
    """A K-major (m, k) read as source[index]: the ragged-M GEMMs (see the module doc)."""

    def host_rows(self, t):
        return cute.size(getattr(t, self.row_index), mode=[0])

    @property
    def a_rows_per_thread(self) -> int:
        """The most rows of a tile one gathering thread copies from: each row's source
        offset is a register pair beside the walk's state in the producers' 40 registers.
        The most that ptxas fit without spilling at the shapes of the compile tier: 4
        with four gathering warps, 8 with one."""
        return 4 if len(self.a_load_warps) == 4 else 8

    def _gathered_tiles(self, mA: cute.Tensor, tile, params):
        """The tile's rows: the source, its row index, the tile's first row of the index
        and how many of its rows the expert owns."""
        row0, rows_valid = self._tile_rows(tile)
        return TileRows(source=mA, index=getattr(params, self.row_index), row0=row0, rows_valid=rows_valid)

    def _gather_copy(self, atom):
        """The tiled copy of a (tile_m, tile_k) tile: `lanes` threads on a row's
        neighbouring chunks, each taking every lanes-th chunk of the row, as many as
        keep its rows to `a_rows_per_thread`; the rows split over the threads' passes."""
        vector = _COPY_BITS // self.ab_dtype.width
        chunks = self.tile_k // vector
        threads = 32 * len(self.a_load_warps)
        lanes = chunks // max(1, self.tile_m * chunks // (threads * self.a_rows_per_thread))
        return cute.make_tiled_copy_tv(atom, cute.make_layout((threads // lanes, lanes), stride=(lanes, 1)),
                                       cute.make_layout((1, vector)))

    def _gathered_partition(self, atom, sA, gA):
        """(this thread's shared destinations (copy, passes, chunks, stage); what it copies
        from: the source in k-tiles, its source row of each pass, its columns of a k-tile,
        its slice of the tiled copy)."""
        tiled = self._gather_copy(atom)
        thr = self._gather_thread(tiled)
        tAcA = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        passes = cute.size(tAcA, mode=[1])
        sources = cute.make_rmem_tensor(passes, Int32)
        last_row = cute.size(gA.source, mode=[0]) - 1
        for p in range(passes):  # static: unrolled as Python
            row = tAcA[0, p, 0][0]
            valid = row < gA.rows_valid
            entry = gA.index[Int32(cutlass.select_(valid, gA.row0 + row, Int32(0)))]
            # A row past the expert reads source row 0: loaded, never stored.
            sources[p] = Int32(cutlass.select_(valid, self._clamped(entry, last_row), Int32(0)))
        return thr.partition_D(sA), RowCopies(
            k_tiles=cute.logical_divide(gA.source, (None, self.tile_k)), sources=sources, columns=tAcA[None, 0, None],
            thr=thr, tiled=tiled, passes=passes, rows_per_pass=self.tile_m // passes,
        )

    @cute.jit
    def _copy_k_tile(self, tAgA, tAsA, k_tile: Int32, stage: Int32):
        """This thread's chunks of k-tile `k_tile` of each of its rows into stage
        `stage`; where k is no multiple of tile_k, a chunk past k is zero-filled."""
        pred = None
        if cutlass.const_expr(self.k % self.tile_k != 0):
            chunks = cute.size(tAgA.columns, mode=[1])
            pred = cute.make_rmem_tensor(cute.make_layout((1, chunks)), Boolean)
            for c in cutlass.range_constexpr(chunks):
                pred[0, c] = k_tile * self.tile_k + tAgA.columns[0, c][1] < self.k
        for p in cutlass.range_constexpr(tAgA.passes):
            row = tAgA.k_tiles[tAgA.sources[p], (None, k_tile)]
            # Every row of this view is this pass's source row: the thread's partition of it
            # is its chunks of that row, shaped as its partition of the shared tile.
            alias = cute.make_tensor(row.iterator, cute.make_layout((tAgA.rows_per_pass, self.tile_k), stride=(0, 1)))
            cute.copy(tAgA.tiled, tAgA.thr.partition_S(alias)[None, 0, None], tAsA[None, p, None, stage], pred=pred)


class GatheredRowsK(GatheredA):
    """An MN-major operand, seen as (width, m), its m rows read as source[index]: the
    contraction, whose k is the expert's rows (see the module doc)."""

    @property
    def _width(self) -> int:
        """The gathered operand's tile extent along its contiguous mode."""
        return self.tile_m if self.gathered == "a" else self.tile_n

    def _gathered_tiles(self, source: cute.Tensor, tile, params):
        """The work item's rows: the source (width, T), its row index, the expert's first
        row and row count, and the block's first column (a multiple of 64)."""
        block = tile.m_tile if self.gathered == "a" else tile.n_tile
        return ExpertRows(source=source, index=getattr(params, self.row_index), first_row=tile.first_row,
                          rows=tile.rows, column0=cute.assume(block * self._width, divby=64))

    def _gather_copy(self, atom):
        """The tiled copy of a (width, tile_k) tile, the width contiguous: `lanes` threads
        on neighbouring 16-byte chunks of a row (16, or 8 where 16 do not divide the
        row), each taking every lanes-th chunk of it; the rows split over the threads."""
        vector = _COPY_BITS // self.ab_dtype.width
        lanes = math.gcd(self._width // vector, 16)
        threads = 32 * len(self.a_load_warps)
        return cute.make_tiled_copy_tv(atom, cute.make_layout((lanes, threads // lanes), stride=(1, lanes)),
                                       cute.make_layout((vector, 1)))

    def _gathered_partition(self, atom, smem, item):
        """(this thread's shared destinations (copy, chunks, rows, stage); what it copies
        from: the item, its rows' coordinates in a k-tile, which of its chunks lie within
        the width, its slice of the tiled copy)."""
        tiled = self._gather_copy(atom)
        thr = self._gather_thread(tiled)
        coords = thr.partition_S(cute.make_identity_tensor((self._width, self.tile_k)))
        chunks = cute.size(coords, mode=[1])
        width = cute.size(item.source, mode=[0])
        in_width = cute.make_rmem_tensor(chunks, Boolean)
        for c in range(chunks):  # static: unrolled as Python
            in_width[c] = item.column0 + coords[0, c, 0][0] < width
        return thr.partition_D(smem), ColumnCopies(item=item, rows=coords[0, 0, None], in_width=in_width,
                                                    thr=thr, tiled=tiled)

    @cute.jit
    def _copy_k_tile(self, gathered, shared, k_tile: Int32, stage: Int32):
        """This thread's chunks of each of its rows of k-tile `k_tile` into stage `stage`,
        the row's source row read from the index now; zero-filled past the expert's rows
        or past the width."""
        item = gathered.item
        last_row = cute.size(item.source, mode=[1]) - 1
        chunks = cute.size(gathered.in_width)
        for r in cutlass.range_constexpr(cute.size(gathered.rows)):
            row = k_tile * self.tile_k + gathered.rows[r][1]  # within the expert
            valid = row < item.rows
            entry = item.index[Int32(cutlass.select_(valid, item.first_row + row, Int32(0)))]
            source_row = Int32(cutlass.select_(valid, self._clamped(entry, last_row), Int32(0)))
            pred = cute.make_rmem_tensor(cute.make_layout((1, chunks)), Boolean)
            for c in cutlass.range_constexpr(chunks):
                pred[0, c] = valid & gathered.in_width[c]
            # Every column of this view is the source row's block: the thread's partition
            # of it is its chunks of that row, shaped as its partition of the shared tile.
            block = cute.domain_offset((item.column0, source_row), item.source)
            alias = cute.make_tensor(block.iterator, cute.make_layout((self._width, self.tile_k), stride=(1, 0)))
            cute.copy(gathered.tiled, gathered.thr.partition_S(alias)[None, None, r], shared[None, None, r, stage],
                      pred=pred)

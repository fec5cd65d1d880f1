"""The skeleton of the Hopper kernel family, written once: every kernel is a variant of `GemmSm90`.

Every kernel of the family is a persistent, warp-specialized GEMM, acc = A B^T in float32,
one CTA per multiprocessor, 384 threads:

    warpgroup 0       producers: warp 0 streams A and B k-tiles into the operand ring
                      (TMA, `mainloop.load_k_tiles`; an operand read through a row index
                      comes by cp.async from more warps, `gather_a.py`); warp 1 streams
                      the epilogue input (a variant's C, e.g. the dsReLU kernel's preact)
                      subtile by subtile into its own ring, where the variant has one
    warpgroups 1, 2   consumers, cooperative: 64 rows of the 128-row tile each, wgmma into
                      the accumulator (`mainloop.mma_k_tiles`), then the variant's epilogue,
                      stored through shared memory by TMA (`epilogue_store`)

The base owns the host function (`__call__`: the operands unpacked by name, the MMA and
shared layouts, the TMA atoms, the shared-storage struct, the launch), the device entry
(`kernel`: descriptor prefetch, the pipelines, the schedule's tables, the warp-role
dispatch), the persistent loops of every role and the pipeline walk. A variant is a
short file of hooks:

    operands()             the declaration (`operands.KernelOperand`), in host order; the
                           call plans and the unpacking by name come from it
    primitive_schema, schema_sizes(), index_params()
                           the primitive's schema, the kernel's sizes of its dimension
                           letters and the row indices it reads: `declare(name, role,
                           dtype, mode)` makes the primitive's buffers from them
    operand_a, operand_b   the declared names of A and B; their majorness follows from
                           the declared mode order
    stored_outputs()       the declared outputs the epilogue stores by TMA, in order
    epilogue_input         the declared input loaded by TMA on warp 1 for the epilogue, or
                           None (its ring: `epilogue_input_stages`)
    kernel_params(t)       the kernel's other arguments (a dict, in order)
    epilogue_scratch       (dtype, shape) of a row-major shared buffer of the epilogue's
                           own, or None; the consumers get it as `ctx.scratch`
    grid(t), after_gemm(t, stream)     the launch's CTAs; what runs after the GEMM on
                           its stream (the dsReLU kernel's slot reduction)

  How A and B are loaded (TMA by default; a variant reading an operand's rows through a
  row index overrides these, `gather_a.py`):
    a_source(t, layout), b_source(t, layout)
                           host: (copy atom, tensor) the kernel gets for A, for B
    loads_operands(warp)   which producer warps run the operand loop (warp 0)
    operand_pipeline(...)  the operand ring (filled by TMA alone by default)
    operands_written_by_generic_proxy
                           True where a ring stage is written by cp.async: the
                           consumers fence each stage before wgmma reads it
                           (`mainloop.mma_k_tiles`)
    epilogue_input_fenced  True where the consumers fence the proxies between reading
                           an epilogue input buffer and handing it back to warp 1
                           (`read_epilogue_input`)
    partition_a(...), partition_b(...)
                           A's and B's per-work-item partitions for the copy
    load_k_tiles(...)      the per-work-item k-tile loop (`mainloop.load_k_tiles`)
    descriptors(...)       the TMA descriptors warp 0 prefetches
    staged_inputs(), staged_view(name, t), staged_tiles(name, view, tile, params)
                           float32 inputs loaded by TMA into every operand stage beside
                           its k-tiles (a run of elements each; the consumers read them
                           as ctx.staged and fence before the release)

  The work schedule (`ragged_m.RaggedMGemmSm90` for the ragged-M kernels):
    num_rows(params)                          the row count m (params.num_rows)
    publish_schedule(storage, params, m, tidx)  the per-CTA tables every role reads
    make_schedule(tables, m)                  a role's walk (`schedule.py`)
    a_tiles(mA, tile, params), b_tiles(mB, tile, params), c_tiles(mC, tile)
                                              a work item's (tile, tile_k | epi_n, blocks)
                                              views (A's and B's with the kernel's
                                              parameters: a gathered operand reads its
                                              row table there)
    k_tile_count(tile), store_views(outputs, tile)
    store_zero_tile(...)                      a walk's item of rows no expert owns (walk_rebinds)

  Every hook the base calls is declared on it, with what it returns; the schedule's raise
  NotImplementedError until a variant's walk (`ragged_m.py`, the contraction) supplies them.

  The epilogue, on the consumer warpgroups, given `ctx`, an `EpilogueContext`
  (`epilogue_context.py`: ctid, warp and lane of the consumers, acc and tCcAcc, the
  accumulator and its (row, column) coordinates, tile_row, sub_values, registers, each
  stored output's float32 subtile, which the store rounds, outputs, input_registers, the
  epilogue input's subtile in float32, scratch, params, the kernel_params by name; a
  variant with registers of its own declares them on a subclass, `context_type`); `item`
  is what epilogue_prefetch returned:
    epilogue_setup(ctx)                       extra registers, before the walk
    mainloop_setup(ctx, sA, sB)               a variant's own wgmma fragments of the
                                              operand rings, before the walk
    epilogue_prefetch(ctx, tile)              per work item, before its mainloop: loads
                                              whose latency hides behind it; returns the
                                              item's state
    mainloop(ctx, item, tile, read, release)  the accumulator over the item's k-tiles
                                              (`mainloop.mma_k_tiles` by default)
    mma_active(ctx, item)                     `mainloop.mma_k_tiles`' warpgroup switch
    epilogue_begin(ctx, item)                 after the mainloop
    epilogue_visit(ctx, item, tile, subtile)  the subtile's outputs, in float32 registers
    epilogue_reduce(ctx, item, tile, subtile) after the subtile's stores are issued
    epilogue_end(ctx, item, tile)             after the last subtile

Two walks: the ragged-M walk (`schedule.RaggedMSchedule`) has items of rows no expert
owns, stored as zeros, and locating an item moves its expert cursor, so each role's loop
rebinds the walk; the contraction's (`schedule.ContractSchedule`) has a mainloop in every
item and no cursor. Each role's loop is written once per walk: the DSL carries a loop's
values in the order their names first appear in it, and that order is each kernel's PTX.
The rest of an item's work, mainloop and epilogue, is one method for both.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import numpy as np
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.tensor_utils import LayoutEnum

from jax_dsrelu.kernels.group_tables import build_expert_tables
from jax_dsrelu.kernels.operands import Declaration, KernelOperand, by_name, declaration
from jax_dsrelu.kernels.sm90 import epilogue_store, mainloop
from jax_dsrelu.kernels.sm90.epilogue_context import EpilogueContext, EpilogueInput, StoredOutput


@dataclasses.dataclass(frozen=True)
class KernelArguments:
    """What the host passes a kernel besides A and B (`GemmSm90._kernel_arguments`)."""

    c: Any  # (TMA atom, tensor) of the epilogue input, or None
    stored: tuple  # (TMA atom, tensor) of each stored output, in `stored_outputs` order
    params: SimpleNamespace  # the variant's `kernel_params`, by name
    tiled_mma: Any
    a_layout: Any  # the operand ring's shared layouts
    b_layout: Any
    c_layout: Any  # the epilogue input's, or None
    d_layout: Any  # the stored outputs'
    staged: tuple = ()  # (TMA atom, tensor, ring layout) of each of `staged_inputs`, in order


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

    operand_a: str
    operand_b: str
    epilogue_input: str | None = None
    epilogue_input_stages = 0
    epilogue_scratch = None
    # What the epilogue hooks receive: a variant with registers of its own subclasses it.
    context_type = EpilogueContext
    # The walk's items include rows no expert owns, and locating an item moves the walk.
    walk_rebinds = False
    # Every subtile of a tile made by `epilogue_visit`, staged at once and stored as one
    # bulk group (`epilogue_store.store_tile`): needs a buffer per subtile of each stored
    # output, and an epilogue with no input ring and no per-subtile reduction.
    whole_tile = False
    # The operand ring filled by TMA alone: wgmma reads its stages with no proxy fence.
    operands_written_by_generic_proxy = False
    # The consumers fence the proxies between reading an epilogue input buffer (ldmatrix,
    # the generic proxy) and handing it back to warp 1, whose next TMA write (the async
    # proxy) mbarrier ordering alone does not order after those reads; CUTLASS's epilogues
    # fence there. Without it the gathered fused kernel gave wrong rows at 13cf1f7
    # (docs/sm90.md, "The preact ring"); False only in benchmarks/check_gathered.py's
    # unfenced variants, which show whether the race is there.
    epilogue_input_fenced = True

    def __init__(self, config, num_experts: int):
        self.config = config
        self.num_experts = num_experts
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.tile_k = config.tile_k
        self.epi_n = config.epi_n
        self.subtiles = config.subtiles

    def check_operand_bytes(self, operand_dtype) -> None:
        """The config's operand_bytes must be the operands' element size: the shared-memory
        estimate and the k-tile's swizzle row are counted in it."""
        itemsize = np.dtype(operand_dtype).itemsize
        if self.config.operand_bytes != itemsize:
            raise ValueError(f"config.operand_bytes must be {itemsize} for {np.dtype(operand_dtype).name} operands, "
                             f"got {self.config.operand_bytes}")

    # ------------------------------------------------------------- the declaration

    def operands(self) -> list[KernelOperand]:
        """The host function's buffers, in its order: the primitive's from `declare`, and
        the kernel's workspaces."""
        raise NotImplementedError(f"{type(self).__name__} declares no operands")

    @property
    def primitive_schema(self):
        """The schema (`jax_dsrelu.primitive_schema`) of the primitive the kernel serves."""
        raise NotImplementedError(f"{type(self).__name__} names no primitive schema")

    def schema_sizes(self) -> dict[str, int]:
        """The kernel's static sizes of the schema's dimension letters."""
        raise NotImplementedError(f"{type(self).__name__} gives no sizes of its schema's dimensions")

    def index_params(self) -> dict[str, bool]:
        """The static parameters of the operands the kernel reads through a row index
        (with_<operand>_index); none here."""
        return {}

    @property
    def declare(self) -> Declaration:
        """declare(name, role, dtype, mode): the primitive's buffer `name`, its shape from
        the schema."""
        return declaration(self.primitive_schema, self.request, self.schema_sizes(), **self.index_params())

    def operand(self, name: str) -> KernelOperand:
        return next(o for o in self.operands() if o.name == name)

    def stored_outputs(self) -> tuple[str, ...]:
        raise NotImplementedError(f"{type(self).__name__} declares no stored outputs")

    def major(self, name: str) -> LayoutEnum:
        """K-major (ROW_MAJOR: the kernel's mode 1, K, is contiguous) or MN-major
        (COL_MAJOR), from the declared mode order of GEMM operand `name`."""
        return LayoutEnum.ROW_MAJOR if self.operand(name).contiguous_mode == 1 else LayoutEnum.COL_MAJOR

    # ---------------------------------------------------------------- host function

    @cute.jit
    def __call__(self, stream: cuda.CUstream, *tensors: cute.Tensor):
        """Launches the GEMM on `stream`, then `after_gemm`. `tensors` are the declared
        operands in declaration order (inputs and accumulate buffers, then outputs), as
        the JAX bridge passes them."""
        t = by_name(self.operands(), tensors, type(self).__name__)
        tiled_mma, a_layout, b_layout = self._mma(
            getattr(t, self.operand_a).element_type, self.major(self.operand_a), self.major(self.operand_b)
        )
        copy_a, mA = self.a_source(t, a_layout)
        tma_b, mB = self.b_source(t, b_layout)
        args, barriers, buffers = self._kernel_arguments(t, tiled_mma, a_layout, b_layout)
        self.shared_storage = self._shared_storage(a_layout, b_layout, barriers, buffers)
        self._launch(self.kernel(copy_a, mA, tma_b, mB, args), self.grid(t), stream)
        self.after_gemm(t, stream)

    def _kernel_arguments(self, t, tiled_mma, a_layout, b_layout):
        """(the kernel's arguments after A and B, the ring barriers and the shared buffers
        besides the operand ring): the epilogue input's TMA, the stored outputs' TMA, the
        variant's parameters, the MMA and the shared layouts, in that order."""
        self.out_dtype = getattr(t, self.stored_outputs()[0]).element_type
        d_layout = self._epi_layout(self.out_dtype, self.config.store_stages)
        barriers, buffers = {}, {}
        c = None
        c_layout = None
        if self.epilogue_input is not None:
            tensor = getattr(t, self.epilogue_input)
            self.c_dtype = tensor.element_type
            c_layout = self._epi_layout(self.c_dtype, self.epilogue_input_stages)
            c = self._tma_load(tensor, c_layout, (self.tile_m, self.epi_n))
            barriers["c_barriers"] = self.epilogue_input_stages
            buffers["sC"] = (self.c_dtype, cute.cosize(c_layout))
        stored = []
        for name in self.stored_outputs():
            stored.append(self._tma_store(self.store_view(getattr(t, name)), d_layout))
            buffers[f"s_{name}"] = (self.out_dtype, cute.cosize(d_layout))
        if self.epilogue_scratch is not None:
            dtype, shape = self.epilogue_scratch
            buffers["epilogue_scratch"] = (dtype, cute.size(shape))
        staged = []
        if self.staged_inputs() and self.config.cluster_n > 1:
            raise ValueError(f"{type(self).__name__} stages inputs, which are not multicast: cluster_n must be 1, "
                             f"got {self.config.cluster_n}")
        for name, elements in self.staged_inputs().items():
            # A stage's run is one TMA box of (elements, 1); zeros past the tensor's end.
            ring = cute.make_layout((elements, 1, self.config.ab_stages), stride=(1, elements, elements))
            atom, tensor = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), self.staged_view(name, getattr(t, name)),
                cute.slice_(ring, (None, None, 0)), (elements, 1))
            staged.append((atom, tensor, ring))
            buffers[f"s_{name}"] = (Float32, cute.cosize(ring))
        args = KernelArguments(
            c=c, stored=tuple(stored), params=SimpleNamespace(**self.kernel_params(t)),
            tiled_mma=tiled_mma, a_layout=a_layout, b_layout=b_layout, c_layout=c_layout, d_layout=d_layout,
            staged=tuple(staged),
        )
        return args, barriers, buffers

    # Host hooks: the defaults are a variant's with nothing to add.

    def a_source(self, t, a_layout):
        """(copy atom, tensor) of A in the kernel: a TMA load of `a_view`; with clusters
        along N each CTA of one loads its slice of the box into all of them."""
        return self._tma_load(self.a_view(getattr(t, self.operand_a)), a_layout, (self.tile_m, self.tile_k),
                              self.config.cluster_n)

    def b_source(self, t, b_layout):
        """(copy atom, tensor) of B in the kernel: a TMA load of `b_view`."""
        return self._tma_load(self.b_view(getattr(t, self.operand_b)), b_layout, (self.tile_n, self.tile_k))

    def staged_inputs(self) -> dict[str, int]:
        """Declared float32 inputs loaded by TMA into every stage of the operand ring beside
        its A and B k-tiles, under the same barrier, {name: elements a stage}: none by
        default. The FP8 contraction's scales of a k-tile's rows and columns are, so that
        they arrive with the operands, stages ahead, instead of being loaded from global
        memory when the k-tile is multiplied."""
        return {}

    def staged_view(self, name: str, tensor: cute.Tensor) -> cute.Tensor:
        """Staged input `name` as a rank-2 tensor (elements, k-blocks), its first mode
        contiguous: a stage holds one k-block's run of `staged_inputs()[name]` elements."""
        raise NotImplementedError(f"{type(self).__name__} stages no input {name}")

    def staged_tiles(self, name: str, view: cute.Tensor, tile, params) -> cute.Tensor:
        """(elements, 1, k-tiles) of `staged_view` for work item `tile`'s k-tiles."""
        raise NotImplementedError(f"{type(self).__name__} stages no input {name}")

    def a_view(self, tensor: cute.Tensor) -> cute.Tensor:
        return tensor

    def b_view(self, tensor: cute.Tensor) -> cute.Tensor:
        return tensor

    def store_view(self, tensor: cute.Tensor) -> cute.Tensor:
        return tensor

    def kernel_params(self, t) -> dict:
        return {}

    def after_gemm(self, t, stream) -> None:
        pass

    def grid(self, t) -> Int32:
        """The launch's CTAs (persistent: at most one per multiprocessor, whole clusters,
        no more than there are work items), from the operands `t`."""
        raise NotImplementedError(f"{type(self).__name__} has no work schedule (ragged_m, or the contraction's)")

    # Host helpers.

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
        other rings' `barriers` ({name: stages}), the expert tables, the operand ring,
        then `buffers` ({name: (dtype, elements)}), each 1024-byte aligned (the swizzled
        layouts' requirement)."""
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

    # ----------------------------------------------------------------- device entry

    @cute.kernel
    def kernel(self, copy_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor, args):
        """`args`: the host's `_kernel_arguments`."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        num_rows = self.num_rows(args.params)
        self._prefetch(self.descriptors(copy_a, tma_b, args))
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        ab_pipeline = self.operand_pipeline(storage, args.a_layout, args.b_layout)
        c_pipeline = self._epilogue_input_pipeline(storage, args.c_layout)
        tables = self.publish_schedule(storage, args.params, num_rows, tidx)
        sA = self._smem(storage.sA, args.a_layout)
        sB = self._smem(storage.sB, args.b_layout)
        sC = self._epilogue_input_buffer(storage, args.c_layout)
        epilogue_storage = self._epilogue_storage(storage)
        # Each staged input's (TMA atom, tensor, ring in shared memory).
        staged = [(atom, tensor, getattr(storage, f"s_{name}").get_tensor(ring))
                  for name, (atom, tensor, ring) in zip(self.staged_inputs(), args.staged)]

        if warp_idx < self.producer_warps:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if self.loads_operands(warp_idx):
                self.load_operands(copy_a, mA, tma_b, mB, sA, sB, ab_pipeline, self.make_schedule(tables, num_rows),
                                   args.params, staged)
            if cutlass.const_expr(self.epilogue_input is not None):
                if warp_idx == 1:
                    self.load_epilogue_input(args.c[0], args.c[1], sC, c_pipeline,
                                             self.make_schedule(tables, num_rows))
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            stored_smem = self._stored_buffers(storage, epilogue_storage, args.d_layout)
            scratch = None
            if cutlass.const_expr(self.epilogue_scratch is not None):
                scratch = epilogue_storage.epilogue_scratch.get_tensor(self._row_major(self.epilogue_scratch[1]))
            self.consume(args.tiled_mma, sA, sB, ab_pipeline, sC, c_pipeline, stored_smem, scratch, args,
                         self.make_schedule(tables, num_rows), tidx - 128, [ring for _, _, ring in staged])

    def num_rows(self, params) -> Int32:
        """The problem's row count m (`Rows` extents are in it), from the kernel's parameters."""
        return params.num_rows

    # The work schedule: a variant's walk of its work items, which every role asks for its
    # next item in the same order (`schedule.py`), and the item's views of the operands.

    def publish_schedule(self, storage, params, num_rows: Int32, tidx: Int32):
        """Builds the per-CTA tables every role's walk reads (in `storage`, from the kernel's
        parameters) and publishes them to every warp; returns them."""
        raise NotImplementedError(f"{type(self).__name__} has no work schedule")

    def make_schedule(self, tables, num_rows: Int32):
        """A role's own walk over the work items, from the published tables: an object with
        valid(), advance() and either tile() or, with `walk_rebinds`, owned() and located()."""
        raise NotImplementedError(f"{type(self).__name__} has no work schedule")

    def a_tiles(self, mA: cute.Tensor, tile, params) -> cute.Tensor:
        """(tile_m, tile_k, k-tiles): the work item's k-tiles of A, from the kernel's
        parameters where its rows come through a row index."""
        raise NotImplementedError(f"{type(self).__name__} has no view of A")

    def b_tiles(self, mB: cute.Tensor, tile, params) -> cute.Tensor:
        """(tile_n, tile_k, k-tiles): the work item's k-tiles of B."""
        raise NotImplementedError(f"{type(self).__name__} has no view of B")

    def c_tiles(self, mC: cute.Tensor, tile) -> cute.Tensor:
        """(tile_m, epi_n, subtiles of the width): the work item's rows of the epilogue
        input, where the variant has one; subtile s of N-tile t is column block
        t * subtiles + s."""
        raise NotImplementedError(f"{type(self).__name__} has no epilogue input")

    def k_tile_count(self, tile) -> Int32:
        """The work item's k-tiles: the mainloop's trip count."""
        raise NotImplementedError(f"{type(self).__name__} has no work schedule")

    def store_views(self, outputs, tile) -> list:
        """The stored outputs as `_store_subtile` takes them (`_epilogue_outputs`' entries),
        each with its global tensor replaced by the work item's view of it, clipped where
        the item's rows or columns end."""
        raise NotImplementedError(f"{type(self).__name__} has no work schedule")

    def store_zero_tile(self, work_schedule, tiled_r2s, outputs, store_pipeline, store_count: Int32,
                        ctid: Int32) -> Int32:
        """With `walk_rebinds`: stores zeros into every output over the current item, a tile
        of rows no expert owns; returns the store count."""
        raise NotImplementedError(f"{type(self).__name__}'s walk has no unowned rows")

    def descriptors(self, copy_a, tma_b, args) -> list:
        """The TMA descriptors warp 0 prefetches."""
        return [copy_a, tma_b] + ([args.c[0]] if self.epilogue_input is not None else []) + [
            tma for tma, _ in args.stored
        ]

    @cute.jit
    def _prefetch(self, atoms):
        """Warp 0 prefetches the TMA descriptors."""
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
            for i in cutlass.range_constexpr(len(atoms)):
                cpasync.prefetch_descriptor(atoms[i])

    def operand_pipeline(self, storage, a_layout, b_layout) -> pipeline.PipelineTmaAsync:
        """The A/B ring: warp 0 produces, the 8 consumer warps release. In a cluster along
        N a stage's A tile is written by every CTA of the cluster, so each consumer warp
        releases the stage in every CTA (one lane per CTA)."""
        return self._tma_pipeline(
            storage.ab_barriers, self.config.ab_stages,
            cute.size_in_bytes(self.ab_dtype, cute.slice_(a_layout, (None, None, 0)))
            + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_layout, (None, None, 0)))
            + 4 * sum(self.staged_inputs().values()),
            self.config.cluster_n,
        )

    def _epilogue_input_pipeline(self, storage, c_layout):
        """The epilogue input's ring, filled by warp 1; None without one."""
        if self.epilogue_input is None:
            return None
        return self._tma_pipeline(
            storage.c_barriers, self.epilogue_input_stages,
            cute.size_in_bytes(self.c_dtype, cute.slice_(c_layout, (None, None, 0))),
        )

    def _epilogue_input_buffer(self, storage, c_layout):
        return None if self.epilogue_input is None else self._smem(storage.sC, c_layout)

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

    def _cluster_walk(self):
        """(first work item, stride, rank) of this CTA's walk: the items are its cluster's,
        every CTA of a cluster walks the same ones, and `rank` says which N-tile of each
        is this CTA's."""
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        cluster_n = self.config.cluster_n
        return bidx // cluster_n, grid // cluster_n, bidx % cluster_n

    @staticmethod
    def _smem(buffer, layout) -> cute.Tensor:
        return buffer.get_tensor(layout.outer, swizzle=layout.inner)

    def _epilogue_storage(self, storage):
        """The struct, where the epilogue has shared buffers of its own (an input ring, a
        scratch buffer), else None. Named in the consumers' branch, it enters that branch
        as an argument, and the DSL derives its field pointers there rather than at the
        kernel's top: a placement that changes the code ptxas receives, kept as the
        kernels were measured (tests/ptx_digests.py checks their PTX)."""
        if self.epilogue_input is None and self.epilogue_scratch is None:
            return None
        return storage

    def _stored_buffers(self, storage, epilogue_storage, d_layout) -> list:
        struct = storage if epilogue_storage is None else epilogue_storage
        return [self._smem(getattr(struct, f"s_{name}"), d_layout) for name in self.stored_outputs()]

    @staticmethod
    def _row_major(shape):
        strides, stride = [], 1
        for extent in reversed(shape):
            strides.insert(0, stride)
            stride *= extent
        return cute.make_layout(shape, stride=tuple(strides))

    # --------------------------------------------------------------- producer warps

    def loads_operands(self, warp_idx):
        return warp_idx == 0

    @cute.jit
    def load_operands(self, copy_a, mA, tma_b, mB, sA, sB, ab_pipeline, work_schedule, params, staged=()):
        """The A/B k-tiles of every work item with a mainloop, in schedule order, through
        one ring whose state carries across items; with them, the `staged` inputs' runs
        ((TMA atom, tensor, shared ring) each)."""
        state = self._producer_state(self.config.ab_stages)
        if cutlass.const_expr(self.walk_rebinds):
            while work_schedule.owned():
                tile, work_schedule = work_schedule.located()
                state = self._load_item(copy_a, mA, tma_b, mB, sA, sB, ab_pipeline, state, tile, work_schedule.rank,
                                        params, staged)
                work_schedule.advance()
        else:
            while work_schedule.valid():
                tile = work_schedule.tile()
                state = self._load_item(copy_a, mA, tma_b, mB, sA, sB, ab_pipeline, state, tile, work_schedule.rank,
                                        params, staged)
                work_schedule.advance()
        ab_pipeline.producer_tail(state)

    def _load_item(self, copy_a, mA, tma_b, mB, sA, sB, ab_pipeline, state, tile, rank, params, staged):
        gA = self.a_tiles(mA, tile, params)
        gB = self.b_tiles(mB, tile, params)
        tAsA, tAgA = self.partition_a(copy_a, sA, gA, rank)
        tBsB, tBgB = self.partition_b(tma_b, sB, gB)
        runs = []
        for name, (atom, tensor, ring) in zip(self.staged_inputs(), staged):
            tSs, tSg = mainloop.tma_partition(atom, ring, self.staged_tiles(name, tensor, tile, params))
            runs.append((atom, tSg, tSs))
        return self.load_k_tiles(copy_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, self.k_tile_count(tile),
                                 runs)

    def partition_a(self, copy_a, sA, gA, rank):
        """(shared, global) partitions of A's k-tiles: the CTAs of a cluster share the
        rows, each loads its slice of A for all."""
        return mainloop.tma_partition(copy_a, sA, gA, rank, self.config.cluster_n)

    def partition_b(self, tma_b, sB, gB):
        """(shared, global) TMA partitions of B's k-tiles."""
        return mainloop.tma_partition(tma_b, sB, gB)

    def load_k_tiles(self, copy_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, k_tiles, staged):
        """`staged`: (TMA atom, global k-tile runs, shared ring) of each staged input."""
        return mainloop.load_k_tiles(copy_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, k_tiles,
                                     self.config.cluster_n, staged)

    @cute.jit
    def load_epilogue_input(self, tma_c, mC, sC, c_pipeline, work_schedule):
        """Warp 1: the epilogue input's subtiles of every expert work item (of the ragged-M
        walk), in epilogue order.

        A warp of its own, so that waiting for a free buffer (freed only by the epilogue)
        never holds back the A/B loads of the next tile."""
        state = self._producer_state(self.epilogue_input_stages)
        while work_schedule.owned():
            tile, work_schedule = work_schedule.located()
            tCsC, tCgC = mainloop.tma_partition(tma_c, sC, self.c_tiles(mC, tile))
            for subtile in cutlass.range_constexpr(self.subtiles):
                c_pipeline.producer_acquire(state)
                cute.copy(
                    tma_c,
                    tCgC[None, tile.n_tile * self.subtiles + subtile],
                    tCsC[None, state.index],
                    tma_bar_ptr=c_pipeline.producer_get_barrier(state),
                )
                c_pipeline.producer_commit(state)
                state.advance()
            work_schedule.advance()
        c_pipeline.producer_tail(state)

    @staticmethod
    def _producer_state(stages: int):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)

    # ------------------------------------------------------------ consumer warpgroups

    @cute.jit
    def consume(self, tiled_mma, sA, sB, ab_pipeline, sC, c_pipeline, stored_smem, scratch, args, work_schedule,
                ctid: Int32, staged_rings=()):
        """Consumer warpgroups: per work item, the wgmma mainloop, then the epilogue.
        `staged_rings`: the staged inputs' shared rings, (elements, 1, stages) each, as
        ctx.staged."""
        if cutlass.const_expr(self.whole_tile and (self.epilogue_input is not None
                                                   or type(self).epilogue_reduce is not GemmSm90.epilogue_reduce)):
            raise ValueError(f"{type(self).__name__}: whole-tile stores skip the epilogue input and per-subtile "
                             "reductions, and it has one")
        warp_c = ctid // 32  # consumer warp 0..7, rows [16 warp_c, 16 warp_c + 16) of the tile
        lane = ctid % 32
        tCrA, tCrB, tCcAcc, acc = self._mma_fragments(tiled_mma, sA, sB, ctid)
        tiled_copy_c, tiled_r2s, thr_r2s, sub_shape = self._store_copy(tiled_mma, self.out_dtype, ctid)
        ctx = self.context_type(
            ctid=ctid, warp=warp_c, lane=lane, tiled_mma=tiled_mma, tCrA=tCrA, tCrB=tCrB, tCcAcc=tCcAcc, acc=acc,
            ab_pipeline=ab_pipeline, tiled_r2s=tiled_r2s, sub_shape=sub_shape, params=args.params, scratch=scratch,
            staged=list(staged_rings),
        )
        ctx.outputs = self._epilogue_outputs(ctx, thr_r2s, stored_smem, args.stored)
        self._epilogue_input_copies(ctx, c_pipeline, tiled_copy_c, sC, ctid)
        self.epilogue_setup(ctx)
        self.mainloop_setup(ctx, sA, sB)
        # With a buffer per subtile, a tile's stores are one bulk group (one stage).
        store_pipeline = self._store_pipeline(1 if cutlass.const_expr(self.whole_tile) else self.config.store_stages)
        ctx.store_pipeline = store_pipeline
        read_state, release_state = self._consumer_states()
        c_state = self._epilogue_input_state()
        store_count = Int32(0)
        # This thread's two rows in the tile (h = 0, 1: accumulator values 0 and 2). The wgmma
        # fragment holds value v = c + 2 h + 4 j at column 8 j + 2 (lane % 4) + c, row + 8 h.
        ctx.tile_row = [tCcAcc[0][0], tCcAcc[2][0]]
        if cutlass.const_expr(self.walk_rebinds):
            while work_schedule.valid():
                if work_schedule.owned():
                    tile, work_schedule = work_schedule.located()
                    read_state, release_state, store_count, c_state = self._work_item(
                        ctx, tile, read_state, release_state, store_count, c_state)
                else:
                    store_count = self.store_zero_tile(work_schedule, ctx.tiled_r2s, ctx.outputs, store_pipeline,
                                                        store_count, ctid)
                work_schedule.advance()
        else:
            while work_schedule.valid():
                tile = work_schedule.tile()
                read_state, release_state, store_count, c_state = self._work_item(
                    ctx, tile, read_state, release_state, store_count, c_state)
                work_schedule.advance()
        if ctid == 0:
            store_pipeline.producer_tail()

    def _work_item(self, ctx, tile, read_state, release_state, store_count, c_state):
        """One work item: the variant's prefetch, the mainloop, the epilogue subtile by
        subtile (epilogue input in, visit, store, reduce), the epilogue's end. Returns the
        states it advances."""
        item = self.epilogue_prefetch(ctx, tile)
        read_state, release_state = self.mainloop(ctx, item, tile, read_state, release_state)
        self.epilogue_begin(ctx, item)
        stores = self.store_views(ctx.outputs, tile)
        if self.whole_tile:
            epilogue_store.store_tile(
                lambda subtile: self.epilogue_visit(ctx, item, tile, subtile), ctx.tiled_r2s, stores,
                ctx.store_pipeline, tile.n_tile * self.subtiles, ctx.ctid, self.subtiles, self.consumer_threads,
            )
        else:
            for subtile in range(self.subtiles):
                if self.epilogue_input is not None:
                    c_state = self.read_epilogue_input(ctx, c_state)
                self.epilogue_visit(ctx, item, tile, subtile)
                store_count = self._store_subtile(ctx.tiled_r2s, stores, ctx.store_pipeline, store_count, tile.n_tile,
                                                  subtile, ctx.ctid)
                self.epilogue_reduce(ctx, item, tile, subtile)
        self.epilogue_end(ctx, item, tile)
        return read_state, release_state, store_count, c_state

    def mainloop(self, ctx, item, tile, read_state, release_state):
        """The work item's accumulator, ctx.acc = A B^T over its k-tiles
        (`mainloop.mma_k_tiles`); returns the advanced (read, release) states. A variant
        whose operands are block-scaled promotes partial sums here instead
        (`promoted_mainloop.py`)."""
        return mainloop.mma_k_tiles(
            ctx.tiled_mma, ctx.acc, ctx.tCrA, ctx.tCrB, ctx.ab_pipeline, read_state, release_state,
            self.k_tile_count(tile), self.mma_active(ctx, item), self.operands_written_by_generic_proxy,
        )

    # Epilogue hooks: the defaults are a variant's with nothing to add.

    def epilogue_setup(self, ctx) -> None:
        pass

    def mainloop_setup(self, ctx, sA, sB) -> None:
        """Nothing: the mainloop reads ctx.tCrA and ctx.tCrB. A variant whose mainloop
        issues other wgmma shapes makes their fragments of the rings sA and sB here, into
        its context."""

    def epilogue_prefetch(self, ctx, tile):
        return None

    def mma_active(self, ctx, item):
        """None: both warpgroups multiply every tile (see `mainloop.mma_k_tiles`)."""
        return None

    def epilogue_begin(self, ctx, item) -> None:
        pass

    def epilogue_visit(self, ctx, item, tile, subtile: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no epilogue")

    def epilogue_reduce(self, ctx, item, tile, subtile: int) -> None:
        pass

    def epilogue_end(self, ctx, item, tile) -> None:
        pass

    # Consumer helpers.

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

    def _epilogue_outputs(self, ctx, thr_r2s, stored_smem, stored):
        """The stored outputs (`StoredOutput`) as `_store_subtile` takes them, before their
        store views; `ctx.registers` lists their float32 registers."""
        ctx.registers = [cute.make_rmem_tensor(ctx.sub_shape, Float32) for _ in stored]
        ctx.sub_values = cute.size(ctx.registers[0])  # 2 rows x epi_n / 4 columns
        return [
            StoredOutput(rF, cute.make_rmem_tensor(ctx.sub_shape, self.out_dtype), thr_r2s.partition_D(smem), tma,
                         tensor, smem)
            for rF, smem, (tma, tensor) in zip(ctx.registers, stored_smem, stored)
        ]

    def _epilogue_input_copies(self, ctx, c_pipeline, tiled_copy_c, sC, ctid: Int32) -> None:
        """ctx.epilogue_input (`EpilogueInput`), in the layout of the accumulator fragment
        (value v of a subtile is accumulator value s v + v), and ctx.input_registers, its
        float32 registers, which hold the subtile's input when `epilogue_visit` runs. Both
        None without an epilogue input."""
        if self.epilogue_input is None:
            return
        tiled_s2r = cute.make_tiled_copy_S(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), self.c_dtype), tiled_copy_c
        )
        thr_s2r = tiled_s2r.get_slice(ctid)
        tSR_sC = thr_s2r.partition_S(sC)
        tRS_rC = cute.make_rmem_tensor(ctx.sub_shape, self.c_dtype)
        tSR_rC = thr_s2r.retile(tRS_rC)
        ctx.input_registers = cute.make_rmem_tensor(ctx.sub_shape, Float32)
        ctx.epilogue_input = EpilogueInput(c_pipeline, tiled_s2r, tSR_sC, tRS_rC, tSR_rC, ctx.input_registers)

    def read_epilogue_input(self, ctx, c_state):
        """The next subtile of the epilogue input into `ctx.input_registers` (float32), its
        buffer handed back to warp 1; returns the advanced ring state. With
        `epilogue_input_fenced`, a proxy fence between the read and the release."""
        source = ctx.epilogue_input
        source.pipeline.consumer_wait(c_state)
        cute.copy(source.copy, source.partition[None, None, None, c_state.index], source.values_view)
        if self.epilogue_input_fenced:
            cute.arch.fence_proxy("async.shared", space="cta")
        source.pipeline.consumer_release(c_state)
        c_state.advance()
        source.registers.store(source.values.load().to(Float32))
        return c_state

    def _epilogue_input_state(self):
        if self.epilogue_input is None:
            return None
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.epilogue_input_stages)

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

    def _consumer_states(self):
        """(read, release) states of the operand ring, both at its start."""
        make = lambda: pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.ab_stages)  # noqa: E731
        return make(), make()

"""What a consumer thread's epilogue hooks receive: typed objects instead of bags of names.

These live only while a kernel is traced (Python objects holding the DSL's values), so they
cost nothing in the compiled code; they name what each hook may read, and where it comes
from.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple


class StoredOutput(NamedTuple):
    """One output the epilogue stores by TMA, subtile by subtile."""

    registers: Any  # this thread's subtile in float32, which the epilogue writes
    rounded: Any  # the same in the output's dtype, which the store rounds into
    partition: Any  # this thread's part of the output's shared buffers (stmatrix)
    tma: Any  # the TMA store atom
    gmem: Any  # the global tensor, or a work item's view of it (`GemmSm90.store_views`)
    smem: Any  # the output's shared buffers


class EpilogueInput(NamedTuple):
    """The epilogue input's subtiles (the fused kernel's preact), read from their ring."""

    pipeline: Any  # the ring warp 1 fills by TMA
    copy: Any  # the ldmatrix tiled copy
    partition: Any  # this thread's part of the ring's buffers
    values: Any  # a subtile's registers in the input's dtype
    values_view: Any  # the same registers as ldmatrix writes them
    registers: Any  # the subtile in float32, as the epilogue reads it


@dataclasses.dataclass(eq=False, slots=True)
class EpilogueContext:
    """A consumer thread's view of the kernel, built once before its walk.

    The wgmma fragment holds value v = c + 2 h + 4 j of the accumulator at column
    8 j + 2 (lane % 4) + c and row `tile_row[h]` of the tile; subtile s of the tile is
    accumulator values [s sub_values, (s + 1) sub_values). A variant with registers of
    its own declares them on a subclass (`GemmSm90.context_type`): slots refuse any other."""

    ctid: Any  # consumer thread 0..255
    warp: Any  # consumer warp 0..7: rows [16 warp, 16 warp + 16) of the tile
    lane: Any
    tiled_mma: Any
    tCrA: Any  # the warpgroup's wgmma fragments of the operand ring
    tCrB: Any
    tCcAcc: Any  # the (row, column) in the tile of each accumulator value of this thread
    acc: Any  # the float32 accumulator
    ab_pipeline: Any  # the operand ring
    tiled_r2s: Any  # the register-to-shared store copy of the outputs
    sub_shape: Any  # a subtile's register shape
    params: Any  # the variant's kernel_params, by name
    scratch: Any  # the variant's shared scratch buffer (`epilogue_scratch`), or None
    outputs: list[StoredOutput] = dataclasses.field(default_factory=list)
    registers: list = dataclasses.field(default_factory=list)  # each output's float32 subtile
    sub_values: int = 0  # accumulator values per subtile (2 rows x epi_n / 4 columns)
    epilogue_input: EpilogueInput | None = None
    input_registers: Any = None  # the epilogue input's subtile in float32, when epilogue_visit runs
    store_pipeline: Any = None
    tile_row: list = dataclasses.field(default_factory=list)  # this thread's two rows of the tile
    # The wgmma over half the tile's columns (`promoted_mainloop.ColumnHalves`), for an FP8
    # variant whose promotion goes by column halves (its `mainloop_setup`), else None.
    column_halves: Any = None
    # The staged inputs' shared rings (`GemmSm90.staged_inputs`), (elements, 1, stages) each.
    staged: list = dataclasses.field(default_factory=list)

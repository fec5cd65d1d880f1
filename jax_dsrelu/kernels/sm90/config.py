"""Tile configurations of the SM90 kernel family, their constraints, and the rules that pick them.

Every measured choice of the rules (tile widths, k-tile depths, stages, store buffers,
cluster pairs, the contraction's walk) is read from `tuning.DECISIONS`, which holds each
with the measurements that decided it; the comments here say why the rules have the shape
they have. Imports no CuTe DSL: backend choice asks `cannot_implement` without loading the
kernel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, ClassVar

import numpy as np

from jax_dsrelu.kernels.request import RaggedContractRequest, RaggedMatmulRequest, Request
from jax_dsrelu.kernels.sm90 import tuning
from jax_dsrelu.quantization.schema import E4M3, FP8_BLOCKWISE

# Largest expert count: the per-CTA expert tables (two int32 prefix sums of E + 1 entries)
# live in shared memory next to the pipelines, and one warp builds them in E / 32 steps.
MAX_EXPERTS = 512
# Usable shared memory per CTA on sm_90 (227 KiB), as the driver grants it with the opt-in.
SMEM_CAPACITY = 232_448
# Rows per work tile: two consumer warpgroups of 64 rows each (wgmma's M is 64).
TILE_M = 128
# Every shared buffer starts 1024-byte aligned (the swizzled layouts' requirement).
_SMEM_ALIGN = 1024
_SIXTEEN_BIT = (np.dtype("bfloat16"), np.dtype("float16"))
FP8 = E4M3
# The FP8 recipe's scale block along K and N: a k-tile is one block, so each k-tile's
# partial sum is promoted with one pair of scales.
BLOCK = FP8_BLOCKWISE.promotion
# The FP8 ragged GEMM's N tile of one and a half scale blocks: it spans at most two N
# blocks of the weight (it starts at a block's edge or half way), and its 96 accumulator
# values a thread, with a partial-sum buffer as large, fit the consumers' registers.
WIDE_TILE_N = 192
# H100 and H200 SXM have 132 multiprocessors; used when no GPU is visible at lowering.
DEFAULT_SM_COUNT = 132
# Columns per epilogue subtile, the same in every kernel of the family.
_EPI_N = tuning.value("subtile_columns")


def _check_tile(config, positive: tuple[str, ...]) -> None:
    """The checks every config of the family shares: the tile shape the cooperative
    consumers and wgmma allow, a pipeline deep enough to overlap loads and wgmma, and
    positive counts."""
    if config.tile_m != TILE_M:
        raise ValueError(f"tile_m must be {TILE_M} (two 64-row consumer warpgroups), got {config.tile_m}")
    if config.tile_n not in (64, 128, 192, 256):
        raise ValueError(f"tile_n must be 64, 128, 192 or 256 (a wgmma N), got {config.tile_n}")
    if config.operand_bytes not in (1, 2):
        raise ValueError(f"operand_bytes must be 1 (e4m3) or 2 (bf16, fp16), got {config.operand_bytes}")
    if config.tile_k * config.operand_bytes not in (64, 128):
        raise ValueError(
            f"tile_k must make a 64- or 128-byte swizzle row of {config.operand_bytes}-byte operands "
            f"(32 or 64 of 16 bits, 64 or 128 of 8), got {config.tile_k}"
        )
    if config.cluster_n not in (1, 2):
        raise ValueError(f"cluster_n must be 1 or 2 (CTAs sharing an A tile by multicast), got {config.cluster_n}")
    if config.max_ctas % config.cluster_n:
        raise ValueError(f"max_ctas must be a multiple of cluster_n={config.cluster_n} (whole clusters), got {config.max_ctas}")
    if config.ab_stages < 2:
        raise ValueError(f"ab_stages must be at least 2 to overlap loads and wgmma, got {config.ab_stages}")
    for name in positive:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(config, name)}")


def _check_subtiles(config) -> None:
    # Each thread holds epi_n / 4 columns of a subtile; the dsReLU column reduction
    # scatters them over the 8 row groups of a warp, so it needs at least 8.
    if config.epi_n not in (32, 64) or config.tile_n % config.epi_n:
        raise ValueError(f"epi_n must be 32 or 64 and divide tile_n={config.tile_n}, got {config.epi_n}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelTiles:
    """What every kernel's static configuration holds: output tiles of tile_m x tile_n,
    tile_k of the contraction per operand stage, ab_stages operand stages, stored in
    (tile_m x epi_n) subtiles through store_stages shared buffers, by max_ctas persistent
    CTAs. The consumer mode is cooperative: both consumer warpgroups work on the same
    tile, 64 rows each, and run the epilogue together (docs/sm90.md says why not
    ping-pong). cluster_n CTAs (1 or 2) form
    a cluster along N: they take neighbouring N-tiles of the same rows, and each loads
    half of the shared A tile and multicasts it to both, so A crosses from L2 once per
    cluster. Along M a cluster could span two experts, whose B tiles differ.
    `__post_init__` is the one validity check."""

    tile_n: int  # columns per work tile (the N extent of each wgmma)
    tile_k: int  # k per pipeline stage
    ab_stages: int  # operand (A/B) shared-memory stages
    epi_n: int  # columns per epilogue subtile
    store_stages: int  # output subtile buffers, each a TMA store in flight
    max_ctas: int  # persistent grid size: one CTA per multiprocessor
    tile_m: int = TILE_M
    cluster_n: int = 1  # CTAs per cluster along N, sharing each A tile by multicast
    operand_bytes: int = 2  # bytes per A and B element: 2 (bf16, fp16) or 1 (e4m3)

    # Fields that count something and must be positive, beyond the tile's own.
    counts: ClassVar[tuple[str, ...]] = ("store_stages", "max_ctas")

    def __post_init__(self) -> None:
        _check_tile(self, self.counts)
        _check_subtiles(self)

    @property
    def subtiles(self) -> int:
        return self.tile_n // self.epi_n

    def _shared_bytes(self, num_experts: int, tables: int, other_ring_stages: int, buffers) -> int:
        """The shared-memory struct `gemm_base.GemmSm90._shared_storage` lays out: two
        8-byte barriers per stage of the operand ring and of the variant's other rings,
        `tables` int32 expert tables of E + 1 entries, padded to the first buffer's
        alignment; then the operand ring's A and B buffers (operand_bytes each) and the
        variant's `buffers` (bytes each), each aligned. The compile tier checks it against
        the struct the DSL builds (test_shared_memory_estimate_is_the_kernels_struct)."""
        header = 16 * (self.ab_stages + other_ring_stages) + 4 * tables * (num_experts + 1)
        operands = [self.ab_stages * rows * self.tile_k * self.operand_bytes for rows in (self.tile_m, self.tile_n)]
        return sum(-(-size // _SMEM_ALIGN) * _SMEM_ALIGN for size in [header, *operands, *buffers])

    def _store_bytes(self, out_bytes: int = 2) -> int:
        """One output's ring of store buffers."""
        return self.store_stages * self.tile_m * self.epi_n * out_bytes


def _check_overlap_promotion(config: KernelTiles) -> None:
    """What a config's overlap_promotion asks: block-scaled FP8 operands."""
    if config.overlap_promotion and config.operand_bytes != 1:
        raise ValueError("overlap_promotion=True is for block-scaled FP8 operands (operand_bytes=1)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig(KernelTiles):
    """The fused dsReLU kernel's configuration: the family's, with preact_stages preact
    subtiles in flight; for block-scaled FP8 operands, whether each K block's promotion
    runs beside a wgmma batch, each block's batch split into the tile's two column halves
    (`promoted_mainloop.mma_k_tiles_promoted_in_halves`)."""

    preact_stages: int
    overlap_promotion: bool = False
    counts: ClassVar[tuple[str, ...]] = KernelTiles.counts + ("preact_stages",)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_overlap_promotion(self)

    def smem_bytes(self, num_experts: int, with_act: bool, with_dbias: bool, out_bytes: int = 2) -> int:
        """Shared memory the kernel allocates for this config (16-bit preact, outputs of
        out_bytes): the preact ring, dh's and act's store buffers, and the per-warp column
        partials of the tile (8 consumer warps, float32)."""
        preact = self.preact_stages * self.tile_m * self.epi_n * 2
        buffers = [preact] + [self._store_bytes(out_bytes)] * (2 if with_act else 1)
        if with_dbias:
            buffers.append(8 * self.tile_n * 4)
        return self._shared_bytes(num_experts, 2, self.preact_stages, buffers)

    def check_fits(self, num_experts: int, with_act: bool, with_dbias: bool, out_bytes: int = 2) -> None:
        need = self.smem_bytes(num_experts, with_act, with_dbias, out_bytes)
        if need > SMEM_CAPACITY:
            raise ValueError(
                f"{self} needs {need} bytes of shared memory with E={num_experts}, "
                f"with_act={with_act}, with_dbias={with_dbias}, {out_bytes}-byte outputs; sm_90 has {SMEM_CAPACITY}"
            )


def _blockwise_dsrelu_reason(request: Request) -> str | None:
    """Why the fused kernel on FP8_BLOCKWISE operands (`blockwise_dsrelu_kernel.py`)
    cannot serve `request`, or None. Its dh and act are 16-bit (as the FP8 step stores
    them) or float32."""
    if np.dtype(request.preact_dtype) not in _SIXTEEN_BIT:
        return f"the sm90 kernel needs preact dtype bfloat16 or float16, got {np.dtype(request.preact_dtype).name}"
    return _fp8_reason("fused kernel", request, _SIXTEEN_BIT + (np.dtype(np.float32),))


def _fp8_reason(kernel: str, request, out_dtypes, extents=("n", "k")) -> str | None:
    """What every sm90 kernel on FP8_BLOCKWISE operands asks: e4m3 operands, 1 to
    MAX_EXPERTS experts, the request's `extents` multiples of 16 (16-byte TMA rows of
    e4m3), an output dtype of `out_dtypes`."""
    if np.dtype(request.operand_dtype) != FP8:
        return f"FP8_BLOCKWISE operands (A and B) on sm90 are float8_e4m3fn, got {np.dtype(request.operand_dtype).name}"
    if request.num_experts < 1 or request.num_experts > MAX_EXPERTS:
        return f"the sm90 kernels take 1 to {MAX_EXPERTS} experts, got E={request.num_experts}"
    for name, extent in ((name, getattr(request, name)) for name in extents):
        if extent < 16 or extent % 16:
            return f"the FP8 {kernel} needs {name} to be a positive multiple of 16 (16-byte TMA rows), got {name}={extent}"
    if np.dtype(request.out_dtype) not in out_dtypes:
        names = [np.dtype(dtype).name for dtype in out_dtypes]
        return f"the FP8 {kernel} writes {' or '.join(names)}, got out_dtype={np.dtype(request.out_dtype).name}"
    return None


def max_m_tiles(num_rows: int, num_experts: int, tile_m: int = TILE_M) -> int:
    """Upper bound on the scheduler's expert M-tiles: sum_e ceil(size_e / tile_m).

    With clamped sizes summing to at most num_rows, each expert adds at most one partial
    tile, so the count is at most ceil(num_rows / tile_m) + E. The dbias slot workspace
    has exactly this many rows.
    """
    return math.ceil(num_rows / tile_m) + num_experts


def cannot_implement(request: Request) -> str | None:
    """Why the SM90 kernel cannot serve `request`, or None when it can."""
    if request.block_scaled:
        return "block-scaled (MXFP8) operands need the sm100 backend; the sm90 kernel takes bf16/fp16"
    if request.blockwise_scaled:
        return _blockwise_dsrelu_reason(request)
    for name, dtype in (
        ("grad/weight dtype", request.operand_dtype),
        ("preact dtype", request.preact_dtype),
        ("out_dtype", request.out_dtype),
    ):
        if np.dtype(dtype) not in _SIXTEEN_BIT:
            return f"the sm90 kernel needs {name} bfloat16 or float16, got {np.dtype(dtype).name}"
    if request.num_experts < 1 or request.num_experts > MAX_EXPERTS:
        return f"the sm90 kernel takes 1 to {MAX_EXPERTS} experts, got E={request.num_experts}"
    for name, extent in (("n", request.n), ("k", request.k)):
        # TMA needs every row stride to be a multiple of 16 bytes: 8 elements of 16 bits.
        if extent < 8 or extent % 8:
            return f"the sm90 kernel needs {name} to be a positive multiple of 8 (16-byte TMA rows), got {name}={extent}"
    return None


# The N tiles of the ragged-M GEMM and the contraction, widest first.
_WIDTHS = tuning.value("tile_widths")


def choose_tile_n(n: int, enough_stages: Callable[[int], bool] = lambda tile_n: True) -> int:
    """The N tile of the ragged-M GEMM and the contraction: of the tiles that pad n least,
    the widest; where the two widest both do (n a multiple of 768), the widest only if
    `enough_stages` of it holds (`choose_gemm_config` asks for operand stages); 64 for
    narrow problems. A partial last tile loads and computes columns that are never
    stored, and a wider tile issues wider wgmma (more operand reuse per byte of shared
    memory read), so it wins when the padding and the stages are equal."""
    if n < 128:
        return 64
    least = min(_padded_width(n, tile) for tile in _WIDTHS)
    widest_first = [tile for tile in _WIDTHS if _padded_width(n, tile) == least]
    if widest_first[:2] == list(_WIDTHS[:2]) and not enough_stages(_WIDTHS[0]):
        return _WIDTHS[1]
    return widest_first[0]


def _padded_width(n: int, tile: int) -> int:
    """The columns computed for n with tile-wide N tiles."""
    return -(-n // tile) * tile


def pairs_up(n: int, tile_n: int) -> bool:
    """Whether n's tile_n-wide N-tiles pair up, as clusters of two CTAs along N need."""
    return -(-n // tile_n) % 2 == 0


def most_stages(fits: Callable[[int], bool], fewest: int, most: int = 8) -> int:
    """`fewest` operand stages, or more, up to `most`, while a config with one more fits:
    the operand ring is what the kernels wait on, so every byte of shared memory left
    over goes to it. `fewest` itself is not checked: the family's smallest configs fit
    at every supported expert count (tests/test_sm90_gemms.py checks the chosen ones at
    E = MAX_EXPERTS)."""
    stages = fewest
    while stages < most and fits(stages + 1):
        stages += 1
    return stages


_DSRELU_NARROW_TILE_COST = tuning.value("fused_narrow_tile_cost")
_DSRELU_192_COLUMNS = tuning.value("fused_tile_192")
_DSRELU_PREACT_STAGES, _DSRELU_FEWER_PREACT_STAGES = tuning.value("fused_preact_stages")
# The fused kernel and the ragged-M GEMM share their k-tile depth.
_RAGGED_M_TILE_K = tuning.value("tile_k")


def dsrelu_tile_n(n: int) -> int:
    """The fused kernel's N tile: 64 below n = 128, 128 below n = 256; from n = 256, 256
    unless its padded width exceeds the 128-wide tiles' by the narrow-tile cost, and 192
    where that computes enough fewer columns than this choice between 256 and 128, or as
    many as a 256-wide choice (the decisions `fused_narrow_tile_cost`, `fused_tile_192`).

    Unlike the ragged-M GEMM's, the fused kernel's tile is not the least padding: its
    epilogue holds a preact ring and two outputs' buffers beside the operands, so a
    narrower tile gets few more operand stages, and a wide tile's operand reuse pays for
    some padding. Below n = 256 a single 256-wide tile would cover the output; the GPU
    tier checks no such width, so those keep 128."""
    if n < 128:
        return 64
    if n < 256:
        return 128
    wide = 256 if _padded_width(n, 256) < _DSRELU_NARROW_TILE_COST * _padded_width(n, 128) else 128
    narrower = _padded_width(n, 192) <= _DSRELU_192_COLUMNS * _padded_width(n, wide)
    as_many_as_256 = wide == 256 and _padded_width(n, 192) == _padded_width(n, 256)
    return 192 if narrower or as_many_as_256 else wide


def choose_config(request: Request, sm_count: int = DEFAULT_SM_COUNT) -> TileConfig:
    """The fused kernel's configuration for `request`: the N tile of `dsrelu_tile_n`, then
    as many grad/weight stages as shared memory holds beside the larger preact ring, or
    one more beside the smaller where that makes room for it; alone (no cluster launch)."""
    reason = cannot_implement(request)
    if reason is not None:
        raise ValueError(reason)
    facts = (request.num_experts, request.with_act, request.with_dbias, np.dtype(request.out_dtype).itemsize)
    if request.blockwise_scaled:
        return _blockwise_dsrelu_config(request, facts, sm_count)
    base = dict(tile_n=dsrelu_tile_n(request.n), tile_k=_RAGGED_M_TILE_K, epi_n=_EPI_N,
                store_stages=tuning.value("fused_store_stages"), cluster_n=tuning.value("fused_cluster"),
                max_ctas=sm_count)
    return _with_most_operand_stages(base, facts, fewer_preact=True)


def _blockwise_dsrelu_config(request: Request, facts, sm_count: int) -> TileConfig:
    """The FP8 fused kernel's configuration: the FP8 GEMM's k-tiles of one scale block and
    N tiles of at most one (`_blockwise_gemm_config`), then the operand stages of the
    16-bit kernel's rule where decision `fp8_fused_fewer_preact` takes it, else those that
    fit beside the larger preact ring; alone."""
    base = dict(tile_n=fp8_tile_n(request.n), tile_k=BLOCK, epi_n=_EPI_N, operand_bytes=1,
                store_stages=tuning.value("fused_store_stages"), cluster_n=1, max_ctas=sm_count,
                overlap_promotion=tuning.value("fp8_fused_overlap_promotion"))
    return _with_most_operand_stages(base, facts, fewer_preact=tuning.value("fp8_fused_fewer_preact"))


def _with_most_operand_stages(base: dict, facts, fewer_preact: bool) -> TileConfig:
    """`base` with as many operand stages as shared memory holds beside the larger preact
    ring, or, with fewer_preact, one more beside the smaller where that makes room for it."""
    def with_most_stages(preact_stages):
        fields = dict(base, preact_stages=preact_stages)
        fits = lambda stages: TileConfig(ab_stages=stages, **fields).smem_bytes(*facts) <= SMEM_CAPACITY  # noqa: E731
        return TileConfig(ab_stages=most_stages(fits, 2), **fields)

    config = with_most_stages(_DSRELU_PREACT_STAGES)
    if fewer_preact:
        smaller_ring = with_most_stages(_DSRELU_FEWER_PREACT_STAGES)
        if smaller_ring.ab_stages > config.ab_stages:
            config = smaller_ring
    config.check_fits(*facts)
    return config


# ---------------------------------------------------------------- the grouped-GEMM family


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmConfig(KernelTiles):
    """The ragged-M GEMM's configuration (`ragged_matmul_kernel.py`): the family's; for
    block-scaled FP8 operands, whether each K block's promotion runs beside the next
    block's wgmma (`promoted_mainloop`), with two partial-sum buffers; whether the
    epilogue stages the whole tile, a buffer per subtile (store_stages = subtiles), and
    stores it as one bulk group (`epilogue_store.store_tile`) rather than through a ring
    of store_stages buffers."""

    overlap_promotion: bool = False
    whole_tile_store: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_overlap_promotion(self)
        if self.whole_tile_store and self.store_stages != self.subtiles:
            raise ValueError(f"whole_tile_store=True stores a buffer per subtile: store_stages must be the tile's "
                             f"{self.subtiles} subtiles, got {self.store_stages}")

    def smem_bytes(self, num_experts: int, outputs: int) -> int:
        """Shared memory for this config with `outputs` 16-bit output tensors."""
        return self._shared_bytes(num_experts, 2, 0, [self._store_bytes()] * outputs)

    def request_bytes(self, request: RaggedMatmulRequest) -> int:
        """Shared memory for this config serving `request`."""
        return self.smem_bytes(request.num_experts, stored_outputs(request))

    def check_fits(self, request: RaggedMatmulRequest) -> None:
        _check_capacity(self, self.request_bytes(request), request)


def stored_outputs(request: RaggedMatmulRequest) -> int:
    """The 16-bit tensors a ragged-M kernel stores: h and act after the squared-ReLU
    epilogue that stores act, else one."""
    return 2 if request.epilogue == "srelu" and request.with_act else 1


def _check_capacity(config, need: int, request) -> None:
    """A config given by the caller must fit in shared memory with the request's tables and
    outputs: else the launch would fail with no word of why."""
    if need > SMEM_CAPACITY:
        raise ValueError(f"config={config} needs {need} bytes of shared memory for {request}; sm_90 has {SMEM_CAPACITY}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContractConfig(KernelTiles):
    """The ragged contraction's configuration (`ragged_contract_kernel.py`): the family's,
    tile_k expert rows per stage, at most a buffer per subtile; an expert's output tiles
    walked a-block fastest (the CTAs in flight share a b-block of rhs) where a_fastest,
    else b-block fastest (they share an a-block of lhs); for block-scaled FP8 operands,
    whether each group's promotion runs beside a wgmma batch, each group's batch split
    into the tile's two column halves
    (`promoted_mainloop.mma_k_tiles_promoted_by_column_in_halves`)."""

    a_fastest: bool = False
    overlap_promotion: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_overlap_promotion(self)
        if self.store_stages > self.subtiles:
            raise ValueError(
                f"store_stages must be at most the tile's {self.subtiles} subtiles (a buffer per "
                f"subtile stores the whole tile at once), got {self.store_stages}"
            )

    def smem_bytes(self, num_experts: int, out_bytes: int) -> int:
        """Shared memory for this config with an output of `out_bytes` per element; its
        tables are row_start, tile_start and the expert order. On FP8 operands each stage
        also holds its k-tile's float32 scales of the tile's rows and of its columns
        (`BlockScaledContractSm90.staged_inputs`), a buffer each."""
        staged = [self.ab_stages * rows * 4 for rows in (self.tile_m, self.tile_n)] if self.operand_bytes == 1 else []
        return self._shared_bytes(num_experts, 3, 0, [self._store_bytes(out_bytes), *staged])

    def request_bytes(self, request: RaggedContractRequest) -> int:
        """Shared memory for this config serving `request`."""
        return self.smem_bytes(request.num_experts, np.dtype(request.out_dtype).itemsize)

    def check_fits(self, request: RaggedContractRequest) -> None:
        _check_capacity(self, self.request_bytes(request), request)


def _reason(kernel: str, num_experts: int, operand_dtype, out_dtype, out_dtypes, **extents: int) -> str | None:
    """Why the sm90 `kernel` cannot take these operands and extents, or None."""
    if np.dtype(operand_dtype) not in _SIXTEEN_BIT:
        return f"the sm90 kernels need bfloat16 or float16 operands, got {np.dtype(operand_dtype).name}"
    if num_experts < 1 or num_experts > MAX_EXPERTS:
        return f"the sm90 kernels take 1 to {MAX_EXPERTS} experts, got E={num_experts}"
    for name, extent in extents.items():
        if extent < 8 or extent % 8:
            return f"the sm90 kernels need {name} to be a positive multiple of 8 (16-byte TMA rows), got {name}={extent}"
    if np.dtype(out_dtype) not in out_dtypes:
        names = [np.dtype(dtype).name for dtype in out_dtypes]
        return f"the sm90 {kernel} writes {', '.join(names[:-1])} or {names[-1]}, got out_dtype={np.dtype(out_dtype).name}"
    return None


def cannot_implement_gemm(request: RaggedMatmulRequest) -> str | None:
    """Why the ragged-M GEMM cannot serve `request`, or None when it can."""
    if request.rhs_layout not in ("kn", "nk"):
        return f"rhs_layout must be 'kn' or 'nk', got {request.rhs_layout!r}"
    if request.epilogue not in ("none", "srelu"):
        return f"the sm90 ragged GEMM has epilogues 'none' and 'srelu', got {request.epilogue!r}"
    if request.block_scaled:
        return _blockwise_reason(request)
    return _reason("ragged GEMM", request.num_experts, request.operand_dtype, request.out_dtype, _SIXTEEN_BIT,
                   n=request.n, k=request.k)


def _blockwise_reason(request: RaggedMatmulRequest) -> str | None:
    """Why the blockwise-scaled FP8 ragged-M GEMM (`blockwise_matmul_kernel.py`) cannot
    serve `request`, or None."""
    if request.rhs_layout != "nk":
        # Hopper's FP8 wgmma reads both operands K-major from shared memory.
        return f"block-scaled FP8 needs rhs stored K-major, rhs_layout 'nk', got {request.rhs_layout!r}"
    return _fp8_reason("ragged GEMM", request, _SIXTEEN_BIT)


def cannot_implement_contract(request: RaggedContractRequest) -> str | None:
    """Why the ragged contraction cannot serve `request`, or None when it can."""
    out_dtypes = (np.dtype(np.float32),) + _SIXTEEN_BIT
    if request.block_scaled:
        return _fp8_reason("ragged contraction", request, out_dtypes, extents=("a", "b"))
    return _reason("ragged contraction", request.num_experts, request.operand_dtype, request.out_dtype,
                   out_dtypes, a=request.a, b=request.b)


def choose_gemm_config(request: RaggedMatmulRequest, sm_count: int = DEFAULT_SM_COUNT) -> GemmConfig:
    """The ragged-M GEMM's configuration: the N tile of `choose_tile_n` (where the two
    widest pad alike, the widest only with enough operand stages: beside two outputs'
    store buffers the expert tables decide it), cluster pairs for the plain GEMM from
    the decision's k where its N-tiles pair up, then as many stages as shared memory holds.

    Pairs share each A tile by multicast, which pays where the k loop is long enough for
    the saved L2 traffic to outweigh the cluster's lock-step; the up-projection's two
    outputs of epilogue leave it nothing to gain (decision `gemm_pairs`)."""
    reason = cannot_implement_gemm(request)
    if reason is not None:
        raise ValueError(reason)
    outputs = stored_outputs(request)
    if request.block_scaled:
        return _blockwise_gemm_config(request, sm_count)

    def with_most_stages(tile_n, cluster_n=1, outputs=outputs):
        base = dict(tile_n=tile_n, tile_k=_RAGGED_M_TILE_K, epi_n=_EPI_N,
                    store_stages=tuning.value("gemm_store_stages"), cluster_n=cluster_n,
                    max_ctas=sm_count - sm_count % cluster_n)
        fits = lambda stages: GemmConfig(ab_stages=stages, **base).smem_bytes(request.num_experts, outputs) <= SMEM_CAPACITY  # noqa: E731
        return GemmConfig(ab_stages=most_stages(fits, 2), **base)

    enough = tuning.value("gemm_enough_stages")
    # The up-projection storing h alone takes the tile width the one storing act beside it
    # takes, so that the backward making h again (`expert_mlp.preactivation`) runs the
    # forward's wgmma shapes; the stages it frees are its own.
    tile_outputs = stored_outputs(dataclasses.replace(request, with_act=True))
    tile_n = choose_tile_n(request.n, lambda tile: with_most_stages(tile, outputs=tile_outputs).ab_stages >= enough)
    pairs = request.epilogue == "none" and request.k >= tuning.value("gemm_pairs") and pairs_up(request.n, tile_n)
    return with_most_stages(tile_n, 2 if pairs else 1)


def _blockwise_gemm_config(request: RaggedMatmulRequest, sm_count: int) -> GemmConfig:
    """The FP8 ragged-M GEMM's configuration: k-tiles of one scale block (128 of K, a
    128-byte row), N tiles of at most one scale block (128 columns, 64 below n = 128),
    so that a tile's k-tile has one weight scale; alone, or in pairs along N where its
    N-tiles pair up and decision `fp8_gemm_pairs` takes them; as many stages as fit; the plain
    GEMM's promotion beside the next K block's wgmma (decision `fp8_overlap_promotion`), and
    the up-projection's storing h alone where k is deep enough (`fp8_up_overlap_min_k`, under
    the same decision): with act beside h it would spill. That up-projection takes N tiles of
    192 columns, promoted in column halves, where they pad little (decision `fp8_up_wide_tiles`).
    The plain GEMM stores whole tiles where that costs no operand stage (`fp8_gemm_whole_tile`)."""
    h_alone = request.epilogue == "srelu" and not request.with_act
    overlap = request.epilogue == "none" or (h_alone and request.k >= tuning.value("fp8_up_overlap_min_k"))
    tile_n = fp8_tile_n(request.n)
    if h_alone and overlap and tuning.value("fp8_up_wide_tiles") and _wide_fp8_tiles_pad_little(request.n):
        tile_n = WIDE_TILE_N  # promoted in column halves (`BlockScaledMainloop.promotes_in_halves`)
    cluster_n = 2 if tuning.value("fp8_gemm_pairs") and pairs_up(request.n, tile_n) else 1
    base = dict(tile_n=tile_n, tile_k=BLOCK, epi_n=_EPI_N, operand_bytes=1, store_stages=tuning.value("gemm_store_stages"),
                cluster_n=cluster_n, max_ctas=sm_count - sm_count % cluster_n,
                overlap_promotion=overlap and tuning.value("fp8_overlap_promotion"))
    ring = with_most_gemm_stages(GemmConfig(ab_stages=2, **base), request)
    if request.epilogue != "none" or not tuning.value("fp8_gemm_whole_tile"):
        return ring
    # Whole tiles where their buffers cost no operand stage, as measured (at k = 1856 with a stage
    # fewer, 512 experts' tables beside them, ptxas spilled).
    whole = with_most_gemm_stages(dataclasses.replace(ring, store_stages=ring.subtiles, whole_tile_store=True), request)
    return whole if whole.ab_stages >= ring.ab_stages else ring


def fp8_tile_n(n: int) -> int:
    """The FP8 kernels' N tile of at most one scale block, so that a k-tile has one weight
    scale: 128 columns, 64 below n = 128."""
    return 64 if n < BLOCK else BLOCK


def _wide_fp8_tiles_pad_little(n: int) -> bool:
    """Whether N tiles of WIDE_TILE_N columns compute at most 1/32 more columns than
    128-column ones (n = 1856: as many; 2048: 1/32 more, where they were measured to pay)."""
    return n >= WIDE_TILE_N and 32 * _padded_width(n, WIDE_TILE_N) <= 33 * _padded_width(n, BLOCK)


def with_most_gemm_stages(config: GemmConfig, request: RaggedMatmulRequest) -> GemmConfig:
    """`config` with as many operand stages (at least 2) as shared memory holds beside what
    it keeps for `request`: the rules' last step, and what a config they did not choose
    (another tile width) takes."""
    fits = lambda stages: dataclasses.replace(config, ab_stages=stages).request_bytes(request) <= SMEM_CAPACITY  # noqa: E731
    return dataclasses.replace(config, ab_stages=most_stages(fits, 2))


# The contraction's operand ring: no config of more stages was measured.
_CONTRACT_MAX_STAGES = 8


def choose_contract_config(request: RaggedContractRequest, sm_count: int = DEFAULT_SM_COUNT) -> ContractConfig:
    """128 x choose_tile_n(b) output tiles, alone, `contract_tile_k` expert rows per stage;
    a shared buffer for every subtile of a tile (the whole tile stored at once, two
    barriers per tile) if that leaves the decision's rows of operands in flight, else a
    ring of store buffers; then as many operand stages as fit.

    Shallow stages because with ragged experts every expert's last k-tile is partly
    empty. The rows per expert (m / E) do not enter: persistent CTAs keep the operand
    pipeline running across work items, so short experts pay no pipeline fill. The walk
    takes the smaller operand's blocks fastest (decision `contract_walk`): each wave of
    CTAs reads that side's whole slice of the expert again.
    """
    reason = cannot_implement_contract(request)
    if reason is not None:
        raise ValueError(reason)
    out_bytes = np.dtype(request.out_dtype).itemsize
    tile_k = tuning.value("contract_tile_k")
    base = dict(tile_n=choose_tile_n(request.b), tile_k=tile_k, epi_n=_EPI_N, max_ctas=sm_count,
                cluster_n=tuning.value("contract_cluster"),
                a_fastest=tuning.value("contract_walk") and request.a < request.b)
    if request.block_scaled:
        # FP8: a k-tile is one group of 128 rows, whose scales it multiplies; N tiles of
        # at most 128 columns, since each thread holds a scale per column of its
        # accumulator beside the group's partial sum; alone, as the FP8 GEMM runs.
        # Each group's promotion beside the wgmma batch of the tile's other column half, or
        # between the batches (decision `fp8_contract_overlap_promotion`).
        tile_k = BLOCK
        base.update(tile_n=fp8_tile_n(request.b), tile_k=tile_k, operand_bytes=1, cluster_n=1,
                    overlap_promotion=tuning.value("fp8_contract_overlap_promotion"))
    subtiles = base["tile_n"] // base["epi_n"]

    def fits(ab_stages, store_stages):
        config = ContractConfig(ab_stages=ab_stages, store_stages=store_stages, **base)
        return config.smem_bytes(request.num_experts, out_bytes) <= SMEM_CAPACITY

    def stages_beside(store_stages):
        return most_stages(lambda stages: fits(stages, store_stages), 1, _CONTRACT_MAX_STAGES)

    whole_tile_stages = stages_beside(subtiles)
    if whole_tile_stages * tile_k >= tuning.value("contract_whole_tile"):
        return ContractConfig(ab_stages=whole_tile_stages, store_stages=subtiles, **base)
    store_stages = 2
    ab_stages = stages_beside(store_stages)
    while store_stages < subtiles and fits(ab_stages, store_stages + 1):
        store_stages += 1
    return ContractConfig(ab_stages=ab_stages, store_stages=store_stages, **base)

"""The ragged contraction on FP8_BLOCKWISE operands (the FP8 recipe's dW1 and dW2): the
block-scaled `ragged_contract`, its XLA reference, the sm90 kernel's K-major layout, its
compile tier and GPU tier.

Operands: lhs (m, a) and rhs (m, b) e4m3, quantized in groups of 128 rows that restart
at each expert (`quantization.ragged`), scales (G, a) and (G, b). Kernel:
`kernels/sm90/blockwise_contract_kernel.py` on K-major copies in which each group has 128
rows of its own (`kernels/sm90/contract_layout.py`).

CPU: the XLA reference against float64 of the represented values; the kernel's plan (the
padded layout, k-tile t of an expert reading group first_row / 128 + t, the scales
multiplied per row and column) emulated in float64 from the layout the call builds; the
bound shown to reject a scale from the wrong group, a dropped group, another expert's rows;
refusals. Compile tier: compiles for sm_90a into e4m3 wgmma with no spills and no
serialized wgmma, its shared memory as estimated, lowered for cuda, its
buffers bound in their declared order. GPU tier: against float64 and the emulated plan,
outputs NaN-filled first, ragged, empty and past-m groups, experts of fewer rows than a
group, 1 to 256 experts; the same bits on every run.
"""

from __future__ import annotations

import dataclasses
import functools
import os

# Before anything imports CuTe DSL: on a machine without a GPU it cannot detect one.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from contract_numpy import expert_rows  # noqa: E402
from jax_dsrelu.kernels.request import RaggedContractRequest  # noqa: E402
from jax_dsrelu.primitives.ragged_contract import ragged_contract  # noqa: E402
from jax_dsrelu.quantization import ragged  # noqa: E402
from jax_dsrelu.quantization.schema import E4M3, FP8_BLOCKWISE  # noqa: E402
from kernel_cases import dirichlet_sizes  # noqa: E402

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)
GROUP = FP8_BLOCKWISE.activations.block[1]
# As tests/test_sm90_fp8.py derives them: Hopper's FP8 wgmma truncates a group's sum of
# |products| at most 16 times at 2^-13 (a step per 8 products of the group's 128 rows), the
# promotion adds the groups in float32 (2^-23 each, twice the unit roundoff for margin),
# then one rounding to the output (2^-24 float32, 2^-8 bfloat16) and its subnormal step.
_FP8_GROUP_UNIT = 16 * 2.0**-13
_F32_UNIT = 2.0**-23
_OUT_UNIT = {F32: (2.0**-24, 2.0**-149), BF16: (2.0**-8, 2.0**-133)}

# name: ((E, a, b), m, group sizes or None for Dirichlet sizes, out dtype)
GROUPINGS = {
    # Empty experts, one of 1 row, partial last groups, rows past every expert's.
    "ragged_with_empty": ((8, 256, 320), 3000, [0, 700, 1, 0, 1100, 129, 900, 0], F32),
    "past_m": ((8, 256, 320), 2000, [900, 800, 700, 0, 0, 0, 0, 5], BF16),
    "short_of_m": ((4, 128, 192), 1500, [500, 0, 300, 3], F32),
    "no_rows": ((8, 256, 320), 0, [0] * 8, F32),
    # Every expert fewer rows than a group.
    "fewer_rows_than_a_group": ((16, 128, 256), 700, [1, 0, 127, 5, 64, 100, 3, 0, 90, 2, 77, 33, 0, 120, 50, 28],
                                F32),
    "one_expert": ((1, 512, 384), 1500, [1500], BF16),
    "narrow_b": ((4, 384, 48), 1000, [400, 0, 300, 300], F32),
    "experts_256": ((256, 128, 256), 24000, None, BF16),
    # Nemotron-3 Nano's widths: dW1 (d = 2688, f = 1856) with 14.5 blocks of f.
    "nano_widths": ((16, 2688, 1856), 5000, None, BF16),
}


def grouping(name):
    shape, m, sizes, out_dtype = GROUPINGS[name]
    return shape, m, dirichlet_sizes(m, shape[0], seed=5) if sizes is None else sizes, out_dtype


def request_for(shape, out_dtype) -> RaggedContractRequest:
    num_experts, a, b = shape
    return RaggedContractRequest(num_experts=num_experts, a=a, b=b, operand_dtype=E4M3, out_dtype=out_dtype,
                                 block_scaled=True)


def quantized(rng, m, width, sizes):
    """(values, scales) of rows whose magnitudes span 2^-6 .. 2^6 from row to row (so that
    every group's scales differ), and their float64 dequantized values."""
    rows = rng.standard_normal((m, width)) * np.exp2(rng.uniform(-6, 6, (m, 1)))
    q = ragged.quantize_ragged_rows(jnp.asarray(rows, jnp.float32), jnp.asarray(sizes, jnp.int32),
                                    FP8_BLOCKWISE.activations)
    return (q.values, q.scales), np.asarray(ragged.dequantize_ragged_rows(q), np.float64)


def operands(name, seed=0):
    (num_experts, a, b), m, sizes, out_dtype = grouping(name)
    rng = np.random.default_rng(seed)
    (lhs, lhs_scale), lhs64 = quantized(rng, m, a, sizes)
    (rhs, rhs_scale), rhs64 = quantized(rng, m, b, sizes)
    named = dict(lhs=lhs, rhs=rhs, group_sizes=jnp.asarray(sizes, jnp.int32), lhs_scale=lhs_scale,
                 rhs_scale=rhs_scale)
    return named, (lhs64, rhs64), sizes, out_dtype


def reference(lhs64, rhs64, sizes, num_experts):
    """float64 (out (E, a, b), |lhs|^T |rhs|) over each expert's rows."""
    a, b = lhs64.shape[1], rhs64.shape[1]
    ref, abs_dot = np.zeros((num_experts, a, b)), np.zeros((num_experts, a, b))
    for e, (start, end) in enumerate(expert_rows(sizes, lhs64.shape[0])):
        ref[e] = lhs64[start:end].T @ rhs64[start:end]
        abs_dot[e] = np.abs(lhs64[start:end]).T @ np.abs(rhs64[start:end])
    return ref, abs_dot


def check_against(out, ref, abs_dot, sizes, num_rows, what="float64"):
    """Per entry: the FP8 accumulation within each group, the float32 promotion over the
    expert's groups, one rounding to the output dtype."""
    got = np.asarray(out, np.float64)
    assert np.isfinite(got).all(), "an output element was not written (NaN poison left)"
    unit, subnormal = _OUT_UNIT[np.dtype(out.dtype)]
    group_counts = np.array([-(-(end - start) // GROUP) for start, end in expert_rows(sizes, num_rows)])[:, None, None]
    bound = (_FP8_GROUP_UNIT + (group_counts + 1) * _F32_UNIT) * abs_dot * (1 + unit) + unit * np.abs(ref) + subnormal
    excess = np.abs(got - ref) - bound
    assert (excess <= 0).all(), f"against {what}: worst excess {excess.max()} at {np.unravel_index(np.argmax(excess), excess.shape)}"


def xla_copy(values, group_sizes):
    """The K-major copy by XLA: rows gathered through `ragged.padded_sources` (empty places
    0), transposed."""
    return ragged.gather_padded(values, ragged.padded_sources(group_sizes, values.shape[0], 128)).T


def emulated_plan(named, num_experts):
    """The kernel's arithmetic in float64 on the layout its call builds: expert by expert,
    k-tile t at padded row r0 + 128 t reads group r0 / 128 + t, its product of e4m3 values
    times the group's row scales and column scales, added group after group."""
    lhs_t, rhs_t = (np.asarray(xla_copy(named[k], named["group_sizes"]), np.float64) for k in ("lhs", "rhs"))
    lhs_scale, rhs_scale = (np.asarray(named[k], np.float64) for k in ("lhs_scale", "rhs_scale"))
    # Each expert's rows, clamped to m, rounded up to whole groups.
    ends = np.minimum(np.cumsum(np.clip(np.asarray(named["group_sizes"], np.int64), 0, None)), named["lhs"].shape[0])
    padded_sizes = -(-np.diff(ends, prepend=0) // GROUP) * GROUP
    out = np.zeros((num_experts, lhs_t.shape[0], rhs_t.shape[0]))
    first = 0
    for e, size in enumerate(padded_sizes.tolist()):
        for t in range(size // GROUP):
            rows = slice(first + t * GROUP, first + (t + 1) * GROUP)
            group = first // GROUP + t
            out[e] += (lhs_t[:, rows] @ rhs_t[:, rows].T) * lhs_scale[group][:, None] * rhs_scale[group][None, :]
        first += size
    assert first <= lhs_t.shape[1]
    return out


# ---------------------------------------------------------------------------- CPU


def test_padded_sources_give_each_group_its_own_128_rows():
    sizes = [3, 0, 130, 5]
    # The layout's places, each holding the row that lands there, 140 (none) where empty.
    sources = np.asarray(ragged.padded_sources(jnp.asarray(sizes, jnp.int32), 140, GROUP))
    assert sources.shape == (GROUP * ragged.max_groups(140, 4, GROUP),)
    assert np.array_equal(np.sort(sources[sources < 140]), np.arange(140))  # every row at one place
    positions = np.argsort(sources, kind="stable")[:140]  # where each row lies
    expected = [0, 1, 2] + list(range(128, 258)) + [384, 385, 386, 387, 388] + [512, 513]
    assert positions.tolist() == expected
    assert (np.delete(sources, positions) == 140).all()


def test_the_fp8_weight_gradients_operands_are_made_without_a_scatter():
    """A scatter of every element into its group (a max, or a move into the padded layout)
    contends on the GPU's atomics; the quantizer and the K-major copies gather instead."""
    from jax_dsrelu.kernels.sm90 import contract_layout

    named, _, sizes, _ = operands("ragged_with_empty")
    rows = jax.random.normal(jax.random.key(0), named["lhs"].shape, jnp.float32)
    quantize = lambda x, g: ragged.quantize_ragged_rows(x, g, FP8_BLOCKWISE.activations)  # noqa: E731
    for fn, args in ((quantize, (rows, named["group_sizes"])),
                     (contract_layout.k_major_operands, (named["lhs"], named["rhs"], named["group_sizes"]))):
        assert "scatter" not in jax.jit(fn).lower(*args).as_text()
    # The search finds one where one is written.
    assert "scatter" in jax.jit(lambda x: jnp.zeros_like(x).at[jnp.array([0])].max(x[:1])).lower(rows).as_text()


@pytest.mark.parametrize("name", [name for name in GROUPINGS if name not in ("experts_256", "nano_widths")])
def test_xla_reference_and_the_kernels_plan_are_the_float64_product(name):
    named, (lhs64, rhs64), sizes, out_dtype = operands(name)
    num_experts = len(sizes)
    ref, abs_dot = reference(lhs64, rhs64, sizes, num_experts)
    out = ragged_contract(**named, out_dtype=out_dtype, backend="xla")
    m = lhs64.shape[0]
    check_against(out, ref, abs_dot, sizes, m)
    check_against(jnp.asarray(emulated_plan(named, num_experts), out_dtype), ref, abs_dot, sizes, m, "the plan")


def test_the_bound_rejects_wrong_answers():
    named, (lhs64, rhs64), sizes, _ = operands("ragged_with_empty", seed=3)
    ref, abs_dot = reference(lhs64, rhs64, sizes, len(sizes))
    wrong_group = dict(named, rhs_scale=jnp.roll(named["rhs_scale"], 1, axis=0))  # each group the previous one's
    # Expert 4 owns rows [701, 1801): its groups start at 701, 829, 957, ...
    dropped_group = ref.copy()
    dropped_group[4] -= lhs64[829:957].T @ rhs64[829:957]  # expert 4's second group
    other_expert = ref.copy()
    other_expert[1] = lhs64[701:1801].T @ rhs64[701:1801]  # expert 4's rows for expert 1
    for wrong in (emulated_plan(wrong_group, len(sizes)), dropped_group, other_expert):
        with pytest.raises(AssertionError):
            check_against(jnp.asarray(wrong, F32), ref, abs_dot, sizes, lhs64.shape[0])


def test_block_scaled_contractions_are_refused_by_name():
    named, _, _, _ = operands("short_of_m")
    call = lambda **changed: ragged_contract(**dict(named, **changed), out_dtype=F32, backend="xla")  # noqa: E731
    with pytest.raises(ValueError, match="lhs_scale and rhs_scale come together"):
        call(rhs_scale=None)
    with pytest.raises(ValueError, match=r"lhs_scale must be float32 of shape \(16, 128\)"):
        call(lhs_scale=named["lhs_scale"][:-1])
    with pytest.raises(TypeError, match="block-scaled rhs must be float8_e4m3fn, got rhs.dtype=bfloat16"):
        call(rhs=named["rhs"].astype(BF16))
    with pytest.raises(ValueError, match="read in row order"):
        call(lhs_index=jnp.arange(named["lhs"].shape[0], dtype=jnp.int32))


def test_rows_stay_whole_across_devices():
    # The groups are numbered over all of the rows (`Schema.whole_when`): with the rows
    # split over two devices the call keeps them whole and gives the one-device bits.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    named, _, _, out_dtype = operands("ragged_with_empty")
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    split = NamedSharding(mesh, P("data", None))
    sharded = dict(named, lhs=jax.device_put(named["lhs"], split), rhs=jax.device_put(named["rhs"], split))
    run = jax.jit(lambda o: ragged_contract(**o, out_dtype=out_dtype, backend="auto"))
    assert np.array_equal(np.asarray(run(sharded)), np.asarray(run(named)))


# ---------------------------------------------------------------------------- compile tier


@pytest.mark.compile
@pytest.mark.parametrize("shape, out_dtype", [((128, 2688, 1856), BF16), ((128, 1856, 2688), BF16),
                                              ((8, 4096, 2048), F32), ((256, 768, 2048), BF16),
                                              ((4, 384, 48), F32)], ids=str)
def test_fp8_contraction_compiles_for_sm90a(shape, out_dtype, monkeypatch):
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import config, ragged_call

    built, make = [], ragged_call._kernel
    monkeypatch.setattr(ragged_call, "_kernel", lambda *key: built.append(make(*key)) or built[-1])
    request = request_for(shape, out_dtype)
    chosen = ragged_call.choose_config(request)
    compiled = ragged_call.compile_kernel(request, chosen, keep=True)
    assert "wgmma.mma_async.sync.aligned.m64n" in compiled.ptx and ".f32.e4m3.e4m3" in compiled.ptx
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    # The staged scales are read with ld.shared (the generic proxy) from a stage the producer's
    # next TMA write (the async proxy) reuses: the consumers fence the proxies before releasing
    # it, a fence beside the epilogue's before its TMA store (which alone was there before).
    assert compiled.ptx.count("fence.proxy.async.shared::cta") >= 2
    ptxas.check_assembly(compiled.ptx)
    assert built[-1].shared_storage.size_in_bytes() == chosen.request_bytes(request) <= config.SMEM_CAPACITY


@pytest.mark.compile
@pytest.mark.parametrize("shape, out_dtype", [((128, 1856, 2688), BF16), ((8, 4096, 2048), F32), ((4, 384, 48), F32)],
                         ids=str)
def test_fp8_contraction_with_the_promotion_overlapped_compiles_for_sm90a(shape, out_dtype):
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import ragged_call

    request = request_for(shape, out_dtype)
    config = config_of(request, True)
    compiled = ragged_call.compile_kernel(request, config, keep=True)
    assert f"wgmma.mma_async.sync.aligned.m64n{config.tile_n // 2}k32.f32.e4m3.e4m3" in compiled.ptx
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    # Two half batches per k-tile: half 0 promoted while half 1's runs, then half 1 alone.
    assert compiled.ptx.count("wgmma.commit_group") == 2
    assert all(f"wgmma.wait_group.sync.aligned \t{n};" in compiled.ptx for n in (0, 1))
    ptxas.check_assembly(compiled.ptx)


def test_a_column_slots_offset_is_its_values_column_in_the_fragment():
    """The overlapped promotion makes a column's index from the thread's first column and
    `fragment.column_offset`: value v = c + 2 h + 4 j lies at column 8 j + c past it."""
    from jax_dsrelu.kernels.sm90 import fragment

    for value in range(64):
        assert fragment.column_offset(fragment.column_slot(value)) == 8 * (value // 4) + value % 2


def test_the_rules_keep_128_columns_whichever_promotion_the_table_picks(decide):
    """The promotion by column halves holds the waited one's registers, so the rules keep
    the 128-column tile with either; 16-bit operands have no promotion to overlap."""
    from jax_dsrelu.kernels.sm90 import config

    request = request_for((8, 4096, 2048), F32)
    for overlapped in (False, True):
        decide("fp8_contract_overlap_promotion", overlapped)
        chosen = config.choose_contract_config(request)
        assert (chosen.tile_n, chosen.overlap_promotion) == (128, overlapped)
    sixteen_bit = config.choose_contract_config(
        RaggedContractRequest(num_experts=8, a=4096, b=2048, operand_dtype=BF16, out_dtype=F32))
    with pytest.raises(ValueError, match="overlap_promotion=True is for block-scaled FP8 operands"):
        dataclasses.replace(sixteen_bit, overlap_promotion=True)


@pytest.mark.compile
def test_fp8_contraction_lowers_for_cuda():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from test_operand_binding import unbound_buffers

    from jax_dsrelu.kernels.operands import ROWS
    from jax_dsrelu.kernels.sm90 import contract_layout, ragged_call

    named, _, sizes, out_dtype = operands("ragged_with_empty")
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in named.items()}
    call = jax.jit(lambda o: ragged_contract(**o, out_dtype=out_dtype, backend="sm90"))
    text = call.trace(shapes).lower(lowering_platforms=("cuda",)).as_text()
    plan = ragged_call.operands(request_for((len(sizes), 256, 320), out_dtype))
    counts = {ROWS: contract_layout.padded_rows(named["lhs"].shape[0], len(sizes))}
    # A copy kernel per operand (no transposed gather left to XLA), then the contraction,
    # which reads their results and so comes last.
    assert text.count("stablehlo.custom_call") == 3 and "stablehlo.transpose" not in text
    assert unbound_buffers(plan, counts, text, call=-1) == []


# The K-major copy's kernel (`k_major_copy_kernel.py`), held to XLA's gather and transpose, on
# random bytes (every e4m3 bit pattern, NaNs included): (m, n, group sizes), with empty,
# negative and unowned groups, sums past m, fewer rows than a group, widths that are not
# multiples of 128, and 512 experts.
COPY_CASES = {
    "ragged_with_empty": (1000, 384, [300, 0, 129, 1, 570]),
    "negative_and_past_m": (700, 48, [-5, 300, 0, 500, 128]),
    "unowned_rows": (900, 272, [100, 200, 3]),
    "fewer_rows_than_a_group": (37, 160, [10, 27]),
    "one_expert": (1500, 2688, [1500]),
    "nano_widths": (5000, 1856, None),
    "experts_512": (20000, 128, None),
}


def copy_case(name):
    m, n, sizes = COPY_CASES[name]
    experts = {"nano_widths": 16, "experts_512": 512}.get(name)
    return m, n, dirichlet_sizes(m, experts, seed=3) if sizes is None else sizes


def prebuild_copy_jobs():
    """The copies the GPU tier runs (in place, into a poisoned buffer), for the kernel cache."""
    from jax_dsrelu.kernels.sm90 import contract_layout

    built = sorted({(copy_case(name)[1], len(copy_case(name)[2])) for name in COPY_CASES})
    return [functools.partial(contract_layout.compile_copy_kernel, *case, outputs_in_place=True) for case in built]


@pytest.mark.compile
@pytest.mark.parametrize("n, num_experts", [(4096, 8), (1856, 128), (48, 4)], ids=str)
def test_the_k_major_copy_kernel_compiles_for_sm90a(n, num_experts):
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import contract_layout

    ptx = contract_layout.compile_copy_kernel(n, num_experts, keep=True).ptx
    # 16-byte loads of the rows and stores of the columns' groups; byte reads of the tile.
    for instruction in ("ld.global.v4.b32", "st.shared.v4.b32", "st.global.v4.b32", "ld.shared.b8"):
        assert instruction in ptx, instruction
    assert "ld.local" not in ptx and "st.local" not in ptx
    ptxas.check_assembly(ptx)


# ---------------------------------------------------------------------------- GPU tier


# Groupings whose experts have 1, 2 and many groups, run by column halves too.
OVERLAPPED = ["ragged_with_empty", "past_m", "fewer_rows_than_a_group", "narrow_b", "nano_widths"]
GPU_CASES = [(name, False) for name in GROUPINGS] + [(name, True) for name in OVERLAPPED]


def config_of(request, overlapped: bool):
    """The chosen config with the promotion by column halves or waited, whatever the
    tuning table decides."""
    from jax_dsrelu.kernels.sm90 import ragged_call

    return dataclasses.replace(ragged_call.choose_config(request), overlap_promotion=overlapped)


def prebuild_requests():
    """Every (request, config, outputs_in_place) the GPU tier runs, for the kernel cache."""
    requests = {(request_for(grouping(name)[0], grouping(name)[3]), overlapped) for name, overlapped in GPU_CASES}
    return [(request, config_of(request, overlapped), True) for request, overlapped in sorted(requests, key=repr)]


@pytest.mark.gpu
@pytest.mark.parametrize("name, overlapped", GPU_CASES, ids=[n + ("-overlapped" if o else "") for n, o in GPU_CASES])
def test_fp8_contraction_matches_float64_and_the_plan(hopper, name, overlapped):
    from jax_dsrelu.kernels.sm90 import ragged_call

    named, (lhs64, rhs64), sizes, out_dtype = operands(name)
    request = request_for(grouping(name)[0], out_dtype)
    run = ragged_call.implementation(request, config_of(request, overlapped), outputs_in_place=True)
    filled = {"out": jnp.full((len(sizes), request.a, request.b), jnp.nan, out_dtype)}
    results = [jax.jit(lambda o: run(**o, filled=filled))(named)["out"] for _ in range(3)]
    ref, abs_dot = reference(lhs64, rhs64, sizes, len(sizes))
    check_against(results[0], ref, abs_dot, sizes, lhs64.shape[0])
    check_against(results[0], emulated_plan(named, len(sizes)), abs_dot, sizes, lhs64.shape[0], "the emulated plan")
    for again in results[1:]:
        assert np.array_equal(np.asarray(results[0]), np.asarray(again))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(COPY_CASES))
def test_the_k_major_copy_kernel_is_xlas_copy_byte_for_byte(hopper, name):
    from jax_dsrelu.kernels.sm90 import contract_layout

    m, n, sizes = copy_case(name)
    values = jnp.asarray(np.random.default_rng(7).integers(0, 256, (m, n), dtype=np.uint8))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    count = ragged.max_groups(m, len(sizes), 128)
    want = np.asarray(jax.jit(xla_copy)(values, group_sizes))
    first_rows = ragged.group_first_rows(group_sizes, m, 128)
    copy = jax.jit(lambda v, f, p: contract_layout.copy_by_kernel(v, f, len(sizes), filled=p))
    # Into buffers poisoned two ways: a byte the kernel does not write keeps the poison.
    for poison in (0xA5, 0x5A):
        got = np.asarray(copy(values, first_rows, jnp.full((n, count, 128), poison, jnp.uint8)))
        assert got.shape == want.shape and np.array_equal(got, want), np.argwhere(got != want)[:5]


@pytest.mark.parametrize("name", sorted(COPY_CASES))
def test_the_copy_kernels_arithmetic_is_xlas_copy(name):
    """The kernel's formula (`k_major_copy_kernel.py`: group g's rows [first_rows[g],
    min(first_rows[g + 1], m)) into columns 128 g on, zeros after) in numpy, against XLA's
    copy: the GPU tier above then only has to show the kernel computes its formula."""
    m, n, sizes = copy_case(name)
    values = np.random.default_rng(7).integers(0, 256, (m, n), dtype=np.uint8)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    count = ragged.max_groups(m, len(sizes), 128)
    first_rows = np.asarray(ragged.group_first_rows(group_sizes, m, 128))
    emulated = np.zeros((n, count, 128), np.uint8)
    for group in range(count):
        rows = min(first_rows[group + 1], m) - first_rows[group]
        assert 0 <= rows <= 128
        emulated[:, group, :rows] = values[first_rows[group]:first_rows[group] + rows].T
    want = xla_copy(jnp.asarray(values), group_sizes)
    assert np.array_equal(emulated.reshape(n, -1), np.asarray(want))


def test_the_copy_kernel_refuses_what_it_cannot_copy():
    from jax_dsrelu.kernels.sm90 import contract_layout

    first_rows = jnp.zeros((3,), jnp.int32)
    for shape in ((0, 64), (10, 40), (10, 0)):
        with pytest.raises(ValueError, match=r"m > 0 rows of n > 0 a multiple of 16 bytes, got values.shape="):
            contract_layout.copy_by_kernel(jnp.zeros(shape, jnp.uint8), first_rows, 1)

"""The sm100 layout bridge, checked without a GPU.

`emulate_kernel` computes the contract the way cuDNN's kernel does, from nothing but the
tensors the bridge hands the kernel: padded row segments delimited by `padded_offsets`,
MMA-tiled scale bytes (read back through the tcgen05 atom formula written out here),
cuDNN's deterministic slot layout, and never-written rows poisoned with NaN. Mapped back
through the bridge, the result must equal the XLA reference: a wrong offset, a padding row
leaking into a segment, a mis-tiled scale or a row read from outside a segment shows up as
a wrong or NaN value. The formula itself is checked against CuTe DSL's own layout in
tests/test_sm100_compile.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mx_reference import quantized_inputs

import jax_dsrelu
from jax_dsrelu import groups
from jax_dsrelu.kernels.sm100 import layout
from jax_dsrelu.kernels.sm100.config import CONFIG


def scale_atom_offset(row, col, num_rows, num_cols, expert=0):
    """Byte offset of scale (row, col) of `expert` in the tcgen05 MMA scale layout:
    128x4 atoms of 512 bytes, row r at (r % 32) * 16 + (r // 32 % 4) * 4, column c at c % 4;
    atoms K-fastest, then rows, then experts."""
    row_atoms, col_atoms = -(-num_rows // 128), -(-num_cols // 4)
    atom = (expert * row_atoms + row // 128) * col_atoms + col // 4
    return atom * 512 + (row % 32) * 16 + (row // 32 % 4) * 4 + col % 4


def detile(flat, num_rows, num_cols, num_experts=1) -> np.ndarray:
    bits = np.asarray(jax.lax.bitcast_convert_type(flat, jnp.uint8))
    e, r, c = np.meshgrid(np.arange(num_experts), np.arange(num_rows), np.arange(num_cols), indexing="ij")
    return bits[scale_atom_offset(r, c, num_rows, num_cols, e)]


def dequantize(values, scale_bits) -> np.ndarray:
    factor = np.where(scale_bits == 255, np.nan, np.exp2(scale_bits.astype(np.float64) - 127))
    return np.asarray(values, np.float64) * np.repeat(factor, 32, axis=-1)


def bf16(x) -> np.ndarray:
    return np.asarray(np.asarray(x, np.float32).astype(jnp.bfloat16), np.float64)


def emulate_kernel(ops: layout.KernelOperands, n: int, k: int, out_dtype):
    """cuDNN's kernel and our reduction pass in float64 on the padded operands.

    Returns padded (d, act, dprob) and per-expert (dbias, amax), as the custom call does.
    """
    num_padded = ops.grad.shape[0]
    num_experts = ops.weight.shape[0]
    offsets = np.asarray(ops.padded_offsets)
    np.testing.assert_array_equal(np.asarray(ops.padded_sizes), np.diff(offsets, prepend=0))
    # The kernel's requirements on padded_offsets: nondecreasing multiples of 256 in range.
    assert np.all(offsets % CONFIG.segment_rows == 0) and np.all(np.diff(offsets) >= 0)
    assert offsets[-1] <= num_padded and num_padded % CONFIG.segment_rows == 0

    a = dequantize(ops.grad, detile(ops.grad_scale_tiled, num_padded, k // 32)[0])
    b = dequantize(ops.weight, detile(ops.weight_scale_tiled, n, k // 32, num_experts))
    c = np.maximum(np.asarray(ops.preact, np.float64), 0.0)
    prob = np.asarray(ops.prob, np.float64)
    alpha = np.asarray(ops.alpha, np.float64)

    # Rows no segment covers are never written: NaN, so that reading one fails the test.
    d = np.full((num_padded, n), np.nan)
    act = np.full((num_padded, n), np.nan)
    n_tiles = CONFIG.dprob_slots(n)
    dprob_slots = np.zeros((num_padded, n_tiles))
    dbias_slots = np.zeros((CONFIG.dbias_slots(num_padded), n))
    amax = np.zeros(num_experts)
    start = 0
    for e, end in enumerate(offsets):
        rows = slice(start, end)
        g = alpha[e] * (a[rows] @ b[e].T)
        d[rows] = c[rows] * g * (2.0 * prob[rows, None])
        act[rows] = c[rows] ** 2 * prob[rows, None]
        contributions = c[rows] ** 2 * g
        for t in range(n_tiles):
            dprob_slots[rows, t] = contributions[:, t * 256 : (t + 1) * 256].sum(axis=1)
        for block in range(start // 128, end // 128):  # one slot per CTA M-tile, in bf16
            dbias_slots[block] = bf16(d[block * 128 : (block + 1) * 128].sum(axis=0))
        amax[e] = np.max(np.abs(d[rows]), initial=0.0)
        start = end

    # The reduction pass over the padded row space, with the padded sizes as group sizes.
    dprob = np.where(np.arange(num_padded) < offsets[-1], dprob_slots.sum(axis=1), 0.0)
    starts = np.concatenate([[0], offsets[:-1]])
    dbias = np.stack([dbias_slots[s // 128 : e // 128].sum(axis=0) for s, e in zip(starts, offsets)])
    return d.astype(out_dtype), act.astype(out_dtype), dprob.astype(np.float32), dbias, amax


GROUPINGS = {
    # sizes straddling the 256-row segment and 128-row slot boundaries, with empty experts
    "ragged": [300, 0, 1, 255, 256, 257, 0],
    "short_of_m": [5, 130, 9],  # rows past the total belong to no expert
    "past_m": [500, 700, 40],  # the running total is capped at m
    "negative": [-3, 260, -1, 128],  # negative sizes count as 0
    "one_expert_full": [1200],
}


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("element_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_kernel_view_of_the_bridge_computes_the_reference(grouping, element_dtype):
    sizes = GROUPINGS[grouping]
    num_rows, k, n = 1200, 160, 320  # k/32 = 5 and n/128 = 2.5: partial scale atoms
    rng = np.random.default_rng(len(sizes) * 7 + sum(map(abs, sizes)))
    grad, weight, preact, prob, group_sizes, grad_scale, weight_scale = quantized_inputs(
        rng, num_rows, k, n, sizes, element_dtype
    )
    alpha = jnp.asarray(rng.uniform(0.5, 2.0, len(sizes)), jnp.float32)

    ops, rows = jax.jit(layout.kernel_operands, static_argnums=8)(
        grad, weight, preact, prob, group_sizes, alpha, grad_scale, weight_scale, CONFIG
    )
    assert ops.grad.shape[0] == CONFIG.padded_rows(num_rows, len(sizes))
    d, act, dprob, dbias, amax = emulate_kernel(ops, n, k, jnp.bfloat16)
    emulated = dict(
        dh=np.asarray(layout.caller_rows(jnp.asarray(d), rows), np.float64),
        act=np.asarray(layout.caller_rows(jnp.asarray(act), rows), np.float64),
        dprob=np.asarray(layout.caller_rows(jnp.asarray(dprob), rows), np.float64),
        dbias=dbias,
        amax=amax,
    )

    ref = jax_dsrelu.grouped_gemm_dsrelu(
        grad, weight, preact, prob, group_sizes, alpha=alpha, grad_scale=grad_scale,
        weight_scale=weight_scale, with_dbias=True, with_act=True, backend="xla",
    )
    ref = {name: np.asarray(getattr(ref, name), np.float64) for name in emulated}
    for name, value in emulated.items():
        assert not np.any(np.isnan(value)), f"{name} read a row the kernel never writes"
    # dh and act: float64 against float32, both rounded once to bfloat16: at most one
    # bfloat16 unit apart.
    for name in ("dh", "act"):
        np.testing.assert_allclose(emulated[name], ref[name], rtol=2.0**-7, atol=1e-30, err_msg=name)
    np.testing.assert_allclose(emulated["dprob"], ref["dprob"], rtol=1e-4, atol=1e-3 * np.abs(ref["dprob"]).max())
    np.testing.assert_allclose(emulated["amax"], ref["amax"], rtol=1e-5)
    # dbias: every 128-row partial was rounded to bfloat16 once, as the kernel does; each
    # rounding errs by at most 2^-9 of the partial's absolute sum.
    expert, owned = groups.row_experts(group_sizes, num_rows)
    expert, owned = np.asarray(expert), np.asarray(owned)
    bound = np.stack([np.abs(ref["dh"])[owned & (expert == e)].sum(axis=0) for e in range(len(sizes))])
    assert np.all(np.abs(emulated["dbias"] - ref["dbias"]) <= 2.0**-8 * bound + 1e-6)
    # Exact zeros where the contract says so.
    unowned = np.asarray(rows.padded_rows) == ops.grad.shape[0]
    assert not np.any(emulated["dh"][unowned]) and not np.any(emulated["dprob"][unowned])
    empty = np.asarray(groups.clamped_group_sizes(group_sizes, num_rows)) == 0
    assert not np.any(emulated["dbias"][empty]) and not np.any(emulated["amax"][empty])


def test_padding_reads_nothing_from_the_caller():
    sizes = jnp.asarray([3, 0, 300], jnp.int32)
    rows = layout.row_map(sizes, 400, CONFIG)
    source = np.asarray(rows.source_rows)
    np.testing.assert_array_equal(np.asarray(rows.padded_offsets), [256, 256, 768])
    np.testing.assert_array_equal(source[:3], [0, 1, 2])
    assert np.all(source[3:256] == 400)  # expert 0's padding
    np.testing.assert_array_equal(source[256:556], np.arange(3, 303))
    assert np.all(source[556:] == 400)
    padded = np.asarray(rows.padded_rows)
    np.testing.assert_array_equal(padded[:3], [0, 1, 2])
    np.testing.assert_array_equal(padded[3:303], np.arange(256, 556))
    assert np.all(padded[303:] == source.shape[0])  # rows past the total: no expert


def test_tile_scales_places_every_scale_by_the_atom_formula():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 255, (3, 200, 7), dtype=np.uint8)  # partial atoms both ways
    flat = layout.tile_scales(jnp.asarray(bits))
    assert flat.shape == (3 * 2 * 2 * 512,) and flat.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(detile(flat, 200, 7, 3), bits)
    padding = np.ones(flat.shape, bool)
    e, r, c = np.meshgrid(np.arange(3), np.arange(200), np.arange(7), indexing="ij")
    padding[scale_atom_offset(r, c, 200, 7, e)] = False
    flat_bits = np.asarray(jax.lax.bitcast_convert_type(flat, jnp.uint8))
    assert np.all(flat_bits[padding] == 127)  # unit scales in the padding


def test_bridge_has_no_scatter():
    sizes = GROUPINGS["ragged"]
    args = quantized_inputs(np.random.default_rng(1), 1200, 64, 128, sizes, jnp.float8_e4m3fn)
    alpha = jnp.ones((len(sizes),), jnp.float32)

    def bridge(grad, weight, preact, prob, group_sizes, grad_scale, weight_scale):
        ops, rows = layout.kernel_operands(
            grad, weight, preact, prob, group_sizes, alpha, grad_scale, weight_scale, CONFIG
        )
        return ops, layout.caller_rows(ops.preact, rows)

    hlo = jax.jit(bridge).lower(*args).as_text()
    assert "gather" in hlo and "scatter" not in hlo

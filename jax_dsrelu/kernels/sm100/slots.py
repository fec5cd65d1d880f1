"""cuDNN's deterministic slot layout, handed to the shared fixed-order reduction pass.

In deterministic mode cuDNN's Blackwell kernel writes
- dprob partials to a float32 (M_pad, S_p) buffer: row p of the padded row space, slot t
  the N-tile (256 columns) that produced it; one writer per (p, t);
- dbias partials to a bfloat16 (M_pad / 128, n) buffer: row T the absolute 128-row M-tile
  (`padded_start / 128 + tile`), one writer per (T, column).

`jax_dsrelu.kernels.slot_reduction.SlotReduction` sums (S_p, R) dprob slots over S_p and
(tiles, n) dbias slots over each expert's tiles. In the padded row space, expert e's rows
are the segment of length padded_sizes[e], so passing the padded sizes as group sizes,
M_pad as R and 128 as tile_m makes its tile ranges exactly cuDNN's: T_e = padded_start_e /
128, and ceil(padded_size_e / 128) tiles, exact since segments are multiples of 256. The
dprob slots are the same buffer with its two modes swapped; no copy. Padded rows past the
last segment get dprob 0, and no tile past the last segment is read.

Imports CuTe DSL only (not cuDNN), so the pass can be run and tested on its own.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute


@cute.jit
def reduce_cudnn_slots(
    dprob_acc: cute.Tensor,  # (M_pad, S_p) float32, cuDNN's dprob slots
    dbias_acc: cute.Tensor | None,  # (M_pad / 128, n) bfloat16, cuDNN's dbias slots
    padded_sizes: cute.Tensor,  # (E,) int32, the experts' padded segment lengths
    dprob: cute.Tensor,  # (M_pad,) float32 out
    dbias: cute.Tensor | None,  # (E, n) float32 out
    reduction: cutlass.Constexpr,  # a SlotReduction with tile_m = 128
    stream: cuda.CUstream,
):
    dprob_slots = cute.make_tensor(dprob_acc.iterator, cute.select(dprob_acc.layout, [1, 0]))
    reduction(dprob_slots, dbias_acc, padded_sizes, dprob, dbias, stream)

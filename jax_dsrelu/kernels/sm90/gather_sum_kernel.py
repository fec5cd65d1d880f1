"""The ordered gather-and-sum for Hopper (sm_90a), in CuTe DSL: each token adds its rows.

Math, with index (T, slots) int32 and rows (m, n):

    out[t, j] = rows[i(t, 0), j] + rows[i(t, 1), j] + ... + rows[i(t, slots - 1), j]
                in float32, left to right (slot 0 first, then each next slot added),
                i(t, s) = index[t, s] clamped into [0, m)

It is the MoE layer's combine (each token's top_k expert outputs) and the input gradient
of its dispatch (each token's top_k row gradients): one thread writes each output
element, once, after adding its slots in slot order, so the result is bitwise the same
on every run and equals the sequential sum the XLA reference writes out (its first slot
taken as it is, then one float32 addition per slot). No atomics, no scatter.

Work decomposition: a CTA of 128 threads takes `tokens_per_cta` tokens, `lanes` threads
each; thread l of a token walks the token's 16-byte column chunks l, l + lanes, ... For
each chunk it loads the chunk of every slot's row first (slots independent 16-byte loads
in flight), then adds them in order in float32 and stores the chunk's float32 sums with
16-byte stores. Neighbouring threads take neighbouring chunks of a row, so a warp's loads
and stores are contiguous. The grid is one CTA per `tokens_per_cta` tokens: T varies
from call to call without a recompile.

Constraints (`gather_sum_config.cannot_implement`): rows bfloat16, float16 or float32
with n a positive multiple of 16 bytes' worth of elements; 1 to `MAX_SLOTS` slots (every
slot's chunk is held in registers at once).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32

from jax_dsrelu.kernels.operands import KernelOperand, declaration
from jax_dsrelu.kernels.request import GatherSumRequest
from jax_dsrelu.primitive_schema import GATHER_SUM
from jax_dsrelu.kernels.sm90.gather_sum_config import THREADS, VECTOR_BYTES, token_lanes, vector_elements

_I32 = np.dtype(np.int32)
_F32 = np.dtype(np.float32)


class GatherSumSm90:
    """The kernel for one static configuration (n, slots, the rows' dtype)."""

    def __init__(self, request: GatherSumRequest):
        self.request = request
        self.n = request.n
        self.slots = request.slots
        self.vector = vector_elements(request.rows_dtype)
        self.chunks = self.n // self.vector
        self.lanes = token_lanes(request)
        self.tokens_per_cta = THREADS // self.lanes

    def operands(self) -> list[KernelOperand]:
        """rows (m, n), index (T, slots) int32, out (T, n) float32."""
        r, declare = self.request, declaration(GATHER_SUM, self.request, dict(n=self.n, s=self.slots))
        return [declare("rows", "input", r.rows_dtype), declare("index", "input", _I32), declare("out", "output", _F32)]

    @cute.jit
    def __call__(self, stream: cuda.CUstream, rows: cute.Tensor, index: cute.Tensor, out: cute.Tensor):
        tokens = cute.size(index, mode=[0])
        grid = (tokens + (self.tokens_per_cta - 1)) // self.tokens_per_cta
        self.kernel(rows, index, out).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, rows: cute.Tensor, index: cute.Tensor, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        token = bidx * self.tokens_per_cta + tidx // self.lanes
        lane = tidx % self.lanes
        if token < cute.size(index, mode=[0]):
            last_row = cute.size(rows, mode=[0]) - 1
            sources = [self._clamped(index[token, s], last_row) for s in range(self.slots)]
            load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), rows.element_type,
                                       num_bits_per_copy=8 * VECTOR_BYTES)
            store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=8 * VECTOR_BYTES)
            # (vector, chunks) views of a row: chunk c is the row's elements [c v, (c + 1) v).
            chunked_rows = cute.logical_divide(rows, (None, self.vector))
            chunked_out = cute.logical_divide(out, (None, self.vector))
            loaded = [cute.make_rmem_tensor(cute.make_layout(self.vector), rows.element_type)
                      for _ in range(self.slots)]
            total = cute.make_rmem_tensor(cute.make_layout(self.vector), Float32)
            for chunk in range(lane, self.chunks, self.lanes):
                for s in cutlass.range_constexpr(self.slots):
                    cute.copy(load, chunked_rows[sources[s], (None, chunk)], loaded[s])
                total.store(loaded[0].load().to(Float32))
                for s in cutlass.range_constexpr(1, self.slots):
                    total.store(total.load() + loaded[s].load().to(Float32))
                cute.copy(store, total, chunked_out[token, (None, chunk)])

    @staticmethod
    def _clamped(row: Int32, last_row: Int32) -> Int32:
        """`row` clamped into [0, last_row], as the primitive clamps indices."""
        return cutlass.max(Int32(0), cutlass.min(row, last_row))

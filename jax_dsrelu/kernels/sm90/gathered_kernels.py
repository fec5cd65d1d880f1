"""The kernels of the family that read an operand's rows through a row index (`gather_a.py`).

    GatheredRaggedGemmSm90   the ragged-M GEMM (plain or squared-ReLU epilogue) with lhs
                             read as lhs[lhs_index]: the up-projection on the tokens x
                             (T, d) through the routing, with no (m, d) copy of them
    GatheredDsreluSm90       the fused dsReLU kernel with grad read as grad[grad_index]:
                             the layer's dy (T, d) read per row through the routing
    GatheredContractSm90     the ragged contraction with lhs read as lhs[lhs_index]: dW1
                             = x^T dh with x's rows read through the routing
    GatheredRhsContractSm90  the ragged contraction with rhs read as rhs[rhs_index]: dW2
                             = act^T dy with dy's rows read through the routing

Each is its variant with the gathered operand's load hooks and the row index among the kernel's
parameters; the rest (schedule, epilogue, outputs) is the variant's own, so they compute
what the variant computes on the gathered rows.
"""

from __future__ import annotations

import cutlass.cute as cute

from jax_dsrelu.kernels.sm90.dsrelu_kernel import GroupedGemmDsreluSm90
from jax_dsrelu.kernels.sm90.gather_a import GatheredRowsA, GatheredRowsK
from jax_dsrelu.kernels.sm90.ragged_contract_kernel import RaggedContractSm90
from jax_dsrelu.kernels.sm90.ragged_matmul_kernel import RaggedGemmSm90


class GatheredRaggedGemmSm90(GatheredRowsA, RaggedGemmSm90):
    """The ragged-M GEMM with lhs (T, k) read through lhs_index (m,)."""

    row_index = "lhs_index"

    def kernel_params(self, t) -> dict:
        return dict(super().kernel_params(t), num_rows=cute.size(t.lhs_index, mode=[0]), lhs_index=t.lhs_index)


class GatheredDsreluSm90(GatheredRowsA, GroupedGemmDsreluSm90):
    """The fused dsReLU kernel with grad (T, k) read through grad_index (m,)."""

    row_index = "grad_index"

    def kernel_params(self, t) -> dict:
        return dict(super().kernel_params(t), grad_index=t.grad_index)


class GatheredContractSm90(GatheredRowsK, RaggedContractSm90):
    """The ragged contraction with lhs (T, a) read through lhs_index (m,): dW1 = x^T dh
    with x's rows read through the routing."""

    row_index = "lhs_index"

    def a_view(self, tensor: cute.Tensor) -> cute.Tensor:
        return tensor  # read by cp.async through the index: no ragged TMA view

    def kernel_params(self, t) -> dict:
        return dict(super().kernel_params(t), num_rows=cute.size(t.lhs_index, mode=[0]), lhs_index=t.lhs_index)


class GatheredRhsContractSm90(GatheredRowsK, RaggedContractSm90):
    """The ragged contraction with rhs (T, b) read through rhs_index (m,): dW2 = act^T dy
    with dy's rows read through the routing."""

    row_index = "rhs_index"
    gathered = "b"

    def b_view(self, tensor: cute.Tensor) -> cute.Tensor:
        return tensor  # read by cp.async through the index: no ragged TMA view

    def kernel_params(self, t) -> dict:
        return dict(super().kernel_params(t), rhs_index=t.rhs_index)

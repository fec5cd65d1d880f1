"""The operands and results of every primitive: names, order, dimensions, optionality.

One `Schema` per primitive is the single description that abstract evaluation, the XLA
reference call, the kernel call, sharding and batching all read, so no code outside this
module knows an operand's position.

Dimensions are letters ("m" rows, "k" the contraction, "e" experts, ...), written
space-separated per array; a letter stands for one size wherever it appears. `{param}`
in a dimension string is replaced by the letters of that static parameter's value
(rhs_layout "kn" -> "k n"), so a layout parameter reorders dimensions without a second
schema.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

ROWS = "m"  # the ragged dimension: expert e owns a contiguous run of rows
GROUP_SIZES = "group_sizes"  # the operand holding the rows per expert


@dataclasses.dataclass(frozen=True)
class Field:
    """One operand or result.

    present_if: a boolean static parameter; the array exists only when it is True.
    absent_as_none: an absent operand is passed to kernel implementations as None
    (otherwise it is left out of their positional arguments).
    dtype (results only): a dtype name, or "out_dtype" for that static parameter.
    reduce (results only): how per-shard partials combine across a split dimension the
    result lacks ("sum" or "max").
    """

    name: str
    dims: str
    present_if: str | None = None
    absent_as_none: bool = False
    dtype: str | None = None
    reduce: str = "sum"

    def present(self, params: Mapping[str, Any]) -> bool:
        return self.present_if is None or bool(params[self.present_if])

    def letters(self, params: Mapping[str, Any]) -> tuple[str, ...]:
        out: list[str] = []
        for token in self.dims.split():
            if token.startswith("{"):
                out.extend(str(params[token.strip("{}")]))
            else:
                out.append(token)
        return tuple(out)

    def result_dtype(self, params: Mapping[str, Any]) -> np.dtype:
        return np.dtype(params["out_dtype"] if self.dtype == "out_dtype" else self.dtype)


@dataclasses.dataclass(frozen=True)
class Schema:
    """A primitive's operands and results, in order; `kept_whole` dimensions are never
    split across devices (see `jax_dsrelu.primitives.sharding`)."""

    name: str
    operands: tuple[Field, ...]
    results: tuple[Field, ...]
    kept_whole: tuple[str, ...]

    def operand_fields(self, params: Mapping[str, Any]) -> tuple[Field, ...]:
        """The operands the primitive is bound with: the present ones, in order."""
        return tuple(f for f in self.operands if f.present(params))

    def result_fields(self, params: Mapping[str, Any]) -> tuple[Field, ...]:
        return tuple(f for f in self.results if f.present(params))

    def bound_operands(self, named: Mapping[str, Any], params: Mapping[str, Any]) -> list[Any]:
        """Operands by name -> the primitive's positional operands."""
        fields = self.operand_fields(params)
        missing = [f.name for f in fields if named.get(f.name) is None]
        if missing:
            raise ValueError(f"{self.name}: operands {missing} are required with {dict(params)}")
        return [named[f.name] for f in fields]

    def named_results(self, results: Sequence[Any], params: Mapping[str, Any]) -> dict[str, Any]:
        """The primitive's results -> results by name; absent ones are None."""
        values = iter(results)
        return {f.name: next(values) if f.present(params) else None for f in self.results}

    def call_arguments(self, operands: Sequence[Any], params: Mapping[str, Any]) -> list[Any]:
        """The primitive's operands -> a kernel implementation's (or the reference's)
        positional arguments, which keep a None in place of an absent_as_none operand."""
        values = iter(operands)
        arguments = []
        for field in self.operands:
            if field.present(params):
                arguments.append(next(values))
            elif field.absent_as_none:
                arguments.append(None)
        return arguments

    def dim_sizes(self, operand_shapes: Sequence[Sequence[int]], params: Mapping[str, Any]) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for field, shape in zip(self.operand_fields(params), operand_shapes):
            for letter, size in zip(field.letters(params), shape):
                sizes.setdefault(letter, int(size))
        return sizes

    def result_shapes(
        self, operand_shapes: Sequence[Sequence[int]], params: Mapping[str, Any]
    ) -> list[tuple[tuple[int, ...], np.dtype]]:
        sizes = self.dim_sizes(operand_shapes, params)
        return [
            (tuple(sizes[d] for d in f.letters(params)), f.result_dtype(params))
            for f in self.result_fields(params)
        ]


GROUPED_GEMM_DSRELU = Schema(
    name="grouped_gemm_dsrelu",
    operands=(
        Field("grad", "m k"),
        Field("weight", "e n k"),
        Field("preact", "m n"),
        Field("prob", "m"),
        Field(GROUP_SIZES, "e"),
        Field("alpha", "e"),
        # MXFP8 operands: one scale per 32 elements along k ("b" the k/32 blocks).
        Field("grad_scale", "m b", present_if="block_scaled"),
        Field("weight_scale", "e n b", present_if="block_scaled"),
    ),
    results=(
        Field("dh", "m n", dtype="out_dtype"),
        Field("dprob", "m", dtype="float32"),
        Field("dbias", "e n", present_if="with_dbias", dtype="float32"),
        Field("act", "m n", present_if="with_act", dtype="out_dtype"),
        Field("amax", "e", dtype="float32", reduce="max"),
    ),
    # k: a cross-device sum would come before the nonlinear epilogue; e: splitting the
    # experts of a ragged, row-ordered layout is not a sharding of its rows.
    kept_whole=("k", "e", "b"),
)

# lhs (m, k) times expert e's rhs, stored (e, k, n) or (e, n, k).
_RAGGED_MATMUL_OPERANDS = (Field("lhs", "m k"), Field("rhs", "e {rhs_layout}"), Field(GROUP_SIZES, "e"))

RAGGED_MATMUL = Schema(
    name="ragged_matmul",
    operands=_RAGGED_MATMUL_OPERANDS,
    results=(Field("out", "m n", dtype="out_dtype"),),
    kept_whole=("k", "e"),
)

RAGGED_MATMUL_SRELU = Schema(
    name="ragged_matmul_srelu",
    operands=_RAGGED_MATMUL_OPERANDS + (
        Field("prob", "m"),
        Field("bias", "e n", present_if="with_bias", absent_as_none=True),
    ),
    results=(
        Field("h", "m n", dtype="out_dtype"),
        Field("act", "m n", dtype="out_dtype"),
    ),
    # k: the epilogue is nonlinear in the sum over k.
    kept_whole=("k", "e"),
)

RAGGED_CONTRACT = Schema(
    name="ragged_contract",
    operands=(
        Field("lhs", "m a"),
        Field("rhs", "m b"),
        Field(GROUP_SIZES, "e"),
    ),
    # Rows are the contracted dimension: split rows give per-shard partials to sum.
    results=(Field("out", "e a b", dtype="out_dtype", reduce="sum"),),
    kept_whole=("e",),
)

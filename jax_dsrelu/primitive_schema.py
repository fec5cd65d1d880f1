"""The operands and results of every primitive: names, order, dimensions, optionality.

One `Schema` per primitive is the single description that abstract evaluation, the XLA
reference call, the kernel call, sharding and batching all read, so no code outside this
module knows an operand's position. Between a primitive and its implementations (the XLA
reference, a kernel backend's call) everything goes by name: the operands as keyword
arguments (`call_arguments`), the results as a mapping (`ordered_results`), so a kernel's
call plan names its buffers as declared here and no list is matched by position.

Dimensions are letters ("m" rows, "k" the contraction, "e" experts, ...), written
space-separated per array; a letter stands for one size wherever it appears. `{param}`
in a dimension string is replaced by the letters of that static parameter's value
(rhs_layout "kn" -> "k n"), so a layout parameter reorders dimensions without a second
schema.

An operand whose rows the primitive may read through a row index ("gathered") is declared
with `row_gathered`: row i of the operand is then source[index[i]], the source holding
rows of its own count (a letter of its own, kept whole: any row of it may be read), and
the index (m,) int32 is an operand of its own, present when the static parameter
`with_<operand>_index` is True. A call without that parameter reads its rows in place.
The index operands come after every other operand, so the other operands' positions do
not depend on which are gathered.
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
    dtype (results only): a dtype name, or "out_dtype" for that static parameter.
    reduce (results only): how per-shard partials combine across a split dimension the
    result lacks ("sum" or "max").
    gathered_if, source (operands that may be gathered): the static parameter saying that
    the operand's rows are read through its index, and the letter of its source's rows,
    which then stands in place of the row letter.
    gathers (index operands): the name of the operand whose rows the index picks.
    """

    name: str
    dims: str
    present_if: str | None = None
    dtype: str | None = None
    reduce: str = "sum"
    gathered_if: str | None = None
    source: str | None = None
    gathers: str | None = None

    def present(self, params: Mapping[str, Any]) -> bool:
        if self.present_if is None:
            return True
        # A row index is optional by nature: a call that does not name its flag reads
        # the operand's rows in place.
        if self.gathers:
            return bool(params.get(self.present_if, False))
        if self.present_if not in params:
            raise ValueError(f"{self.name!r} is present where the static parameter {self.present_if!r} is True, "
                             f"but the call's parameters {sorted(params)} do not name it")
        return bool(params[self.present_if])

    def gathered(self, params: Mapping[str, Any]) -> bool:
        return self.gathered_if is not None and bool(params.get(self.gathered_if, False))

    def letters(self, params: Mapping[str, Any]) -> tuple[str, ...]:
        out: list[str] = []
        for token in self.dims.split():
            if token.startswith("{"):
                out.extend(str(params[token.strip("{}")]))
            else:
                out.append(token)
        if self.gathered(params):
            out = [self.source if letter == ROWS else letter for letter in out]
        return tuple(out)

    def result_dtype(self, params: Mapping[str, Any]) -> np.dtype:
        return np.dtype(params["out_dtype"] if self.dtype == "out_dtype" else self.dtype)


@dataclasses.dataclass(frozen=True)
class Schema:
    """A primitive's operands and results, in order; `kept_whole` dimensions are never
    split across devices (see `jax_dsrelu.primitives.sharding`), nor those of
    `whole_when` where its boolean static parameter is True."""

    name: str
    operands: tuple[Field, ...]
    results: tuple[Field, ...]
    kept_whole: tuple[str, ...]
    whole_when: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (parameter, dimensions)

    def whole(self, params: Mapping[str, Any]) -> tuple[str, ...]:
        """The dimensions a call with these static parameters never splits."""
        extra = [letter for flag, letters in self.whole_when if params.get(flag) for letter in letters]
        return self.kept_whole + tuple(extra)

    def field(self, name: str) -> Field:
        """The operand or result named `name`."""
        for f in self.operands + self.results:
            if f.name == name:
                return f
        raise ValueError(f"{self.name} has no operand or result {name!r}; it has "
                         f"{[f.name for f in self.operands + self.results]}")

    def is_result(self, name: str) -> bool:
        return any(f.name == name for f in self.results)

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

    def named_operands(self, operands: Sequence[Any], params: Mapping[str, Any]) -> dict[str, Any]:
        """The primitive's positional operands -> operands by name (absent ones None)."""
        values = iter(operands)
        return {f.name: next(values) if f.present(params) else None for f in self.operands}

    def index_fields(self, params: Mapping[str, Any]) -> tuple[Field, ...]:
        """The row indices present in a call, each naming (`gathers`) the operand it reads."""
        return tuple(f for f in self.operands if f.gathers is not None and f.present(params))

    def call_arguments(self, operands: Sequence[Any], params: Mapping[str, Any]) -> dict[str, Any]:
        """The primitive's operands -> an implementation's (or the reference's) keyword
        arguments: the present operands by name, row indices included (a call's indices
        are present only where its implementation reads rows through them; see
        `jax_dsrelu.primitives.base`). Absent operands are left out."""
        return {name: value for name, value in self.named_operands(operands, params).items() if value is not None}

    def ordered_results(
        self,
        named: Mapping[str, Any],
        operand_shapes: Sequence[Sequence[int]],
        params: Mapping[str, Any],
        producer: str,
    ) -> list[Any]:
        """An implementation's results by name -> the primitive's results, in order.

        Each present result is taken by its name and must have the shape and dtype that
        abstract evaluation gives it; other names (a kernel's workspaces) are ignored."""
        results = []
        for field, (shape, dtype) in zip(self.result_fields(params), self.result_shapes(operand_shapes, params)):
            if field.name not in named:
                raise ValueError(f"{self.name}: {producer} returned {sorted(named)}, without the result "
                                 f"{field.name!r} ({shape}, {dtype.name}) that {dict(params)} asks for")
            value = named[field.name]
            seen = (tuple(value.shape), np.dtype(value.dtype))
            if seen != (shape, dtype):
                raise ValueError(f"{self.name}: {producer} returned {field.name} of shape {seen[0]} and dtype "
                                 f"{seen[1].name}; expected {shape} and {dtype.name}")
            results.append(value)
        return results

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


def row_gathered(name: str, dims: str, source: str) -> tuple[Field, Field]:
    """(the operand, its row index): an operand (m, ...) that a call may read as
    source[index] instead, source (`source`, ...) and index (m,) int32, when the static
    parameter with_<name>_index is True. List the index after every other operand."""
    flag = f"with_{name}_index"
    return (
        Field(name, dims, gathered_if=flag, source=source),
        Field(f"{name}_index", ROWS, present_if=flag, gathers=name),
    )


# The rows of a gathered operand's source: tokens, of which each row of the primitive
# reads one (a token is read by each of its top_k rows). Never split across devices: a
# device's rows may read any token.
SOURCE_ROWS = "t"
_GRAD, _GRAD_INDEX = row_gathered("grad", "m k", SOURCE_ROWS)

GROUPED_GEMM_DSRELU = Schema(
    name="grouped_gemm_dsrelu",
    operands=(
        _GRAD,
        Field("weight", "e n k"),
        Field("preact", "m n"),
        Field("prob", "m"),
        Field(GROUP_SIZES, "e"),
        Field("alpha", "e"),
        # MXFP8 operands: one scale per 32 elements along k ("b" the k/32 blocks).
        Field("grad_scale", "m b", present_if="block_scaled"),
        Field("weight_scale", "e n b", present_if="block_scaled"),
        # FP8_BLOCKWISE operands: float32 scales per row and 128 of k ("q" the k blocks), and
        # per 128 x 128 block of weight ("p" the n blocks).
        Field("grad_block_scale", "m q", present_if="blockwise_scaled"),
        Field("weight_block_scale", "e p q", present_if="blockwise_scaled"),
        _GRAD_INDEX,
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
    kept_whole=("k", "e", "b", "p", "q", SOURCE_ROWS),
    # FP8_BLOCKWISE: a device's columns of weight would need their own 128-column blocks.
    whole_when=(("blockwise_scaled", ("n",)),),
)

# lhs (m, k) times expert e's rhs, stored (e, k, n) or (e, n, k).
_LHS, _LHS_INDEX = row_gathered("lhs", "m k", SOURCE_ROWS)
_RAGGED_MATMUL_OPERANDS = (_LHS, Field("rhs", "e {rhs_layout}"), Field(GROUP_SIZES, "e"))
# FP8_BLOCKWISE operands: a float32 scale per row and 128 of k ("q" the k blocks), and per
# 128 x 128 block of rhs stored (e, n, k) ("p" the n blocks).
_BLOCK_SCALES = (
    Field("lhs_scale", "m q", present_if="block_scaled"),
    Field("rhs_scale", "e p q", present_if="block_scaled"),
)

RAGGED_MATMUL = Schema(
    name="ragged_matmul",
    operands=_RAGGED_MATMUL_OPERANDS + _BLOCK_SCALES + (_LHS_INDEX,),
    results=(Field("out", "m n", dtype="out_dtype"),),
    kept_whole=("k", "e", "p", "q", SOURCE_ROWS),
    # Block-scaled: a device's columns of rhs would need their own 128-column blocks.
    whole_when=(("block_scaled", ("n",)),),
)

RAGGED_MATMUL_SRELU = Schema(
    name="ragged_matmul_srelu",
    operands=_RAGGED_MATMUL_OPERANDS + (
        Field("prob", "m"),
        Field("bias", "e n", present_if="with_bias"),
    ) + _BLOCK_SCALES + (_LHS_INDEX,),
    results=(
        Field("h", "m n", dtype="out_dtype"),
        Field("act", "m n", present_if="with_act", dtype="out_dtype"),
    ),
    # k: the epilogue is nonlinear in the sum over k.
    kept_whole=("k", "e", "p", "q", SOURCE_ROWS),
    whole_when=(("block_scaled", ("n",)),),
)

# Each side its own source: the weight gradients read x rows (dW1 = x^T dh) or dy rows
# (dW2 = act^T dy) through the routing's index, beside an operand in row order.
_CONTRACT_LHS, _CONTRACT_LHS_INDEX = row_gathered("lhs", "m a", SOURCE_ROWS)
_CONTRACT_RHS, _CONTRACT_RHS_INDEX = row_gathered("rhs", "m b", "u")

RAGGED_CONTRACT = Schema(
    name="ragged_contract",
    operands=(
        _CONTRACT_LHS,
        _CONTRACT_RHS,
        Field(GROUP_SIZES, "e"),
        # FP8_BLOCKWISE operands (`jax_dsrelu.quantization.ragged`): a float32 scale per
        # column and group of 128 rows, the groups restarting at each expert ("g" the
        # groups, ceil(m / 128) + E).
        Field("lhs_scale", "g a", present_if="block_scaled"),
        Field("rhs_scale", "g b", present_if="block_scaled"),
        _CONTRACT_LHS_INDEX,
        _CONTRACT_RHS_INDEX,
    ),
    # Rows are the contracted dimension: split rows give per-shard partials to sum.
    results=(Field("out", "e a b", dtype="out_dtype", reduce="sum"),),
    kept_whole=("e", "g", SOURCE_ROWS, "u"),
    # Block-scaled or quantized here: the groups are numbered over all of the rows, which stay whole.
    whole_when=(("block_scaled", (ROWS,)), ("quantize", (ROWS,))),
)

GATHER_SUM = Schema(
    name="gather_sum",
    # out[t] = sum over s of rows[index[t, s]]: rows (m, n), index (t, s) int32.
    operands=(Field("rows", "m n"), Field("index", "t s")),
    results=(Field("out", "t n", dtype="float32"),),
    # m: a token may read any row; s: the slots of a token are added in one order.
    kept_whole=("m", "s"),
)

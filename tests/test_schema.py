"""The primitive schemas: optional operands and results, layouts, kernel arguments."""

from __future__ import annotations

import numpy as np
import pytest

from jax_dsrelu import primitive_schema as schema


def test_optional_results_and_operands_follow_their_flags():
    params = dict(with_dbias=False, with_act=True, block_scaled=False, blockwise_scaled=False, out_dtype=np.float16)
    s = schema.GROUPED_GEMM_DSRELU
    assert [f.name for f in s.operand_fields(params)] == [
        "grad", "weight", "preact", "prob", "group_sizes", "alpha"
    ]
    assert [f.name for f in s.result_fields(params)] == ["dh", "dprob", "act", "amax"]
    shapes = s.result_shapes([(10, 4), (3, 6, 4), (10, 6), (10,), (3,), (3,)], params)
    assert shapes == [
        ((10, 6), np.dtype(np.float16)),
        ((10,), np.dtype(np.float32)),
        ((10, 6), np.dtype(np.float16)),
        ((3,), np.dtype(np.float32)),
    ]
    assert s.named_results(["dh", "dprob", "act", "amax"], params) == dict(
        dh="dh", dprob="dprob", dbias=None, act="act", amax="amax"
    )
    # Arguments by name; absent MXFP8 scales are left out.
    assert s.call_arguments(list("abcdef"), params) == dict(
        grad="a", weight="b", preact="c", prob="d", group_sizes="e", alpha="f"
    )


def test_layout_parameter_orders_the_rhs_dimensions():
    s = schema.RAGGED_MATMUL
    for layout, rhs_shape in (("kn", (4, 8, 5)), ("nk", (4, 5, 8))):
        params = dict(rhs_layout=layout, out_dtype=np.float32, block_scaled=False)
        assert s.result_shapes([(7, 8), rhs_shape, (4,)], params) == [((7, 5), np.dtype(np.float32))]


def test_an_absent_bias_is_no_argument():
    s = schema.RAGGED_MATMUL_SRELU
    params = dict(rhs_layout="kn", out_dtype=np.float32, with_bias=False, block_scaled=False, with_act=True)
    assert s.call_arguments(["x", "w", "g", "p"], params) == dict(lhs="x", rhs="w", group_sizes="g", prob="p")
    with pytest.raises(ValueError, match=r"operands \['prob'\] are required"):
        s.bound_operands(dict(lhs=1, rhs=2, group_sizes=3, bias=None), params)


def test_results_are_taken_by_name_and_checked_against_abstract_evaluation():
    s = schema.GROUPED_GEMM_DSRELU
    params = dict(with_dbias=False, with_act=False, block_scaled=False, blockwise_scaled=False, out_dtype=np.float16)
    operand_shapes = [(10, 4), (3, 6, 4), (10, 6), (10,), (3,), (3,)]
    arrays = dict(
        dh=np.zeros((10, 6), np.float16), dprob=np.zeros((10,), np.float32), amax=np.zeros((3,), np.float32),
        dprob_slots=np.zeros((1, 10), np.float32),  # a workspace: not a result, ignored
    )
    results = s.ordered_results(arrays, operand_shapes, params, "a test")
    assert [r is arrays[name] for r, name in zip(results, ("dh", "dprob", "amax"))] == [True] * 3
    with pytest.raises(ValueError, match=r"without the result 'amax'"):
        s.ordered_results(dict(dh=arrays["dh"], dprob=arrays["dprob"]), operand_shapes, params, "a test")
    # Two results bound to each other's arrays: caught by their shapes.
    swapped = dict(arrays, dprob=arrays["amax"], amax=arrays["dprob"])
    with pytest.raises(ValueError, match=r"returned dprob of shape \(3,\) and dtype float32; expected \(10,\)"):
        s.ordered_results(swapped, operand_shapes, params, "a test")


def test_a_missing_presence_flag_is_named():
    params = dict(rhs_layout="kn", out_dtype=np.float32, with_bias=False, block_scaled=False)  # no with_act
    with pytest.raises(ValueError, match=r"'act' is present where the static parameter 'with_act' is True"):
        schema.RAGGED_MATMUL_SRELU.result_fields(params)

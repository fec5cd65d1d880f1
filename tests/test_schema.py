"""The primitive schemas: optional operands and results, layouts, kernel arguments."""

from __future__ import annotations

import numpy as np
import pytest

from jax_dsrelu.primitives import schema


def test_optional_results_and_operands_follow_their_flags():
    params = dict(with_dbias=False, with_act=True, block_scaled=False, out_dtype=np.float16)
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
    # Absent MXFP8 scales are left out of the kernel's positional arguments.
    assert s.call_arguments(list("abcdef"), params) == list("abcdef")


def test_layout_parameter_orders_the_rhs_dimensions():
    s = schema.RAGGED_MATMUL
    for layout, rhs_shape in (("kn", (4, 8, 5)), ("nk", (4, 5, 8))):
        params = dict(rhs_layout=layout, out_dtype=np.float32)
        assert s.result_shapes([(7, 8), rhs_shape, (4,)], params) == [((7, 5), np.dtype(np.float32))]


def test_absent_bias_reaches_the_kernel_as_none():
    s = schema.RAGGED_MATMUL_SRELU
    params = dict(rhs_layout="kn", out_dtype=np.float32, with_bias=False)
    assert s.call_arguments(["x", "w", "g", "p"], params) == ["x", "w", "g", "p", None]
    with pytest.raises(ValueError, match=r"operands \['prob'\] are required"):
        s.bound_operands(dict(lhs=1, rhs=2, group_sizes=3, bias=None), params)

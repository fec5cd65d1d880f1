"""Each primitive's custom call binds its buffers in the order its kernel declares them
(compile tier: lowered for cuda on the real sm90 backend, no GPU needed).

The kernel's host function unpacks its buffers by the declared names, in declared order;
identical PTX cannot show that XLA hands them over in that order, the StableHLO can. The
shapes below differ from operand to operand, so every buffer's place shows in its type.
"""

from __future__ import annotations

import os

# Before anything imports CuTe DSL: on a machine without a GPU it cannot detect one.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import dataclasses  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")

from jax_dsrelu.kernels import operands as kernel_operands  # noqa: E402
from jax_dsrelu.kernels.operands import ROWS, SOURCE_ROWS  # noqa: E402
from jax_dsrelu.kernels.request import GatherSumRequest, RaggedContractRequest, RaggedMatmulRequest, Request  # noqa: E402
from jax_dsrelu.kernels.sm90 import backend as sm90_backend  # noqa: E402
from jax_dsrelu.kernels.sm90 import config as sm90_config  # noqa: E402
from jax_dsrelu.kernels.sm90 import dsrelu_call, gather_sum_call, ragged_call  # noqa: E402
from jax_dsrelu.kernels.sm90.arch import sm_count  # noqa: E402
from jax_dsrelu.kernels.sm90.dsrelu_kernel import GroupedGemmDsreluSm90  # noqa: E402
from jax_dsrelu import primitive_schema as schema  # noqa: E402
from jax_dsrelu.primitives import dsrelu  # noqa: E402
from jax_dsrelu.primitives.gather_sum import gather_sum  # noqa: E402
from jax_dsrelu.primitives.ragged_contract import ragged_contract  # noqa: E402
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul, ragged_matmul_srelu  # noqa: E402

M, K, N, E, T, SLOTS = 40, 24, 16, 5, 12, 3
BF16, F32, I32 = np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.int32)
KERNEL_CALL = re.compile(r"stablehlo\.custom_call @CuteDSLRT\w*\(.*?\) (?:\{.*\} )?: \((.*?)\) -> (.*)$", re.M)
_MLIR_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int32": "i32", "float8_e4m3fn": "f8E4M3FN"}


def tensor_type(shape, dtype) -> str:
    return "tensor<" + "".join(f"{extent}x" for extent in shape) + _MLIR_DTYPES[np.dtype(dtype).name] + ">"


def bound_types(text: str, call: int | None = None) -> tuple[list[str], list[str]]:
    """(operand types, result types) of the one kernel custom call in a lowered module, or
    of the call-th where a module holds several."""
    calls = KERNEL_CALL.findall(text)
    assert call is not None or len(calls) == 1, f"expected one kernel call, found {len(calls)}"
    operands, results = calls[call or 0]
    return re.findall(r"tensor<[^>]*>", operands), re.findall(r"tensor<[^>]*>", results)


def declared_types(plan, counts) -> tuple[list[str], list[str]]:
    """(input types, output types) of a kernel's declared plan at the run-time counts."""
    inputs, outputs, _ = kernel_operands.call_layout(plan, outputs_in_place=False)
    return ([tensor_type(o.shape_for(counts), o.dtype) for o in inputs],
            [tensor_type(o.shape_for(counts), o.dtype) for o in outputs])


def unbound_buffers(plan, counts, text: str, call: int | None = None) -> list[str]:
    """The declared buffers that the custom call (`bound_types`' call) does not bind in
    their place (by index, name, declared type and the type bound there)."""
    declared_in, declared_out = declared_types(plan, counts)
    bound_in, bound_out = bound_types(text, call)
    inputs, outputs, _ = kernel_operands.call_layout(plan, outputs_in_place=False)
    wrong = [f"input {i} {o.name}: declared {d}, bound {b}"
             for i, (o, d, b) in enumerate(zip(inputs, declared_in, bound_in)) if d != b]
    wrong += [f"output {i} {o.name}: declared {d}, bound {b}"
              for i, (o, d, b) in enumerate(zip(outputs, declared_out, bound_out)) if d != b]
    if len(bound_in) != len(declared_in) or len(bound_out) != len(declared_out):
        wrong.append(f"{len(bound_in)} inputs and {len(bound_out)} outputs bound; "
                     f"{len(declared_in)} and {len(declared_out)} declared")
    return wrong


def lowered(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def arrays():
    rng = np.random.default_rng(41)
    return dict(
        x=jnp.asarray(rng.standard_normal((M, K)), BF16),
        w_kn=jnp.asarray(rng.standard_normal((E, K, N)), BF16),
        w_nk=jnp.asarray(rng.standard_normal((E, N, K)), BF16),
        h=jnp.asarray(rng.standard_normal((M, N)), BF16),
        prob=jnp.asarray(rng.uniform(0.1, 1.0, M), F32),
        bias=jnp.asarray(rng.standard_normal((E, N)), F32),
        sizes=jnp.asarray([7, 0, 20, 3, 2], I32),
        alpha=jnp.ones((E,), F32),
        index=jnp.asarray(rng.integers(0, M, (T, SLOTS)), I32),
    )


def dsrelu_request() -> Request:
    return Request(num_experts=E, n=N, k=K, operand_dtype=BF16, preact_dtype=BF16, prob_dtype=F32, out_dtype=BF16,
                   with_dbias=True, with_act=True, deterministic=True)


def dsrelu_step(a):
    def step(grad, weight, preact, prob, sizes, alpha):
        return dsrelu.bind(grad=grad, weight=weight, preact=preact, prob=prob, group_sizes=sizes, alpha=alpha,
                           with_dbias=True, with_act=True, out_dtype=BF16, deterministic=True, backend="sm90")
    return step, (a["x"], a["w_nk"], a["h"], a["prob"], a["sizes"], a["alpha"])


def dsrelu_plan():
    request = dsrelu_call.kernel_request(dsrelu_request())
    return dsrelu_call.operands(request, sm90_config.choose_config(request, sm_count()))


def matmul_request(epilogue="none", with_bias=False) -> RaggedMatmulRequest:
    return RaggedMatmulRequest(num_experts=E, k=K, n=N, rhs_layout="nk", operand_dtype=BF16, out_dtype=BF16,
                               epilogue=epilogue, with_bias=with_bias)


# primitive: (its one-call function and arguments, the kernel's declared plan, its counts,
# the primitive's schema and its static params)
def cases():
    a = arrays()
    return {
        "grouped_gemm_dsrelu": (
            dsrelu_step(a), dsrelu_plan(), {ROWS: M}, schema.GROUPED_GEMM_DSRELU,
            dict(with_dbias=True, with_act=True, block_scaled=False, blockwise_scaled=False, out_dtype=BF16),
        ),
        "ragged_matmul": (
            (lambda x, w, g: ragged_matmul(x, w, g, rhs_layout="nk", out_dtype=BF16, backend="sm90"),
             (a["x"], a["w_nk"], a["sizes"])),
            ragged_call.operands(matmul_request()), {ROWS: M}, schema.RAGGED_MATMUL,
            dict(rhs_layout="nk", out_dtype=BF16, block_scaled=False),
        ),
        "ragged_matmul_srelu": (
            (lambda x, w, g, p, b: ragged_matmul_srelu(x, w, g, p, b, rhs_layout="nk", out_dtype=BF16, backend="sm90"),
             (a["x"], a["w_nk"], a["sizes"], a["prob"], a["bias"])),
            ragged_call.operands(matmul_request("srelu", True)), {ROWS: M}, schema.RAGGED_MATMUL_SRELU,
            dict(rhs_layout="nk", out_dtype=BF16, with_bias=True, block_scaled=False, with_act=True),
        ),
        "ragged_contract": (
            (lambda x, h, g: ragged_contract(x, h, g, out_dtype=F32, backend="sm90"), (a["x"], a["h"], a["sizes"])),
            ragged_call.operands(RaggedContractRequest(num_experts=E, a=K, b=N, operand_dtype=BF16, out_dtype=F32)),
            {ROWS: M}, schema.RAGGED_CONTRACT, dict(out_dtype=F32, block_scaled=False, quantize=False),
        ),
        "gather_sum": (
            (lambda r, i: gather_sum(r, i, backend="sm90"), (a["h"], a["index"])),
            gather_sum_call.operands(GatherSumRequest(n=N, slots=SLOTS, rows_dtype=BF16)),
            {ROWS: M, SOURCE_ROWS: T}, schema.GATHER_SUM, {},
        ),
    }


@pytest.fixture
def unverified_kernels():
    # The gather-and-sum kernel serves calls only when named (`sm90.backend`).
    with sm90_backend.unverified_enabled("gather_sum"):
        yield


@pytest.mark.compile
@pytest.mark.parametrize("name", list(cases()))
def test_the_custom_call_binds_the_declared_buffers_in_order(unverified_kernels, name):
    (fn, args), plan, counts, primitive_schema, params = cases()[name]
    assert unbound_buffers(plan, counts, lowered(fn, *args)) == []
    # The buffers named as the primitive names its operands and results hold exactly
    # those arrays: the primitive's declared shapes and dtypes.
    operand_avals = dict(zip([f.name for f in primitive_schema.operand_fields(params)], args))
    result_shapes = dict(zip([f.name for f in primitive_schema.result_fields(params)],
                             primitive_schema.result_shapes([x.shape for x in args], params)))
    for buffer in plan:
        if buffer.name in operand_avals and buffer.role == "input":
            # prob, alpha and bias reach the kernels as float32; these arrays already are.
            aval = operand_avals[buffer.name]
            assert (buffer.shape_for(counts), buffer.dtype) == (aval.shape, np.dtype(aval.dtype)), buffer.name
        elif buffer.name in result_shapes and buffer.name != "amax":  # amax: float32 as int32 bits
            assert (buffer.shape_for(counts), buffer.dtype) == result_shapes[buffer.name], buffer.name


@pytest.mark.compile
def test_a_declaration_with_two_operands_swapped_is_caught(monkeypatch):
    # A planted bug: the fused kernel's declaration with grad and preact swapped.
    declared = GroupedGemmDsreluSm90.operands

    def swapped(self):
        renamed = {"grad": "preact", "preact": "grad"}
        return [dataclasses.replace(o, name=renamed.get(o.name, o.name)) for o in declared(self)]

    (fn, args), *_ = cases()["grouped_gemm_dsrelu"]
    monkeypatch.setattr(GroupedGemmDsreluSm90, "operands", swapped)
    with pytest.raises(ValueError, match=r"kernel buffer 'preact' is declared \(40, 24\) bfloat16, but is bound to "
                                         r"an array of shape \(40, 16\)"):
        lowered(fn, *args)


@pytest.mark.compile
def test_the_binding_check_sees_buffers_out_of_their_declared_order():
    # The same call against a declaration listing grad and preact in each other's place:
    # the check names both places.
    (fn, args), plan, counts, *_ = cases()["grouped_gemm_dsrelu"]
    text = lowered(fn, *args)
    first, second = (i for i, o in enumerate(plan) if o.name in ("grad", "preact"))
    reordered = list(plan)
    reordered[first], reordered[second] = plan[second], plan[first]
    wrong = unbound_buffers(reordered, counts, text)
    assert [line.split(":")[0] for line in wrong] == [f"input {first} preact", f"input {second} grad"]


def test_a_kernel_buffer_of_the_primitive_takes_the_schemas_name_and_shape():
    # The kernels declare the primitive's buffers through the schema (`Declaration`):
    # names it lacks, buffers absent under the call's parameters and roles against the
    # field's kind are refused, and a gathered operand gets its source's rows.
    declare = kernel_operands.declaration(schema.GROUPED_GEMM_DSRELU, dsrelu_request(), dict(e=E, n=N, k=K))
    assert declare("weight", "input", BF16, mode=(1, 2, 0)) == kernel_operands.KernelOperand(
        "weight", "input", BF16, (E, N, K), mode=(1, 2, 0))
    assert declare("dh", "output", BF16).shape == (kernel_operands.M, N)
    with pytest.raises(ValueError, match=r"grouped_gemm_dsrelu has no operand or result 'grads'"):
        declare("grads", "input", BF16)
    with pytest.raises(ValueError, match=r"'dh' is a result; a kernel cannot declare it as 'input'"):
        declare("dh", "input", BF16)
    with pytest.raises(ValueError, match=r"'grad' is an operand; a kernel cannot declare it as 'accumulate'"):
        declare("grad", "accumulate", BF16)
    without_dbias = kernel_operands.declaration(schema.GROUPED_GEMM_DSRELU,
                                                dataclasses.replace(dsrelu_request(), with_dbias=False), {})
    with pytest.raises(ValueError, match=r"'dbias' is absent .* \(present only with with_dbias=True\)"):
        without_dbias("dbias", "output", F32)
    with pytest.raises(ValueError, match=r"'weight' has dimensions \('e', 'n', 'k'\); the kernel gives no size"):
        without_dbias("weight", "input", BF16)
    gathered = kernel_operands.declaration(schema.GROUPED_GEMM_DSRELU, dsrelu_request(), dict(e=E, n=N, k=K),
                                           with_grad_index=True)
    assert gathered("grad", "input", BF16).shape == (kernel_operands.T, K)
    assert gathered("grad_index", "input", I32).shape == (kernel_operands.M,)
    # dW2's rhs, dy, is gathered from a source of its own (the count "u").
    contract = kernel_operands.declaration(
        schema.RAGGED_CONTRACT, RaggedContractRequest(num_experts=E, a=K, b=N, operand_dtype=BF16, out_dtype=F32),
        dict(e=E, a=K, b=N), with_rhs_index=True)
    assert contract("rhs", "input", BF16).shape == (kernel_operands.U, N)


@pytest.mark.parametrize("name", list(cases()))
def test_every_kernel_buffer_named_by_the_schema_has_its_shape(name):
    # Whatever the kernel's own buffers (slots, workspaces), each of the primitive's
    # buffers it declares is shaped as the schema's letters say, at the case's sizes.
    (_, args), plan, counts, primitive_schema, params = cases()[name]
    sizes = primitive_schema.dim_sizes([x.shape for x in args], params)
    named = {f.name: f for f in primitive_schema.operands + primitive_schema.results}
    ours = [o for o in plan if o.name in named]
    assert ours, plan
    for buffer in ours:
        expected = tuple(counts.get(letter, sizes.get(letter)) for letter in named[buffer.name].letters(params))
        assert buffer.shape_for(counts) == expected, buffer.name

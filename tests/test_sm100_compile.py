"""Compile-only tier of the sm100 backend: no GPU needed.

`grouped_gemm_dsrelu(..., backend="sm100")` is lowered for the cuda platform, which
compiles cuDNN's Blackwell kernel (and in deterministic mode our reduction pass) for
sm_100a with CuTe DSL on the host, and the HLO is inspected. Nothing here runs a kernel.

CuTe DSL reads CUTE_DSL_ARCH once, when `cutlass` is first imported, and other test
modules compile for other architectures in this process; so the compiling happens in a
child process running this file as a script, with CUTE_DSL_ARCH=sm_100a and JAX limited
to the CPU (so that a visible GPU of another kind does not make the backend refuse).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jax_dsrelu.kernels import registry as backend_choice

# Asked without importing CuTe DSL, which must first be imported in the child (see above).
_MISSING = backend_choice.kernel_backend("sm100").software_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"{_MISSING}: nothing to compile with")

CASES = {
    # name: (m, k, n, E, element dtype, preact dtype, prob dtype, out dtype, dbias, act, deterministic)
    "deterministic": (1000, 256, 512, 5, "float8_e4m3fn", "bfloat16", "float32", "bfloat16", True, True, True),
    "atomic": (1000, 256, 512, 5, "float8_e4m3fn", "bfloat16", "float32", "bfloat16", True, True, False),
    "deterministic_plain": (700, 128, 256, 3, "float8_e4m3fn", "bfloat16", "float32", "bfloat16", False, False, True),
    "atomic_act_only": (700, 128, 256, 3, "float8_e4m3fn", "bfloat16", "float32", "bfloat16", False, True, False),
    "deterministic_e5m2_f16": (512, 256, 384, 4, "float8_e5m2", "float32", "bfloat16", "float16", True, True, True),
    "deterministic_f32_out": (512, 128, 256, 2, "float8_e4m3fn", "float16", "float32", "float32", True, True, True),
    "atomic_f16_out": (512, 128, 320, 2, "float8_e5m2", "bfloat16", "float32", "float16", True, True, False),
    "one_expert_smallest": (300, 32, 64, 1, "float8_e4m3fn", "bfloat16", "float32", "bfloat16", True, True, True),
    "many_experts": (4096, 128, 128, 256, "float8_e4m3fn", "bfloat16", "float32", "bfloat16", True, True, True),
    "no_rows": (0, 128, 256, 3, "float8_e4m3fn", "bfloat16", "float32", "bfloat16", True, True, True),
    # The first case again with another row count and prob dtype: the same compiled code.
    "deterministic_other_m": (1731, 256, 512, 5, "float8_e4m3fn", "bfloat16", "bfloat16", "bfloat16", True, True, True),
}
# backend="auto" on a Blackwell GPU (its compute capability faked in the child): MXFP8
# operands go to sm100, bf16 operands (which neither kernel backend here takes on
# Blackwell) to the XLA reference.
AUTO_CASES = {"auto_mxfp8": "float8_e4m3fn", "auto_bf16": "bfloat16"}
# (rows, k, experts) of the scale buffers whose CuTe layout is evaluated; partial atoms.
SCALE_SHAPES = [(256, 256, 1), (320, 160, 3)]
CUTE_TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"


def _probe(cases: dict) -> dict:
    """Runs in the child: lowers every case, evaluates the scale layouts, reports JSON."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_dsrelu
    from jax_dsrelu.kernels import registry as backend_choice
    from jax_dsrelu.kernels import request as request_facts
    from jax_dsrelu.ffi import cutlass_bridge
    from jax_dsrelu.kernels.sm100 import adapter, layout
    from jax_dsrelu.kernels.sm100 import dsrelu_call as lowering
    from jax_dsrelu.kernels.sm100.config import CONFIG

    report = {"cases": {}, "scale_offsets": []}
    compiles = []
    for name, (m, k, n, e, element, preact, prob, out, dbias, act, det) in cases.items():
        s = jax.ShapeDtypeStruct
        args = (
            s((m, k), jnp.dtype(element)),
            s((e, n, k), jnp.dtype(element)),
            s((m, n), jnp.dtype(preact)),
            s((m,), jnp.dtype(prob)),
            s((e,), jnp.int32),
            s((m, k // 32), jnp.float8_e8m0fnu),
            s((e, n, k // 32), jnp.float8_e8m0fnu),
        )

        def f(grad, weight, pre, p, sizes, grad_scale, weight_scale):
            return jax_dsrelu.grouped_gemm_dsrelu(
                grad, weight, pre, p, sizes, grad_scale=grad_scale, weight_scale=weight_scale,
                with_dbias=dbias, with_act=act, out_dtype=jnp.dtype(out), deterministic=det,
                backend="sm100",
            )

        traced = jax.jit(f).trace(*args)
        hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
        compiles.append(cutlass_bridge.compile_count())
        modules = re.findall(r'module = "(.*?)"[,}]', hlo, re.S)
        report["cases"][name] = dict(
            targets=re.findall(r"stablehlo\.custom_call @(\w+)", hlo),
            scatter="scatter" in hlo,
            cudnn_kernel=[("BlockScaledMoEGroupedGemmQuantBwdKernel" in mod) for mod in modules],
            reduction_kernel=[("SlotReduction" in mod) for mod in modules],
            arch=[sorted(set(re.findall(r"sm_\d+a?", mod))) for mod in modules],
            outputs=[[list(o.shape), str(o.dtype)] for o in jax.tree.leaves(traced.out_info)],
        )
        if m:
            # The shared memory cuDNN's kernel will request at launch: compiling does not
            # check it against the device, so a variant could build and then fail to launch.
            request = request_facts.request_from_avals(
                args[:4], block_scaled=True, out_dtype=np.dtype(out), with_dbias=dbias,
                with_act=act, deterministic=det,
            )
            gemm = adapter.gemm_kernel(lowering.kernel_key(request))
            report["cases"][name]["smem"] = [gemm.shared_storage.size_in_bytes(), gemm.num_smem_capacity]
            # The call's declaration against the arrays the layout bridge makes: the shapes
            # it declares at the padded row count, and the dtypes, input by input.
            ops, _ = jax.eval_shape(lambda *a: layout.kernel_operands(*a, CONFIG), *args[:5], s((e,), jnp.float32),
                                    *args[5:])
            padded = ops.grad.shape[0]
            plan = adapter.Sm100Call(lowering.kernel_key(request)).operands()
            report["cases"][name]["declared"] = {
                o.name: [list(o.shape_for(padded)), str(o.dtype)] for o in plan if o.role == "input"}
            report["cases"][name]["laid_out"] = {
                field: [list(array.shape), str(array.dtype)] for field, array in ops._asdict().items()}
            # The accumulators against the slot counts the config gives cuDNN's scheduler.
            report["cases"][name]["accumulators"] = {
                o.name: list(o.shape_for(padded)) for o in plan if o.role == "accumulate"}
            report["cases"][name]["slots"] = [padded, CONFIG.dprob_slots(n), CONFIG.dbias_slots(padded)]

    report["compiles"] = compiles

    backend_choice.cuda_compute_capability = lambda: (10, 0)
    # The occupancy query needs the GPU; the compile-only figure stands in for it.
    adapter.max_active_clusters = lambda config: adapter.COMPILE_ONLY_MAX_ACTIVE_CLUSTERS
    for name, dtype in AUTO_CASES.items():
        s = jax.ShapeDtypeStruct
        args = [s((512, 128), jnp.dtype(dtype)), s((2, 256, 128), jnp.dtype(dtype)),
                s((512, 256), jnp.bfloat16), s((512,), jnp.float32), s((2,), jnp.int32)]
        scales = {}
        if dtype != "bfloat16":
            scales = dict(grad_scale=s((512, 4), jnp.float8_e8m0fnu), weight_scale=s((2, 256, 4), jnp.float8_e8m0fnu))

        def f(*a):
            return jax_dsrelu.grouped_gemm_dsrelu(*a[:5], **dict(zip(scales, a[5:])), deterministic=True)

        hlo = jax.jit(f).trace(*args, *scales.values()).lower(lowering_platforms=("cuda",)).as_text()
        report["cases"][name] = dict(targets=re.findall(r"stablehlo\.custom_call @(\w+)", hlo))

    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as blockscaled_layout

    @cute.jit
    def evaluate_layouts():
        for rows, k, experts in SCALE_SHAPES:
            sf = blockscaled_layout.tile_atom_to_shape_SF((rows, k, experts), 32)
            report["scale_offsets"].append(
                [[int(sf((r, c * 32, l))) for c in range(k // 32)] for l in range(experts) for r in range(rows)]
            )

    cute.compile(evaluate_layouts)
    report["torch_imported"] = "torch" in sys.modules
    return report


def child_env() -> dict:
    """This environment, with the directory jax_dsrelu is imported from on PYTHONPATH."""
    import jax_dsrelu

    source = os.path.dirname(os.path.dirname(os.path.abspath(jax_dsrelu.__file__)))
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = dict(child_env(), CUTE_DSL_ARCH="sm_100a", JAX_PLATFORMS="cpu")
    # Compile for real: no object code from the bridge's optional disk cache.
    env.pop("JAX_DSRELU_KERNEL_CACHE", None)
    done = subprocess.run(
        [sys.executable, __file__, json.dumps(CASES)],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _expected_outputs(case) -> list:
    m, _, n, e, _, _, _, out, dbias, act, _ = case
    outputs = [[[m, n], out], [[m], "float32"]]
    if dbias:
        outputs.append([[e, n], "float32"])
    if act:
        outputs.append([[m, n], out])
    return outputs + [[[e], "float32"]]


@pytest.mark.compile
@pytest.mark.parametrize("name", [name for name in CASES if CASES[name][0] > 0])
def test_lowers_to_one_custom_call_running_cudnns_kernel(compiled, name):
    report = compiled["cases"][name]
    deterministic = CASES[name][-1]
    assert report["targets"] == [CUTE_TARGET]
    assert report["cudnn_kernel"] == [True]
    # The reduction pass rides in the same custom call, in deterministic mode only.
    assert report["reduction_kernel"] == [deterministic]
    assert report["arch"] == [["sm_100a"]]
    assert not report["scatter"]
    assert report["outputs"] == _expected_outputs(CASES[name])
    requested, capacity = report["smem"]
    assert 0 < requested <= capacity


@pytest.mark.compile
@pytest.mark.parametrize("name", [name for name in CASES if CASES[name][0] > 0])
def test_the_call_declares_the_arrays_the_layout_makes(compiled, name):
    # Every input the adapter's declaration names, at its declared shape and dtype; the
    # padding bookkeeping (source and padded rows) stays with the layout bridge.
    report = compiled["cases"][name]
    declared, laid_out = report["declared"], report["laid_out"]
    deterministic = CASES[name][-1]
    assert set(declared) == set(laid_out) - ({"padded_sizes"} if not deterministic else set())
    assert {name: laid_out[name] for name in declared} == declared
    m, _, n, experts, *_, with_dbias, _, _ = CASES[name]
    padded, dprob_slots, dbias_slots = report["slots"]
    expected = {"dprob_slots": [padded, dprob_slots]} if deterministic else {"dprob": [padded]}
    expected["amax"] = [experts]
    if with_dbias:
        expected.update({"dbias_slots": [dbias_slots, n]} if deterministic else {"dbias": [experts, n]})
    assert report["accumulators"] == expected


@pytest.mark.compile
def test_auto_takes_sm100_for_mxfp8_on_blackwell(compiled):
    assert compiled["cases"]["auto_mxfp8"]["targets"] == [CUTE_TARGET]
    assert compiled["cases"]["auto_bf16"]["targets"] == []


@pytest.mark.compile
def test_a_new_row_count_reuses_the_compiled_kernel(compiled):
    names = list(CASES)
    counts = dict(zip(names, compiled["compiles"]))
    before = counts[names[names.index("deterministic_other_m") - 1]]
    assert counts["deterministic_other_m"] == before
    assert counts["deterministic"] >= 1 and counts["atomic"] == counts["deterministic"] + 1


@pytest.mark.compile
def test_no_rows_launch_nothing(compiled):
    report = compiled["cases"]["no_rows"]
    assert report["targets"] == [] and report["outputs"] == _expected_outputs(CASES["no_rows"])


@pytest.mark.compile
def test_scale_atom_formula_is_cute_dsls_layout(compiled):
    import numpy as np
    from test_sm100_layout import scale_atom_offset

    for (rows, k, experts), offsets in zip(SCALE_SHAPES, compiled["scale_offsets"]):
        e, r, c = np.meshgrid(np.arange(experts), np.arange(rows), np.arange(k // 32), indexing="ij")
        expected = scale_atom_offset(r, c, rows, k // 32, e).reshape(experts * rows, k // 32)
        np.testing.assert_array_equal(np.asarray(offsets), expected)


@pytest.mark.compile
def test_kernel_path_imports_no_torch(compiled):
    assert compiled["torch_imported"] is False


if __name__ == "__main__":
    print(json.dumps(_probe(json.loads(sys.argv[1]))))

"""Times the six grouped GEMMs of an MoE layer step against their alternatives, on one GPU.

At each layer shape (m, d, f, E) and grouping (--groups), on one set of bf16 inputs, each GEMM (2 m d f FLOPs): up
(h, act = srelu(x W1[e] + b1[e]), fused), down (act W2[e]), dsrelu (grouped_gemm_dsrelu(dy, W2, h, prob): dh,
dprob, db1, act), dx (dh W1[e]^T, W1 read in place), dw1 (x_e^T dh_e) and dw2 (act_e^T dy_e); by sm90 (ours;
sm90_det for dsrelu), cublas_dense (one dense bf16 GEMM of the same FLOPs), cublas_batched (E batches of m / E
rows) and, when --variants names it, quack (quack_gemms.py); precision.py states each. Ours are checked against
XLA's float32 result before they are timed (`compare`).

    python benchmarks/bench_gemms.py --commit $(git rev-parse --short HEAD) --out benchmarks/results
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/bench_gemms.py --prebuild
    python benchmarks/bench_gemms.py --cpu --out /tmp/gemms     # plumbing test, wall clock

writes bench_gemms.json (bench_gemms_<label>.json with --label) and its PNG.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import types
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import harness
import precision
import quack_gemms
import run_record
import timing
from harness import BF16, group_sizes_for, operand_shapes
import jax_dsrelu
from jax_dsrelu.kernels import registry as backend_choice
from jax_dsrelu.kernels.request import RaggedContractRequest, RaggedMatmulRequest

GEMMS = ("up", "down", "dsrelu", "dx", "dw1", "dw2")
VARIANTS = ("sm90", "sm90_det", "cublas_dense", "cublas_batched")
# Run only when --variants names them: QuACK needs PyTorch and quack-kernels installed.
OPTIONAL_VARIANTS = ("quack",)
# Unit roundoff (half an ulp at 1) of each output dtype, and of the float32 accumulator.
UNIT_ROUNDOFF = {np.dtype(jnp.bfloat16): 2.0**-8, np.dtype(jnp.float16): 2.0**-11, np.dtype(jnp.float32): 2.0**-24}
F32_ROUNDOFF = 2.0**-24
# dsrelu is checked normwise against the XLA backend: outputs rounded to bf16 on both sides
# differ by at most two roundings plus the effect of the float32 summation order, so 4 units
# of bf16 roundoff; float32 sums differ only by their order, about sqrt(n) 2^-24 relative.
DSRELU_TOLERANCE = {"dh": 2.0**-6, "act": 2.0**-6, "dprob": 2.0**-10, "dbias": 2.0**-10, "amax": 2.0**-6}
RAGGED_ROWS_CONTRACTED = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
# One way to compute a GEMM: build() (which may raise: then the variant is an error entry) gives a
# function of the named operands; ours are checked.
Variant = collections.namedtuple("Variant", ("name", "build", "operands"))


def make_operands(m, d, f, num_experts, seed, grouping="dirichlet") -> dict[str, jax.Array]:
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    normal = lambda shape, scale=1.0: (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(BF16)  # noqa: E731
    h = normal((m, f))
    prob = jax.random.uniform(next(keys), (m,), jnp.float32, 0.05, 1.0)
    operands = dict(x=normal((m, d)), dy=normal((m, d)), h=h, dh=normal((m, f)), act=activation(h, prob),
                    w1=normal((num_experts, d, f), 1 / np.sqrt(d)), w2=normal((num_experts, f, d), 1 / np.sqrt(f)),
                    b1=0.1 * jax.random.normal(next(keys), (num_experts, f), jnp.float32), prob=prob,
                    group_sizes=jnp.asarray(group_sizes_for(grouping, m, num_experts, seed)))
    # The dense GEMM's weight is its own array, so no slice copy is timed with it.
    return dict(operands, w1_dense=jnp.array(operands["w1"][0]), w2_dense=jnp.array(operands["w2"][0]))


@dataclasses.dataclass(frozen=True)
class RaggedMatmul:
    """out = lhs @ rhs[e] row by row; rhs stored (E, k, n) ("kn") or (E, n, k) ("nk")."""

    lhs: str
    rhs: str
    rhs_layout: str
    dense_weight: str  # the dense GEMM's weight of the same FLOPs, stored as rhs[0] is
    epilogue: str = "none"  # "srelu": h = acc + b1[e] and act = relu(h)^2 prob

    def operand_names(self):
        return (self.lhs, self.rhs, "group_sizes") + (("prob", "b1") if self.epilogue == "srelu" else ())

    def request(self, shapes, contract_out_dtype):  # the ragged-M outputs in the operand dtype, as moe_mlp's are
        lhs, rhs = shapes[self.lhs], shapes[self.rhs]
        return RaggedMatmulRequest(num_experts=rhs.shape[0], k=lhs.shape[1], n=rhs.shape[2 if self.rhs_layout == "kn" else 1],
                                   rhs_layout=self.rhs_layout, operand_dtype=np.dtype(lhs.dtype), out_dtype=BF16,
                                   epilogue=self.epilogue, with_bias=self.epilogue == "srelu")

    def xla_accumulator(self, lhs, rhs, group_sizes):
        rhs = rhs if self.rhs_layout == "kn" else jnp.swapaxes(rhs, 1, 2)
        return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)

    def dense(self, lhs, weight):
        return lax.dot_general(lhs, weight, (((1,), (0 if self.rhs_layout == "kn" else 1,)), ((), ())))

    def batched(self, lhs, rhs):
        """E batches of m / E rows of lhs, each times its rhs[e] as stored."""
        contract = 1 if self.rhs_layout == "kn" else 2
        out = lax.dot_general(lhs.reshape(rhs.shape[0], -1, lhs.shape[1]), rhs, (((2,), (contract,)), ((0,), (0,))))
        return out.reshape(lhs.shape[0], -1)

    def reference(self, operands) -> dict:
        reference = accumulated(self, operands, terms=operands[self.lhs].shape[1])
        if self.epilogue == "srelu":
            reference["bias"] = jax.jit(harness.bias_rows, static_argnums=2)(
                operands["b1"], operands["group_sizes"], operands[self.lhs].shape[0])
        return reference

    def check(self, outputs, reference, operands):
        acc, bound, terms = reference["acc"], reference["bound"], reference["terms"]
        if self.epilogue == "none":
            return dict(out=compare(outputs[0], acc, jnp.abs(acc), bound, terms))
        bias = reference["bias"]
        # Rounding scale |acc| + |b1|: one rounding of acc + b1, or two where acc is rounded first.
        checks = dict(h=compare(outputs[0], acc + bias, jnp.abs(acc) + jnp.abs(bias), bound, terms))
        # act is made from the h the kernel stored: relu(h)^2 prob in float32, rounded once.
        expected = jax.jit(activation, static_argnums=2)(outputs[0], operands["prob"], jnp.float32)
        checks["act"] = compare(outputs[1], expected, jnp.abs(expected), jnp.zeros_like(expected), 0)
        return checks


@dataclasses.dataclass(frozen=True)
class RaggedContract:
    """out[e] = lhs_e^T rhs_e over expert e's rows: (m, a), (m, b) -> (E, a, b)."""

    lhs: str
    rhs: str

    def operand_names(self):
        return (self.lhs, self.rhs, "group_sizes")

    def request(self, shapes, contract_out_dtype):
        lhs, rhs = shapes[self.lhs], shapes[self.rhs]
        return RaggedContractRequest(num_experts=shapes["group_sizes"].shape[0], a=lhs.shape[1], b=rhs.shape[1],
                                     operand_dtype=np.dtype(lhs.dtype), out_dtype=np.dtype(contract_out_dtype))

    def xla_accumulator(self, lhs, rhs, group_sizes):
        return lax.ragged_dot_general(lhs, rhs, group_sizes, RAGGED_ROWS_CONTRACTED, preferred_element_type=jnp.float32)

    def dense(self, lhs, rhs):
        return lax.dot_general(lhs, rhs, (((0,), (0,)), ((), ())))

    def batched(self, lhs, rhs, batches):
        """lhs_e^T rhs_e over E batches of m / E rows."""
        lhs, rhs = lhs.reshape(batches, -1, lhs.shape[1]), rhs.reshape(batches, -1, rhs.shape[1])
        return lax.dot_general(lhs, rhs, (((1,), (1,)), ((0,), (0,))))

    def reference(self, operands) -> dict:
        # The longest float32 sum is over the largest expert's rows.
        return accumulated(self, operands, terms=int(np.max(np.asarray(operands["group_sizes"]))))

    def check(self, outputs, reference, operands):
        return dict(out=compare(outputs[0], reference["acc"], jnp.abs(reference["acc"]), reference["bound"], reference["terms"]))


def accumulated(spec, operands, terms) -> dict:
    """spec's float32 result by XLA and |lhs| @ |rhs|, the scale of its summation error."""
    lhs, rhs, sizes = (operands[n] for n in (spec.lhs, spec.rhs, "group_sizes"))
    accumulate = jax.jit(spec.xla_accumulator)
    return dict(acc=accumulate(lhs, rhs, sizes), bound=accumulate(jnp.abs(lhs), jnp.abs(rhs), sizes), terms=terms)


def activation(h, prob, dtype=None):
    """act = relu(h)^2 prob in float32 from the rounded h, rounded to `dtype` (default h's, as moe_mlp makes it)."""
    r = jnp.maximum(h.astype(jnp.float32), 0.0)
    return (r * r * prob[:, None]).astype(dtype or h.dtype)


MATMULS = {"up": RaggedMatmul("x", "w1", "kn", "w1_dense", epilogue="srelu"),
           "down": RaggedMatmul("act", "w2", "kn", "w2_dense"), "dx": RaggedMatmul("dh", "w1", "nk", "w1_dense"),
           "dw1": RaggedContract("x", "dh"), "dw2": RaggedContract("act", "dy")}
DSRELU_OPERANDS = ("dy", "w2", "h", "prob", "group_sizes")


@jax.jit
def _compare(ours, reference, scale, accumulation_bound, terms):
    error = jnp.abs(ours.astype(jnp.float32) - reference)
    tiny = np.finfo(np.float32).tiny
    tolerance = 2.0 * UNIT_ROUNDOFF[np.dtype(ours.dtype)] * scale + 2.0 * terms * F32_ROUNDOFF * accumulation_bound + tiny
    relative = jnp.linalg.norm(error) / jnp.maximum(jnp.linalg.norm(reference), tiny)
    return jnp.max(error), jnp.max(error / tolerance), relative


def compare(ours, reference, scale, accumulation_bound, terms) -> dict:
    """Elementwise check of a result rounded once from a float32 sum of `terms` products:
    |ours - reference| <= 2 u |scale| + 2 terms 2^-24 (|lhs| @ |rhs|), u the output dtype's unit
    roundoff (a path may round twice), the second term how far two float32 sums of the same
    products in different orders drift apart. `worst` is the largest error over its bound."""
    if ours.shape != reference.shape:
        raise ValueError(f"result shape {ours.shape} differs from the reference's {reference.shape}")
    max_error, worst, relative = _compare(ours, reference, scale, accumulation_bound, float(terms))
    return dict(max_abs_error=float(max_error), worst_error_over_bound=float(worst), relative_frobenius_error=float(relative))


def check_passes(checks: dict) -> bool:
    return all(entry["worst_error_over_bound"] <= 1.0 if "worst_error_over_bound" in entry else entry["passes"]
               for entry in checks.values())


def check_dsrelu(outputs, reference, tolerances=DSRELU_TOLERANCE) -> dict:
    checks = {}
    for field, tolerance in tolerances.items():
        ours, ref = (np.asarray(getattr(o, field), np.float64) for o in (outputs, reference))
        relative = float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))
        checks[field] = dict(relative_frobenius_error=relative, max_abs_error=float(np.max(np.abs(ours - ref))),
                             tolerance=tolerance, passes=relative <= tolerance)
    return checks


def check_squared_relu(outputs, reference) -> dict:
    """The up-projection as QuACK computes it: h, and act = relu(h)^2 (no prob) of its float32 h."""
    acc, bound, terms, bias = (reference[key] for key in ("acc", "bound", "terms", "bias"))
    h = acc + bias
    checks = dict(h=compare(outputs[0], h, jnp.abs(acc) + jnp.abs(bias), bound, terms))
    # act's rounding (u) after squaring h, rounded (2u) or not: compare's 2u |scale|, scale 2 |act|.
    # A float32 sum of another order moves h by dh = 2 terms 2^-24 bound, act by 2 (|h| + dh) dh.
    drift = 2.0 * terms * F32_ROUNDOFF * bound
    expected = jnp.maximum(h, 0.0) ** 2
    checks["act"] = compare(outputs[1], expected, 2.0 * expected, 2.0 * (jnp.abs(h) + drift) * bound, terms)
    return checks


def quack_check(gemm, operands, reference) -> Callable:
    """How QuACK's outputs of `gemm` (quack_gemms.py says which) are checked."""
    if gemm == "dsrelu":
        tolerances = {field: DSRELU_TOLERANCE[field] for field in ("dh", "act", "dprob")}  # QuACK has no db1
        return lambda out: check_dsrelu(types.SimpleNamespace(dh=out[0], act=out[1], dprob=out[2]), reference, tolerances)
    if gemm == "up":
        return lambda out: check_squared_relu(out, reference)
    return lambda out: MATMULS[gemm].check(out, reference, operands)


def fused(backend, deterministic=False):
    """grouped_gemm_dsrelu with every output (dbias, act) on `backend`."""
    return jax.jit(lambda *a: jax_dsrelu.grouped_gemm_dsrelu(*a, with_dbias=True, with_act=True,
                                                             deterministic=deterministic, backend=backend))


def sm90_implementation(request):
    """Our kernel for `request` through the backend protocol (or NotImplementedError why not), called
    with a spec's `operand_names` in order and giving its results in order, as every variant runs."""
    backend = backend_choice.kernel_backend("sm90")
    if (reason := backend.software_missing() or backend.cannot_implement(request)) is not None:
        raise NotImplementedError(f"backend 'sm90' does not serve {request}: {reason}")
    implementation = backend.implementation(request)
    srelu = isinstance(request, RaggedMatmulRequest) and request.epilogue == "srelu"
    operands = ("lhs", "rhs", "group_sizes") + (("prob", "bias") if srelu else ())
    results = ("h", "act") if srelu else ("out",)
    return lambda *arrays: tuple(implementation(**dict(zip(operands, arrays)))[name] for name in results)


def gemm_variants(gemm: str, shapes, out_dtype) -> list[Variant]:
    """Every variant of one GEMM, in the order they run."""
    if gemm == "dsrelu":
        spec = RaggedMatmul("dy", "w2", "nk", "w2_dense")  # its GEMM: dy W2[e]^T
        ours = [Variant(name, lambda det=det: fused("sm90", det), DSRELU_OPERANDS)
                for name, det in (("sm90", False), ("sm90_det", True))]
    else:
        spec = MATMULS[gemm]
        request = spec.request(shapes, out_dtype)
        ours = [Variant("sm90", lambda: jax.jit(sm90_implementation(request)), spec.operand_names())]
    batched = (functools.partial(spec.batched, batches=shapes["group_sizes"].shape[0])
               if isinstance(spec, RaggedContract) else spec.batched)
    return ours + [Variant("cublas_dense", lambda: jax.jit(spec.dense), (spec.lhs, getattr(spec, "dense_weight", spec.rhs))),
                   Variant("cublas_batched", lambda: jax.jit(batched), (spec.lhs, spec.rhs))]


def bench_gemm(gemm, shape, operands, reps, clock, out_dtype, selected) -> dict:
    """Builds, checks (ours) and times each selected variant of `gemm`; any failure becomes its entry's error."""
    flops = 2.0 * shape[0] * shape[1] * shape[2]  # 2 m d f
    reference = fused("xla")(*(operands[n] for n in DSRELU_OPERANDS)) if gemm == "dsrelu" else MATMULS[gemm].reference(operands)
    def check(outputs):
        checks = check_dsrelu(outputs, reference) if gemm == "dsrelu" else MATMULS[gemm].check(outputs, reference, operands)
        return checks, check_passes(checks)
    results: dict[str, dict] = {}
    for variant in (v for v in gemm_variants(gemm, operand_shapes(*shape), out_dtype) if v.name in selected):
        print(f"{shape} {gemm} {variant.name}", flush=True)
        try:
            fn = variant.build()
        except Exception as error:  # not built: recorded, the next variant runs
            results[variant.name] = run_record.error_entry(error, "build")
            continue
        results[variant.name] = harness.measure(fn, tuple(operands[n] for n in variant.operands), reps, clock,
                                                check=check if variant.name.startswith("sm90") else None)[0]
    if "quack" in selected:
        print(f"{shape} {gemm} quack", flush=True)
        results["quack"] = quack_gemms.bench_entry(
            gemm, operands, quack_check(gemm, operands, reference), check_passes, reps, clock, out_dtype)
    for entry in (entry for entry in results.values() if "ms" in entry):
        entry["tflops"] = timing.tflops(flops, entry["ms"])
    return dict(flops=flops, variants=results)


def prebuild(shapes, gemms, variants, out_dtype) -> None:
    """Lowers the selected sm90 variants at these shapes for cuda, which builds and caches their kernels."""
    for shape, gemm in itertools.product(shapes, gemms):
        described = operand_shapes(*shape)
        for variant in gemm_variants(gemm, described, out_dtype):
            if variant.name in variants and variant.name.startswith("sm90"):  # built while traced: "not built" is said
                harness.lower_for_cuda(f"bench_gemms {gemm} {variant.name} {shape}", lambda *a, build=variant.build: build()(*a),
                                       *(described[n] for n in variant.operands))


def plot(rows, path, title):
    shown = ("sm90", "cublas_dense", "cublas_batched", "quack")
    harness.plot_bars([(f"{harness.row_title(row)}, {row['grouping']} groups", list(row["gemms"]),
                        {v: [g["variants"].get(v, {}).get("tflops", 0.0) for g in row["gemms"].values()] for v in shown})
                       for row in rows], path, title, "TFLOP/s")


def main(argv=None):
    parser = harness.parser(__doc__.split("\n\n")[0], reps=20, variants=VARIANTS, optional_variants=OPTIONAL_VARIANTS,
                            subsets=dict(gemms=GEMMS))
    parser.add_argument("--contract-out-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="dtype of dW1 and dW2 (the ragged contraction's output)")
    options = harness.parse(parser, argv)
    out_dtype = np.dtype(options.contract_out_dtype)
    if options.prebuild:
        return prebuild(options.shapes, options.gemms, options.variants, out_dtype)

    def measure_row(shape, grouping, row, clock, save):
        operands = make_operands(*shape, options.seed, grouping)
        row.update(group_sizes=np.asarray(operands["group_sizes"]).tolist(), gemms={})
        for gemm in options.gemms:
            try:
                row["gemms"][gemm] = bench_gemm(gemm, shape, operands, options.reps, clock, out_dtype, options.variants)
            except Exception as error:  # the reference itself failed (out of memory, say)
                row["gemms"][gemm] = dict(run_record.error_entry(error, "reference"), variants={})
            save()

    harness.run(options, measure_row, plot, "gemms", benchmark="bench_gemms", title="grouped GEMMs, bf16",
                description="the six grouped GEMMs of an MoE layer step, bf16", contract_out_dtype=out_dtype.name,
                flops="2 m d f per GEMM", precision=precision.stated("bench_gemms", options.variants))


if __name__ == "__main__":
    main()

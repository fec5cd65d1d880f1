"""Times a whole MoE layer step through `moe_mlp` against its alternatives, on one GPU.

At each shape (m, d, f, E) and grouping (--groups), on one set of bf16 inputs (b1 included): the step
(jax.value_and_grad of sum(y * cotangent) in x, w1, w2, prob and b1, 12 m d f FLOPs, m the rows the experts own)
and the forward (4 m d f), by moe_mlp on backend xla and sm90 (sm90_det: deterministic), and the bf16 baselines a
user would write: dense_mlp (one expert's weights for every row, autodiff), batched_mlp (E equal batches), and the
step's six GEMMs alone on cuBLAS, cublas_dense (the practical ceiling) and cublas_batched; precision.py states
each. The sm90 results are checked against xla's before they are timed, and the step's kernels set against their
rooflines (roofline.py). By --variants, the FP8 step: moe_mlp at precision=FP8_BLOCKWISE on xla (xla_fp8, the reference),
on sm90's FP8 kernels as "auto" runs them (sm90_fp8; sm90_fp8_det: deterministic; sm90_fp8_reused: the weights
quantized once outside the step, as across micro-steps), cublas_fp8: six e4m3 GEMMs.

    python benchmarks/bench_layer.py --commit $(git rev-parse --short HEAD) --out benchmarks/results
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/bench_layer.py --prebuild
    python benchmarks/bench_layer.py --cpu --out /tmp/layer     # plumbing test, wall clock

writes bench_layer.json (gzipped where large: run_record.write_json) and bench_layer.png.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import harness
import precision
import roofline
from bench_gemms import activation
from harness import BF16, group_sizes_for, operand_shapes

import jax_dsrelu
from jax_dsrelu.quantization.schema import E4M3, FP8_BLOCKWISE

VARIANTS = ("xla", "sm90", "sm90_det", "dense_mlp", "batched_mlp", "cublas_dense", "cublas_batched")
FP8_VARIANTS = ("xla_fp8", "sm90_fp8", "sm90_fp8_det", "sm90_fp8_reused", "cublas_fp8")
# Variants that compute something else than moe_mlp: timed, not checked against it.
BASELINES = ("dense_mlp", "batched_mlp", "cublas_dense", "cublas_batched", "cublas_fp8")
# The variants through moe_mlp, which a prebuild lowers (xla compiles no kernel, but tests the path).
LAYER_VARIANTS = ("xla", "sm90", "sm90_det", *(v for v in FP8_VARIANTS if v not in BASELINES))
# Each one's check, against the XLA backend in its precision.
REFERENCE = {"sm90": "xla", "sm90_det": "xla", **{v: "xla_fp8" for v in LAYER_VARIANTS if v.startswith("sm90_fp8")}}
MODES = ("step", "forward")
FLOPS_PER_MDF = {"step": 12.0, "forward": 4.0}
GRADIENTS = ("x", "w1", "w2", "prob", "b1")  # moe_mlp's differentiable operands, in order
# Normwise, against the xla backend: both round h, act and dh to bf16, an ulp apart where
# their float32 sums differ in the last bits, so results agree to a few bf16 ulps (2^-8).
TOLERANCE = 2e-2


def make_operands(m, d, f, num_experts, seed, grouping="dirichlet", fp8=False, quantized=False) -> dict[str, jax.Array]:
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    normal = lambda shape, scale=1.0: (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(BF16)  # noqa: E731
    operands = dict(
        x=normal((m, d)), w1=normal((num_experts, d, f), 1 / np.sqrt(d)), w2=normal((num_experts, f, d), 1 / np.sqrt(f)),
        prob=jax.random.uniform(next(keys), (m,), jnp.float32, 0.05, 1.0),
        b1=0.1 * jax.random.normal(next(keys), (num_experts, f), jnp.float32),
        group_sizes=jnp.asarray(group_sizes_for(grouping, m, num_experts, seed)),
        cotangent=normal((m, d)), act=normal((m, f)), dh=normal((m, f)))
    # The dense MLP's own weights, so no slice copy is timed with it.
    operands.update({f"{name}_dense": jnp.array(operands[name][0]) for name in ("w1", "w2", "b1")})
    # With fp8, the dense FP8 GEMMs' (A, B) pairs, e4m3 and K-major as cuBLASLt's FP8 GEMM reads both.
    x, act, dh, dy, w1, w2 = (operands[n] for n in ("x", "act", "dh", "cotangent", "w1_dense", "w2_dense"))
    pairs = ((x, w1.T), (act, w2.T), (dy, w2), (dh, w1), (x.T, dh.T), (act.T, dy.T)) if fp8 else ()
    operands.update({f"fp8_{i}{side}": t.astype(E4M3) for i, pair in enumerate(pairs) for side, t in zip("ab", pair)})
    if quantized:  # the weights' FP8 copies, for sm90_fp8_reused
        operands["quantized"] = jax.jit(jax_dsrelu.quantize_expert_weights, static_argnums=2)(
            operands["w1"], operands["w2"], FP8_BLOCKWISE)
    return dict(operands, one=jnp.ones((), jnp.float32))


def moe_mlp_with(backend, deterministic, precision=None):
    return lambda x, w1, w2, prob, b1, group_sizes, quantized=None: jax_dsrelu.moe_mlp(
        x, w1, w2, prob, group_sizes, b1=b1, deterministic=deterministic, backend=backend, precision=precision,
        quantized_weights=quantized)


def fp8_gemms(*pairs):
    """(A, B) pairs, then a per-tensor float32 scale: each A (M, K) B (N, K)^T of e4m3 operands, bf16 out."""
    up = lambda t: t.astype(BF16) * pairs[-1].astype(BF16)  # noqa: E731
    return tuple(jax.lax.dot_general(up(a), up(b), (((1,), (1,)), ((), ())), preferred_element_type=BF16)
                 for a, b in zip(pairs[:-1:2], pairs[1:-1:2]))


def dense_mlp(x, w1, w2, prob, b1):
    """The dense MLP of the same FLOPs, every row through one expert's shapes, in bf16."""
    h = jnp.dot(x, w1, preferred_element_type=x.dtype) + b1.astype(x.dtype)
    return jnp.dot(activation(h, prob), w2, preferred_element_type=x.dtype)


def batched_mlp(x, w1, w2, prob, b1):
    """The MLP over E batches of m / E rows, batch e through expert e's weights, in bf16."""
    xb = x.reshape(w1.shape[0], -1, x.shape[1])
    h = jnp.einsum("erd,edf->erf", xb, w1, preferred_element_type=x.dtype) + b1[:, None].astype(x.dtype)
    act = activation(h.reshape(x.shape[0], -1), prob).reshape(h.shape)
    return jnp.einsum("erf,efd->erd", act, w2, preferred_element_type=x.dtype).reshape(x.shape)


def cublas_gemms(mode, batched):
    """The step's GEMMs alone: x W1, act W2 (the forward's), dy W2^T, dh W1^T, x^T dh and act^T dy."""
    def gemms(x, w1, w2, act, dh, dy):
        if batched:  # E equal batches of rows, each with its expert's weights
            x, act, dh, dy = (a.reshape(w1.shape[0], -1, a.shape[1]) for a in (x, act, dh, dy))
        rows, weight = ("er", "e") if batched else ("r", "")
        gemm = lambda spec, a, b: jnp.einsum(spec.format(r=rows, e=weight), a, b, preferred_element_type=BF16)  # noqa: E731
        outputs = (gemm("{r}d,{e}df->{r}f", x, w1), gemm("{r}f,{e}fd->{r}d", act, w2))
        if mode == "step":
            outputs += (gemm("{r}d,{e}fd->{r}f", dy, w2), gemm("{r}f,{e}df->{r}d", dh, w1),
                        gemm("{r}d,{r}f->{e}df", x, dh), gemm("{r}f,{r}d->{e}fd", act, dy))
        return outputs

    return gemms


def loss_of(layer):
    """sum(layer(*operands) * cotangent), the cotangent the last operand, in float32."""
    return lambda *operands: jnp.sum(layer(*operands[:-1]).astype(jnp.float32) * operands[-1].astype(jnp.float32))


def computation(variant, mode):
    """(function, operand names) of one variant's step or forward."""
    if variant in ("cublas_dense", "cublas_batched"):
        weights = ("w1", "w2") if variant == "cublas_batched" else ("w1_dense", "w2_dense")
        return cublas_gemms(mode, variant == "cublas_batched"), ("x", *weights, "act", "dh", "cotangent")
    if variant == "cublas_fp8":
        return fp8_gemms, tuple(f"fp8_{i}{side}" for i in range(6 if mode == "step" else 2) for side in "ab") + ("one",)
    if variant == "dense_mlp":
        layer, names = dense_mlp, ("x", "w1_dense", "w2_dense", "prob", "b1_dense")
    elif variant == "batched_mlp":
        layer, names = batched_mlp, ("x", "w1", "w2", "prob", "b1")
    else:
        names, fp8 = ("x", "w1", "w2", "prob", "b1", "group_sizes"), "_fp8" in variant
        if variant == "sm90_fp8_reused":  # moe_mlp's quantized_weights, made before the step (untimed)
            names += ("quantized",)
        backend = "xla" if variant.startswith("xla") else "auto" if fp8 else "sm90"  # sm90 refuses a precision
        layer = moe_mlp_with(backend, variant.endswith("_det"), FP8_BLOCKWISE if fp8 else None)
    if mode == "forward":
        return layer, names
    return jax.value_and_grad(loss_of(layer), argnums=tuple(range(5))), names + ("cotangent",)


def flatten(outputs, mode):
    """The named results: the loss and every gradient (step), or y (forward)."""
    return ({"y": outputs} if mode == "forward"
            else {"loss": outputs[0], **{f"d{name}": grad for name, grad in zip(GRADIENTS, outputs[1])}})


def compare(outputs, reference) -> tuple[dict, bool]:
    """Normwise errors against the xla backend, and whether all pass. The loss is recorded but
    not judged: a sum of terms of both signs, its relative error says nothing about the layer."""
    errors = {name: float(harness.relative_error(outputs[name], ref)) for name, ref in reference.items()}
    checks = {name: dict(relative_error=error, **({} if name == "loss" else dict(passes=error <= TOLERANCE)))
              for name, error in errors.items()}
    return checks, all(c.get("passes", True) for c in checks.values())


def run_variant(variant, mode, operands, reference, reps, clock, flops) -> tuple[dict, dict | None]:
    """(entry, named outputs): compiled, checked against `reference`, timed; or an error."""
    fn, names = computation(variant, mode)
    if variant not in BASELINES:
        fn = functools.partial(lambda fn, *args: flatten(fn(*args), mode), fn)
    ours = variant in REFERENCE
    entry, outputs = harness.measure(
        fn, tuple(operands[name] for name in names), reps, clock,
        check=functools.partial(compare, reference=reference) if ours and reference else None,
        flops=flops, compiler_options=harness.CUBLAS_ONLY if variant.startswith("cublas") else None)
    if ours and reference is None:  # recorded rather than dropped
        entry["check"] = f"not checked: {REFERENCE[variant]}, its reference, did not run or failed at this shape"
    return entry, outputs


def prebuild(shapes, variants, modes) -> None:
    """Lowers the selected moe_mlp variants' steps and forwards for cuda, building their kernels."""
    built = [v for v in variants if v in LAYER_VARIANTS and v != "sm90_fp8_reused"]  # whose kernels are sm90_fp8's
    for shape, variant, mode in itertools.product(shapes, built, modes):
        fn, names = computation(variant, mode)
        harness.lower_for_cuda(f"bench_layer {variant} {mode} {shape}", fn, *(operand_shapes(*shape)[n] for n in names))


def plot(rows, path, title):
    labels = [f"{r['shape']['m']},{r['shape']['d']}\n{r['shape']['f']},{r['shape']['E']}\n{r['grouping']}" for r in rows]
    panels = [(f"{mode} (TFLOP/s at {FLOPS_PER_MDF[mode]:.0f} m d f)", labels,
               {v: [r["modes"][mode]["variants"].get(v, {}).get("tflops", 0.0) for r in rows] for v in VARIANTS + FP8_VARIANTS})
              for mode in (rows[0]["modes"] if rows else ())]
    harness.plot_bars(panels, path, title, "TFLOP/s")


def main(argv=None):
    options = harness.parse(harness.parser(__doc__.split("\n\n")[0], reps=10, variants=VARIANTS,
                                           optional_variants=FP8_VARIANTS, subsets=dict(modes=MODES)), argv)
    if options.prebuild:
        return prebuild(options.shapes, options.variants, options.modes)

    copy = {}

    def measure_row(shape, grouping, row, clock, save):
        """Fills `row` with every mode's variants, saving after each, and the step's rooflines."""
        if not copy:  # once per run, beside the kernels it is the ceiling of
            copy.update(roofline.copy_rate(clock, options.reps, 1 << 20 if options.cpu else roofline.COPY_BYTES))
        (m, d, f, _), operands = shape, make_operands(*shape, options.seed, grouping, "cublas_fp8" in options.variants,
                                                             "sm90_fp8_reused" in options.variants)
        row.update(group_sizes=np.asarray(operands["group_sizes"]).tolist(), modes={})
        owned = int(np.sum(row["group_sizes"]))  # m, but where token rounding cut rows
        for mode in options.modes:
            flops, results, references = FLOPS_PER_MDF[mode] * owned * d * f, {}, {}
            for variant in harness.reference_first(options.variants, set(REFERENCE.values())):
                print(f"{shape} {mode} {variant}", flush=True)
                done = FLOPS_PER_MDF[mode] * m * d * f if variant in BASELINES else flops  # they compute every row
                results[variant], outputs = run_variant(variant, mode, operands, references.get(REFERENCE.get(variant)),
                                                        options.reps, clock, done)
                references.update({variant: outputs} if variant in REFERENCE.values() else {})
            del references
            row["modes"][mode] = dict(flops=flops, variants=results)
            row["modes"][mode].update({key: roofline.roofline(shape, owned, row["modes"][mode], copy, *of) for key, of in
                                       roofline.STEPS.items() if mode == "step" and of[0] in options.variants})
            save()

    harness.run(options, measure_row, plot, "modes", benchmark="bench_layer",
                title="moe_mlp layer, bf16", description="moe_mlp layer: value_and_grad step and forward, bf16, with b1",
                flops="12 m d f per step, 4 m d f per forward, m the rows the experts own", memory=harness.MEMORY,
                precision=precision.stated("bench_layer", options.variants))


if __name__ == "__main__":
    main()

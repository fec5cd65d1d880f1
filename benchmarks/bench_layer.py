"""Times a whole MoE layer step through `moe_mlp` against its alternatives, on one GPU.

At each shape (m, d, f, E) and grouping (--groups: "dirichlet" ragged sizes or "equal",
m / E rows each), with one set of bf16 inputs (b1 included) shared by every variant, two
computations:

    step     jax.value_and_grad of sum(y * cotangent) in x, w1, w2, prob and b1
    forward  y alone

for the variants

    xla        moe_mlp(backend="xla")
    sm90       moe_mlp(backend="sm90", deterministic=False)
    sm90_det   moe_mlp(backend="sm90", deterministic=True)
    pallas     an MLP of jaxlib's Pallas kernels with a custom VJP (`pallas_mlp`): the
               GEMMs on ragged_dot_mgpu (forward, da, dx) and transposed_ragged_dot_mgpu
               (dW1, dW2); in XLA: b1, the activation, the dsReLU epilogue, dprob and db1
    dense_xla  XLA's dense MLP of the same FLOPs (one (d, f) and one (f, d) weight)
    batched_xla  XLA's MLP over E batches of m / E rows (batched GEMMs, every expert's
               own weights): the ceiling of equal groups
    batched_cublas  the same with every GEMM on cuBLAS (harness.CUBLAS_ONLY)

Throughput counts 12 m d f FLOPs per step and 4 m d f per forward. Each variant records
its CUPTI per-kernel breakdown (timing.py) and the step's peak device memory from XLA's
memory analysis of the compiled computation (arguments + outputs + temporaries - aliased).
The sm90 and Pallas results are checked against the xla backend's before they are timed;
a variant that fails is recorded as an error and the script goes on.

    python benchmarks/bench_layer.py --commit $(git rev-parse --short HEAD) --out benchmarks/results
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/bench_layer.py --prebuild
    python benchmarks/bench_layer.py --cpu --out /tmp/layer     # plumbing test, wall clock

writes bench_layer.json and bench_layer.png.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import cuda_lowering
import harness
import run_record
import timing
from bench_gemms import activation
from harness import SHAPES, group_sizes_for

import jax_dsrelu
from jax_dsrelu import groups

VARIANTS = ("xla", "sm90", "sm90_det", "pallas", "dense_xla", "batched_xla", "batched_cublas")
XLA_VARIANTS = ("xla", "dense_xla", "batched_xla", "batched_cublas")
MODES = ("step", "forward")
FLOPS_PER_MDF = {"step": 12.0, "forward": 4.0}
GRADIENTS = ("x", "w1", "w2", "prob", "b1")  # moe_mlp's differentiable operands, in order
BF16 = np.dtype(jnp.bfloat16)
# Block configurations of the Pallas MLP, tried in order until one compiles and agrees
# (ragged_dot_mgpu, transposed_ragged_dot_mgpu); the first pair was bench_dsrelu.py's best.
PALLAS_CONFIGS = [
    (dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=4, grid_block_n=2),
     dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)),
    (dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2),
     dict(block_m=128, block_n=128, block_k=128, max_concurrent_steps=2, grid_block_n=2)),
]
# Normwise, against the xla backend. Both round h, act and dh to bf16 before the bf16
# GEMMs that follow; where their float32 sums differ in the last bits those roundings
# differ by an ulp, so results agree to a few bf16 ulps (2^-8 each) relative to their norm.
TOLERANCE = 2e-2


# ------------------------------------------------------------------------------ operands


def operand_shapes(m, d, f, num_experts) -> dict[str, jax.ShapeDtypeStruct]:
    s = jax.ShapeDtypeStruct
    return dict(
        x=s((m, d), BF16), w1=s((num_experts, d, f), BF16), w2=s((num_experts, f, d), BF16),
        prob=s((m,), jnp.float32), b1=s((num_experts, f), jnp.float32),
        group_sizes=s((num_experts,), jnp.int32), cotangent=s((m, d), BF16),
        w1_dense=s((d, f), BF16), w2_dense=s((f, d), BF16), b1_dense=s((f,), jnp.float32),
    )


def make_operands(m, d, f, num_experts, seed, grouping="dirichlet") -> dict[str, jax.Array]:
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    normal = lambda shape, scale=1.0: (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(BF16)  # noqa: E731
    operands = dict(
        x=normal((m, d)), w1=normal((num_experts, d, f), 1 / np.sqrt(d)),
        w2=normal((num_experts, f, d), 1 / np.sqrt(f)),
        prob=jax.random.uniform(next(keys), (m,), jnp.float32, 0.05, 1.0),
        b1=0.1 * jax.random.normal(next(keys), (num_experts, f), jnp.float32),
        group_sizes=jnp.asarray(group_sizes_for(grouping, m, num_experts, seed)),
        cotangent=normal((m, d)),
    )
    # The dense MLP's own weights, so no slice copy is timed with it.
    operands.update(w1_dense=jnp.array(operands["w1"][0]), w2_dense=jnp.array(operands["w2"][0]),
                    b1_dense=jnp.array(operands["b1"][0]))
    return operands


# ------------------------------------------------------------------------ the variants


def pallas_mlp(config, transposed_config):
    """moe_mlp's function on jaxlib's Pallas Mosaic GPU kernels (`mlp_on`)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    def ragged(lhs, rhs, group_sizes, transpose_rhs=False):
        return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **config)

    def contract(lhs, rhs, group_sizes):
        # lhs (m, a) and rhs (m, b) are read as stored, the ragged m contracted.
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(lhs, rhs, group_sizes=group_sizes, **transposed_config)

    return mlp_on(ragged, contract)


def mlp_on(ragged, contract):
    """(x, w1, w2, prob, b1, group_sizes) -> y with a custom VJP, on two GEMM functions:

        ragged(lhs (m, k), rhs, group_sizes, transpose_rhs) -> (m, n) in lhs.dtype, rhs
            stored (E, k, n), or (E, n, k) with transpose_rhs
        contract(lhs (m, a), rhs (m, b), group_sizes) -> (E, a, b) in lhs.dtype

    Pallas has no ragged GEMM with a fused epilogue, so b1, the activation, the dsReLU
    backward (dh, dprob) and db1 (a dense dot with the one-hot expert matrix: a fixed
    order, unlike a scatter-add) are XLA fusions around the GEMMs.
    """

    def forward(x, w1, w2, prob, b1, group_sizes):
        expert, owned = groups.row_experts(group_sizes, x.shape[0])
        bias = jnp.where(owned[:, None], b1[expert], 0.0)
        h = (ragged(x, w1, group_sizes).astype(jnp.float32) + bias).astype(x.dtype)
        return ragged(activation(h, prob), w2, group_sizes).astype(x.dtype), h

    @jax.custom_vjp
    def mlp(x, w1, w2, prob, b1, group_sizes):
        return forward(x, w1, w2, prob, b1, group_sizes)[0]

    def mlp_fwd(x, w1, w2, prob, b1, group_sizes):
        y, h = forward(x, w1, w2, prob, b1, group_sizes)
        return y, (x, w1, w2, prob, b1, group_sizes, h)

    def mlp_bwd(residuals, dy):
        x, w1, w2, prob, b1, group_sizes, h = residuals
        dy = dy.astype(x.dtype)
        expert, owned = groups.row_experts(group_sizes, x.shape[0])
        da = ragged(dy, w2, group_sizes, transpose_rhs=True).astype(jnp.float32)  # W2 (E, f, d) read as (E, n, k)
        r = jnp.maximum(h.astype(jnp.float32), 0.0)
        dh32 = jnp.where(owned[:, None], 2.0 * da * r * prob[:, None], 0.0)
        dprob = jnp.where(owned, jnp.sum(r * r * da, axis=1), 0.0)
        one_hot = ((expert[:, None] == jnp.arange(w1.shape[0])) & owned[:, None]).astype(jnp.float32)
        db1 = lax.dot_general(one_hot, dh32, (((0,), (0,)), ((), ())))
        dh = dh32.astype(x.dtype)
        dx = ragged(dh, w1, group_sizes, transpose_rhs=True).astype(x.dtype)  # W1 (E, d, f) read as (E, n, k)
        dw1 = contract(x, dh, group_sizes).astype(w1.dtype)
        dw2 = contract(activation(h, prob), dy, group_sizes).astype(w2.dtype)
        dgroup_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
        return dx, dw1, dw2, dprob.astype(prob.dtype), db1.astype(b1.dtype), dgroup_sizes

    mlp.defvjp(mlp_fwd, mlp_bwd)
    return mlp


def moe_mlp_with(backend, deterministic):
    def layer(x, w1, w2, prob, b1, group_sizes):
        return jax_dsrelu.moe_mlp(x, w1, w2, prob, group_sizes, b1=b1, deterministic=deterministic, backend=backend)

    return layer


def dense_mlp(x, w1, w2, prob, b1):
    """XLA's dense MLP of the same FLOPs: every row through one expert's shapes."""
    h = (jnp.dot(x, w1, preferred_element_type=jnp.float32) + b1).astype(x.dtype)
    return jnp.dot(activation(h, prob), w2, preferred_element_type=jnp.float32).astype(x.dtype)


def batched_mlp(x, w1, w2, prob, b1):
    """XLA's MLP over E batches of m / E rows, batch e through expert e's weights."""
    batches = w1.shape[0]
    xb = x.reshape(batches, -1, x.shape[1])
    h = (jnp.einsum("erd,edf->erf", xb, w1, preferred_element_type=jnp.float32) + b1[:, None]).astype(x.dtype)
    act = activation(h.reshape(x.shape[0], -1), prob).reshape(h.shape)
    y = jnp.einsum("erf,efd->erd", act, w2, preferred_element_type=jnp.float32).astype(x.dtype)
    return y.reshape(x.shape)


def loss_of(layer):
    def loss(*operands):
        *layer_operands, cotangent = operands
        y = layer(*layer_operands)
        return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32))

    return loss


def computation(variant, mode, pallas_configs=None):
    """(function, operand names) of one variant's step or forward."""
    if variant == "dense_xla":
        layer, names = dense_mlp, ("x", "w1_dense", "w2_dense", "prob", "b1_dense")
    elif variant in ("batched_xla", "batched_cublas"):
        layer, names = batched_mlp, ("x", "w1", "w2", "prob", "b1")
    else:
        names = ("x", "w1", "w2", "prob", "b1", "group_sizes")
        if variant == "pallas":
            layer = pallas_mlp(*pallas_configs)
        else:
            layer = moe_mlp_with("xla" if variant == "xla" else "sm90", variant == "sm90_det")
    if mode == "forward":
        return layer, names
    return jax.value_and_grad(loss_of(layer), argnums=tuple(range(5))), names + ("cotangent",)


# ----------------------------------------------------------------------------- running


def memory(compiled) -> dict:
    stats = compiled.memory_analysis()
    if stats is None:
        return {"unavailable": "this backend gives no memory analysis"}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    entry = {field: int(getattr(stats, field)) for field in fields}
    entry["peak_bytes"] = (
        entry["argument_size_in_bytes"] + entry["output_size_in_bytes"]
        + entry["temp_size_in_bytes"] - entry["alias_size_in_bytes"]
    )
    return entry


def flatten(outputs, mode):
    """The named results: the loss and every gradient (step), or y (forward)."""
    if mode == "forward":
        return {"y": outputs}
    value, grads = outputs
    return {"loss": value, **{f"d{name}": grad for name, grad in zip(GRADIENTS, grads)}}


@jax.jit
def _relative_error(ours, reference):
    difference = ours.astype(jnp.float32) - reference.astype(jnp.float32)
    scale = jnp.maximum(jnp.linalg.norm(reference.astype(jnp.float32)), np.finfo(np.float32).tiny)
    return jnp.linalg.norm(difference) / scale


def compare(outputs, reference) -> dict:
    """Normwise errors against the xla backend. The loss is recorded but not judged: it is
    a sum of terms of both signs, so its relative error says nothing about the layer."""
    checks = {}
    for name, ref in reference.items():
        relative = float(_relative_error(outputs[name], ref))
        checks[name] = dict(relative_error=relative)
        if name != "loss":
            checks[name]["passes"] = relative <= TOLERANCE
    return checks


def run_variant(variant, mode, operands, reference, reps, clock, flops) -> tuple[dict, dict | None]:
    """(entry, named outputs): compiled, checked against `reference`, timed; or an error."""
    configs = PALLAS_CONFIGS if variant == "pallas" else [None]
    failed: list[dict] = []  # earlier block configurations that did not work, and why
    for config in configs:
        stage, entry = "compile", {}
        try:
            fn, names = computation(variant, mode, config)
            args = tuple(operands[name] for name in names)
            options = harness.CUBLAS_ONLY if variant == "batched_cublas" else None
            compiled = jax.jit(fn, compiler_options=options).lower(*args).compile()
            entry = dict(memory=memory(compiled))
            if config is not None:
                entry["pallas_configs"] = [dict(block) for block in config]
            stage = "run"
            outputs = flatten(compiled(*args), mode)
            if variant not in XLA_VARIANTS and reference is None:
                # Recorded rather than dropped: without XLA's result there is nothing to check.
                entry["check"] = "not checked: the xla backend failed at this shape"
            elif variant not in XLA_VARIANTS:
                stage = "check"
                entry["check"] = compare(outputs, reference)
                if not all(check.get("passes", True) for check in entry["check"].values()):
                    print(f"  {variant} {mode} disagrees with the xla backend: {entry['check']}", flush=True)
                    raise ValueError(f"{variant} {mode} outside the tolerance {TOLERANCE} of the xla backend")
            stage = "timing"
            entry.update(timing.time_call(compiled, args, reps, clock).record())
            entry["tflops"] = timing.tflops(flops, entry["ms"])
            if failed:
                entry["failed_configs"] = failed
            return entry, outputs
        except Exception as error:  # recorded; the next configuration or variant runs
            entry = dict(entry, **run_record.error_entry(error, stage))
            if config is not None:
                failed.append(dict(configs=[dict(block) for block in config], error=entry["error"], stage=stage))
    if failed:
        entry["failed_configs"] = failed
    return entry, None


def bench_shape(shape, row, operands, variants, modes, reps, clock, save) -> None:
    """Fills `row` with every mode's variants at this shape, saving after each mode."""
    m, d, f, num_experts = shape
    row.update(group_sizes=np.asarray(operands["group_sizes"]).tolist(), modes={})
    for mode in modes:
        flops = FLOPS_PER_MDF[mode] * m * d * f
        results: dict[str, dict] = {}
        reference = None
        # The xla backend runs first: every other variant is checked against it.
        for variant in ["xla"] + [v for v in variants if v != "xla"]:
            if variant not in variants:
                continue
            print(f"{shape} {mode} {variant}", flush=True)
            entry, outputs = run_variant(variant, mode, operands, reference, reps, clock, flops)
            if variant == "xla":
                reference = outputs
            results[variant] = entry
        del reference
        row["modes"][mode] = dict(flops=flops, variants=results, ratios=ratios(results))
        save()


def ratios(results) -> dict:
    ms = {name: entry["ms"] for name, entry in results.items() if "ms" in entry}
    out = {}
    for ours in ("sm90", "sm90_det", "pallas"):
        for other in XLA_VARIANTS:
            if ours in ms and other in ms:
                out[f"{ours}_speedup_vs_{other}"] = ms[other] / ms[ours]
    if "sm90" in ms and "sm90_det" in ms:
        out["det_overhead"] = ms["sm90_det"] / ms["sm90"] - 1.0
    peaks = {name: entry["memory"]["peak_bytes"] for name, entry in results.items()
             if "peak_bytes" in entry.get("memory", {})}
    for ours in ("sm90", "sm90_det"):
        if ours in peaks and "xla" in peaks:
            out[f"{ours}_peak_memory_vs_xla"] = peaks[ours] / peaks["xla"]
    return out


# ------------------------------------------------------------------------- prebuild


# Variants that run through moe_mlp, whose kernels a prebuild compiles (xla: none, but
# lowering it tests the path without compiling anything).
LAYER_VARIANTS = ("xla", "sm90", "sm90_det")


def prebuild(shapes, variants, modes) -> None:
    """Lowers the selected moe_mlp variants' steps and forwards for cuda, which builds and
    caches the kernels they run."""
    cuda_lowering.prepare()
    for shape in shapes:
        described = operand_shapes(*shape)
        for variant in (v for v in variants if v in LAYER_VARIANTS):
            for mode in modes:
                fn, names = computation(variant, mode)
                cuda_lowering.lower_for_cuda(
                    f"bench_layer {variant} {mode} {shape}", fn, *(described[n] for n in names)
                )


# ------------------------------------------------------------------------- reporting


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(rows[0]["modes"]) if rows else []
    fig, axes = plt.subplots(1, max(len(modes), 1), figsize=(6.5 * max(len(modes), 1), 4.5), squeeze=False)
    width = 0.14
    for ax, mode in zip(axes[0], modes):
        for index, variant in enumerate(VARIANTS):
            values = [row["modes"][mode]["variants"].get(variant, {}).get("tflops", 0.0) for row in rows]
            x = np.arange(len(rows)) + (index - 2.5) * width
            ax.bar(x, values, width, label=variant)
            for xi, value in zip(x, values):
                if value == 0.0:
                    ax.text(xi, 0, "x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(np.arange(len(rows)))
        ax.set_xticklabels([f"m={r['shape']['m']} d={r['shape']['d']}\nf={r['shape']['f']} E={r['shape']['E']}"
                            f"\n{r.get('grouping', 'dirichlet')}" for r in rows], fontsize=7)
        ax.set_ylabel(f"TFLOP/s ({FLOPS_PER_MDF[mode]:.0f} m d f / time)")
        ax.set_title(mode, fontsize=10)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title + "  (x: failed or not run)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(rows):
    for row in rows:
        s = row["shape"]
        print(f"m={s['m']} d={s['d']} f={s['f']} E={s['E']} {row.get('grouping', 'dirichlet')}   "
              "ms (TFLOP/s), peak memory")
        for mode, entry in row["modes"].items():
            cells = []
            for variant, result in entry["variants"].items():
                if "ms" in result:
                    peak = result["memory"].get("peak_bytes", float("nan")) / 2**30
                    cells.append(f"{variant}={result['ms']:.3f} ({result['tflops']:.0f}) {peak:.2f} GiB")
                else:
                    cells.append(f"{variant}=error")
            print(f"  {mode:<8} " + "  ".join(cells))
            if entry["ratios"]:
                print(f"  {'':<8} " + "  ".join(f"{k}={v:.3f}" for k, v in entry["ratios"].items()))


def arguments(argv=None):
    parser = harness.parser(__doc__.split("\n\n")[0], reps=10, variants=VARIANTS)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    return harness.parse(parser, argv, dict(variants=VARIANTS, modes=MODES))


def main(argv=None):
    options = arguments(argv)
    if options.prebuild:
        prebuild(options.shapes, options.variants, options.modes)
        return

    def measure_row(shape, grouping, row, clock, save):
        operands = make_operands(*shape, options.seed, grouping)
        bench_shape(shape, row, operands, options.variants, options.modes, options.reps, clock, save)

    harness.run(
        options, "bench_layer.json", "moe_mlp layer, bf16", measure_row, plot, summarize,
        benchmark="moe_mlp layer: value_and_grad step and forward, bf16, with b1",
        flops="12 m d f per step, 4 m d f per forward",
        memory="XLA memory analysis of the compiled computation: arguments + outputs + temporaries - aliased",
        pallas_in_xla="b1, activation, dsReLU epilogue (dh, dprob), db1 as a one-hot dense dot",
    )


if __name__ == "__main__":
    main()

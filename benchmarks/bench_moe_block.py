"""Times one training step of a Nemotron-3-Nano MoE block, against its GEMMs alone, on one GPU.

The block (`jax_dsrelu.moe_layer`): T = 8192 tokens of d = 2688, sigmoid routing over 128
experts with a selection bias, top-6, weights renormalized and scaled by 2.5, experts of
width f = 1856, a shared expert of width 3712; bf16 weights and tokens, a float32 router.
The step is jax.value_and_grad of sum(out * cotangent) in x, the router, w1, w2 and the
shared expert's weights. Variants:

    auto       moe_layer(backend="auto", deterministic=False): the library's kernels
    auto_det   moe_layer(backend="auto", deterministic=True)
    xla        moe_layer(backend="xla"): the same block with its experts on XLA
    gemms      the block's GEMMs alone, as XLA builds them (meant as a ceiling; at many
               small experts XLA's batched GEMMs are slower than the library's kernels).
               The routed experts' six (h, y forward; da, dx, dw1, dw2 backward) batched
               over 128 equal experts of T * top_k / E rows each, the shared expert's six
               and the router's three (logits, dx, drouter), with only the elementwise
               work between them (the activation and its derivative). No routing, no
               sort, no gathers, no ragged sizes.
    gemms_cublas  the same with every GEMM on cuBLAS (harness.CUBLAS_ONLY); the ceiling
               is the faster of the two

For each block variant the record gives its time, its CUPTI kernel breakdown, its peak
memory (XLA's memory analysis) and outside_gemms = 1 - ceiling / variant, the ceiling being
the faster GEMMs-alone variant: the fraction of the step that the ceiling does not spend, i.e. routing, dispatch, combine, the ragged
grouping's cost and the fused epilogues beyond a plain GEMM's. The kernels' results are
checked against the xla variant's before they are timed (normwise, bf16).

    python benchmarks/bench_moe_block.py --commit $(git rev-parse --short HEAD) --out benchmarks/results
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/bench_moe_block.py --prebuild
    python benchmarks/bench_moe_block.py --cpu --out /tmp/block    # plumbing test at a tiny size

writes bench_moe_block.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import cuda_lowering
import harness
import run_record
import timing
from bench_layer import memory

import jax_dsrelu

BF16 = np.dtype(jnp.bfloat16)
VARIANTS = ("auto", "auto_det", "xla", "gemms", "gemms_cublas")
GRADIENTS = ("x", "router", "w1", "w2", "shared_w1", "shared_w2")
# Normwise against the xla variant: both round h, the activation and dh to bf16, so their
# results agree to a few bf16 ulps (2^-8) relative to their norm (as in bench_layer.py).
TOLERANCE = 2e-2


@dataclasses.dataclass(frozen=True)
class Block:
    tokens: int
    d: int
    experts: int
    f: int
    top_k: int
    shared: int
    scale: float

    @property
    def flops(self) -> float:
        """Multiply-adds x 2 of the step: three GEMMs of each expert matrix's shape per
        matrix (forward, two backward), for the routed rows, the shared expert and the router."""
        routed = self.tokens * self.top_k * self.d * self.f
        shared = self.tokens * self.d * self.shared
        router = self.tokens * self.d * self.experts
        return 2.0 * 3 * (2 * routed + 2 * shared + router)


NANO = Block(tokens=8192, d=2688, experts=128, f=1856, top_k=6, shared=3712, scale=2.5)
TINY = Block(tokens=256, d=64, experts=8, f=32, top_k=2, shared=48, scale=2.5)


def operand_shapes(block: Block) -> dict[str, jax.ShapeDtypeStruct]:
    """Every operand of every variant. The ceiling's routed rows: T * top_k rows, split
    equally among the experts."""
    s = jax.ShapeDtypeStruct
    rows = block.tokens * block.top_k // block.experts
    return dict(
        x=s((block.tokens, block.d), BF16),
        router=s((block.d, block.experts), jnp.float32),
        w1=s((block.experts, block.d, block.f), BF16),
        w2=s((block.experts, block.f, block.d), BF16),
        shared_w1=s((block.d, block.shared), BF16),
        shared_w2=s((block.shared, block.d), BF16),
        expert_bias=s((block.experts,), jnp.float32),
        cotangent=s((block.tokens, block.d), BF16),
        rows=s((block.experts, rows, block.d), BF16),
        rows_cotangent=s((block.experts, rows, block.d), BF16),
    )


# Weights scaled by 1 / sqrt(fan-in), so that every activation is O(1); a small bias.
SCALES = dict(router="fan_in", w1="fan_in", w2="fan_in", shared_w1="fan_in", shared_w2="fan_in", expert_bias=1e-3)


def make_operands(block: Block, seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    operands = {}
    for name, shape in operand_shapes(block).items():
        scale = SCALES.get(name, 1.0)
        scale = 1 / np.sqrt(shape.shape[-2]) if scale == "fan_in" else scale
        operands[name] = jnp.asarray(scale * rng.standard_normal(shape.shape, np.float32), shape.dtype)
    return operands


def prebuild(block: Block, variants) -> None:
    """Lowers the kernel variants' steps for cuda, which builds and caches their kernels."""
    cuda_lowering.prepare()
    shapes = operand_shapes(block)
    for variant in (v for v in variants if v in ("auto", "auto_det")):
        fn, names = computation(block, variant)
        cuda_lowering.lower_for_cuda(f"bench_moe_block {variant}", fn, *(shapes[n] for n in names))


def block_step(block: Block, backend: str, deterministic: bool):
    def loss(x, router, w1, w2, shared_w1, shared_w2, expert_bias, cotangent):
        out = jax_dsrelu.moe_layer(
            x, router, w1, w2, top_k=block.top_k, score="sigmoid", expert_bias=expert_bias, normalize=True,
            scale=block.scale, shared_w1=shared_w1, shared_w2=shared_w2, deterministic=deterministic,
            backend=backend,
        )
        return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

    names = ("x", "router", "w1", "w2", "shared_w1", "shared_w2", "expert_bias", "cotangent")
    return jax.value_and_grad(loss, argnums=tuple(range(len(GRADIENTS)))), names


def squared_relu(h):
    return jnp.square(jnp.maximum(h, 0.0)).astype(BF16)


def gemms_step():
    """The ceiling: the block's GEMMs with nothing but elementwise work between them."""

    def loss(x, router, w1, w2, shared_w1, shared_w2, rows, cotangent, rows_cotangent):
        h = jnp.einsum("erd,edf->erf", rows, w1, preferred_element_type=jnp.float32)
        y = jnp.einsum("erf,efd->erd", squared_relu(h), w2, preferred_element_type=jnp.float32)
        shared_h = jnp.dot(x, shared_w1, preferred_element_type=jnp.float32)
        shared = jnp.dot(squared_relu(shared_h), shared_w2, preferred_element_type=jnp.float32)
        logits = jnp.dot(x.astype(jnp.float32), router)
        return (
            jnp.sum(y * rows_cotangent.astype(jnp.float32))
            + jnp.sum(shared * cotangent.astype(jnp.float32))
            + jnp.sum(logits)
        )

    names = ("x", "router", "w1", "w2", "shared_w1", "shared_w2", "rows", "cotangent", "rows_cotangent")
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6)), names


def computation(block: Block, variant: str):
    if variant in ("gemms", "gemms_cublas"):
        return gemms_step()
    return block_step(block, "xla" if variant == "xla" else "auto", variant == "auto_det")


@jax.jit
def _relative_error(ours, reference):
    difference = ours.astype(jnp.float32) - reference.astype(jnp.float32)
    scale = jnp.maximum(jnp.linalg.norm(reference.astype(jnp.float32)), np.finfo(np.float32).tiny)
    return jnp.linalg.norm(difference) / scale


def named_gradients(outputs) -> dict:
    _, grads = outputs
    return {f"d{name}": grad for name, grad in zip(GRADIENTS, grads)}


def run_variant(block, variant, operands, reference, reps, clock) -> tuple[dict, dict | None]:
    """(entry, gradients): compiled, checked against `reference`, timed; or an error."""
    stage, entry = "compile", {}
    try:
        fn, names = computation(block, variant)
        args = tuple(operands[name] for name in names)
        options = harness.CUBLAS_ONLY if variant == "gemms_cublas" else None
        compiled = jax.jit(fn, compiler_options=options).lower(*args).compile()
        entry = dict(memory=memory(compiled))
        stage = "run"
        outputs = compiled(*args)
        gradients = named_gradients(outputs) if not variant.startswith("gemms") else None
        if variant in ("auto", "auto_det"):
            stage = "check"
            if reference is None:
                entry["check"] = "not checked: the xla variant failed"
            else:
                entry["check"] = {
                    name: dict(relative_error=float(_relative_error(gradients[name], want)))
                    for name, want in reference.items()
                }
                bad = {name: c for name, c in entry["check"].items() if not c["relative_error"] <= TOLERANCE}
                if bad:
                    raise ValueError(f"{variant} outside the tolerance {TOLERANCE} of the xla variant: {bad}")
        stage = "timing"
        entry.update(timing.time_call(compiled, args, reps, clock).record())
        entry["tflops"] = timing.tflops(block.flops, entry["ms"])
        return entry, gradients
    except Exception as error:  # recorded; the next variant runs
        return dict(entry, **run_record.error_entry(error, stage)), None


def bench(block, operands, variants, reps, clock) -> dict:
    results: dict[str, dict] = {}
    reference = None
    # xla first: the kernels are checked against it.
    for variant in sorted(variants, key=lambda v: v != "xla"):
        print(f"{variant}", flush=True)
        results[variant], gradients = run_variant(block, variant, operands, reference, reps, clock)
        if variant == "xla":
            reference = gradients
    ratios = {}
    ms = {name: entry["ms"] for name, entry in results.items() if "ms" in entry}
    ceiling = min((ms[v] for v in ("gemms", "gemms_cublas") if v in ms), default=None)
    for variant in ("auto", "auto_det", "xla"):
        if variant in ms and ceiling is not None:
            ratios[f"{variant}_outside_gemms"] = 1.0 - ceiling / ms[variant]
        if variant in ms and variant != "xla" and "xla" in ms:
            ratios[f"{variant}_speedup_vs_xla"] = ms["xla"] / ms[variant]
    if "auto" in ms and "auto_det" in ms:
        ratios["det_overhead"] = ms["auto_det"] / ms["auto"] - 1.0
    return dict(variants=results, ratios=ratios)


def summarize(row) -> None:
    for variant, entry in row["variants"].items():
        if "ms" in entry:
            peak = entry["memory"].get("peak_bytes", float("nan")) / 2**30
            print(f"  {variant:<9} {entry['ms']:9.3f} ms  {entry['tflops']:7.1f} TFLOP/s  {peak:6.2f} GiB")
        else:
            print(f"  {variant:<9} error at {entry.get('stage')}: {entry.get('error', '')[:120]}")
    for name, value in row["ratios"].items():
        print(f"  {name} = {value:.3f}")


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--prebuild", action="store_true",
                        help="lower the kernel variants for cuda here (no GPU) to fill JAX_DSRELU_KERNEL_CACHE, then stop")
    parser.add_argument("--cpu", action="store_true",
                        help="plumbing test on the CPU at a tiny size, timed by wall clock (not a measurement)")
    options = parser.parse_args(argv)
    options.variants = options.variants.split(",")
    unknown = sorted(set(options.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected a subset of {list(VARIANTS)}")
    return options


def main(argv=None):
    options = arguments(argv)
    if options.prebuild:
        prebuild(NANO, options.variants)
        return
    clock = timing.default_clock()
    if clock != timing.CUPTI and not options.cpu:
        raise SystemExit(f"no GPU here (JAX platform {jax.default_backend()!r}): pass --cpu for a plumbing test")
    block = TINY if options.cpu else NANO
    started = time.time()
    result = dict(
        run_record.header(options.commit, timing.DESCRIPTIONS[clock]),
        benchmark="Nemotron-3-Nano MoE block: value_and_grad step, bf16, sigmoid top-k with bias, shared expert",
        block=dataclasses.asdict(block),
        clock=clock,
        flops="6 x (2 T top_k d f + 2 T d fs + T d E) per step",
        memory="XLA memory analysis of the compiled computation: arguments + outputs + temporaries - aliased",
    )
    operands = make_operands(block, options.seed)
    row = bench(block, operands, options.variants, options.reps, clock)
    result.update(row, seconds=time.time() - started)
    path = run_record.write_json(result, options.out, "bench_moe_block.json")
    print(f"{block}: {path}")
    summarize(row)


if __name__ == "__main__":
    main()

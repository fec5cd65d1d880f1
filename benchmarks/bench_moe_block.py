"""Times one training step of a Nemotron-3-Nano MoE block, against its GEMMs alone, on one GPU.

The block (`jax_dsrelu.moe_layer`): T = 8192 tokens of d = 2688, sigmoid routing over 128
experts with a selection bias, top-6, weights renormalized and scaled by 2.5, experts of
width f = 1856, a shared expert of width 3712; bf16 weights and tokens, a float32 router.
The step is jax.value_and_grad of sum(out * cotangent) in x, the router, w1, w2 and the
shared expert's weights. Variants:

    auto       moe_layer(backend="auto", deterministic=False): the library's kernels
    auto_det   moe_layer(backend="auto", deterministic=True)
    xla        moe_layer(backend="xla"): the same block with its experts on XLA
    gemms      the block's GEMMs alone, in bf16 as a user writes them (the router float32,
               as the block's): the routed experts' six batched over 128 equal experts of
               T * top_k / E rows, the shared expert's six and the router's three, with only
               the activation and its derivative between them; no routing, no ragged sizes.
    gemms_cublas  the same with every GEMM on cuBLAS (harness.CUBLAS_ONLY)

Each variant's record holds its time, its CUPTI kernel breakdown and its peak memory; the
kernels' gradients are checked against the xla variant's before they are timed.

    python benchmarks/bench_moe_block.py --commit $(git rev-parse --short HEAD) --out benchmarks/results
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/bench_moe_block.py --prebuild
    python benchmarks/bench_moe_block.py --cpu --out /tmp/block    # plumbing test at a tiny size

writes bench_moe_block.json.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import cuda_lowering
import harness
import precision
from harness import BF16

import jax_dsrelu

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
    return jnp.square(jnp.maximum(h.astype(jnp.float32), 0.0)).astype(BF16)


def gemms_step():
    """The ceiling: the block's GEMMs with nothing but elementwise work between them."""

    def loss(x, router, w1, w2, shared_w1, shared_w2, rows, cotangent, rows_cotangent):
        h = jnp.einsum("erd,edf->erf", rows, w1, preferred_element_type=BF16)
        y = jnp.einsum("erf,efd->erd", squared_relu(h), w2, preferred_element_type=BF16)
        shared_h = jnp.dot(x, shared_w1, preferred_element_type=BF16)
        shared = jnp.dot(squared_relu(shared_h), shared_w2, preferred_element_type=BF16)
        logits = jnp.dot(x.astype(jnp.float32), router)
        return (
            jnp.sum(y.astype(jnp.float32) * rows_cotangent.astype(jnp.float32))
            + jnp.sum(shared.astype(jnp.float32) * cotangent.astype(jnp.float32))
            + jnp.sum(logits)
        )

    names = ("x", "router", "w1", "w2", "shared_w1", "shared_w2", "rows", "cotangent", "rows_cotangent")
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6)), names


def computation(block: Block, variant: str):
    if variant in ("gemms", "gemms_cublas"):
        return gemms_step()
    return block_step(block, "xla" if variant == "xla" else "auto", variant == "auto_det")


def named_gradients(outputs) -> dict:
    _, grads = outputs
    return {f"d{name}": grad for name, grad in zip(GRADIENTS, grads)}


def run_variant(block, variant, operands, reference, reps, clock) -> tuple[dict, dict | None]:
    """(entry, gradients): compiled, checked against `reference` (the kernels), timed; or an error."""
    fn, names = computation(block, variant)

    def check(outputs):
        errors = {name: dict(relative_error=float(harness.relative_error(grad, reference[name])))
                  for name, grad in named_gradients(outputs).items()}
        return errors, all(e["relative_error"] <= TOLERANCE for e in errors.values())

    checked = variant in ("auto", "auto_det") and reference is not None
    entry, outputs = harness.measure(
        fn, tuple(operands[name] for name in names), reps, clock, check=check if checked else None,
        compiler_options=harness.CUBLAS_ONLY if variant == "gemms_cublas" else None, flops=block.flops)
    if variant in ("auto", "auto_det") and reference is None:
        entry["check"] = "not checked: the xla variant failed"
    return entry, None if outputs is None or variant.startswith("gemms") else named_gradients(outputs)


def bench(block, operands, variants, reps, clock) -> dict:
    results: dict[str, dict] = {}
    reference = None
    # xla first: the kernels are checked against it.
    for variant in sorted(variants, key=lambda v: v != "xla"):
        print(f"{variant}", flush=True)
        results[variant], gradients = run_variant(block, variant, operands, reference, reps, clock)
        if variant == "xla":
            reference = gradients
    return dict(variants=results)


def summarize(row) -> None:
    for variant, entry in row["variants"].items():
        print(f"  {variant:<12} " + (f"{entry['ms']:9.3f} ms ({entry['tflops']:.0f} TFLOP/s)" if "ms" in entry
                                     else f"error at {entry.get('stage')}: {entry.get('error', '')[:120]}"))


def arguments(argv=None):
    parser = harness.parser(__doc__.split("\n\n")[0], reps=10, variants=VARIANTS, shaped=False)
    return harness.parse(parser, argv, dict(variants=VARIANTS))


def main(argv=None):
    options = arguments(argv)
    if options.prebuild:
        prebuild(NANO, options.variants)
        return
    block = TINY if options.cpu else NANO
    result, clock, save = harness.start_record(
        options, benchmark="bench_moe_block", block=dataclasses.asdict(block),
        description="Nemotron-3-Nano MoE block: value_and_grad step, bf16, sigmoid top-k with bias, shared expert",
        flops="6 x (2 T top_k d f + 2 T d fs + T d E) per step", memory=harness.MEMORY,
        precision=precision.stated("bench_moe_block", options.variants))
    row = bench(block, make_operands(block, options.seed), options.variants, options.reps, clock)
    result.update(row)
    print(f"{block}: {save()}")
    summarize(row)


if __name__ == "__main__":
    main()

"""Times one training step of MoE blocks built with `moe_layer`, beside their GEMMs alone, on one GPU.

The blocks (BLOCKS; --blocks picks), bf16 with a float32 router; a step is jax.value_and_grad of sum(out *
cotangent) in x, the router and every expert weight, by the variants (--variants picks; precision.py states each):
auto and auto_det (moe_layer on the kernels, both modes), xla and xla_det, tokamax (the block around
tokamax.ragged_dot; skipped where not installed), gemms_cublas (the step's GEMMs alone on cuBLAS), gathered and
gathered_det (auto with the sm90 kernels not yet verified switched on). Each entry holds the step's CUPTI kernel
breakdown and peak memory; all but xla and the GEMMs alone are checked against xla's gradients first.

    python benchmarks/bench_moe_block.py --commit $(git rev-parse --short HEAD) --out benchmarks/results
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/bench_moe_block.py --prebuild
    python benchmarks/bench_moe_block.py --cpu --out /tmp/block    # plumbing test at tiny sizes

writes bench_moe_block.json (gzipped where large) and bench_moe_block.png.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import harness
import precision
from bench_layer import TOLERANCE, cublas_gemms
from harness import BF16

import jax_dsrelu
from jax_dsrelu.kernels.sm90 import backend as sm90_backend

VARIANTS = ("auto", "auto_det", "xla", "xla_det", "tokamax", "gemms_cublas", "gathered", "gathered_det")
KERNEL_VARIANTS = tuple(v for v in VARIANTS if v.startswith(("auto", "gathered")))  # those a prebuild lowers
F32 = jnp.float32
WEIGHTS = ("router", "w1", "w2", "shared_w1", "shared_w2")


@dataclasses.dataclass(frozen=True)
class Block:
    tokens: int
    d: int
    experts: int
    f: int
    top_k: int
    score: str  # "sigmoid" or "softmax"
    bias: bool  # a selection bias (expert_bias)
    normalize: bool
    scale: float
    shared: int = 0  # the shared expert's width; 0: none

    @property
    def gradients(self) -> tuple[str, ...]:
        return ("x", "router", "w1", "w2") + (("shared_w1", "shared_w2") if self.shared else ())

    @property
    def flops(self) -> float:
        """Three GEMMs (forward, two backward) per weight: the routed rows', the shared expert's, the router's."""
        return 6.0 * self.tokens * self.d * (2 * self.top_k * self.f + 2 * self.shared + self.experts)

    def tiny(self) -> Block:
        """The same routing at a size the CPU runs in a moment (whole rows per expert for the GEMMs alone)."""
        return dataclasses.replace(self, tokens=64, d=32, experts=max(2 * self.top_k, 8), f=16, shared=32 * bool(self.shared))

    def describe(self) -> str:
        routing = self.score + " with a selection bias" * self.bias + ", normalized" * self.normalize
        routing += f", scaled by {self.scale:g}" if self.scale != 1 else ""
        shared = f", a shared expert of {self.shared}" if self.shared else ""
        return f"T = {self.tokens}, d = {self.d}, {self.experts} experts of {self.f}, top-{self.top_k}, {routing}{shared}"


NANO = Block(8192, 2688, 128, 1856, 6, "sigmoid", bias=True, normalize=True, scale=2.5, shared=3712)
BLOCKS = {"nano_8k": NANO, "nano_32k": dataclasses.replace(NANO, tokens=32768),
          "deepseek_v3_shard": Block(4096, 7168, 32, 2048, 8, "sigmoid", bias=True, normalize=True, scale=2.5),
          "few_experts": Block(8192, 4096, 8, 8192, 2, "softmax", bias=False, normalize=True, scale=1.0)}


def operand_shapes(block: Block) -> dict[str, jax.ShapeDtypeStruct]:
    """Every variant's operands; the GEMMs alone take those of the step's GEMMs' shapes (T top_k rows)."""
    s, t, d, e, f, fs = jax.ShapeDtypeStruct, block.tokens, block.d, block.experts, block.f, block.shared
    rows = t * block.top_k
    shapes = dict(x=s((t, d), BF16), router=s((d, e), F32), w1=s((e, d, f), BF16), w2=s((e, f, d), BF16),
                  expert_bias=s((e,), F32), cotangent=s((t, d), BF16), x_f32=s((t, d), F32), rows=s((rows, d), BF16),
                  rows_act=s((rows, f), BF16), rows_dh=s((rows, f), BF16), rows_dy=s((rows, d), BF16))
    if fs:
        shapes.update(shared_w1=s((d, fs), BF16), shared_w2=s((fs, d), BF16), shared_act=s((t, fs), BF16),
                      shared_dh=s((t, fs), BF16))
    return shapes


def make_operands(block: Block, seed: int) -> dict[str, jax.Array]:
    """Standard normal; the weights scaled by 1 / sqrt(fan-in) (activations O(1)); a small selection bias."""
    shapes = operand_shapes(block)
    keys = dict(zip(shapes, jax.random.split(jax.random.key(seed), len(shapes))))
    scale = {name: 1e-3 if name == "expert_bias" else 1 / np.sqrt(s.shape[-2]) if name in WEIGHTS else 1.0
             for name, s in shapes.items()}
    return {name: (scale[name] * jax.random.normal(keys[name], s.shape, F32)).astype(s.dtype) for name, s in shapes.items()}


def library_layer(block: Block, backend: str, deterministic: bool):
    return lambda x, router, w1, w2, expert_bias, shared_w1=None, shared_w2=None: jax_dsrelu.moe_layer(
        x, router, w1, w2, top_k=block.top_k, score=block.score, expert_bias=expert_bias if block.bias else None,
        normalize=block.normalize, scale=block.scale, shared_w1=shared_w1, shared_w2=shared_w2,
        deterministic=deterministic, backend=backend)


def squared_relu(h, weight=1.0):
    return (jnp.square(jnp.maximum(h.astype(F32), 0.0)) * weight).astype(h.dtype)


def tokamax_layer(block: Block, implementation: str):
    """The block as a user writes it around tokamax.ragged_dot, computing what moe_layer does:
    float32 scores, the top_k of the biased ones, weights from the unbiased ones applied to
    the activations of rows sorted by expert, each token's rows added in float32."""
    def layer(x, router, w1, w2, expert_bias, shared_w1=None, shared_w2=None):
        import tokamax  # here, so that a failing import is the variant's error

        logits = jnp.dot(x.astype(F32), router)
        probs = jax.nn.sigmoid(logits) if block.score == "sigmoid" else jax.nn.softmax(logits, axis=-1)
        _, experts = lax.top_k(lax.stop_gradient(probs) + (expert_bias if block.bias else 0.0), block.top_k)
        weight = jnp.take_along_axis(probs, experts, axis=1)
        weight = weight / (jnp.sum(weight, axis=1, keepdims=True) + 1e-20) if block.normalize else weight
        order = jnp.argsort(experts.reshape(-1), stable=True)  # the (token, slot) rows by expert
        sizes = jnp.bincount(experts.reshape(-1), length=block.experts).astype(jnp.int32)
        h = tokamax.ragged_dot(x[order // block.top_k], w1, sizes, implementation=implementation)
        act = squared_relu(h, block.scale * weight.reshape(-1)[order, None])
        y = tokamax.ragged_dot(act, w2, sizes, implementation=implementation)
        out = y[jnp.argsort(order)].reshape(x.shape[0], block.top_k, -1).astype(F32).sum(axis=1)
        if shared_w1 is not None:
            out = out + jnp.dot(squared_relu(jnp.dot(x, shared_w1)), shared_w2).astype(F32)
        return out.astype(x.dtype)
    return layer


def step_of(block: Block, layer):
    """(jax.value_and_grad of sum(layer(...) * cotangent) in block.gradients, operand names)."""
    names = block.gradients + ("expert_bias", "cotangent")
    loss = lambda *ops: jnp.sum(layer(**dict(zip(names, ops[:-1]))).astype(F32) * ops[-1].astype(F32))  # noqa: E731
    return jax.value_and_grad(loss, argnums=tuple(range(len(block.gradients)))), names


def gemms_step(block: Block):
    """The ceiling: the step's GEMMs alone (bench_layer.cublas_gemms): the routed experts' six
    batched over E equal experts, the shared expert's six, the router's three in float32
    (the logits, and the logits again for their gradient, times the router and times x)."""
    routed, shared = cublas_gemms("step", batched=True), cublas_gemms("step", batched=False)
    def gemms(x, x_f32, router, w1, w2, rows, rows_act, rows_dh, rows_dy, cotangent, *shared_operands):
        logits = jnp.dot(x_f32, router)
        outputs = routed(rows, w1, w2, rows_act, rows_dh, rows_dy) + (
            logits, jnp.einsum("te,de->td", logits, router), jnp.einsum("td,te->de", x_f32, logits))
        if shared_operands:
            shared_w1, shared_w2, shared_act, shared_dh = shared_operands
            outputs += shared(x, shared_w1, shared_w2, shared_act, shared_dh, cotangent)
        return outputs
    names = ("x", "x_f32", "router", "w1", "w2", "rows", "rows_act", "rows_dh", "rows_dy", "cotangent")
    return gemms, names + (("shared_w1", "shared_w2", "shared_act", "shared_dh") if block.shared else ())


def computation(block: Block, variant: str):
    """(function, operand names) of one variant's step."""
    if variant == "gemms_cublas":
        return gemms_step(block)
    if variant == "tokamax":
        return step_of(block, tokamax_layer(block, "xla" if jax.default_backend() == "cpu" else "mosaic"))
    backend = "auto" if variant.startswith("gathered") else variant.removesuffix("_det")
    return step_of(block, library_layer(block, backend, variant.endswith("_det")))


def run_variant(block, variant, operands, reference, reps, clock) -> tuple[dict, dict | None]:
    """(entry, xla's gradients by name): compiled, checked against `reference` (xla's), timed; or why not."""
    if variant == "tokamax" and importlib.util.find_spec("tokamax") is None:
        return dict(skipped="tokamax not installed"), None
    fn, names = computation(block, variant)
    def check(outputs):
        errors = {f"d{name}": float(harness.relative_error(grad, reference[name]))
                  for name, grad in zip(block.gradients, outputs[1])}
        return errors, all(error <= TOLERANCE for error in errors.values())
    checked = variant not in ("xla", "gemms_cublas")
    with sm90_backend.unverified_enabled(on=variant.startswith("gathered")):
        entry, outputs = harness.measure(
            fn, tuple(operands[name] for name in names), reps, clock, check=check if checked and reference else None,
            compiler_options=harness.CUBLAS_ONLY if variant == "gemms_cublas" else None, flops=block.flops)
    if checked and reference is None:
        entry["check"] = "not checked: the xla variant failed"
    if variant == "tokamax":
        entry["version"] = importlib.metadata.version("tokamax")
    return entry, dict(zip(block.gradients, outputs[1])) if variant == "xla" and outputs else None


def prebuild(blocks, variants) -> None:
    """Lowers the kernel variants' steps for cuda, which builds and caches their kernels."""
    for block, variant in itertools.product(blocks, [v for v in variants if v in KERNEL_VARIANTS]):
        fn, names = computation(block, variant)
        with sm90_backend.unverified_enabled(on=variant.startswith("gathered")):
            harness.lower_for_cuda(f"bench_moe_block {variant} {block}", fn, *(operand_shapes(block)[n] for n in names))


def main(argv=None):
    options = harness.parse(harness.parser(__doc__.split("\n\n")[0], reps=10, variants=VARIANTS, shaped=False,
                                           subsets=dict(blocks=tuple(BLOCKS))), argv)
    blocks = {name: BLOCKS[name].tiny() if options.cpu else BLOCKS[name] for name in options.blocks}
    if options.prebuild:
        return prebuild(blocks.values(), options.variants)
    result, clock, save = harness.start_record(
        options, benchmark="bench_moe_block", description="MoE blocks of moe_layer: value_and_grad step, bf16",
        flops="6 x (2 T top_k d f + 2 T d fs + T d E) per step", memory=harness.MEMORY,
        precision=precision.stated("bench_moe_block", options.variants), blocks={})
    for name, block in blocks.items():
        print(f"{name}: {block.describe()}", flush=True)
        entries, operands, reference = {}, make_operands(block, options.seed), None
        result["blocks"][name] = dict(block=dataclasses.asdict(block), description=block.describe(), variants=entries)
        for variant in harness.reference_first(options.variants):
            entry, gradients = run_variant(block, variant, operands, reference, options.reps, clock)
            entries[variant], reference = entry, gradients if variant == "xla" else reference
            print(f"  {variant:<12} " + (f"{entry['ms']:9.3f} ms ({entry['tflops']:.0f} TFLOP/s)" if "ms" in entry
                                         else entry.get("skipped") or f"failed at {entry['stage']}"), flush=True)
            save()
    series = {v: [b["variants"].get(v, {}).get("tflops", 0.0) for b in result["blocks"].values()] for v in VARIANTS}
    harness.plot_bars([("step", list(result["blocks"]), series)], harness.png_path(options, "bench_moe_block"),
                      f"MoE block steps, {result['device']} ({clock})", "TFLOP/s")
    print(save())


if __name__ == "__main__":
    main()

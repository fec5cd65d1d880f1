"""Train a small decoder-only transformer language model whose feed-forward layers are MoE.

Character-level (one token per byte) on the Python standard library's own source files,
which every Python installation has: the top-level `*.py` files of the directory holding
`os.py`, in sorted order, every tenth file held out for evaluation. Each transformer
block is causal self-attention followed by `jax_dsrelu.flax.MoE` (top-k routing,
squared-ReLU experts whose backward runs on `grouped_gemm_dsrelu`), trained with optax's
AdamW under `nnx.jit`, with the load-balancing and router z-losses added to the loss.

    python examples/train_lm.py                       # the CPU defaults: about two minutes
    python examples/train_lm.py --dtype bfloat16 --backend sm90 --d-model 512 --layers 4 \\
        --experts 8 --d-ff 1024 --seq-len 256 --batch 64 --steps 2000    # a Hopper GPU
    python examples/train_lm.py --router sigmoid --normalize --routed-scale 2.5 \\
        --experts 8 --top-k 3 --num-groups 4 --top-groups 2 --shared-d-ff 128 --latent-dim 32
        # Nemotron-H style blocks: sigmoid routing whose expert bias is moved every step
        # by the step's load (auxiliary-loss-free balancing), a shared expert, a latent width
    python examples/train_lm.py --fp8                 # the experts' GEMMs on FP8 operands
        # (DeepSeek-V3's blockwise recipe, docs/fp8.md); the parameters stay in float32
    python examples/train_lm.py --fp8 --micro-batches 4   # gradient accumulation: the
        # experts' weights quantized once a step, every micro-batch reading those copies

It prints a progress bar, tokens per second, the training and held-out losses, a short
sample of generated text, and draws the loss curves into a PNG (--plot; needs matplotlib).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_dsrelu
from jax_dsrelu.flax import MoE

VOCAB = 256  # bytes


def load_corpus() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(training bytes, held-out bytes, file names) from the standard library's sources."""
    library = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(library, "*.py")))
    if len(files) < 10:
        raise SystemExit(f"expected the standard library's sources in {library}, found {len(files)} .py files")
    train, held_out = [], []
    for index, path in enumerate(files):
        with open(path, "rb") as source:
            (held_out if index % 10 == 9 else train).append(source.read())
    as_array = lambda texts: np.frombuffer(b"\n".join(texts), dtype=np.uint8)  # noqa: E731
    return as_array(train), as_array(held_out), files


class CausalSelfAttention(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, dtype, rngs: nnx.Rngs):
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.num_heads = num_heads

    def __call__(self, x):  # (B, S, d)
        batch, length, d_model = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        shape = (batch, length, self.num_heads, d_model // self.num_heads)
        # The XLA implementation on every platform: its gradients have no atomics, which
        # --deterministic relies on.
        y = jax.nn.dot_product_attention(
            q.reshape(shape), k.reshape(shape), v.reshape(shape), is_causal=True, implementation="xla"
        )
        return self.out(y.reshape(batch, length, d_model))


class Block(nnx.Module):
    def __init__(self, args, rngs: nnx.Rngs):
        dtype = jnp.dtype(args.dtype)
        self.attention_norm = nnx.RMSNorm(args.d_model, rngs=rngs)
        self.attention = CausalSelfAttention(args.d_model, args.heads, dtype, rngs)
        self.moe_norm = nnx.RMSNorm(args.d_model, rngs=rngs)
        self.moe = MoE(
            args.d_model,
            args.d_ff,
            args.experts,
            top_k=args.top_k,
            score=args.router,
            num_groups=args.num_groups,
            top_groups=args.top_groups,
            normalize=args.normalize,
            scale=args.routed_scale,
            round_to=args.round_to,
            shared_d_ff=args.shared_d_ff,
            latent_dim=args.latent_dim,
            deterministic=args.deterministic,
            backend=args.backend,
            precision=jax_dsrelu.quantization.FP8_BLOCKWISE if args.fp8 else None,
            dtype=dtype,
            rngs=rngs,
        )

    def __call__(self, x, quantized_weights=None):
        x = x + self.attention(self.attention_norm(x)).astype(x.dtype)
        y, aux = self.moe(self.moe_norm(x), return_aux=True, quantized_weights=quantized_weights)
        return x + y, aux


class LanguageModel(nnx.Module):
    def __init__(self, args, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, args.d_model, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (args.seq_len, args.d_model)))
        self.blocks = nnx.List([Block(args, rngs) for _ in range(args.layers)])
        self.norm = nnx.RMSNorm(args.d_model, rngs=rngs)

    def __call__(self, tokens, quantized=None):  # (B, S) int32 -> logits (B, S, VOCAB) float32, (aux losses, loads)
        """quantized: each block's `MoE.quantize_weights()`, or None (each block quantizes its own)."""
        # The lookup as a one-hot matmul: a table lookup's gradient adds every token's row
        # into the table with a scatter-add, which XLA runs on a GPU with atomics in an
        # order that varies from run to run; a matmul's gradient is a GEMM, summed in a
        # fixed order. At HIGHEST precision the product is the table's row, exactly.
        one_hot = jax.nn.one_hot(tokens, VOCAB, dtype=self.embed.embedding.dtype)
        embedded = jnp.matmul(one_hot, self.embed.embedding[...], precision=jax.lax.Precision.HIGHEST)
        x = embedded + self.position[...][: tokens.shape[1]]
        load_balancing, z_loss, group_sizes = 0.0, 0.0, []
        for block, quantized_weights in zip(self.blocks, quantized or [None] * len(self.blocks)):
            x, aux = block(x, quantized_weights)
            load_balancing += aux.load_balancing_loss
            z_loss += aux.router_z_loss
            group_sizes.append(aux.group_sizes)
        # The output projection is the embedding, transposed.
        return self.embed.attend(self.norm(x)).astype(jnp.float32), (load_balancing, z_loss, group_sizes)


def loss_fn(model, tokens, targets, args, quantized=None):
    """(total loss, (cross-entropy in nats per byte, each block's expert loads (E,)));
    quantized: as `LanguageModel` takes it."""
    logits, (load_balancing, z_loss, group_sizes) = model(tokens, quantized)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    total = cross_entropy + args.aux_weight * load_balancing + args.z_weight * z_loss
    return total, (cross_entropy, group_sizes)


def accumulated_gradients(model, tokens, targets, args, quantized=None):
    """(cross-entropy, each block's expert loads, gradients) of the batch in
    args.micro_batches equal parts, one after another: the parts' gradients and loads
    summed in order (a fixed order, so --deterministic holds), the losses and gradients
    divided by the count. quantized: as `LanguageModel` takes it, read by every part."""
    cross_entropy, loads, grads = 0.0, None, None
    for part_tokens, part_targets in zip(jnp.split(tokens, args.micro_batches), jnp.split(targets, args.micro_batches)):
        (_, (part_entropy, part_loads)), part_grads = nnx.value_and_grad(loss_fn, has_aux=True)(
            model, part_tokens, part_targets, args, quantized)
        cross_entropy += part_entropy
        loads = part_loads if loads is None else [a + b for a, b in zip(loads, part_loads)]
        grads = part_grads if grads is None else jax.tree.map(jnp.add, grads, part_grads)
    count = args.micro_batches
    return cross_entropy / count, loads, jax.tree.map(lambda g: g / count, grads)


def quantized_experts(model, args):
    """Each block's routed experts' weights quantized once for a step's micro-batches
    (`MoE.quantize_weights`): they do not change between the parts, so every part reads
    the same FP8 copies and the gradients are those of quantizing in each part, bit for
    bit. None without --fp8 or with one micro-batch (the step quantizes them itself)."""
    if not args.fp8 or args.micro_batches == 1:
        return None
    return [block.moe.quantize_weights() for block in model.blocks]


def batches(data: np.ndarray, rng: np.random.Generator, batch: int, length: int):
    """(tokens, next tokens), each (batch, length) int32, at random offsets."""
    starts = rng.integers(0, len(data) - length - 1, size=batch)
    window = np.stack([data[s : s + length + 1] for s in starts]).astype(np.int32)
    return jnp.asarray(window[:, :-1]), jnp.asarray(window[:, 1:])


class ProgressBar:
    """One line redrawn in place on a terminal; a line every 10% of the steps otherwise."""

    def __init__(self, total: int, width: int = 30):
        self.total, self.width = total, width
        self.interactive = sys.stderr.isatty()

    def update(self, step: int, text: str) -> None:
        done = step + 1
        filled = self.width * done // self.total
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {text}"
        if self.interactive:
            sys.stderr.write("\r" + line + ("\n" if done == self.total else ""))
            sys.stderr.flush()
        elif done == self.total or done % max(1, self.total // 10) == 0:
            print(line, flush=True)


def plot_curves(path: str, train_curve, held_out_curve, args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot drawn (pip install matplotlib)")
        return
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(*zip(*train_curve), label="training batch", alpha=0.6)
    axes.plot(*zip(*held_out_curve), "o-", label="held-out files")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats per byte)")
    axes.set_title(
        f"{args.layers}-layer MoE LM, {args.experts} experts, top-{args.top_k}, d_model {args.d_model}, {args.dtype}"
        + (", experts' GEMMs in FP8" if args.fp8 else "")
    )
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"training curve: {path}")


def sample(model, prompt: bytes, length: int, context: int, temperature: float, seed: int) -> bytes:
    """Continuation of prompt, one byte at a time, each drawn at `temperature` (0: the most likely).

    Greedy decoding of a small model repeats its likeliest words; drawing from the softened
    distribution, with a fixed key, reads more like the training text and is the same on
    every run.
    """

    @nnx.jit
    def next_byte(model, window, position, key):
        logits, _ = model(window[None])
        logits = logits[0, position].astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits)
        return jax.random.categorical(key, logits / temperature)

    text = list(prompt)
    keys = jax.random.split(jax.random.key(seed), length)
    for key in keys:
        window = text[-context:]
        padded = jnp.asarray(window + [0] * (context - len(window)), jnp.int32)
        text.append(int(next_byte(model, padded, len(window) - 1, key)))
    return bytes(text)


def digest(model) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        h.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    return h.hexdigest()


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="gradient accumulation: each step's batch in this many parts (dividing --batch)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=128)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--router", choices=["softmax", "sigmoid"], default="softmax",
                        help="routing scores; sigmoid also balances the experts with a bias moved every step")
    parser.add_argument("--normalize", action="store_true", help="divide each token's top-k weights by their sum")
    parser.add_argument("--routed-scale", type=float, default=1.0, help="multiply the routing weights by this")
    parser.add_argument("--num-groups", type=int, default=1, help="experts in this many groups for group-limited routing")
    parser.add_argument("--top-groups", type=int, default=None, help="keep each token's best this many groups")
    parser.add_argument("--round-to", type=int, default=None,
                        help="token rounding: cut each expert's tokens to a multiple of this (e.g. 128)")
    parser.add_argument("--shared-d-ff", type=int, default=None, help="width of a shared expert on every token")
    parser.add_argument("--latent-dim", type=int, default=None, help="routed experts run in this width")
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="expert bias update speed (--router sigmoid)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--aux-weight", type=float, default=1e-2, help="weight of the load-balancing loss")
    parser.add_argument("--z-weight", type=float, default=1e-3, help="weight of the router z-loss")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    parser.add_argument("--backend", choices=["auto", "xla", "sm90", "sm100"], default="auto")
    parser.add_argument("--deterministic", action="store_true", help="bitwise reproducible gradients")
    parser.add_argument("--fp8", action="store_true",
                        help="the experts' GEMMs on FP8 operands (DeepSeek-V3's blockwise recipe, docs/fp8.md)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--plot", default="train_lm.png", help="PNG of the loss curves; '' for none")
    parser.add_argument("--sample", type=int, default=240, help="bytes of text to generate at the end")
    parser.add_argument("--temperature", type=float, default=0.8, help="of the sample; 0 for greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.d_model % args.heads:
        parser.error(f"--d-model={args.d_model} must be a multiple of --heads={args.heads}")
    if args.micro_batches < 1 or args.batch % args.micro_batches:
        parser.error(f"--micro-batches={args.micro_batches} must be positive and divide --batch={args.batch}")
    return args


def main() -> None:
    args = arguments()
    if args.deterministic:
        # XLA picks the algorithms of its own GEMMs (attention, the routers) by timing
        # candidates when it compiles, once per process; with autotuning off every process
        # compiles the same ones, so the run also repeats across processes
        # (docs/determinism.md). nnx.jit takes no compiler options, and XLA reads XLA_FLAGS when
        # JAX first starts a backend, which is below.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()
    train_data, held_out_data, files = load_corpus()
    print(
        f"corpus: {len(files)} files of {os.path.dirname(os.__file__)}; {len(train_data):,} bytes for "
        f"training, {len(held_out_data):,} held out (every tenth file)"
    )
    print(f"devices: {jax.devices()}  dtype: {args.dtype}  backend: {args.backend}  deterministic: {args.deterministic}"
          f"  fp8: {args.fp8}")

    model = LanguageModel(args, nnx.Rngs(args.seed))
    parameters = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {args.layers} blocks, d_model {args.d_model}, {args.experts} experts of d_ff {args.d_ff}, "
          f"top-{args.top_k}: {parameters:,} parameters")
    if args.router == "sigmoid" or args.shared_d_ff or args.latent_dim or args.round_to:
        print(f"routing: {args.router}, groups {args.top_groups or args.num_groups} of {args.num_groups}, "
              f"normalize {args.normalize}, scale {args.routed_scale}; shared expert d_ff {args.shared_d_ff}; "
              f"latent {args.latent_dim}; round_to {args.round_to}")
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(50, args.steps // 10 + 1), args.steps)
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens, targets):
        cross_entropy, group_sizes, grads = accumulated_gradients(
            model, tokens, targets, args, quantized_experts(model, args))
        optimizer.update(model, grads)
        if args.router == "sigmoid":
            # Auxiliary-loss-free balancing: the step's loads over all of its tokens (one
            # device here; under data parallelism they would be summed over the devices).
            for block, sizes in zip(model.blocks, group_sizes):
                block.moe.update_expert_bias(sizes, args.bias_rate)
        return cross_entropy

    @nnx.jit
    def eval_step(model, tokens, targets):
        return loss_fn(model, tokens, targets, args)[1][0]

    eval_rng = np.random.default_rng(args.seed + 1)
    held_out = [batches(held_out_data, eval_rng, args.batch, args.seq_len) for _ in range(args.eval_batches)]

    def evaluate() -> float:
        return float(np.mean([eval_step(model, *batch) for batch in held_out]))

    train_rng = np.random.default_rng(args.seed)
    train_curve, held_out_curve = [], [(0, evaluate())]
    progress = ProgressBar(args.steps)
    tokens_per_step = args.batch * args.seq_len
    start, timed_from, timed_steps = time.perf_counter(), None, 0
    for step in range(args.steps):
        loss = float(train_step(model, optimizer, *batches(train_data, train_rng, args.batch, args.seq_len)))
        train_curve.append((step, loss))
        if step == 0:  # the first step compiles: time the others
            timed_from = time.perf_counter()
        else:
            timed_steps += 1
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            held_out_curve.append((step + 1, evaluate()))
        rate = tokens_per_step * timed_steps / max(time.perf_counter() - timed_from, 1e-9)
        progress.update(step, f"loss {loss:.3f}  held-out {held_out_curve[-1][1]:.3f}  {rate:,.0f} tokens/s")

    elapsed = time.perf_counter() - start
    first = np.mean([loss for _, loss in train_curve[:10]])
    last = np.mean([loss for _, loss in train_curve[-10:]])
    print(f"training loss {first:.4f} -> {last:.4f} (mean of the first and last 10 steps)")
    print(f"held-out loss {held_out_curve[0][1]:.4f} -> {held_out_curve[-1][1]:.4f}")
    print(f"{args.steps} steps in {elapsed:.1f} s, {rate:,.0f} tokens/s after compilation")
    if args.sample:
        prompt = b"def "
        text = sample(model, prompt, args.sample, args.seq_len, args.temperature, args.seed)
        print("sample:\n" + text.decode("utf-8", errors="replace"))
    if args.router == "sigmoid":
        for index, block in enumerate(model.blocks):
            bias = np.asarray(block.moe.expert_bias[...])
            print(f"block {index} expert bias: min {bias.min():+.4f} max {bias.max():+.4f}")
    if args.deterministic:
        print(f"parameter digest: {digest(model)}")
    if args.plot:
        plot_curves(args.plot, train_curve, held_out_curve, args)
    print("backends:\n" + jax_dsrelu.describe_backends())


if __name__ == "__main__":
    main()

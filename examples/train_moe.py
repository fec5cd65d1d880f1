"""Train a small mixture-of-experts layer, jax_dsrelu.moe_layer, on synthetic data.

A student MoE (router, top-k dispatch, squared-ReLU experts, weighted combine) learns to
imitate a randomly drawn teacher MoE on synthetic tokens, with optax's Adam under
jax.jit. The experts' backward runs on `grouped_gemm_dsrelu` through `moe_mlp`'s
custom VJP, on whichever backend `backend="auto"` picks here. For a whole language
model built from the same layer, see train_lm.py.

    python examples/train_moe.py                    # a few hundred steps, loss printed
    python examples/train_moe.py --deterministic    # also prints a digest of the final
                                                    # parameters, identical across runs
                                                    # and processes
    python examples/train_moe.py --fp8              # the student's experts on FP8 operands
                                                    # (DeepSeek-V3's blockwise recipe,
                                                    # docs/fp8.md); the teacher stays exact
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_dsrelu


# XLA picks the algorithms of its own GEMMs (here the router's) by timing candidates when
# it compiles, once per process, and candidates add in different orders; with autotuning
# off every process compiles the same algorithms, so a deterministic run repeats bit for
# bit across processes as well as within one (docs/determinism.md).
REPRODUCIBLE_COMPILATION = {"xla_gpu_autotune_level": 0}


def init_moe(key, d_model, d_ff, num_experts, dtype):
    k_router, k_w1, k_w2 = jax.random.split(key, 3)
    return {
        "router": jax.random.normal(k_router, (d_model, num_experts), jnp.float32) / np.sqrt(d_model),
        "w1": (jax.random.normal(k_w1, (num_experts, d_model, d_ff)) / np.sqrt(d_model)).astype(dtype),
        "b1": jnp.zeros((num_experts, d_ff), jnp.float32),
        "w2": (jax.random.normal(k_w2, (num_experts, d_ff, d_model)) / np.sqrt(d_ff)).astype(dtype),
    }


def moe_layer(params, x, top_k, deterministic, precision=None):
    """Route each token to its top_k experts, run them, combine by routing weight.

    jax_dsrelu.moe_layer does the sort by expert, the group sizes and the way back;
    with deterministic=True its gradients, the router's included, are bitwise
    reproducible. precision=jax_dsrelu.quantization.FP8_BLOCKWISE runs the experts'
    GEMMs on FP8 operands; the parameters stay in their dtype.
    """
    return jax_dsrelu.moe_layer(
        x,
        params["router"],
        params["w1"],
        params["w2"],
        b1=params["b1"],
        top_k=top_k,
        deterministic=deterministic,
        precision=precision,
    )


def precision_of(args):
    """The experts' precision option that --fp8 asks for (None: the parameters' dtype)."""
    return jax_dsrelu.quantization.FP8_BLOCKWISE if args.fp8 else None


def digest(tree) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def training_arguments(description: str, steps: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--d-ff", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true", help="bitwise reproducible gradients")
    parser.add_argument("--fp8", action="store_true",
                        help="the experts' GEMMs on FP8 operands (DeepSeek-V3's blockwise recipe, docs/fp8.md)")
    return parser


def train(args, layer, place_params=lambda params: params, place_tokens=lambda x: x) -> None:
    """Fits `layer(params, x)` to a teacher MoE with Adam, printing the loss as it goes.

    place_params and place_tokens put the student's parameters and each batch where the
    layer wants them (on one device by default).
    """
    k_teacher, k_student, k_data = jax.random.split(jax.random.key(args.seed), 3)
    teacher = init_moe(k_teacher, args.d_model, args.d_ff, args.experts, jnp.float32)
    params = place_params(init_moe(k_student, args.d_model, args.d_ff, args.experts, jnp.dtype(args.dtype)))
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)

    compiler_options = REPRODUCIBLE_COMPILATION if args.deterministic else None

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def train_step(params, opt_state, key):
        x = place_tokens(jax.random.normal(key, (args.tokens, args.d_model), jnp.float32))
        target = moe_layer(teacher, x, args.top_k, True)
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((layer(p, x) - target) ** 2))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    print(f"devices: {jax.devices()}  dtype: {args.dtype}  deterministic: {args.deterministic}  fp8: {args.fp8}  "
          f"compiler options: {json.dumps(compiler_options or {})}")
    start = time.perf_counter()
    keys = jax.random.split(k_data, args.steps)
    first_loss = None
    for step in range(args.steps):
        params, opt_state, loss = train_step(params, opt_state, keys[step])
        if step % 25 == 0 or step == args.steps - 1:
            loss = float(loss)
            first_loss = loss if first_loss is None else first_loss
            print(f"step {step:4d}  loss {loss:.6f}  ({time.perf_counter() - start:.1f} s)")
    print(f"loss {first_loss:.6f} -> {loss:.6f} in {args.steps} steps")
    if args.deterministic:
        print(f"parameter digest: {digest(params)}")


def main() -> None:
    args = training_arguments(__doc__.splitlines()[0], steps=500).parse_args()
    print("backends:\n" + jax_dsrelu.describe_backends())
    train(args, lambda params, x: moe_layer(params, x, args.top_k, args.deterministic, precision_of(args)))


if __name__ == "__main__":
    main()

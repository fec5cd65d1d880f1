"""Times the sm90 kernels under a few tile configurations each.

--kernel dsrelu: the fused kernel at the three few-expert benchmark shapes, the measurements behind
`choose_config` (docs/sm90.md): deterministic=False, with_dbias and with_act, bf16, same
inputs as bench_dsrelu.py. Writes sweep_configs.json to --out.

--kernel contract: the ragged contraction (dW1 = x^T dh and dW2 = act^T dy, bf16 out) at
the fine-grained layer shapes of bench_gemms.py with Dirichlet group sizes, the
measurements behind `choose_contract_config`: N tiles of 128, 192 and 256 (b = 1856 and
2688 are no multiple of 256), 32- and 64-row k-tiles, a whole tile of store buffers
against a ring of 3 (more operand stages), and the chosen tiles in the other cluster size.
Writes sweep_contract.json to --out.

--kernel gemm: the ragged-M kernels of a layer step (up: h, act = srelu(x W1[e] + b1);
down: act W2[e]; dx: dh W1[e]^T read in place; and the fused dsReLU kernel) at the
fine-grained and the few-expert shapes with Dirichlet group sizes, the measurements
behind `choose_tile_n`, `dsrelu_tile_n` and the cluster size: N tiles of 128, 192 and 256
(n = 1856 and 2688 are no multiple of 256), each with as many operand stages as fit, each
also in clusters of two CTAs along N where its N-tiles pair up; alone, each also with
32-deep k-tiles (as many stages as fit, about twice), and the kernels that store two
outputs (up, dsrelu) with one store buffer per output instead of two where that frees
room for another operand stage. --gemms picks the kernels. Writes sweep_gemm.json to
--out, with the clusters of two the GPU holds at once.

All: CUPTI time of the custom call's kernels, median of --reps calls.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import run_record
import numpy as np
from bench_dsrelu import SHAPES, cupti_ms, make_inputs
from contract_alternatives import ALTERNATIVES
from harness import group_sizes_for, parse_shapes

from jax_dsrelu.kernels import request as request_facts
from jax_dsrelu.kernels.sm90 import dsrelu_call as lowering
from jax_dsrelu.kernels.sm90 import ragged_call as sm90_gemm
from jax_dsrelu.kernels.sm90 import config as sm90_config

BF16 = np.dtype(jnp.bfloat16)
# (m, d, f, E) and the contraction's (a, b) = (d, f) for dW1, (f, d) for dW2.
CONTRACT_SHAPES = [(49152, 2688, 1856, 128), (65536, 2048, 768, 128), (32768, 7168, 2048, 32), (16384, 4096, 2048, 8)]


def candidates(sm_count):
    common = dict(tile_k=64, max_ctas=sm_count)
    return {
        "128x256 epi32 ab3": sm90_config.TileConfig(
            tile_n=256, ab_stages=3, epi_n=32, preact_stages=4, store_stages=2, **common
        ),
        "128x256 epi64 ab3": sm90_config.TileConfig(
            tile_n=256, ab_stages=3, epi_n=64, preact_stages=2, store_stages=1, **common
        ),
        "128x128 epi32 ab4": sm90_config.TileConfig(
            tile_n=128, ab_stages=4, epi_n=32, preact_stages=4, store_stages=2, **common
        ),
    }


def contract_candidates(sm_count, request):
    """The chosen config for a contraction request and its alternatives: tiles of other
    widths, rows per stage and store buffers, each walked as the chosen one is (so a row
    compares tiles at one walk), and the chosen tiles walked the other way."""
    chosen = sm90_config.choose_contract_config(request, sm_count)
    common = dict(epi_n=32, max_ctas=sm_count, a_fastest=chosen.a_fastest)
    configs = {"chosen": chosen} | {
        name: sm90_config.ContractConfig(**fields, **common) for name, fields in ALTERNATIVES.items()
    }
    # The chosen tiles in the other work order, and in the other cluster size where the
    # b-blocks pair up.
    configs["chosen " + ("b-fastest" if chosen.a_fastest else "a-fastest")] = dataclasses.replace(
        chosen, a_fastest=not chosen.a_fastest)
    if sm90_config.pairs_up(request.b, chosen.tile_n):
        other = 3 - chosen.cluster_n
        configs[f"chosen cluster{other}"] = dataclasses.replace(chosen, cluster_n=other, max_ctas=sm_count - sm_count % other)
    # A config under two names is timed once, under the first.
    unique = {}
    for name, config in configs.items():
        fits = config.smem_bytes(request.num_experts, np.dtype(request.out_dtype).itemsize) <= sm90_config.SMEM_CAPACITY
        if config not in unique.values() and fits:
            unique[name] = config
    return unique


# Nano's widths, and n = 768, where the 192- and 256-wide tiles pad alike, at 128 and 256
# experts; the other fine-grained step shape, then the few-expert ones.
GEMM_SHAPES = [(49152, 2688, 1856, 128), (65536, 2048, 768, 128), (65536, 2048, 768, 256),
               (65536, 2048, 512, 128), (16384, 4096, 2048, 8), (32768, 7168, 2048, 8), (65536, 2048, 1024, 32)]
GEMM_KERNELS = ("up", "down", "dx", "dsrelu")


def gemm_cases(shapes=GEMM_SHAPES, gemms=GEMM_KERNELS):
    """(shape, gemm, request) of every timed ragged-M kernel of `gemms`: (k, n) = (d, f)
    for up and dsrelu, (f, d) for down and dx."""
    for shape, gemm, request in _all_gemm_cases(shapes):
        if gemm in gemms:
            yield shape, gemm, request


def _all_gemm_cases(shapes):
    for m, d, f, num_experts in shapes:
        common = dict(num_experts=num_experts, operand_dtype=BF16, out_dtype=BF16)
        yield (m, d, f, num_experts), "up", request_facts.RaggedMatmulRequest(
            k=d, n=f, rhs_layout="kn", epilogue="srelu", with_bias=True, **common)
        yield (m, d, f, num_experts), "down", request_facts.RaggedMatmulRequest(k=f, n=d, rhs_layout="kn", **common)
        yield (m, d, f, num_experts), "dx", request_facts.RaggedMatmulRequest(k=f, n=d, rhs_layout="nk", **common)
        yield (m, d, f, num_experts), "dsrelu", request_for(d, f, num_experts)


def gemm_candidates(sm_count, request):
    """The chosen config for a ragged-M request and the same with every other N tile."""
    if isinstance(request, request_facts.Request):
        chosen = sm90_config.choose_config(request, sm_count)
    else:
        chosen = sm90_config.choose_gemm_config(request, sm_count)
    configs = {"chosen": chosen}
    for tile_n in (128, 192, 256):
        if tile_n != chosen.tile_n:
            config = _most_stages(dataclasses.replace(chosen, tile_n=tile_n, cluster_n=1, max_ctas=sm_count), request)
            configs[f"128x{tile_n} ab{config.ab_stages}"] = config
    # The fused kernel's preact ring holds 4 subtiles; with 2 the shared memory it frees can
    # take another operand stage (at n = 1856, 192-wide tiles get 4 stages instead of 3).
    if isinstance(request, request_facts.Request):
        for name, config in list(configs.items()):
            fewer = _most_stages(dataclasses.replace(config, preact_stages=2), request)
            if fewer.ab_stages > config.ab_stages:
                configs[f"128x{fewer.tile_n} ab{fewer.ab_stages} preact2"] = fewer
    # Each in the other cluster size (two CTAs along N, A multicast) where the N-tiles pair up.
    for name, config in list(configs.items()):
        if sm90_config.pairs_up(request.n, config.tile_n):
            other = 3 - config.cluster_n
            configs[f"{name} cluster{other}"] = dataclasses.replace(config, cluster_n=other,
                                                                    max_ctas=sm_count - sm_count % other)
    alone = {name: config for name, config in configs.items() if config.cluster_n == 1}
    # Two outputs (h and act, dh and act) take two store buffers each; with one each, the
    # epilogue waits for a subtile's store before staging the next, and the room freed
    # may take another operand stage (alone only: pairs have not paid for these kernels).
    if _outputs(request) == 2:
        for name, config in alone.items():
            single = _most_stages(dataclasses.replace(config, store_stages=1), request)
            if single.ab_stages > config.ab_stages:
                configs[f"{name} store1 ab{single.ab_stages}"] = single
    # 32-deep k-tiles: about twice the stages in the same bytes, so that the stage a wgmma batch
    # holds and the one it waits on are a smaller share of the ring (alone only).
    for name, config in alone.items():
        shallow = _most_stages(dataclasses.replace(config, tile_k=32), request, most=16)
        configs[f"{name} k32 ab{shallow.ab_stages}"] = shallow
    return configs


def _most_stages(config, request, most=8):
    """`config` with as many operand stages as fit for `request` (up to `most`), by the
    chooser's own search."""
    stages = sm90_config._most_stages(lambda stages: _fits(dataclasses.replace(config, ab_stages=stages), request), 2, most)
    return dataclasses.replace(config, ab_stages=stages)


def _fits(config, request):
    if isinstance(request, request_facts.Request):
        need = config.smem_bytes(request.num_experts, request.with_act, request.with_dbias)
    else:
        need = config.smem_bytes(request.num_experts, _outputs(request))
    return need <= sm90_config.SMEM_CAPACITY


def _outputs(request):
    """The 16-bit tensors the kernel serving `request` stores."""
    if isinstance(request, request_facts.Request):
        return 2 if request.with_act else 1
    return sm90_config.stored_outputs(request)


def sweep_gemm(reps, sm_count, shapes, gemms=GEMM_KERNELS):
    rows = []
    for shape, gemm, request in gemm_cases(shapes, gemms):
        m, d, f, num_experts = shape
        keys = jax.random.split(jax.random.key(1), 4)
        sizes = jnp.asarray(group_sizes_for("dirichlet", m, num_experts, 0))
        if gemm == "dsrelu":
            grad, weight, preact, prob, _ = make_inputs(m, request.k, request.n, num_experts, 0)
            args = (grad, weight, preact, prob, sizes, jnp.ones((num_experts,), jnp.float32))
        else:
            lhs = jax.random.normal(keys[0], (m, request.k), jnp.bfloat16)
            rhs_shape = (num_experts, request.k, request.n) if request.rhs_layout == "kn" else (num_experts, request.n, request.k)
            rhs = (jax.random.normal(keys[1], rhs_shape, jnp.float32) / np.sqrt(request.k)).astype(jnp.bfloat16)
            args = (lhs, rhs, sizes)
            if request.epilogue == "srelu":
                args += (jax.random.uniform(keys[2], (m,), jnp.float32), jax.random.normal(keys[3], (num_experts, request.n)))
        for name, config in gemm_candidates(sm_count, request).items():
            implementation = lowering if gemm == "dsrelu" else sm90_gemm
            run = jax.jit(implementation.implementation(request, config))
            ms, _ = cupti_ms(run, args, reps)
            rows.append(dict(shape=list(shape), gemm=gemm, config=name, ms=ms,
                             tflops=2.0 * m * d * f / (ms * 1e-3) / 1e12, fields=dataclasses.asdict(config)))
            print(f"{shape} {gemm:<6} {name:<14} {ms:8.3f} ms", flush=True)
    return rows


def gemm_builds(sm_count, gemm):
    """(request, config) of every candidate of kernel `gemm` at GEMM_SHAPES: one compile each."""
    return [(request, config) for _, _, request in gemm_cases(gemms=(gemm,))
            for config in gemm_candidates(sm_count, request).values()]


def build_gemm(gemm, request, config):
    if gemm == "dsrelu":
        lowering.compile_kernel(request, config)
    else:
        sm90_gemm.compile_kernel(request, config)


def contract_request(num_experts, a, b):
    return request_facts.RaggedContractRequest(
        num_experts=num_experts, a=a, b=b, operand_dtype=BF16, out_dtype=BF16
    )


def contract_cases(shapes=CONTRACT_SHAPES):
    """(shape, gemm, request) of every timed contraction."""
    for m, d, f, num_experts in shapes:
        for gemm, (a, b) in (("dw1", (d, f)), ("dw2", (f, d))):
            yield (m, d, f, num_experts), gemm, contract_request(num_experts, a, b)


def sweep_contract(reps, sm_count, shapes):
    rows = []
    for shape, gemm, request in contract_cases(shapes):
        m = shape[0]
        keys = jax.random.split(jax.random.key(0), 2)
        lhs = jax.random.normal(keys[0], (m, request.a), jnp.bfloat16)
        rhs = jax.random.normal(keys[1], (m, request.b), jnp.bfloat16)
        sizes = jnp.asarray(group_sizes_for("dirichlet", m, request.num_experts, 0))
        flops = 2.0 * m * request.a * request.b
        for name, config in contract_candidates(sm_count, request).items():
            run = jax.jit(sm90_gemm.implementation(request, config))
            ms, _ = cupti_ms(run, (lhs, rhs, sizes), reps)
            rows.append(dict(shape=list(shape), gemm=gemm, config=name, ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                             fields=dataclasses.asdict(config)))
            print(f"{shape} {gemm}  {name:<22} {ms:8.3f} ms", flush=True)
    return rows


def prebuild_contract(sm_count, shapes):
    for _, _, request in contract_cases(shapes):
        for config in contract_candidates(sm_count, request).values():
            sm90_gemm.compile_kernel(request, config)


def max_active_clusters(size):
    """How many clusters of `size` CTAs the GPU holds at once (one CTA per multiprocessor),
    as the driver reports it: a persistent grid of more would run in two waves."""
    import cutlass.utils

    try:
        return cutlass.utils.HardwareInfo().get_max_active_clusters(size)
    except Exception as error:  # the sweep's times stand without it
        return f"not known: {error}"


def request_for(k, n, num_experts):
    bf16 = jnp.dtype(jnp.bfloat16)
    return request_facts.Request(
        num_experts=num_experts, n=n, k=k, operand_dtype=bf16, preact_dtype=bf16,
        prob_dtype=jnp.dtype(jnp.float32), out_dtype=bf16, with_dbias=True, with_act=True,
        deterministic=False,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--kernel", choices=["dsrelu", "contract", "gemm"], default="dsrelu")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="m,d,f,E;... (contract and gemm; default CONTRACT_SHAPES or GEMM_SHAPES)")
    parser.add_argument("--gemms", default=",".join(GEMM_KERNELS), help="--kernel gemm: the kernels to time, comma-separated")
    parser.add_argument("--prebuild", action="store_true", help="compile the candidates of --kernel contract here, then stop")
    options = parser.parse_args()
    if options.kernel in ("contract", "gemm"):
        if options.prebuild:
            if options.kernel == "gemm":
                raise SystemExit("compile the gemm candidates with prebuild_kernels.py --only 'sweep gemm'")
            prebuild_contract(sm90_config.DEFAULT_SM_COUNT, options.shapes or CONTRACT_SHAPES)
            return
        if options.kernel == "contract":
            rows = sweep_contract(options.reps, lowering.sm_count(), options.shapes or CONTRACT_SHAPES)
        else:
            gemms = tuple(options.gemms.split(","))
            unknown = set(gemms) - set(GEMM_KERNELS)
            if unknown:
                raise SystemExit(f"--gemms takes {', '.join(GEMM_KERNELS)}, got {', '.join(sorted(unknown))}")
            rows = sweep_gemm(options.reps, lowering.sm_count(), options.shapes or GEMM_SHAPES, gemms)
        record = run_record.header(options.commit, "CUPTI kernel time, median of reps")
        if options.kernel == "gemm":
            record["max_active_clusters_of_2"] = max_active_clusters(2)
        run_record.write_json(dict(record, rows=rows), options.out, f"sweep_{options.kernel}.json")
        return
    rows = []
    for m, k, n, num_experts in SHAPES:
        grad, weight, preact, prob, sizes = make_inputs(m, k, n, num_experts, 0)
        alpha = jnp.ones((num_experts,), jnp.float32)
        request = request_for(k, n, num_experts)
        for name, config in candidates(lowering.sm_count()).items():
            run = jax.jit(lowering.implementation(request, config))
            ms, _ = cupti_ms(run, (grad, weight, preact, prob, sizes, alpha), options.reps)
            rows.append(dict(shape=[m, k, n, num_experts], config=name, ms=ms,
                             tflops=2.0 * m * n * k / (ms * 1e-3) / 1e12,
                             fields=dataclasses.asdict(config)))
            print(f"{m:>6} {k:>5} {n:>5} {num_experts:>3}  {name:<20} {ms:8.3f} ms", flush=True)
    run_record.write_json(dict(run_record.header(options.commit, "CUPTI kernel time, median of reps"), rows=rows),
                          options.out, "sweep_configs.json")


if __name__ == "__main__":
    main()

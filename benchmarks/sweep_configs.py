"""Times the sm90 kernels under alternative tile configurations, side by side in one process:
the measurements behind config.py's rules, which kernels/sm90/tuning.py cites.

--kernel gemm: the ragged-M kernels of a layer step (up: h, act = srelu(x W1[e] + b1);
down: act W2[e]; dx: dh W1[e]^T read in place; dsrelu: the fused backward) at GEMM_SHAPES:
the chosen config and the same with every other N tile (as many operand stages as fit),
each also in the other cluster size where its N-tiles pair up; alone, each also with
32-deep k-tiles, and the kernels that store two outputs with one store buffer per output
where that frees an operand stage; the fused kernel also with 2 preact stages where that
frees one, and with 64-column subtiles. --gemms picks the kernels. Writes sweep_gemm.json.

--kernel contract: the ragged contraction (dW1 = x^T dh, dW2 = act^T dy, bf16 out) at
CONTRACT_SHAPES: the chosen config, CONTRACT_ALTERNATIVES walked as it is, and the chosen
tiles walked the other way and in the other cluster size. Writes sweep_contract.json.

Both: Dirichlet group sizes, bench_gemms.py's operands, CUPTI time of the kernel's custom
call, median of --reps calls (timing.py); --label names the record sweep_<kernel>_<label>.json.

    python benchmarks/sweep_configs.py --kernel gemm --commit $(git rev-parse --short HEAD)
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/sweep_configs.py --kernel contract --prebuild
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

import bench_gemms
import harness
import run_record
import timing
from harness import BF16

from jax_dsrelu.kernels import request as request_facts
from jax_dsrelu.kernels.sm90 import config as sm90_config
from jax_dsrelu.kernels.sm90 import dsrelu_call
from jax_dsrelu.kernels.sm90 import ragged_call

GEMM_KERNELS = ("up", "down", "dx", "dsrelu")
# Nano's widths, and n = 768, where the 192- and 256-wide tiles pad alike, at 128 and 256
# experts; the other fine-grained step shape, then the few-expert ones.
GEMM_SHAPES = [(49152, 2688, 1856, 128), (65536, 2048, 768, 128), (65536, 2048, 768, 256),
               (65536, 2048, 512, 128), (16384, 4096, 2048, 8), (32768, 7168, 2048, 8), (65536, 2048, 1024, 32)]
CONTRACT_SHAPES = [(49152, 2688, 1856, 128), (65536, 2048, 768, 128), (32768, 7168, 2048, 32), (16384, 4096, 2048, 8)]
# The contraction's alternative tile configurations, by the names the records give them.
CONTRACT_ALTERNATIVES = {
    "128x192 k32 ab8 whole": dict(tile_n=192, tile_k=32, ab_stages=8, store_stages=6),
    "128x192 k64 ab4 whole": dict(tile_n=192, tile_k=64, ab_stages=4, store_stages=6),
    "128x256 k32 ab6 whole": dict(tile_n=256, tile_k=32, ab_stages=6, store_stages=8),
    "128x256 k32 ab7 ring3": dict(tile_n=256, tile_k=32, ab_stages=7, store_stages=3),
    "128x256 k32 ab8 ring2": dict(tile_n=256, tile_k=32, ab_stages=8, store_stages=2),
    "128x128 k32 ab8 whole": dict(tile_n=128, tile_k=32, ab_stages=8, store_stages=4),
}


def fused_request(k, n, num_experts):
    return request_facts.Request(
        num_experts=num_experts, n=n, k=k, operand_dtype=BF16, preact_dtype=BF16,
        prob_dtype=np.dtype(np.float32), out_dtype=BF16, with_dbias=True, with_act=True, deterministic=False)


def gemm_cases(shapes=GEMM_SHAPES, gemms=GEMM_KERNELS):
    """(shape, gemm, request) of every timed ragged-M kernel of `gemms`: (k, n) = (d, f)
    for up and dsrelu, (f, d) for down and dx."""
    for m, d, f, num_experts in shapes:
        common = dict(num_experts=num_experts, operand_dtype=BF16, out_dtype=BF16)
        requests = dict(
            up=request_facts.RaggedMatmulRequest(k=d, n=f, rhs_layout="kn", epilogue="srelu", with_bias=True, **common),
            down=request_facts.RaggedMatmulRequest(k=f, n=d, rhs_layout="kn", **common),
            dx=request_facts.RaggedMatmulRequest(k=f, n=d, rhs_layout="nk", **common),
            dsrelu=fused_request(d, f, num_experts),
        )
        for gemm in gemms:
            yield (m, d, f, num_experts), gemm, requests[gemm]


def contract_cases(shapes=CONTRACT_SHAPES):
    """(shape, gemm, request) of every timed contraction: (a, b) = (d, f) for dW1, (f, d) for dW2."""
    for m, d, f, num_experts in shapes:
        for gemm, (a, b) in (("dw1", (d, f)), ("dw2", (f, d))):
            yield (m, d, f, num_experts), gemm, request_facts.RaggedContractRequest(
                num_experts=num_experts, a=a, b=b, operand_dtype=BF16, out_dtype=BF16)


def _fits(config, request):
    if isinstance(request, request_facts.Request):
        return config.smem_bytes(request.num_experts, request.with_act, request.with_dbias) <= sm90_config.SMEM_CAPACITY
    return config.request_bytes(request) <= sm90_config.SMEM_CAPACITY


def _most_stages(config, request, most=8):
    """`config` with as many operand stages as fit for `request` (up to `most`), by the rules' own search."""
    stages = sm90_config.most_stages(lambda stages: _fits(dataclasses.replace(config, ab_stages=stages), request), 2, most)
    return dataclasses.replace(config, ab_stages=stages)


def gemm_candidates(sm_count, request):
    """The chosen config for a ragged-M request and its alternatives, by name."""
    fused = isinstance(request, request_facts.Request)
    chosen = (sm90_config.choose_config if fused else sm90_config.choose_gemm_config)(request, sm_count)
    configs = {"chosen": chosen}
    for tile_n in (128, 192, 256):
        if tile_n != chosen.tile_n:
            config = _most_stages(dataclasses.replace(chosen, tile_n=tile_n, cluster_n=1, max_ctas=sm_count), request)
            configs[f"128x{tile_n} ab{config.ab_stages}"] = config
    if fused:
        # 2 preact stages may free room for another operand stage.
        for name, config in list(configs.items()):
            fewer = _most_stages(dataclasses.replace(config, preact_stages=2), request)
            if fewer.ab_stages > config.ab_stages:
                configs[f"128x{fewer.tile_n} ab{fewer.ab_stages} preact2"] = fewer
        wide = _most_stages(dataclasses.replace(chosen, epi_n=64, preact_stages=2, store_stages=1), request)
        configs[f"chosen epi64 ab{wide.ab_stages}"] = wide
    for name, config in list(configs.items()):
        if sm90_config.pairs_up(request.n, config.tile_n) and config.epi_n == 32:
            other = 3 - config.cluster_n
            configs[f"{name} cluster{other}"] = dataclasses.replace(
                config, cluster_n=other, max_ctas=sm_count - sm_count % other)
    alone = {name: config for name, config in configs.items() if config.cluster_n == 1 and config.epi_n == 32}
    # Two outputs: one store buffer each may free room for another operand stage.
    if request.with_act if fused else sm90_config.stored_outputs(request) == 2:
        for name, config in alone.items():
            single = _most_stages(dataclasses.replace(config, store_stages=1), request)
            if single.ab_stages > config.ab_stages:
                configs[f"{name} store1 ab{single.ab_stages}"] = single
    for name, config in alone.items():  # 32-deep k-tiles: about twice the stages in the same bytes
        shallow = _most_stages(dataclasses.replace(config, tile_k=32), request, most=16)
        configs[f"{name} k32 ab{shallow.ab_stages}"] = shallow
    return configs


def contract_candidates(sm_count, request):
    """The chosen config for a contraction request and its alternatives, by name, each
    walked as the chosen one is; a config under two names is kept under the first."""
    chosen = sm90_config.choose_contract_config(request, sm_count)
    common = dict(epi_n=32, max_ctas=sm_count, a_fastest=chosen.a_fastest)
    configs = {"chosen": chosen} | {
        name: sm90_config.ContractConfig(**fields, **common) for name, fields in CONTRACT_ALTERNATIVES.items()}
    configs["chosen " + ("b-fastest" if chosen.a_fastest else "a-fastest")] = dataclasses.replace(
        chosen, a_fastest=not chosen.a_fastest)
    if sm90_config.pairs_up(request.b, chosen.tile_n):
        other = 3 - chosen.cluster_n
        configs[f"chosen cluster{other}"] = dataclasses.replace(chosen, cluster_n=other, max_ctas=sm_count - sm_count % other)
    unique = {}
    for name, config in configs.items():
        if config not in unique.values() and _fits(config, request):
            unique[name] = config
    return unique


def builds(kernel: str, sm_count: int, gemms=GEMM_KERNELS):
    """(request, config) of every candidate at the kernel's default shapes: one compile each."""
    cases = contract_cases() if kernel == "contract" else gemm_cases(gemms=gemms)
    candidates = contract_candidates if kernel == "contract" else gemm_candidates
    return [(request, config) for _, _, request in cases for config in candidates(sm_count, request).values()]


def compile_candidate(request, config) -> None:
    (dsrelu_call if isinstance(request, request_facts.Request) else ragged_call).compile_kernel(request, config)


def operands_for(gemm, request, operands):
    """The kernel's operands, from bench_gemms.py's for the layer shape."""
    if gemm == "dsrelu":
        alpha = jax.numpy.ones((request.num_experts,), jax.numpy.float32)
        return tuple(operands[n] for n in bench_gemms.DSRELU_OPERANDS) + (alpha,)
    spec = bench_gemms.MATMULS[gemm]
    return tuple(operands[name] for name in spec.operand_names())


def sweep(kernel, cases, sm_count, reps, clock, rows, save):
    candidates = contract_candidates if kernel == "contract" else gemm_candidates
    operands, operands_shape = None, None
    for shape, gemm, request in cases:
        m, d, f, num_experts = shape
        if shape != operands_shape:
            operands, operands_shape = bench_gemms.make_operands(m, d, f, num_experts, 0, "dirichlet"), shape
        args = operands_for(gemm, request, operands)
        for name, config in candidates(sm_count, request).items():
            row = dict(shape=list(shape), gemm=gemm, config=name, fields=dataclasses.asdict(config))
            try:  # a config that does not build is recorded as such; the next one runs
                call = bench_gemms.positional(
                    (dsrelu_call if gemm == "dsrelu" else ragged_call).implementation(request, config), request)
                ms = timing.time_call(jax.jit(call), args, reps, clock).ms
            except Exception as error:
                rows.append(dict(row, **run_record.error_entry(error, "timing")))
                continue
            rows.append(dict(row, ms=ms, tflops=timing.tflops(2.0 * m * d * f, ms)))
            print(f"{shape} {gemm:<6} {name:<28} {ms:8.3f} ms", flush=True)
        save()


def main(argv=None):
    parser = harness.parser(__doc__.split("\n\n")[0], reps=20)
    parser.add_argument("--kernel", choices=["gemm", "contract"], required=True)
    parser.add_argument("--gemms", default=",".join(GEMM_KERNELS), help="--kernel gemm: comma-separated subset of "
                                                                        f"{','.join(GEMM_KERNELS)}")
    options = harness.parse(parser, argv, dict(gemms=GEMM_KERNELS), shapes=None)
    if options.cpu:
        parser.error("--cpu: the sweeps time sm90 kernels, which run on a Hopper GPU only")
    options.shapes = options.shapes or (GEMM_SHAPES if options.kernel == "gemm" else CONTRACT_SHAPES)
    if options.prebuild:
        for request, config in builds(options.kernel, sm90_config.DEFAULT_SM_COUNT, tuple(options.gemms)):
            compile_candidate(request, config)
        return
    result, clock, save = harness.start_record(options, benchmark=f"sweep_{options.kernel}", flops="2 m d f per GEMM")
    cases = (contract_cases(options.shapes) if options.kernel == "contract"
             else gemm_cases(options.shapes, tuple(options.gemms)))
    sweep(options.kernel, cases, dsrelu_call.sm_count(), options.reps, clock, result.setdefault("rows", []), save)


if __name__ == "__main__":
    main()

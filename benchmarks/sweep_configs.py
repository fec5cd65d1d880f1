"""Times the sm90 kernels under alternative tile configurations, side by side in one process:
the measurements behind config.py's rules, which kernels/sm90/tuning.py cites.

--kernel gemm: the ragged-M kernels (up, down, dx, dsrelu; --gemms picks) at GEMM_SHAPES, the
chosen config and `gemm_candidates`; writes sweep_gemm.json. --kernel contract: dW1 and dW2
at CONTRACT_SHAPES, the chosen config and `contract_candidates`; writes sweep_contract.json.
Dirichlet group sizes, bench_gemms.py's operands, CUPTI time of the kernel's call.

    python benchmarks/sweep_configs.py --kernel gemm --commit $(git rev-parse --short HEAD)
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/sweep_configs.py --kernel contract --prebuild
"""

from __future__ import annotations

import dataclasses
import functools

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
CONTRACTIONS = ("dw1", "dw2")
# Nano's widths, and n = 768, where the 192- and 256-wide tiles pad alike, at 128 and 256
# experts; the other fine-grained step shape, then the few-expert ones.
GEMM_SHAPES = [(49152, 2688, 1856, 128), (65536, 2048, 768, 128), (65536, 2048, 768, 256),
               (65536, 2048, 512, 128), (16384, 4096, 2048, 8), (32768, 7168, 2048, 8), (65536, 2048, 1024, 32)]
CONTRACT_SHAPES = [(49152, 2688, 1856, 128), (65536, 2048, 768, 128), (32768, 7168, 2048, 32), (16384, 4096, 2048, 8)]
# The contraction's alternative tile configurations, by the names the records give them.
CONTRACT_ALTERNATIVES = {name: dict(zip(("tile_n", "tile_k", "ab_stages", "store_stages"), values)) for name, values in {
    "128x192 k32 ab8 whole": (192, 32, 8, 6), "128x192 k64 ab4 whole": (192, 64, 4, 6),
    "128x256 k32 ab6 whole": (256, 32, 6, 8), "128x256 k32 ab7 ring3": (256, 32, 7, 3),
    "128x256 k32 ab8 ring2": (256, 32, 8, 2), "128x128 k32 ab8 whole": (128, 32, 8, 4)}.items()}


def gemm_cases(shapes=GEMM_SHAPES, gemms=GEMM_KERNELS):
    """(shape, gemm, request) of every kernel of `gemms` (or CONTRACTIONS, in bf16), as bench_gemms.py requests it."""
    for shape in shapes:
        m, d, f, num_experts = shape
        for gemm in gemms:
            yield shape, gemm, (request_facts.Request(
                num_experts=num_experts, n=f, k=d, operand_dtype=BF16, preact_dtype=BF16, prob_dtype=np.dtype(np.float32),
                out_dtype=BF16, with_dbias=True, with_act=True, deterministic=False) if gemm == "dsrelu"
                else bench_gemms.MATMULS[gemm].request(harness.operand_shapes(*shape), BF16))


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
    """The chosen contraction config and its alternatives by name, walked as it is; duplicates dropped."""
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
    cases = gemm_cases(CONTRACT_SHAPES, CONTRACTIONS) if kernel == "contract" else gemm_cases(gemms=gemms)
    candidates = contract_candidates if kernel == "contract" else gemm_candidates
    return [(request, config) for _, _, request in cases for config in candidates(sm_count, request).values()]


def compile_candidate(request, config) -> None:
    (dsrelu_call if isinstance(request, request_facts.Request) else ragged_call).compile_kernel(request, config)


def operands_for(gemm, request, operands):
    """The kernel's operands by the primitive's names, from bench_gemms.py's for the layer shape."""
    if gemm == "dsrelu":
        named = zip(("grad", "weight", "preact", "prob", "group_sizes"), bench_gemms.DSRELU_OPERANDS)
        return {name: operands[ours] for name, ours in named} | dict(alpha=jax.numpy.ones((request.num_experts,)))
    named = zip(("lhs", "rhs", "group_sizes", "prob", "bias"), bench_gemms.MATMULS[gemm].operand_names())
    return {name: operands[ours] for name, ours in named}


def main(argv=None):
    parser = harness.parser(__doc__.split("\n\n")[0], reps=20, subsets=dict(gemms=GEMM_KERNELS))  # --kernel gemm's
    parser.add_argument("--kernel", choices=["gemm", "contract"], required=True)
    options = harness.parse(parser, argv, shapes=None)
    if options.cpu:
        parser.error("--cpu: the sweeps time sm90 kernels, which run on a Hopper GPU only")
    options.shapes = options.shapes or (GEMM_SHAPES if options.kernel == "gemm" else CONTRACT_SHAPES)
    if options.prebuild:
        for request, config in builds(options.kernel, sm90_config.DEFAULT_SM_COUNT, tuple(options.gemms)):
            compile_candidate(request, config)
        return
    result, clock, save = harness.start_record(options, benchmark=f"sweep_{options.kernel}", flops="2 m d f per GEMM")
    rows, sm_count = result.setdefault("rows", []), dsrelu_call.sm_count()
    candidates = contract_candidates if options.kernel == "contract" else gemm_candidates
    layer_operands = functools.lru_cache(maxsize=1)(lambda shape: bench_gemms.make_operands(*shape, 0, "dirichlet"))
    for shape, gemm, request in gemm_cases(options.shapes, CONTRACTIONS if options.kernel == "contract" else options.gemms):
        m, d, f, _ = shape
        args = operands_for(gemm, request, layer_operands(shape))
        for name, config in candidates(sm_count, request).items():
            row = dict(shape=list(shape), gemm=gemm, config=name, fields=dataclasses.asdict(config))
            try:  # a config that does not build is recorded as such; the next one runs
                run = (dsrelu_call if gemm == "dsrelu" else ragged_call).implementation(request, config)
                ms = timing.time_call(jax.jit(lambda named, run=run: run(**named)), (args,), options.reps, clock).ms
            except Exception as error:
                rows.append(dict(row, **run_record.error_entry(error, "timing")))
                continue
            rows.append(dict(row, ms=ms, tflops=timing.tflops(2.0 * m * d * f, ms)))
            print(f"{shape} {gemm:<6} {name:<28} {ms:8.3f} ms", flush=True)
        save()


if __name__ == "__main__":
    main()

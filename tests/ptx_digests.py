"""The PTX of every sm90 kernel configuration the project builds, as sha256 digests.

A change to the kernels' Python that should not change what runs on the GPU (a
restructure, a rename) is shown harmless by PTX that is byte for byte the same: compile
every case below before and after, and compare. The cases cover each kernel's static
options (the fused dsReLU kernel with and without dbias, act and deterministic mode, in
bfloat16 and float16; the ragged-M GEMM without epilogue, with the squared-ReLU one and
its bias, rhs read "kn" and "nk"; the contraction with both walks and float32 or 16-bit
outputs), each tile width, cluster pairs, and the shapes the tests and benchmarks build;
and the kernels not verified on an H200: the gathered variants (an operand's rows read
through a row index) and the gather-and-sum, whose digests show that the code an H200 run
checks is the code that ships.

    CUTE_DSL_ARCH=sm_90a python tests/ptx_digests.py --out before.json
    ... change the kernels ...
    CUTE_DSL_ARCH=sm_90a python tests/ptx_digests.py --out after.json --compare before.json --ptx-dir ptx/

Run it against another checkout with PYTHONPATH pointing there. A case's config is the
one `choose_*_config` picks unless the case names one; the JSON records it beside the
digest, so that a changed choice is told apart from changed code. A few pinned cases'
digests are kept in tests/ptx_digests.json, which the compile tier checks
(tests/test_sm90_ptx.py); a change that means to change the kernels rewrites it:

    CUTE_DSL_ARCH=sm_90a python tests/ptx_digests.py --pinned --out tests/ptx_digests.json
"""

from __future__ import annotations

import os

# Before anything imports CuTe DSL: on a machine without a GPU it cannot detect one.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import NamedTuple  # noqa: E402

import numpy as np  # noqa: E402

from jax_dsrelu.kernels.request import GatherSumRequest, RaggedContractRequest, RaggedMatmulRequest, Request  # noqa: E402
from jax_dsrelu.kernels.sm90 import config as sm90_config  # noqa: E402

BF16 = np.dtype("bfloat16")
FP16 = np.dtype("float16")
F32 = np.dtype("float32")


class Case(NamedTuple):
    name: str
    request: Request | RaggedMatmulRequest | RaggedContractRequest | GatherSumRequest
    config: object = None  # None: the chosen one
    outputs_in_place: bool = False
    gathered: str | None = None  # the operand read through a row index, if any


def dsrelu(k, n, num_experts, *, dtype=BF16, out_dtype=None, deterministic=False, with_dbias=True, with_act=True):
    return Request(num_experts=num_experts, n=n, k=k, operand_dtype=dtype, preact_dtype=dtype, prob_dtype=F32,
                   out_dtype=out_dtype or dtype, with_dbias=with_dbias, with_act=with_act,
                   deterministic=deterministic)


# The ragged-M GEMM's variants as the MoE layer uses them: (rhs_layout, epilogue, with_bias).
MATMUL_VARIANTS = {
    "down_kn": ("kn", "none", False),
    "dx_nk": ("nk", "none", False),
    "up_srelu": ("kn", "srelu", False),
    "up_srelu_bias": ("kn", "srelu", True),
}


def matmul(num_experts, k, n, variant, dtype=BF16):
    rhs_layout, epilogue, with_bias = MATMUL_VARIANTS[variant]
    return RaggedMatmulRequest(num_experts=num_experts, k=k, n=n, rhs_layout=rhs_layout, operand_dtype=dtype,
                               out_dtype=dtype, epilogue=epilogue, with_bias=with_bias)


def contract(num_experts, a, b, out_dtype, dtype=BF16):
    return RaggedContractRequest(num_experts=num_experts, a=a, b=b, operand_dtype=dtype, out_dtype=out_dtype)


def _flags(request: Request) -> str:
    flags = [name for name in ("deterministic", "with_dbias", "with_act") if getattr(request, name)]
    return "+".join(flags) or "plain"


def dsrelu_cases():
    def case(request, tag="", config=None, in_place=False):
        dtypes = request.operand_dtype.name + ("" if request.out_dtype == request.operand_dtype else
                                               f"->{request.out_dtype.name}")
        name = f"dsrelu/{dtypes}/k{request.k}_n{request.n}_e{request.num_experts}/{_flags(request)}{tag}"
        return Case(name, request, config, in_place)

    for deterministic in (False, True):
        for with_dbias in (False, True):
            for with_act in (False, True):
                yield case(dsrelu(256, 512, 5, deterministic=deterministic, with_dbias=with_dbias, with_act=with_act))
        yield case(dsrelu(256, 512, 5, dtype=FP16, deterministic=deterministic))
        yield case(dsrelu(256, 512, 5, deterministic=deterministic), "/in_place", in_place=True)
        # The benchmark shapes, Nemotron-3 Nano's (a partial 192-wide N-tile), the most experts.
        for k, n, num_experts in ((4096, 2048, 8), (7168, 2048, 8), (2048, 1024, 32), (2688, 1856, 128),
                                  (2048, 768, 512)):
            yield case(dsrelu(k, n, num_experts, deterministic=deterministic))
        request = dsrelu(2688, 1856, 128, deterministic=deterministic)
        yield case(request, "/cluster2", dataclasses.replace(sm90_config.choose_config(request), cluster_n=2))
    yield case(dsrelu(256, 512, 5, out_dtype=FP16))
    # Narrow widths: 64-wide tiles, partial 64- and 128-wide ones; the GPU tier's groupings.
    for k, n, num_experts in ((64, 64, 3), (128, 120, 3), (256, 200, 4), (256, 320, 4), (128, 256, 2),
                              (520, 320, 8), (192, 264, 5), (768, 1856, 16), (512, 768, 16)):
        yield case(dsrelu(k, n, num_experts))
    request = dsrelu(256, 448, 4)
    yield case(request, "/cluster2", dataclasses.replace(sm90_config.choose_config(request), cluster_n=2))
    # benchmarks/sweep_configs.py's alternatives: 64-column subtiles, 128-wide tiles.
    common = dict(tile_k=64, max_ctas=sm90_config.DEFAULT_SM_COUNT)
    for tag, config in {
        "128x256_epi64": sm90_config.TileConfig(tile_n=256, ab_stages=3, epi_n=64, preact_stages=2, store_stages=1,
                                                **common),
        "128x128_ab4": sm90_config.TileConfig(tile_n=128, ab_stages=4, epi_n=32, preact_stages=4, store_stages=2,
                                              **common),
    }.items():
        for deterministic in (False, True):
            yield case(dsrelu(4096, 2048, 8, deterministic=deterministic), f"/{tag}", config)


def matmul_cases():
    def case(request, tag="", config=None, in_place=False):
        variant = next(name for name, facts in MATMUL_VARIANTS.items()
                       if facts == (request.rhs_layout, request.epilogue, request.with_bias))
        name = f"matmul/{request.operand_dtype.name}/k{request.k}_n{request.n}_e{request.num_experts}/{variant}{tag}"
        return Case(name, request, config, in_place)

    for variant in MATMUL_VARIANTS:
        for num_experts, k, n in ((8, 4096, 2048), (128, 2688, 1856), (512, 2048, 768), (8, 520, 320),
                                  (256, 2048, 512), (4, 64, 64)):
            yield case(matmul(num_experts, k, n, variant))
        yield case(matmul(8, 520, 320, variant, FP16))
        yield case(matmul(8, 520, 320, variant), "/in_place", in_place=True)
        request = matmul(128, 2688, 1856, variant)
        yield case(request, "/cluster2", dataclasses.replace(sm90_config.choose_gemm_config(request), cluster_n=2))
    # Chosen in pairs (k >= 1536, an even N-tile count), and the same alone.
    request = matmul(128, 1856, 2688, "down_kn")
    yield case(request)
    yield case(request, "/cluster1", dataclasses.replace(sm90_config.choose_gemm_config(request), cluster_n=1))


def contract_cases():
    def case(request, tag="", config=None, in_place=False):
        name = (f"contract/{request.operand_dtype.name}->{request.out_dtype.name}/a{request.a}_b{request.b}_"
                f"e{request.num_experts}{tag}")
        return Case(name, request, config, in_place)

    for out_dtype in (F32, BF16):
        # b-block fastest (dW1's orientation) and a-block fastest (dW2's).
        for num_experts, a, b in ((8, 4096, 2048), (128, 2688, 1856), (256, 1024, 768), (512, 2048, 768),
                                  (128, 1856, 2688), (32, 2048, 7168)):
            yield case(contract(num_experts, a, b, out_dtype))
    yield case(contract(8, 520, 320, FP16, FP16))
    yield case(contract(8, 520, 320, F32, FP16))
    yield case(contract(8, 520, 320, BF16), "/in_place", in_place=True)
    # tests/test_sm90_gemms.py's configs: whole-tile stores and store rings, both walks, pairs.
    tiles = dict(tile_k=32, epi_n=32, max_ctas=sm90_config.DEFAULT_SM_COUNT)
    pairs = dict(tiles, cluster_n=2)  # 132 CTAs: whole clusters
    for tag, config in {
        "128x192_whole_tile": sm90_config.ContractConfig(tile_n=192, ab_stages=8, store_stages=6, **tiles),
        "128x256_whole_tile": sm90_config.ContractConfig(tile_n=256, ab_stages=6, store_stages=8, **tiles),
        "128x256_store_ring": sm90_config.ContractConfig(tile_n=256, ab_stages=7, store_stages=3, **tiles),
        "128x128_whole_tile": sm90_config.ContractConfig(tile_n=128, ab_stages=8, store_stages=4, **tiles),
        "128x256_whole_tile_a_fastest": sm90_config.ContractConfig(
            tile_n=256, ab_stages=6, store_stages=8, a_fastest=True, **tiles),
        "128x192_whole_tile_pairs_a_fastest": sm90_config.ContractConfig(
            tile_n=192, ab_stages=8, store_stages=6, a_fastest=True, **pairs),
        "128x192_whole_tile_pairs": sm90_config.ContractConfig(tile_n=192, ab_stages=8, store_stages=6, **pairs),
        "128x256_store_ring_pairs": sm90_config.ContractConfig(tile_n=256, ab_stages=7, store_stages=3, **pairs),
    }.items():
        yield case(contract(128, 2688, 1856, BF16), f"/{tag}", config)


def unverified_cases():
    """The gathered variants at the layer's shapes and the tests' small ones, and the
    gather-and-sum."""
    for k, n, num_experts in ((2688, 1856, 128), (7168, 2048, 32), (520, 320, 8)):
        for deterministic in (False, True):
            yield Case(f"gathered/dsrelu/k{k}_n{n}_e{num_experts}/{'deterministic' if deterministic else 'atomic'}",
                       dsrelu(k, n, num_experts, deterministic=deterministic), gathered="grad")
        for variant in MATMUL_VARIANTS:
            yield Case(f"gathered/matmul/k{k}_n{n}_e{num_experts}/{variant}", matmul(num_experts, k, n, variant),
                       gathered="lhs")
        # dW1 = x^T dh (a = d) and dW2 = act^T dy (b = d).
        yield Case(f"gathered/contract/a{k}_b{n}_e{num_experts}/lhs", contract(num_experts, k, n, BF16), gathered="lhs")
        yield Case(f"gathered/contract/a{n}_b{k}_e{num_experts}/rhs", contract(num_experts, n, k, BF16), gathered="rhs")
    for n, slots, dtype in ((2688, 6, BF16), (7168, 8, BF16), (2688, 6, F32), (64, 2, FP16)):
        yield Case(f"gather_sum/{dtype.name}/n{n}_slots{slots}", GatherSumRequest(n=n, slots=slots, rows_dtype=dtype))


def cases() -> list[Case]:
    return [*dsrelu_cases(), *matmul_cases(), *contract_cases(), *unverified_cases()]


def fp8_matmul(num_experts, k, n, epilogue, with_act=True):
    from jax_dsrelu.quantization.schema import E4M3 as e4m3

    return RaggedMatmulRequest(num_experts=num_experts, k=k, n=n, rhs_layout="nk", operand_dtype=e4m3, out_dtype=BF16,
                               epilogue=epilogue, with_bias=epilogue == "srelu", block_scaled=True, with_act=with_act)


def fp8_dsrelu(k, n, num_experts, out_dtype=F32):
    from jax_dsrelu.quantization.schema import E4M3 as e4m3

    return Request(num_experts=num_experts, n=n, k=k, operand_dtype=e4m3, preact_dtype=BF16, prob_dtype=F32,
                   out_dtype=out_dtype, with_dbias=True, with_act=True, deterministic=True, blockwise_scaled=True)


def fp8_contract(num_experts, a, b):
    from jax_dsrelu.quantization.schema import E4M3 as e4m3

    return RaggedContractRequest(num_experts=num_experts, a=a, b=b, operand_dtype=e4m3, out_dtype=BF16,
                                 block_scaled=True)


def pinned_cases() -> list[Case]:
    """A few small kernels at configs named here (not chosen, so that a change of the
    tuning rules leaves them be), one per kernel and walk: the compile tier compares their
    PTX with `PINNED_TABLE` (tests/test_sm90_ptx.py)."""
    common = dict(tile_k=64, epi_n=32, store_stages=2, max_ctas=sm90_config.DEFAULT_SM_COUNT)
    contract_tiles = dict(tile_k=32, epi_n=32, max_ctas=sm90_config.DEFAULT_SM_COUNT)
    fp8_tiles = dict(common, tile_k=128)
    return [
        Case("dsrelu/deterministic", dsrelu(256, 512, 5, deterministic=True),
             sm90_config.TileConfig(tile_n=256, ab_stages=3, preact_stages=4, **common)),
        Case("dsrelu/atomic_without_dbias_or_act", dsrelu(256, 512, 5, with_dbias=False, with_act=False),
             sm90_config.TileConfig(tile_n=256, ab_stages=4, preact_stages=2, **common)),
        Case("matmul/up_srelu_bias", matmul(8, 520, 320, "up_srelu_bias"),
             sm90_config.GemmConfig(tile_n=192, ab_stages=4, **common)),
        Case("matmul/dx_nk", matmul(8, 520, 320, "dx_nk"), sm90_config.GemmConfig(tile_n=192, ab_stages=5, **common)),
        Case("contract/whole_tile", contract(8, 520, 320, BF16),
             sm90_config.ContractConfig(tile_n=192, ab_stages=8, store_stages=6, **contract_tiles)),
        Case("contract/store_ring_pairs_a_fastest", contract(8, 520, 512, F32),
             sm90_config.ContractConfig(tile_n=256, ab_stages=7, store_stages=3, cluster_n=2, a_fastest=True,
                                        **contract_tiles)),
        Case("gathered/dsrelu/deterministic", dsrelu(520, 320, 8, deterministic=True),
             sm90_config.TileConfig(tile_n=128, ab_stages=4, preact_stages=2, **common), gathered="grad"),
        Case("gathered/matmul/up_srelu_bias", matmul(8, 520, 320, "up_srelu_bias"),
             sm90_config.GemmConfig(tile_n=192, ab_stages=4, **common), gathered="lhs"),
        Case("gathered/contract/rhs", contract(8, 328, 520, BF16),
             sm90_config.ContractConfig(tile_n=192, ab_stages=8, store_stages=6, **contract_tiles), gathered="rhs"),
        Case("gather_sum/bfloat16", GatherSumRequest(n=2688, slots=6, rows_dtype=BF16)),
        # The FP8 kernels: the ragged-M GEMM (both promotion schedules; the up-projection
        # with act and, as the FP8 forward runs it, h alone), the fused kernel.
        Case("fp8/matmul/plain_overlapped", fp8_matmul(8, 528, 320, "none"),
             sm90_config.GemmConfig(tile_n=128, ab_stages=6, operand_bytes=1, overlap_promotion=True, **fp8_tiles)),
        # As the FP8 step runs down and dx: each tile stored at once (`fp8_gemm_whole_tile`).
        Case("fp8/matmul/plain_whole_tile", fp8_matmul(8, 528, 320, "none"),
             sm90_config.GemmConfig(tile_n=128, ab_stages=6, operand_bytes=1, overlap_promotion=True,
                                    whole_tile_store=True, **dict(fp8_tiles, store_stages=4))),
        Case("fp8/matmul/up_srelu_bias", fp8_matmul(8, 528, 320, "srelu"),
             sm90_config.GemmConfig(tile_n=128, ab_stages=6, operand_bytes=1, **fp8_tiles)),
        Case("fp8/matmul/up_bias_h_alone", fp8_matmul(8, 528, 320, "srelu", with_act=False),
             sm90_config.GemmConfig(tile_n=128, ab_stages=6, operand_bytes=1, **fp8_tiles)),
        Case("fp8/matmul/up_bias_h_alone_overlapped", fp8_matmul(8, 528, 320, "srelu", with_act=False),
             sm90_config.GemmConfig(tile_n=128, ab_stages=6, operand_bytes=1, overlap_promotion=True, **fp8_tiles)),
        # As the FP8 forward runs its up-projection where k >= 2560: 192 columns in halves.
        Case("fp8/matmul/up_bias_h_alone_wide_halves", fp8_matmul(8, 2688, 1856, "srelu", with_act=False),
             sm90_config.GemmConfig(tile_n=192, ab_stages=5, operand_bytes=1, overlap_promotion=True, **fp8_tiles)),
        Case("fp8/dsrelu/deterministic", fp8_dsrelu(528, 320, 8),
             sm90_config.TileConfig(tile_n=128, ab_stages=3, preact_stages=4, operand_bytes=1, **fp8_tiles)),
        # dh and act stored in bf16 beside 2 preact and 5 operand stages, as the FP8 step runs it.
        Case("fp8/dsrelu/deterministic_bf16", fp8_dsrelu(528, 320, 8, BF16),
             sm90_config.TileConfig(tile_n=128, ab_stages=5, preact_stages=2, operand_bytes=1, **fp8_tiles)),
        # The weight gradients' FP8 contraction.
        Case("fp8/contract/whole_tile", fp8_contract(8, 528, 320),
             sm90_config.ContractConfig(tile_n=128, ab_stages=6, store_stages=4, operand_bytes=1,
                                        **dict(contract_tiles, tile_k=128))),
    ]


# The pinned cases' digests, as `--pinned --out` writes them.
PINNED_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ptx_digests.json")


def chosen_config(case: Case):
    """The case's config (None for the gather-and-sum, which has none)."""
    if case.config is not None:
        return case.config
    if isinstance(case.request, GatherSumRequest):
        return None
    if isinstance(case.request, Request):
        config = sm90_config.choose_config(case.request)
    elif isinstance(case.request, RaggedMatmulRequest):
        config = sm90_config.choose_gemm_config(case.request)
    else:
        config = sm90_config.choose_contract_config(case.request)
    # A gathered operand is loaded by each CTA alone, as the call plans choose.
    return dataclasses.replace(config, cluster_n=1) if case.gathered else config


def ptx(case: Case) -> str:
    """The case's PTX, compiled for sm_90a."""
    from jax_dsrelu.kernels.sm90 import dsrelu_call, gather_sum_call, ragged_call

    if isinstance(case.request, GatherSumRequest):
        return gather_sum_call.compile_kernel(case.request, keep=True).ptx
    call = dsrelu_call if isinstance(case.request, Request) else ragged_call
    return call.compile_kernel(case.request, chosen_config(case), outputs_in_place=case.outputs_in_place,
                               keep=True, gathered=case.gathered).ptx


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file of {case: {config, sha256}} to write")
    parser.add_argument("--compare", help="a JSON file written before: report every case that differs")
    parser.add_argument("--ptx-dir", help="also write each case's PTX here (for diffing)")
    parser.add_argument("--only", help="only the cases whose names start with this")
    parser.add_argument("--pinned", action="store_true",
                        help=f"the pinned cases only (their table: --out {os.path.relpath(PINNED_TABLE)})")
    options = parser.parse_args()
    results = {}
    for case in pinned_cases() if options.pinned else cases():
        if options.only and not case.name.startswith(options.only):
            continue
        text = ptx(case)
        results[case.name] = {"config": repr(chosen_config(case)), "sha256": digest(text)}
        print(case.name, results[case.name]["sha256"][:16], flush=True)
        if options.ptx_dir:
            path = os.path.join(options.ptx_dir, case.name.replace("/", "__") + ".ptx")
            os.makedirs(options.ptx_dir, exist_ok=True)
            with open(path, "w") as file:
                file.write(text)
    with open(options.out, "w") as file:
        json.dump(results, file, indent=1, sort_keys=True)
    if options.compare:
        with open(options.compare) as file:
            before = json.load(file)
        shared = sorted(set(before) & set(results))
        other_config = [name for name in shared if before[name]["config"] != results[name]["config"]]
        differ = [name for name in shared if name not in other_config
                  and before[name]["sha256"] != results[name]["sha256"]]
        same = len(shared) - len(other_config) - len(differ)
        print(f"{len(shared)} kernels compared: {same} identical, {len(differ)} differ, "
              f"{len(other_config)} with another config; {len(set(before) ^ set(results))} in one file only")
        for name in differ:
            print("  PTX differs:", name)
        for name in other_config:
            print("  config differs:", name, before[name]["config"], "->", results[name]["config"])
        if differ or other_config:
            sys.exit(1)


if __name__ == "__main__":
    main()

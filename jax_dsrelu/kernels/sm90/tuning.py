"""The tuning decisions of the sm90 kernels, each with the measurements that decided it.

`config.py` reads every measured choice of its rules from `DECISIONS` by name (`value`):
tile widths, k-tile depths, stages, store buffers, cluster pairs and the contraction's walk.
A decision holds its value, one sentence on why, and its evidence: per layer shape
(m, d, f, E) and GEMM, configurations timed side by side in one process by
`benchmarks/sweep_configs.py` (or one kernel class's time in two commits' layer steps on one
machine, `benchmarks/step_ab.sh`), each with its CUPTI time in ms, the record it comes
from and its entry there. The rules' pick comes first in each row; `accepted_loss` is the
most, as a fraction, by which the pick may trail the fastest timing of a row, and a row
beyond it says why in its `exception`.

The records named are files that stood under benchmarks/results/ at commit 03cb159; later
runs replaced them there, so the parts the evidence reads (each record's header, the sweeps'
rows, the layer steps' sm90 kernel times) are kept in the tree in `RECORDS`.
tests/test_tuning.py checks every figure against its record, the accepted losses, and that
the rules pick today the first configuration of every row where that configuration was
measured.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Relative to the repository root: {"about": ..., "records": {path: record}}.
RECORDS = "benchmarks/results/tuning_records.json.gz"


@dataclasses.dataclass(frozen=True)
class Timing:
    config: str  # the configuration, as `describe` writes it, or what ran in a step
    ms: float  # CUPTI kernel time: median of the sweep's calls, or the step's launches of `entry`
    entry: str  # the sweep's name for the configuration, or the kernel class summed in a step
    record: str | None = None  # path under benchmarks/results/, where not the row's


@dataclasses.dataclass(frozen=True)
class Evidence:
    shape: tuple[int, int, int, int]  # (m, d, f, E) of the layer
    gemm: str  # up, down, dx, dsrelu, dw1 or dw2; up+down+dx, dw1+dw2: a step's launches of them together
    record: str | None  # path under benchmarks/results/ of every timing without its own
    timings: tuple[Timing, ...]  # the rules' pick first
    exception: str = ""  # why the pick trails the fastest by more than the accepted loss


@dataclasses.dataclass(frozen=True)
class Decision:
    name: str
    value: Any  # what config.py reads
    accepted_loss: float
    why: str
    evidence: tuple[Evidence, ...]


def T(config: str, ms: float, entry: str, record: str | None = None) -> Timing:  # noqa: N802
    return Timing(config, ms, entry, record)


def E(shape, gemm: str, record: str | None, *timings: Timing, exception: str = "") -> Evidence:  # noqa: N802
    return Evidence(tuple(shape), gemm, record, timings, exception)


def describe(fields: dict[str, Any], contraction: bool) -> str:
    """A configuration in the evidence's words: "128x192 k64 ab4 st2 pre2 pairs", the
    contraction's with its walk ("a-fastest" or "b-fastest")."""
    text = f"{fields.get('tile_m', 128)}x{fields['tile_n']} k{fields['tile_k']} ab{fields['ab_stages']} st{fields['store_stages']}"
    if fields.get("preact_stages") is not None:
        text += f" pre{fields['preact_stages']}"
    if fields.get("epi_n", 32) != 32:
        text += f" epi{fields['epi_n']}"
    if fields.get("cluster_n", 1) == 2:
        text += " pairs"
    if fields.get("overlap_promotion"):
        text += " overlapped"
    if fields.get("whole_tile_store"):
        text += " whole"
    if contraction:
        text += " a-fastest" if fields.get("a_fastest") else " b-fastest"
    return text


def _fp8_promotion_ab(gemm: str, kernel: str, times: dict) -> tuple[Evidence, ...]:
    """The FP8 step's A/B of the promotion's schedule (tuning_records.json.gz keeps both
    sides): per shape, `kernel`'s ms promoted between the batches at 128 columns (447b2b8)
    and beside the next batch at 64 (17848d6)."""
    return tuple(E(shape, gemm, None,
                   T("447b2b8: between the batches, 128x128", waited, kernel, "bench_layer_step_ab_447b2b8_447b2b8_r1.json"),
                   T("17848d6: beside the next batch, 128x64", overlapped, kernel,
                     "bench_layer_step_ab_447b2b8_17848d6_r1.json"))
                 for shape, (waited, overlapped) in times.items())


def _fp8_halves_ab(gemm: str, kernel: str, times: dict, exceptions: dict | None = None) -> tuple[Evidence, ...]:
    """The FP8 step's A/B of the promotion by column halves (tuning_records.json.gz keeps
    both sides): per shape, `kernel`'s ms promoted between the batches (170eda3) and by
    column halves (ee47f1c), both at 128 columns."""
    return tuple(E(shape, gemm, None,
                   T("170eda3: between the batches, 128x128", waited, kernel, "bench_layer_step_ab_170eda3_170eda3_r1.json"),
                   T("ee47f1c: by column halves, 128x128", halves, kernel, "bench_layer_step_ab_170eda3_ee47f1c_r1.json"),
                   exception=(exceptions or {}).get(shape, ""))
                 for shape, (waited, halves) in times.items())


def _fp8_staged_halves_ab(gemm: str, kernel: str, times: dict) -> tuple[Evidence, ...]:
    """The FP8 step's A/B of the promotion by column halves once the contraction's scales
    are staged by TMA (tuning_records.json.gz keeps both sides, dW quantized by kernel):
    per shape, `kernel`'s ms promoted between the batches (8554063) and by column halves
    (f328947), both at 128 columns."""
    return tuple(E(shape, gemm, None,
                   T("8554063: between the batches, staged scales, 128x128", waited, kernel,
                     "bench_layer_step_ab_f328947_8554063_r1.json"),
                   T("f328947: by column halves, staged scales, 128x128", halves, kernel,
                     "bench_layer_step_ab_f328947_f328947_r1.json"))
                 for shape, (waited, halves) in times.items())


def _fp8_fused_preact_ab(times: dict) -> tuple[Evidence, ...]:
    """The FP8 step's A/B of the fused kernel's preact ring beside bf16 dh and act, two
    rounds (tuning_records.json.gz keeps both sides): per shape and round, its ms with 2
    preact and 5 operand stages (fc6c2e9) and with 4 and 4 (38b0c15)."""
    few_expert = ("2.3% slower here in both rounds and 2.3% faster at Nano's shape: one rule, the 16-bit "
                  "kernel's, for both (the step within 0.5% either way in each round)")
    return tuple(E(shape, "dsrelu", None,
                   T("fc6c2e9: pre2 ab5", fewer, "BlockScaledDsreluSm90", f"bench_layer_step_ab_38b0c15_fc6c2e9_r{r}.json"),
                   T("38b0c15: pre4 ab4", more, "BlockScaledDsreluSm90", f"bench_layer_step_ab_38b0c15_38b0c15_r{r}.json"),
                   exception=few_expert if shape[3] == 8 else "")
                 for shape, rounds in times.items() for r, (fewer, more) in enumerate(rounds, 1))


DECISIONS: tuple[Decision, ...] = (
    Decision("subtile_columns", 32, 0.0,
             "Epilogue subtiles of 32 columns, in every kernel of the family (one store path): in the "
             "fused kernel, 64-column subtiles (room for 2 preact stages and 1 store buffer) took more "
             "time at each few-expert shape, and 128-wide tiles more still.", (
        E((16384, 4096, 2048, 8), "dsrelu", "sweep_configs.json",
          T("128x256 k64 ab3 st2 pre4", 0.4330, "128x256 epi32 ab3"),
          T("128x256 k64 ab3 st1 pre2 epi64", 0.4381, "128x256 epi64 ab3"),
          T("128x128 k64 ab4 st2 pre4", 0.4636, "128x128 epi32 ab4")),
        E((32768, 7168, 2048, 8), "dsrelu", "sweep_configs.json",
          T("128x256 k64 ab3 st2 pre4", 1.2883, "128x256 epi32 ab3"),
          T("128x256 k64 ab3 st1 pre2 epi64", 1.3087, "128x256 epi64 ab3"),
          T("128x128 k64 ab4 st2 pre4", 1.5183, "128x128 epi32 ab4")),
        E((65536, 2048, 1024, 32), "dsrelu", "sweep_configs.json",
          T("128x256 k64 ab3 st2 pre4", 0.4381, "128x256 epi32 ab3"),
          T("128x256 k64 ab3 st1 pre2 epi64", 0.4537, "128x256 epi64 ab3"),
          T("128x128 k64 ab4 st2 pre4", 0.4663, "128x128 epi32 ab4")),
        )),
    Decision("fused_narrow_tile_cost", 1.1, 0.0,
             "The fused kernel takes 256-wide tiles over 128-wide ones unless they compute 10% more "
             "columns: at n = 1856, where 256 computes 2048 columns and 128 computes 1920, the 128-wide "
             "tiles still took more time (their operands cross shared memory and L2 a third more often "
             "per FLOP).", (
        E((49152, 2688, 1856, 128), "dsrelu", "fine_grained/sweep_gemm_overlap_0defe86.json",
          T("128x256 k64 ab3 st2 pre4", 1.0090, "128x256 ab3"),
          T("128x128 k64 ab4 st2 pre4", 1.1008, "128x128 ab4 overlap0")),
        E((49152, 2688, 1856, 128), "dsrelu", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x256 k64 ab3 st2 pre2", 0.9835, "128x256 ab3"),
          T("128x128 k64 ab5 st2 pre2", 1.0122, "128x128 ab5")),
        )),
    Decision("fused_tile_192", 0.97, 0.001,
             "The fused kernel takes 192-wide tiles where they compute at least 3% fewer columns than "
             "the choice between 256 and 128, or as many as 256: with the operand stage that 2 preact "
             "stages leave room for, they took less time at n = 1856 (1920 columns against 2048) and at "
             "n = 768 (as many); at n = 512, where they would compute 576, 256 stays (a tie with "
             "128-wide tiles).", (
        E((49152, 2688, 1856, 128), "dsrelu", "fine_grained/sweep_gemm_preact_cb6ff28.json",
          T("128x192 k64 ab4 st2 pre2", 0.9609, "128x192 ab4 preact2"),
          T("128x256 k64 ab3 st2 pre4", 0.9968, "chosen"),
          T("128x128 k64 ab5 st2 pre2", 1.0334, "128x128 ab5 preact2")),
        E((65536, 2048, 768, 256), "dsrelu", "fine_grained/sweep_gemm_preact_cb6ff28.json",
          T("128x192 k64 ab4 st2 pre2", 0.4594, "128x192 ab4 preact2"),
          T("128x256 k64 ab3 st2 pre4", 0.4686, "chosen"),
          T("128x128 k64 ab5 st2 pre2", 0.4766, "128x128 ab5 preact2")),
        E((65536, 2048, 768, 128), "dsrelu", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab4 st2 pre2", 0.3847, "128x192 ab4 preact2"),
          T("128x256 k64 ab3 st2 pre4", 0.4032, "chosen"),
          T("128x128 k64 ab5 st2 pre2", 0.3999, "128x128 ab5 preact2")),
        E((65536, 2048, 512, 128), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab3 st2 pre4", 0.2727, "chosen"),
          T("128x128 k64 ab5 st2 pre2", 0.2727, "128x128 ab5 preact2"),
          T("128x192 k64 ab4 st2 pre2", 0.2968, "128x192 ab4 preact2")),
        )),
    Decision("fused_preact_stages", (4, 2), 0.0,
             "The fused kernel keeps 4 preact subtiles in flight, or 2 where that frees room for one "
             "more operand stage: an operand stage was worth more than two preact stages at both widths "
             "measured.", (
        E((49152, 2688, 1856, 128), "dsrelu", "fine_grained/sweep_gemm_preact_cb6ff28.json",
          T("128x192 k64 ab4 st2 pre2", 0.9609, "128x192 ab4 preact2"),
          T("128x192 k64 ab3 st2 pre4", 1.0520, "128x192 ab3")),
        E((49152, 2688, 1856, 128), "dsrelu", "fine_grained/sweep_gemm_preact_cb6ff28.json",
          T("128x128 k64 ab5 st2 pre2", 1.0334, "128x128 ab5 preact2"),
          T("128x128 k64 ab4 st2 pre4", 1.0393, "128x128 ab4")),
        E((65536, 2048, 768, 256), "dsrelu", "fine_grained/sweep_gemm_preact_cb6ff28.json",
          T("128x192 k64 ab4 st2 pre2", 0.4594, "128x192 ab4 preact2"),
          T("128x192 k64 ab3 st2 pre4", 0.5165, "128x192 ab3")),
        E((65536, 2048, 768, 256), "dsrelu", "fine_grained/sweep_gemm_preact_cb6ff28.json",
          T("128x128 k64 ab5 st2 pre2", 0.4766, "128x128 ab5 preact2"),
          T("128x128 k64 ab4 st2 pre4", 0.4980, "128x128 ab4")),
        )),
    Decision("fused_store_stages", 2, 0.0,
             "Two store buffers per output in the fused kernel: a buffer per subtile costs an operand "
             "stage, and one buffer per output buys the same stage that 2 preact stages do; both took "
             "more time.", (
        E((49152, 2688, 1856, 128), "dsrelu", "fine_grained/sweep_gemm_overlap_0defe86.json",
          T("128x128 k64 ab4 st2 pre4", 1.1008, "128x128 ab4 overlap0"),
          T("128x128 k64 ab3 st4 pre4", 1.2904, "128x128 ab3 store4 overlap0")),
        E((65536, 2048, 768, 256), "dsrelu", "fine_grained/sweep_gemm_overlap_0defe86.json",
          T("128x128 k64 ab4 st2 pre4", 0.5030, "128x128 ab4"),
          T("128x128 k64 ab3 st4 pre4", 0.6163, "128x128 ab3 store4 overlap0")),
        E((65536, 2048, 768, 128), "dsrelu", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab4 st2 pre2", 0.3847, "128x192 ab4 preact2"),
          T("128x192 k64 ab4 st1 pre4", 0.4006, "128x192 ab3 store1 ab4")),
        E((65536, 2048, 768, 256), "dsrelu", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab4 st2 pre2", 0.4546, "128x192 ab4 preact2"),
          T("128x192 k64 ab4 st1 pre4", 0.4674, "128x192 ab3 store1 ab4")),
        )),
    Decision("fused_cluster", 1, 0.0,
             "The fused kernel runs alone (no cluster): in pairs along N it took more time in every "
             "sweep and, in the layer step against the same kernel alone on one machine, as long at "
             "Nano's shape and more at n = 1024 and 512.", (
        E((49152, 2688, 1856, 128), "dsrelu", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab4 st2 pre2", 0.9319, "chosen"),
          T("128x192 k64 ab4 st2 pre2 pairs", 0.9512, "chosen cluster2")),
        E((65536, 2048, 768, 128), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x192 k64 ab4 st2 pre2", 0.3830, "chosen"),
          T("128x192 k64 ab4 st2 pre2 pairs", 0.3922, "chosen cluster2")),
        E((65536, 2048, 768, 256), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x192 k64 ab4 st2 pre2", 0.4525, "chosen"),
          T("128x192 k64 ab4 st2 pre2 pairs", 0.4732, "chosen cluster2")),
        E((65536, 2048, 512, 128), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab3 st2 pre4", 0.2727, "chosen"),
          T("128x256 k64 ab3 st2 pre4 pairs", 0.2808, "chosen cluster2")),
        E((16384, 4096, 2048, 8), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab3 st2 pre4", 0.4200, "chosen"),
          T("128x256 k64 ab3 st2 pre4 pairs", 0.4239, "chosen cluster2")),
        E((32768, 7168, 2048, 8), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab3 st2 pre4", 1.2629, "chosen"),
          T("128x256 k64 ab3 st2 pre4 pairs", 1.2678, "chosen cluster2")),
        E((65536, 2048, 1024, 32), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab3 st2 pre4", 0.4285, "chosen"),
          T("128x256 k64 ab3 st2 pre4 pairs", 0.4376, "chosen cluster2")),
        E((49152, 2688, 1856, 128), "dsrelu", None,
          T("a3f3716: the fused kernel alone", 1.0165, "GroupedGemmDsreluSm90",
            "fine_grained/bench_layer_step_ab_da0e55b_a3f3716_r1.json"),
          T("da0e55b: the fused kernel in pairs", 1.0188, "GroupedGemmDsreluSm90",
            "fine_grained/bench_layer_step_ab_da0e55b_da0e55b_r1.json")),
        E((65536, 2048, 1024, 32), "dsrelu", None,
          T("a3f3716: the fused kernel alone", 0.4321, "GroupedGemmDsreluSm90",
            "fine_grained/bench_layer_step_ab_da0e55b_a3f3716_r1.json"),
          T("da0e55b: the fused kernel in pairs", 0.4389, "GroupedGemmDsreluSm90",
            "fine_grained/bench_layer_step_ab_da0e55b_da0e55b_r1.json")),
        E((65536, 2048, 512, 128), "dsrelu", None,
          T("a3f3716: the fused kernel alone", 0.2791, "GroupedGemmDsreluSm90",
            "fine_grained/bench_layer_step_ab_da0e55b_a3f3716_r1.json"),
          T("da0e55b: the fused kernel in pairs", 0.2859, "GroupedGemmDsreluSm90",
            "fine_grained/bench_layer_step_ab_da0e55b_da0e55b_r1.json")),
        )),
    Decision("tile_widths", (256, 192, 128), 0.01,
             "The ragged-M GEMM and the contraction take, of these N tiles, the widest of those that pad "
             "the output width least: a partial last tile computes columns never stored. At n = 1856 192 "
             "(1920 columns) beat 128 (1920) and 256 (2048); at 2688 = 14 x 192, 256-wide tiles (2816 "
             "columns) came within the accepted loss of 192-wide ones.", (
        E((49152, 2688, 1856, 128), "up", "fine_grained/sweep_gemm_5aff945.json",
          T("128x192 k64 ab4 st2", 1.0282, "chosen"),
          T("128x128 k64 ab5 st2", 1.0717, "128x128 ab5"),
          T("128x256 k64 ab3 st2", 1.1443, "128x256 ab3")),
        E((49152, 2688, 1856, 128), "down", "fine_grained/sweep_gemm_5aff945.json",
          T("128x192 k64 ab5 st2", 0.9249, "chosen"),
          T("128x128 k64 ab6 st2", 0.9841, "128x128 ab6"),
          T("128x256 k64 ab4 st2", 0.9276, "128x256 ab4")),
        E((49152, 2688, 1856, 128), "dx", "fine_grained/sweep_gemm_5aff945.json",
          T("128x192 k64 ab5 st2", 0.9278, "chosen"),
          T("128x128 k64 ab6 st2", 0.9843, "128x128 ab6"),
          T("128x256 k64 ab4 st2", 0.9219, "128x256 ab4")),
        E((49152, 2688, 1856, 128), "dw1", "fine_grained/sweep_contract_260bdd4.json",
          T("128x192 k64 ab4 st6 b-fastest", 0.8912, "chosen"),
          T("128x256 k64 ab3 st8 b-fastest", 0.9390, "128x256 ab3 st8"),
          T("128x128 k64 ab5 st4 b-fastest", 1.0093, "128x128 ab5 st4")),
        E((49152, 2688, 1856, 128), "dw2", "fine_grained/sweep_contract_260bdd4.json",
          T("128x192 k64 ab4 st6 b-fastest", 0.9031, "chosen"),
          T("128x256 k64 ab3 st8 b-fastest", 0.9219, "128x256 ab3 st8"),
          T("128x128 k64 ab5 st4 b-fastest", 1.0107, "128x128 ab5 st4")),
        )),
    Decision("gemm_enough_stages", 4, 0.0,
             "Where 256- and 192-wide tiles pad alike (n a multiple of 768) the ragged-M GEMM takes 256 "
             "only with at least 4 operand stages: at n = 768 the up-projection's 256-wide tiles took "
             "more time than 192-wide ones with 3 stages and less with 4.", (
        E((65536, 2048, 768, 128), "up", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab4 st2", 0.3625, "128x192 ab4"),
          T("128x256 k64 ab3 st2", 0.3814, "chosen")),
        E((65536, 2048, 768, 128), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 0.3573, "128x256 ab4"),
          T("128x192 k64 ab4 st2", 0.3595, "chosen")),
        E((65536, 2048, 768, 256), "up", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab4 st2", 0.4233, "128x192 ab4"),
          T("128x256 k64 ab3 st2", 0.4339, "chosen")),
        E((65536, 2048, 768, 256), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 0.4029, "128x256 ab4"),
          T("128x192 k64 ab4 st2", 0.4204, "chosen")),
        )),
    Decision("gemm_pairs", 1536, 0.01,
             "The plain ragged-M GEMM (down, dx) runs in cluster pairs along N, sharing A by multicast, "
             "from k = 1536 where its N-tiles pair up; the up-projection (two outputs of epilogue) runs "
             "alone. Pairs took less time at k = 1856 and 2048 in the step and the sweeps, and more at k "
             "= 1024 and 768; 1536 lies between. In the A/B step rounds at k = 2048 and 1024 the two "
             "differ by less than the accepted loss either way.", (
        E((49152, 2688, 1856, 128), "down", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab5 st2 pairs", 0.7959, "chosen"),
          T("128x192 k64 ab5 st2", 0.8042, "chosen cluster1")),
        E((65536, 2048, 768, 128), "down", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x256 k64 ab4 st2", 0.3458, "chosen"),
          T("128x256 k64 ab4 st2 pairs", 0.3471, "chosen cluster2")),
        E((65536, 2048, 768, 256), "down", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x256 k64 ab4 st2", 0.3975, "chosen"),
          T("128x256 k64 ab4 st2 pairs", 0.4056, "chosen cluster2")),
        E((49152, 2688, 1856, 128), "dx", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab5 st2 pairs", 0.7969, "chosen"),
          T("128x192 k64 ab5 st2", 0.8319, "chosen cluster1")),
        E((65536, 2048, 768, 128), "dx", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x256 k64 ab4 st2", 0.3452, "chosen"),
          T("128x256 k64 ab4 st2 pairs", 0.3478, "chosen cluster2")),
        E((65536, 2048, 768, 256), "dx", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x256 k64 ab4 st2", 0.4007, "chosen"),
          T("128x256 k64 ab4 st2 pairs", 0.4071, "chosen cluster2")),
        E((16384, 4096, 2048, 8), "up+down+dx", None,
          T("a3f3716: down and dx alone", 1.1554, "RaggedGemmSm90",
            "fine_grained/bench_layer_step_ab_680d6e6_a3f3716_r1.json"),
          T("680d6e6: down and dx in pairs from k = 1024", 1.1465, "RaggedGemmSm90",
            "fine_grained/bench_layer_step_ab_680d6e6_680d6e6_r1.json")),
        E((32768, 7168, 2048, 8), "up+down+dx", None,
          T("a3f3716: down and dx alone", 3.8145, "RaggedGemmSm90",
            "fine_grained/bench_layer_step_ab_680d6e6_a3f3716_r1.json"),
          T("680d6e6: down and dx in pairs from k = 1024", 3.8928, "RaggedGemmSm90",
            "fine_grained/bench_layer_step_ab_680d6e6_680d6e6_r1.json")),
        E((65536, 2048, 1024, 32), "up+down+dx", None,
          T("680d6e6: down and dx in pairs from k = 1024", 1.1559, "RaggedGemmSm90",
            "fine_grained/bench_layer_step_ab_680d6e6_680d6e6_r1.json"),
          T("a3f3716: down and dx alone", 1.1554, "RaggedGemmSm90",
            "fine_grained/bench_layer_step_ab_680d6e6_a3f3716_r1.json")),
        E((49152, 2688, 1856, 128), "up", "fine_grained/sweep_gemm_preact_cb6ff28.json",
          T("128x192 k64 ab4 st2", 0.9085, "chosen"),
          T("128x192 k64 ab4 st2 pairs", 0.9320, "chosen cluster2")),
        E((16384, 4096, 2048, 8), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 0.4081, "chosen"),
          T("128x256 k64 ab4 st2 pairs", 0.4104, "chosen cluster2")),
        E((32768, 7168, 2048, 8), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 1.2416, "chosen"),
          T("128x256 k64 ab4 st2 pairs", 1.2679, "chosen cluster2")),
        E((65536, 2048, 1024, 32), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 0.4035, "chosen"),
          T("128x256 k64 ab4 st2 pairs", 0.4065, "chosen cluster2")),
        E((65536, 2048, 512, 128), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 0.2376, "chosen"),
          T("128x256 k64 ab4 st2 pairs", 0.2407, "chosen cluster2")),
        )),
    Decision("tile_k", 64, 0.0,
             "The ragged-M kernels (the GEMM and the fused kernel) take 64-deep k-tiles: 32-deep ones, "
             "with twice the stages in the same bytes, took more time at each shape measured but one.", (
        E((49152, 2688, 1856, 128), "up", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab4 st2", 0.8817, "chosen"),
          T("128x192 k32 ab9 st2", 0.9560, "chosen k32 ab9")),
        E((49152, 2688, 1856, 128), "down", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab5 st2", 0.8042, "chosen cluster1"),
          T("128x192 k32 ab10 st2", 0.8452, "chosen cluster1 k32 ab10")),
        E((65536, 2048, 768, 128), "down", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x256 k64 ab4 st2", 0.3458, "chosen"),
          T("128x256 k32 ab8 st2", 0.3491, "chosen k32 ab8")),
        E((65536, 2048, 768, 256), "down", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x256 k64 ab4 st2", 0.3975, "chosen"),
          T("128x256 k32 ab8 st2", 0.4007, "chosen k32 ab8")),
        E((49152, 2688, 1856, 128), "dx", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab5 st2", 0.8319, "chosen cluster1"),
          T("128x192 k32 ab10 st2", 0.9673, "chosen cluster1 k32 ab10")),
        E((65536, 2048, 768, 128), "dx", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x256 k64 ab4 st2", 0.3452, "chosen"),
          T("128x256 k32 ab8 st2", 0.3560, "chosen k32 ab8")),
        E((65536, 2048, 768, 256), "dx", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x256 k64 ab4 st2", 0.4007, "chosen"),
          T("128x256 k32 ab8 st2", 0.4119, "chosen k32 ab8")),
        E((65536, 2048, 768, 128), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 0.3573, "128x256 ab4"),
          T("128x256 k32 ab8 st2", 0.3636, "128x256 ab4 k32 ab8")),
        E((65536, 2048, 768, 256), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 0.4029, "128x256 ab4"),
          T("128x256 k32 ab8 st2", 0.4178, "128x256 ab4 k32 ab8")),
        E((16384, 4096, 2048, 8), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 0.4081, "chosen"),
          T("128x256 k32 ab8 st2", 0.4132, "chosen k32 ab8")),
        E((32768, 7168, 2048, 8), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 1.2416, "chosen"),
          T("128x256 k32 ab8 st2", 1.2666, "chosen k32 ab8")),
        E((65536, 2048, 1024, 32), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 0.4035, "chosen"),
          T("128x256 k32 ab8 st2", 0.4093, "chosen k32 ab8")),
        E((65536, 2048, 512, 128), "up", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab4 st2", 0.2376, "chosen"),
          T("128x256 k32 ab8 st2", 0.2405, "chosen k32 ab8")),
        E((65536, 2048, 768, 128), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x192 k64 ab4 st2 pre2", 0.3830, "chosen"),
          T("128x192 k32 ab8 st2 pre2", 0.3870, "chosen k32 ab8")),
        E((65536, 2048, 768, 256), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x192 k64 ab4 st2 pre2", 0.4525, "chosen"),
          T("128x192 k32 ab8 st2 pre2", 0.4572, "chosen k32 ab8")),
        E((16384, 4096, 2048, 8), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab3 st2 pre4", 0.4200, "chosen"),
          T("128x256 k32 ab6 st2 pre4", 0.4319, "chosen k32 ab6")),
        E((32768, 7168, 2048, 8), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab3 st2 pre4", 1.2629, "chosen"),
          T("128x256 k32 ab6 st2 pre4", 1.3099, "chosen k32 ab6")),
        E((65536, 2048, 1024, 32), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab3 st2 pre4", 0.4285, "chosen"),
          T("128x256 k32 ab6 st2 pre4", 0.4335, "chosen k32 ab6")),
        E((65536, 2048, 512, 128), "dsrelu", "fine_grained/sweep_gemm_70248d4.json",
          T("128x256 k64 ab3 st2 pre4", 0.2727, "chosen"),
          T("128x256 k32 ab6 st2 pre4", 0.2576, "chosen k32 ab6"),
          exception="one shape: 32-deep k-tiles took more time at the few-expert shapes, at n = 768 "
                    "and at Nano's width"),
        )),
    Decision("gemm_store_stages", 2, 0.0,
             "Two store buffers per output in the ragged-M GEMM: one per output, even where it frees "
             "room for another operand stage, took more time for the up-projection.", (
        E((49152, 2688, 1856, 128), "up", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab4 st2", 0.8817, "chosen"),
          T("128x192 k64 ab5 st1", 0.9347, "chosen store1 ab5")),
        E((65536, 2048, 768, 128), "up", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab4 st2", 0.3625, "128x192 ab4"),
          T("128x192 k64 ab5 st1", 0.3695, "128x192 ab4 store1 ab5")),
        E((65536, 2048, 768, 256), "up", "fine_grained/sweep_gemm_b938ae4.json",
          T("128x192 k64 ab4 st2", 0.4233, "128x192 ab4"),
          T("128x192 k64 ab5 st1", 0.4274, "128x192 ab4 store1 ab5")),
        )),
    Decision("contract_tile_k", 32, 0.005,
             "The contraction takes 32 expert rows per stage: with ragged experts every expert's last "
             "k-tile is partly empty (about half a k-tile per expert), and the operand ring gets twice "
             "the stages in the same bytes; at the same tiles 32-row stages took less time than 64-row "
             "ones (within the accepted loss at one few-expert shape).", (
        E((49152, 2688, 1856, 128), "dw1", "fine_grained/sweep_contract_260bdd4.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.8843, "128x192 k32 ab8 st6"),
          T("128x192 k64 ab4 st6 b-fastest", 0.8912, "chosen")),
        E((65536, 2048, 768, 128), "dw1", "fine_grained/sweep_contract_260bdd4.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.3383, "128x192 k32 ab8 st6"),
          T("128x192 k64 ab4 st6 b-fastest", 0.3490, "128x192 ab4 st6")),
        E((32768, 7168, 2048, 32), "dw1", "fine_grained/sweep_contract_260bdd4.json",
          T("128x192 k32 ab8 st6 b-fastest", 1.3922, "128x192 k32 ab8 st6"),
          T("128x192 k64 ab4 st6 b-fastest", 1.4036, "128x192 ab4 st6")),
        E((16384, 4096, 2048, 8), "dw1", "fine_grained/sweep_contract_177529d.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.3689, "128x192 k32 ab8 whole"),
          T("128x192 k64 ab4 st6 b-fastest", 0.3772, "128x192 k64 ab4 whole")),
        E((32768, 7168, 2048, 8), "dw1", "fine_grained/sweep_contract_177529d.json",
          T("128x192 k32 ab8 st6 b-fastest", 1.2645, "128x192 k32 ab8 whole"),
          T("128x192 k64 ab4 st6 b-fastest", 1.3011, "128x192 k64 ab4 whole")),
        E((65536, 2048, 1024, 32), "dw1", "fine_grained/sweep_contract_177529d.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.4155, "128x192 k32 ab8 whole"),
          T("128x192 k64 ab4 st6 b-fastest", 0.4425, "128x192 k64 ab4 whole")),
        E((49152, 2688, 1856, 128), "dw2", "fine_grained/sweep_contract_260bdd4.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.8911, "128x192 k32 ab8 st6"),
          T("128x192 k64 ab4 st6 b-fastest", 0.9031, "chosen")),
        E((65536, 2048, 768, 128), "dw2", "fine_grained/sweep_contract_260bdd4.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.3500, "128x192 k32 ab8 st6"),
          T("128x192 k64 ab4 st6 b-fastest", 0.3564, "128x192 ab4 st6")),
        E((32768, 7168, 2048, 32), "dw2", "fine_grained/sweep_contract_260bdd4.json",
          T("128x192 k32 ab8 st6 b-fastest", 1.4816, "128x192 k32 ab8 st6"),
          T("128x192 k64 ab4 st6 b-fastest", 1.5033, "128x192 ab4 st6")),
        E((16384, 4096, 2048, 8), "dw2", "fine_grained/sweep_contract_177529d.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.3911, "128x192 k32 ab8 whole"),
          T("128x192 k64 ab4 st6 b-fastest", 0.4000, "128x192 k64 ab4 whole")),
        E((32768, 7168, 2048, 8), "dw2", "fine_grained/sweep_contract_177529d.json",
          T("128x192 k32 ab8 st6 b-fastest", 1.4560, "128x192 k32 ab8 whole"),
          T("128x192 k64 ab4 st6 b-fastest", 1.4524, "128x192 k64 ab4 whole")),
        E((65536, 2048, 1024, 32), "dw2", "fine_grained/sweep_contract_177529d.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.3964, "128x192 k32 ab8 whole"),
          T("128x192 k64 ab4 st6 b-fastest", 0.4012, "128x192 k64 ab4 whole")),
        )),
    Decision("contract_whole_tile", 192, 0.025,
             "The contraction stages a whole output tile in shared memory (a buffer per subtile, stored "
             "at once) where that leaves at least 192 expert rows of operands in flight, else a ring of "
             "store buffers: rings with more operand stages gained within the accepted loss where they "
             "gained, lost more elsewhere, and no static fact of a request (E, a, b, dtypes) picks out "
             "where they gain.", (
        E((49152, 2688, 1856, 128), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.8254, "chosen"),
          T("128x256 k32 ab7 st3 b-fastest", 0.9029, "128x256 k32 ab7 ring3")),
        E((49152, 2688, 1856, 128), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x192 k32 ab8 st6 a-fastest", 0.8367, "chosen"),
          T("128x256 k32 ab7 st3 a-fastest", 0.8948, "128x256 k32 ab7 ring3")),
        E((65536, 2048, 768, 256), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.4185, "chosen"),
          T("128x256 k32 ab7 st3 b-fastest", 0.4168, "128x256 k32 ab7 ring3")),
        E((65536, 2048, 768, 256), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.4219, "chosen"),
          T("128x256 k32 ab7 st3 a-fastest", 0.4169, "128x256 k32 ab7 ring3")),
        E((65536, 2048, 512, 256), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.2955, "chosen"),
          T("128x256 k32 ab7 st3 b-fastest", 0.2931, "128x256 k32 ab7 ring3")),
        E((65536, 2048, 512, 256), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.2904, "chosen"),
          T("128x256 k32 ab7 st3 a-fastest", 0.2893, "128x256 k32 ab7 ring3")),
        E((49152, 2688, 1856, 256), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x192 k32 ab8 st6 b-fastest", 1.1128, "chosen"),
          T("128x256 k32 ab7 st3 b-fastest", 1.1881, "128x256 k32 ab7 ring3")),
        E((49152, 2688, 1856, 256), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x192 k32 ab8 st6 a-fastest", 1.1173, "chosen"),
          T("128x256 k32 ab7 st3 a-fastest", 1.1868, "128x256 k32 ab7 ring3")),
        E((65536, 2048, 768, 512), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.6440, "chosen"),
          T("128x256 k32 ab7 st3 b-fastest", 0.6305, "128x256 k32 ab7 ring3")),
        E((65536, 2048, 768, 512), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.6427, "chosen"),
          T("128x256 k32 ab7 st3 a-fastest", 0.6277, "128x256 k32 ab7 ring3")),
        E((65536, 2048, 1024, 32), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.3879, "chosen"),
          T("128x256 k32 ab7 st3 b-fastest", 0.3933, "128x256 k32 ab7 ring3")),
        E((65536, 2048, 1024, 32), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.3864, "chosen"),
          T("128x256 k32 ab7 st3 a-fastest", 0.3923, "128x256 k32 ab7 ring3")),
        E((65536, 2048, 1024, 64), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.3933, "chosen"),
          T("128x256 k32 ab7 st3 b-fastest", 0.4046, "128x256 k32 ab7 ring3")),
        E((65536, 2048, 1024, 64), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.3924, "chosen"),
          T("128x256 k32 ab7 st3 a-fastest", 0.4049, "128x256 k32 ab7 ring3")),
        )),
    Decision("contract_walk", True, 0.025,
             "The contraction walks an expert's output tiles along the smaller operand's blocks fastest "
             "(a-blocks where a < b): the CTAs in flight cover every block of the fast side, so each "
             "wave reads that side's whole slice of the expert again, and the smaller slice is the "
             "cheaper. dW2 (a < b) took less time walked so at every shape; dW1 walked a-blocks fastest "
             "gained within the accepted loss at 256 and 512 experts, about as far as two calls of one "
             "shape were apart, and is not taken.", (
        E((49152, 2688, 1856, 128), "dw1", "fine_grained/sweep_contract_9cce2d9.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.8262, "chosen"),
          T("128x192 k32 ab8 st6 a-fastest", 0.8308, "chosen a-fastest")),
        E((49152, 2688, 1856, 128), "dw2", "fine_grained/sweep_contract_9cce2d9.json",
          T("128x192 k32 ab8 st6 a-fastest", 0.8456, "chosen a-fastest"),
          T("128x192 k32 ab8 st6 b-fastest", 0.8481, "chosen")),
        E((65536, 2048, 768, 128), "dw1", "fine_grained/sweep_contract_9cce2d9.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.3300, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.3337, "chosen a-fastest")),
        E((65536, 2048, 768, 128), "dw2", "fine_grained/sweep_contract_9cce2d9.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.3312, "chosen a-fastest"),
          T("128x256 k32 ab6 st8 b-fastest", 0.3376, "chosen")),
        E((65536, 2048, 512, 128), "dw1", "fine_grained/sweep_contract_9cce2d9.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.2336, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.2351, "chosen a-fastest")),
        E((65536, 2048, 512, 128), "dw2", "fine_grained/sweep_contract_9cce2d9.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.2328, "chosen a-fastest"),
          T("128x256 k32 ab6 st8 b-fastest", 0.2397, "chosen")),
        E((32768, 7168, 2048, 32), "dw1", "fine_grained/sweep_contract_9cce2d9.json",
          T("128x256 k32 ab6 st8 b-fastest", 1.3163, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 1.4040, "chosen a-fastest")),
        E((32768, 7168, 2048, 32), "dw2", "fine_grained/sweep_contract_9cce2d9.json",
          T("128x256 k32 ab6 st8 a-fastest", 1.3146, "chosen a-fastest"),
          T("128x256 k32 ab6 st8 b-fastest", 1.4242, "chosen")),
        E((65536, 2048, 768, 256), "dw1", "fine_grained/sweep_contract_9cce2d9.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.4237, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.4109, "chosen a-fastest"),
          exception="the one shape in this sweep where a wave of CTAs spans several experts; the "
                    "later sweeps at 256 and 512 experts found dW1's other walk within the accepted loss"),
        E((65536, 2048, 768, 256), "dw2", "fine_grained/sweep_contract_9cce2d9.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.4220, "chosen a-fastest"),
          T("128x256 k32 ab6 st8 b-fastest", 0.4237, "chosen")),
        E((16384, 4096, 2048, 8), "dw1", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.3544, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.3584, "chosen a-fastest")),
        E((16384, 4096, 2048, 8), "dw2", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.3520, "chosen"),
          T("128x256 k32 ab6 st8 b-fastest", 0.3682, "128x256 k32 ab6 whole")),
        E((32768, 7168, 2048, 8), "dw1", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 b-fastest", 1.2367, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 1.3171, "chosen a-fastest")),
        E((32768, 7168, 2048, 8), "dw2", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 a-fastest", 1.2327, "chosen"),
          T("128x256 k32 ab6 st8 b-fastest", 1.4344, "128x256 k32 ab6 whole")),
        E((65536, 2048, 1024, 32), "dw1", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.3899, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.3941, "chosen a-fastest")),
        E((65536, 2048, 1024, 32), "dw2", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.3885, "chosen"),
          T("128x256 k32 ab6 st8 b-fastest", 0.3983, "128x256 k32 ab6 whole")),
        E((65536, 2048, 768, 256), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.4185, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.4143, "chosen a-fastest")),
        E((65536, 2048, 512, 256), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.2955, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.2949, "chosen a-fastest")),
        E((49152, 2688, 1856, 256), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x192 k32 ab8 st6 b-fastest", 1.1128, "chosen"),
          T("128x192 k32 ab8 st6 a-fastest", 1.1118, "chosen a-fastest")),
        E((65536, 2048, 768, 512), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.6440, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.6306, "chosen a-fastest")),
        E((65536, 2048, 1024, 256), "dw1", "fine_grained/sweep_contract_57b5df0.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.5517, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.5424, "chosen a-fastest")),
        E((131072, 2048, 768, 512), "dw1", "fine_grained/sweep_contract_57b5df0.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.8560, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.8379, "chosen a-fastest")),
        E((32768, 2048, 768, 256), "dw1", "fine_grained/sweep_contract_57b5df0.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.3202, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.3185, "chosen a-fastest")),
        E((65536, 4096, 1024, 256), "dw1", "fine_grained/sweep_contract_57b5df0.json",
          T("128x256 k32 ab6 st8 b-fastest", 1.0879, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 1.0627, "chosen a-fastest")),
        E((65536, 2048, 768, 256), "dw1", "fine_grained/sweep_contract_57b5df0.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.4218, "chosen"),
          T("128x256 k32 ab6 st8 a-fastest", 0.4223, "chosen a-fastest")),
        )),
    Decision("contract_cluster", 1, 0.01,
             "The contraction runs alone: in pairs sharing the a-block it took more time in most of these "
             "sweeps, and where pairs were faster, by less than the accepted loss.", (
        E((16384, 4096, 2048, 8), "dw1", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.3544, "chosen"),
          T("128x256 k32 ab6 st8 pairs b-fastest", 0.3566, "chosen cluster2")),
        E((16384, 4096, 2048, 8), "dw2", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.3520, "chosen"),
          T("128x256 k32 ab6 st8 pairs a-fastest", 0.3580, "chosen cluster2")),
        E((32768, 7168, 2048, 8), "dw1", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 b-fastest", 1.2367, "chosen"),
          T("128x256 k32 ab6 st8 pairs b-fastest", 1.2529, "chosen cluster2")),
        E((32768, 7168, 2048, 8), "dw2", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 a-fastest", 1.2327, "chosen"),
          T("128x256 k32 ab6 st8 pairs a-fastest", 1.2858, "chosen cluster2")),
        E((65536, 2048, 1024, 32), "dw1", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.3899, "chosen"),
          T("128x256 k32 ab6 st8 pairs b-fastest", 0.3921, "chosen cluster2")),
        E((65536, 2048, 1024, 32), "dw2", "fine_grained/sweep_contract_177529d.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.3885, "chosen"),
          T("128x256 k32 ab6 st8 pairs a-fastest", 0.3985, "chosen cluster2")),
        E((49152, 2688, 1856, 128), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x192 k32 ab8 st6 b-fastest", 0.8254, "chosen"),
          T("128x192 k32 ab8 st6 pairs b-fastest", 0.8468, "chosen cluster2")),
        E((49152, 2688, 1856, 128), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x192 k32 ab8 st6 a-fastest", 0.8367, "chosen"),
          T("128x192 k32 ab8 st6 pairs a-fastest", 0.8502, "chosen cluster2")),
        E((65536, 2048, 768, 256), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.4219, "chosen"),
          T("128x256 k32 ab6 st8 pairs a-fastest", 0.4269, "chosen cluster2")),
        E((65536, 2048, 512, 256), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.2955, "chosen"),
          T("128x256 k32 ab6 st8 pairs b-fastest", 0.2943, "chosen cluster2")),
        E((65536, 2048, 512, 256), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.2904, "chosen"),
          T("128x256 k32 ab6 st8 pairs a-fastest", 0.2973, "chosen cluster2")),
        E((49152, 2688, 1856, 256), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x192 k32 ab8 st6 b-fastest", 1.1128, "chosen"),
          T("128x192 k32 ab8 st6 pairs b-fastest", 1.1042, "chosen cluster2")),
        E((49152, 2688, 1856, 256), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x192 k32 ab8 st6 a-fastest", 1.1173, "chosen"),
          T("128x192 k32 ab8 st6 pairs a-fastest", 1.1122, "chosen cluster2")),
        E((65536, 2048, 768, 512), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.6427, "chosen"),
          T("128x256 k32 ab6 st8 pairs a-fastest", 0.6417, "chosen cluster2")),
        E((65536, 2048, 1024, 32), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.3879, "chosen"),
          T("128x256 k32 ab6 st8 pairs b-fastest", 0.3919, "chosen cluster2")),
        E((65536, 2048, 1024, 32), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.3864, "chosen"),
          T("128x256 k32 ab6 st8 pairs a-fastest", 0.3974, "chosen cluster2")),
        E((65536, 2048, 1024, 64), "dw1", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 b-fastest", 0.3933, "chosen"),
          T("128x256 k32 ab6 st8 pairs b-fastest", 0.3989, "chosen cluster2")),
        E((65536, 2048, 1024, 64), "dw2", "fine_grained/sweep_contract_d133ba6.json",
          T("128x256 k32 ab6 st8 a-fastest", 0.3924, "chosen"),
          T("128x256 k32 ab6 st8 pairs a-fastest", 0.4021, "chosen cluster2")),
        )),
    # The FP8 GEMM's (`blockwise_matmul_kernel.py`), from bench_fp8_gemms.py: its variants side by
    # side in one process, each a kernel's CUPTI time.
    Decision("fp8_overlap_promotion", True, 0.0,
             "The plain FP8 GEMM promotes each K block beside the next block's wgmma, in two partial-sum "
             "buffers: less time than promoting between batches at both shapes measured (the up-projection's "
             "squared-ReLU epilogue storing act beside h keeps one buffer: with two it spills registers; storing h "
             "alone, see fp8_up_overlap_min_k).", (
        E((16384, 4096, 2048, 8), "down", "bench_fp8_gemms_e834a7c.json",
          T("128x128 k128 ab6 st2 overlapped", 0.2387, "sm90_fp8_overlap"),
          T("128x128 k128 ab6 st2", 0.2587, "sm90_fp8")),
        E((49152, 2688, 1856, 128), "down", "bench_fp8_gemms_e834a7c.json",
          T("128x128 k128 ab6 st2 overlapped", 0.5427, "sm90_fp8_overlap"),
          T("128x128 k128 ab6 st2", 0.6009, "sm90_fp8")),
        )),
    # The FP8 GEMM in CTA pairs along N sharing each A tile by multicast (sm90_fp8_pairs) against alone, from
    # bench_fp8_gemms.py on one H100: at 128 x 128 FP8 tiles a k-tile's 32 KB of operands per 4 MFLOP asks
    # L2 for more bytes per FLOP than the bf16 GEMM's 128 x 256 tiles, which pairs would cut by a quarter.
    Decision("fp8_gemm_pairs", False, 0.02,
             "The FP8 ragged GEMMs run alone: in pairs they took 3.9% (up) and 1.7% (down) less at 8 experts of "
             "2048 rows on average, and 6.9% and 1.0% more at 256 experts of 256; the rules see neither the rows "
             "per expert (known at run time) nor a k that parts the two, and the gain at 8 experts (about 0.02 "
             "ms over up, down and dx) is under 1% of the FP8 step there, about a step's spread over reps.", (
        E((16384, 4096, 2048, 8), "up", "bench_fp8_gemms_04f97fa.json",
          T("128x128 k128 ab6 st2 overlapped", 0.2613, "sm90_fp8"),
          T("128x128 k128 ab6 st2 pairs overlapped", 0.2512, "sm90_fp8_pairs"),
          exception="pairs take 3.9% less here and 6.9% more at 256 experts; the rules cannot tell the two apart"),
        E((16384, 4096, 2048, 8), "down", "bench_fp8_gemms_04f97fa.json",
          T("128x128 k128 ab6 st2 overlapped", 0.2543, "sm90_fp8"),
          T("128x128 k128 ab6 st2 pairs overlapped", 0.25, "sm90_fp8_pairs")),
        E((65536, 2048, 768, 256), "up", "bench_fp8_gemms_04f97fa.json",
          T("128x128 k128 ab6 st2", 0.2855, "sm90_fp8"),
          T("128x128 k128 ab6 st2 pairs", 0.3051, "sm90_fp8_pairs")),
        E((65536, 2048, 768, 256), "down", "bench_fp8_gemms_04f97fa.json",
          T("128x128 k128 ab6 st2 overlapped", 0.3196, "sm90_fp8"),
          T("128x128 k128 ab6 st2 pairs overlapped", 0.3229, "sm90_fp8_pairs")),
        )),
    # The FP8 up-projection storing h alone (as the FP8 layer runs it), from bench_fp8_gemms.py at two
    # commits of the same kernels on one H100: the promotion between the batches (sm90_fp8, the bias of the
    # tile's columns held from before the mainloop) against beside the next block (sm90_fp8_overlap, the
    # bias loaded subtile by subtile: held, it spills beside the second partial-sum buffer).
    Decision("fp8_up_overlap_min_k", 2560, 0.0,
             "The FP8 up-projection (h alone) promotes each K block beside the next block's wgmma where k is at "
             "least this, else between the batches: overlapped it took 3-4% less at k = 2688 and 2-3% less at "
             "4096, and 6% more at k = 2048 (n = 768, 256 experts), where the subtiles' bias loads weigh more "
             "against fewer K blocks (the plain GEMM, with no bias, gains there too); two rounds, alike. Which "
             "of k and n decides is not measured apart.",
             tuple(E(shape, "up", record,
                     *((T("128x128 k128 ab6 st2 overlapped", overlapped, "sm90_fp8_overlap"),
                        T("128x128 k128 ab6 st2", waited, "sm90_fp8"))[::1 if shape[1] >= 2560 else -1]))
                   for record, times in (
                       ("bench_fp8_gemms_57103cd.json", {(16384, 4096, 2048, 8): (0.2694, 0.2607),
                                                         (49152, 2688, 1856, 128): (0.6293, 0.6087),
                                                         (65536, 2048, 768, 256): (0.282, 0.2979)}),
                       ("bench_fp8_gemms_8a849c0.json", {(16384, 4096, 2048, 8): (0.2743, 0.2668),
                                                         (49152, 2688, 1856, 128): (0.6311, 0.6083),
                                                         (65536, 2048, 768, 256): (0.2827, 0.3)}))
                   for shape, (waited, overlapped) in times.items())),
    # The plain FP8 GEMM (down, dx) storing each tile at once from a buffer per subtile (whole_tile_store,
    # one fewer operand stage) against through a ring of two subtile buffers, each subtile's store waited
    # for before the next reuses its buffer: bench_fp8_gemms at 0a9659b (sm90_fp8_whole against sm90_fp8),
    # and the FP8 step's A/B of cced5d9 (the ring) against 27d89bd (whole tiles), two rounds on one H100.
    Decision("fp8_gemm_whole_tile", True, 0.01,
             "The plain FP8 ragged GEMM stores whole tiles where their buffers cost no operand stage (as "
             "measured; at k = 1856 with a stage fewer, beside 512 experts' tables, ptxas spilled): with the "
             "tensor cores twice as fast as bf16's, a "
             "tile's mainloop is short beside an epilogue of two barriers and a wait for the last store per "
             "subtile. Alone it took 3.4% and 2.0% less at 8 and 256 experts and 0.9% more at Nano's shape; in "
             "the step, its three ragged GEMMs (up unchanged) took 2.6% and 1.8% less at 8 experts and 1.0% "
             "and 0.2% less at Nano's shape (two rounds). The up-projection storing h alone keeps the ring: over 128 or 192 "
             "columns with its promotion overlapped, whole tiles spilled (12 and 128 bytes).", (
        *(E(shape, "down", "bench_fp8_gemms_0a9659b.json",
            T("128x128 k128 ab6 st4 overlapped whole", whole, "sm90_fp8_whole"),
            T("128x128 k128 ab6 st2 overlapped", ring, "sm90_fp8"))
          for shape, (whole, ring) in {(16384, 4096, 2048, 8): (0.2445, 0.253), (49152, 2688, 1856, 128): (0.6088, 0.6036),
                                       (65536, 2048, 768, 256): (0.3068, 0.313)}.items()),
        *(E(shape, "up+down+dx", None,
            T("27d89bd: whole tiles (down, dx)", whole, "BlockScaledRaggedGemmSm90", f"bench_layer_step_ab_cced5d9_27d89bd_r{r}.json"),
            T("cced5d9: a ring of two", ring, "BlockScaledRaggedGemmSm90", f"bench_layer_step_ab_cced5d9_cced5d9_r{r}.json"))
          for shape, rounds in {(16384, 4096, 2048, 8): ((0.7476, 0.7673), (0.7526, 0.7668)),
                                (49152, 2688, 1856, 128): ((1.7623, 1.7804), (1.766, 1.7694))}.items()
          for r, (whole, ring) in enumerate(rounds, 1)),
        )),
    # The FP8 up-projection storing h alone over N tiles of 192 columns (two weight scale blocks a k-tile),
    # promoted in column halves of 96 each beside the other's batch (sm90_fp8_wide_halves) or between the
    # batches (sm90_fp8_wide), against the 128-column tiles the rules took before (sm90_fp8), from
    # bench_fp8_gemms.py on one H100 (one process, the same inputs).
    Decision("fp8_up_wide_tiles", True, 0.0,
             "Where the FP8 up-projection storing h alone promotes beside the wgmma (fp8_up_overlap_min_k), it "
             "takes 192-column tiles promoted in column halves where they pad at most 1/32 more columns: 5.8% "
             "less than 128-column tiles at (16384, 4096, 2048, 8) (n = 2048, 1/32 more columns) and 9.6% less "
             "at Nano's shape (n = 1856, as many); at k = 2048 (256 experts), where the promotion waits, both "
             "192-column schedules took 2-5% more. The plain GEMM (down, dx) keeps 128 columns: in halves it "
             "took 5% and 3% less at 8 and 256 experts and 9% more at Nano's shape, and in the step with every "
             "ragged GEMM on either 192-column schedule the step moved by under 1% either way "
             "(step A/B at 513de3c, benchmarks/results/device_checks.log). With this rule, in the step's A/B "
             "(513de3c against d98a16c, one H100) the up-projection took 8.6% less at Nano's shape and as long "
             "as before at 8 experts (0.2718 against 0.2716 ms).", (
        E((16384, 4096, 2048, 8), "up", "bench_fp8_gemms_513de3c.json",
          T("128x192 k128 ab5 st2 overlapped", 0.2576, "sm90_fp8_wide_halves"),
          T("128x128 k128 ab6 st2 overlapped", 0.2736, "sm90_fp8"), T("128x192 k128 ab5 st2", 0.2725, "sm90_fp8_wide")),
        E((49152, 2688, 1856, 128), "up", "bench_fp8_gemms_513de3c.json",
          T("128x192 k128 ab5 st2 overlapped", 0.5631, "sm90_fp8_wide_halves"),
          T("128x128 k128 ab6 st2 overlapped", 0.6232, "sm90_fp8"), T("128x192 k128 ab5 st2", 0.6288, "sm90_fp8_wide")),
        E((65536, 2048, 768, 256), "up", "bench_fp8_gemms_513de3c.json",
          T("128x128 k128 ab6 st2", 0.2855, "sm90_fp8"), T("128x192 k128 ab5 st2 overlapped", 0.2912, "sm90_fp8_wide_halves"),
          T("128x192 k128 ab5 st2", 0.2987, "sm90_fp8_wide")),
        )),
    # The FP8 contraction's and fused kernel's promotion, from FP8 layer steps of two commits on one H100
    # (`benchmarks/step_ab.sh`, STEP_AB_VARIANTS=sm90_fp8, two rounds each): 447b2b8 promotes between the
    # batches at 128 columns, 17848d6 beside the next batch in a second whole buffer at 64 (at 128 ptxas
    # spilled); 170eda3 between the batches again, ee47f1c by column halves at 128 (each k-tile's batch
    # split in two, one half promoted beside the other's batch).
    Decision("fp8_contract_overlap_promotion", False, 0.0,
             "The FP8 weight gradients' kernel promotes each group of rows between the wgmma batches. Beside "
             "the next batch in a second whole buffer it needed 64-column tiles and took 29-37% longer; by "
             "column halves (128 columns, the waited form's registers) it took 5% longer at the few-expert "
             "shape and 1.5% less at Nano's (two rounds each, alike), the overlap's saving given back, likely by "
             "its 64-column wgmma; one rule serves both shapes. With the scales staged by TMA, by column halves "
             "took 13% and 10% longer (two rounds, alike).",
             _fp8_promotion_ab("dw1+dw2", "BlockScaledContractSm90",
                               {(16384, 4096, 2048, 8): (1.2067, 1.6500), (49152, 2688, 1856, 128): (3.0664, 3.9877)})
             + _fp8_halves_ab("dw1+dw2", "BlockScaledContractSm90",
                              {(16384, 4096, 2048, 8): (1.2178, 1.2780), (49152, 2688, 1856, 128): (3.0675, 3.0200)},
                              {(49152, 2688, 1856, 128): "by column halves 1.5% faster here and 5% slower at the "
                               "few-expert shape (round 2 alike): one rule, waited, for both"})
             + _fp8_staged_halves_ab("dw1+dw2", "BlockScaledContractSm90",
                                     {(16384, 4096, 2048, 8): (0.7097, 0.8054),
                                      (49152, 2688, 1856, 128): (1.7808, 1.9580)})),
    Decision("fp8_fused_overlap_promotion", False, 0.0,
             "The FP8 fused dsReLU kernel promotes each K block between the wgmma batches: beside the next "
             "batch in a second whole buffer it needed 64-column tiles (at 128 its epilogue's live registers "
             "spill) and took 12-19% longer; by column halves (128 columns, every promotion beside a batch) "
             "it took 4-8% longer at both shapes measured (two rounds each).",
             _fp8_promotion_ab("dsrelu", "BlockScaledDsreluSm90",
                               {(16384, 4096, 2048, 8): (0.3780, 0.4315), (49152, 2688, 1856, 128): (0.9118, 1.0836)})
             + _fp8_halves_ab("dsrelu", "BlockScaledDsreluSm90",
                              {(16384, 4096, 2048, 8): (0.3794, 0.4080), (49152, 2688, 1856, 128): (0.8942, 0.9456)})),
    # The FP8 fused kernel storing bf16 dh and act, from FP8 layer steps of two commits on one H100
    # (`benchmarks/step_ab.sh`, two rounds): 38b0c15 keeps 4 preact stages beside 4 operand stages,
    # fc6c2e9 the 16-bit kernel's rule (`fused_preact_stages`), 2 beside 5.
    Decision("fp8_fused_fewer_preact", True, 0.0,
             "The FP8 fused kernel takes the 16-bit kernel's rule, 2 preact stages where that frees room for "
             "one more operand stage: beside bf16 dh and act, 5 operand stages took 2.3% less at Nano's shape "
             "and 2.3% more at the few-expert shape than 4 beside 4 preact stages.",
             _fp8_fused_preact_ab({(16384, 4096, 2048, 8): ((0.3231, 0.3159), (0.3219, 0.3147)),
                                   (49152, 2688, 1856, 128): ((0.7579, 0.7750), (0.7580, 0.7766))})),
)
_BY_NAME = {decision.name: decision for decision in DECISIONS}


def value(name: str) -> Any:
    """The value of decision `name`, as config.py reads it."""
    if name not in _BY_NAME:
        raise KeyError(f"no tuning decision named {name!r}; the table has {sorted(_BY_NAME)}")
    return _BY_NAME[name].value

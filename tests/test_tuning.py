"""The sm90 tuning table (jax_dsrelu/kernels/sm90/tuning.py): its figures are its records',
each row's pick is the fastest or within the loss its decision accepts, the rules pick today
what the table says they pick, and reading the table left every chosen config as it was."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import itertools
import json
import math
import pathlib

import numpy as np
import pytest

from jax_dsrelu.kernels.request import RaggedContractRequest, RaggedMatmulRequest, Request
from jax_dsrelu.kernels.sm90 import config, tuning

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16, F32 = np.dtype("bfloat16"), np.dtype("float32")
ROWS = [(decision, row) for decision in tuning.DECISIONS for row in decision.evidence]


def row_id(item) -> str:
    decision, row = item
    return f"{decision.name}-{'x'.join(map(str, row.shape))}-{row.gemm}"


# --------------------------------------------------------------------- the chosen configs

WIDTHS = (8, 16, 64, 120, 128, 136, 192, 200, 248, 256, 264, 320, 328, 384, 448, 512, 640, 768, 1024, 1032,
          1152, 1536, 1856, 2048, 2688, 3712, 4096, 7168)
EXPERTS = (1, 5, 8, 32, 64, 128, 256, 375, 376, 512, 513)
# Every chooser's answers over the grid below (its config, or its refusal), as the rules
# gave them before they read the table (03cb159): sha256 of one line per request.
GRID_DIGESTS = {"dsrelu": "e19fe1b510214ee5", "gemm": "df7f5b91e044134e", "contract": "c8b3bf47b2496231"}


# Config fields added after the digests were taken (for FP8 operands): at their defaults they
# are left out, so the digests still show that the 16-bit rules choose as they did.
LATER_FIELDS = ("operand_bytes", "overlap_promotion", "whole_tile_store")


def outcome(choose, request, sm_count) -> str:
    try:
        chosen = choose(request, sm_count)
    except ValueError as error:
        return f"ValueError: {error}"
    values = tuple(getattr(chosen, f.name) for f in dataclasses.fields(chosen)
                   if not (f.name in LATER_FIELDS and getattr(chosen, f.name) == f.default))
    return f"{type(chosen).__name__}{values}"


def grid():
    """(chooser, its answer) over widths that pad each tile differently, expert counts
    across the shared-memory steps (375 and 376: where the tables cost the up-projection
    its fourth stage; 513: refused), two SM counts, both fused outputs, both epilogues, k
    on either side of the pairs' threshold and both contraction output dtypes."""
    for sm_count, num_experts, n in itertools.product((132, 114), EXPERTS, WIDTHS):
        for with_act, with_dbias in itertools.product((False, True), repeat=2):
            request = Request(num_experts, n, 2048, BF16, BF16, F32, BF16, with_dbias, with_act, False)
            yield "dsrelu", outcome(config.choose_config, request, sm_count)
        for k, epilogue in itertools.product((512, 1024, 1536, 1856, 2688), ("none", "srelu")):
            request = RaggedMatmulRequest(num_experts, k, n, "kn", BF16, BF16, epilogue, epilogue == "srelu")
            yield "gemm", outcome(config.choose_gemm_config, request, sm_count)
        for a, out_dtype in itertools.product((512, 1856, 2048, 2688, 7168), (BF16, F32)):
            request = RaggedContractRequest(num_experts, a, n, BF16, out_dtype)
            yield "contract", outcome(config.choose_contract_config, request, sm_count)


def test_the_rules_choose_every_config_as_before_they_read_the_table():
    digests = {}
    for chooser, answer in grid():
        digests.setdefault(chooser, hashlib.sha256()).update(answer.encode() + b"\n")
    assert {chooser: digest.hexdigest()[:16] for chooser, digest in digests.items()} == GRID_DIGESTS


# ---------------------------------------------------------------------- the table itself


def test_every_decision_has_evidence_and_config_reads_it():
    source = (ROOT / "jax_dsrelu" / "kernels" / "sm90" / "config.py").read_text()
    for decision in tuning.DECISIONS:
        assert decision.evidence and decision.why, decision.name
        assert f'tuning.value("{decision.name}")' in source, f"config.py does not read {decision.name}"
    with pytest.raises(KeyError, match="no tuning decision named 'tile_m'"):
        tuning.value("tile_m")


@pytest.mark.parametrize("item", ROWS, ids=row_id)
def test_the_pick_is_the_fastest_or_within_the_accepted_loss(item):
    decision, row = item
    fastest = min(timing.ms for timing in row.timings)
    loss = row.timings[0].ms / fastest - 1.0
    assert loss <= decision.accepted_loss or row.exception, (
        f"{decision.name} at {row.shape} {row.gemm}: the pick {row.timings[0].config!r} took {loss:.2%} more than "
        f"the fastest, past the accepted {decision.accepted_loss:.1%}, and the row says no exception")


def chosen_now(shape, gemm) -> str:
    """The configuration the rules choose today for one GEMM of a layer step, in the table's words."""
    _, d, f, num_experts = shape
    if gemm == "up":
        chosen = config.choose_gemm_config(RaggedMatmulRequest(num_experts, d, f, "kn", BF16, BF16, "srelu", True))
    elif gemm in ("down", "dx"):
        chosen = config.choose_gemm_config(
            RaggedMatmulRequest(num_experts, f, d, "kn" if gemm == "down" else "nk", BF16, BF16))
    elif gemm == "dsrelu":
        chosen = config.choose_config(Request(num_experts, f, d, BF16, BF16, F32, BF16, True, True, False))
    else:
        a, b = (d, f) if gemm == "dw1" else (f, d)
        chosen = config.choose_contract_config(RaggedContractRequest(num_experts, a, b, BF16, BF16))
    return tuning.describe(dataclasses.asdict(chosen), gemm in ("dw1", "dw2"))


def test_the_rules_pick_today_the_first_config_of_every_row_that_timed_it():
    checked = 0
    for decision, row in ROWS:
        if row.gemm in ("up+down+dx", "dw1+dw2"):  # a step's kernels together: no one config
            continue
        configs = [timing.config for timing in row.timings]
        now = chosen_now(row.shape, row.gemm)
        if now in configs:
            checked += 1
            assert configs[0] == now, f"{decision.name} at {row.shape} {row.gemm}: the rules pick {now!r}, " \
                                      f"the table's pick is {configs[0]!r}"
    # Most rows timed the configuration chosen today; the rest compare older alternatives.
    assert checked >= 100


# ------------------------------------------------------------------- the figures' records


@functools.cache
def records() -> dict:
    with gzip.open(ROOT / tuning.RECORDS) as file:
        return json.load(file)["records"]


def record(path: str) -> dict:
    return records()[path]


def recorded(row: tuning.Evidence, timing: tuning.Timing) -> tuple[str, float]:
    """(the configuration in the table's words, its ms) as the record has them."""
    data = record(timing.record or row.record)
    if "rows" in data:  # a sweep of sweep_configs.py
        (entry,) = [entry for entry in data["rows"] if tuple(entry["shape"]) == row.shape
                    and entry.get("gemm", "dsrelu") == row.gemm and entry["config"] == timing.entry]
        return tuning.describe(entry["fields"], row.gemm in ("dw1", "dw2")), entry["ms"]
    (step,) = [entry for entry in data["shapes"] if tuple(entry["shape"][key] for key in "mdfE") == row.shape]
    if "gemms" in step:  # bench_fp8_gemms.py: one variant's time
        return timing.config, step["gemms"][row.gemm]["variants"][timing.entry]["ms"]
    # a layer step of bench_layer.py: the launches of one kernel class
    variants = step["modes"]["step"]["variants"]
    kernels = variants[next(name for name in ("sm90", "sm90_fp8", "sm90_fp8_quantize") if name in variants)]["kernels"]
    return timing.config, math.fsum(ms for name, ms in kernels if timing.entry in name)  # summed alike on every Python


@pytest.mark.parametrize("item", ROWS, ids=row_id)
def test_every_figure_is_its_records(item):
    _, row = item
    for timing in row.timings:
        words, ms = recorded(row, timing)
        assert (words, round(ms, 4)) == (timing.config, timing.ms), (row.shape, row.gemm, timing.entry)


def fp8_up_chosen(shape) -> str:
    """The FP8 up-projection storing h alone, as the rules configure it (chosen_now reads
    the bf16 kernels' rules), in the table's words."""
    from jax_dsrelu.quantization.schema import E4M3

    _, d, f, num_experts = shape
    chosen = config.choose_gemm_config(RaggedMatmulRequest(
        num_experts, d, f, "nk", E4M3, BF16, "srelu", with_bias=True, block_scaled=True, with_act=False))
    return tuning.describe(dataclasses.asdict(chosen), False)


def test_the_fp8_up_projection_promotes_as_its_rows_pick(decide):
    """At each shape `fp8_up_overlap_min_k` timed (at 128 columns, as before
    `fp8_up_wide_tiles`), the rules choose the row's first configuration."""
    decide("fp8_up_wide_tiles", False)
    rows = tuning._BY_NAME["fp8_up_overlap_min_k"].evidence
    for row in rows:
        assert fp8_up_chosen(row.shape) == row.timings[0].config, row.shape
    assert {row.timings[0].config.endswith("overlapped") for row in rows} == {True, False}


def test_the_fp8_up_projection_takes_the_tile_width_its_rows_pick():
    """At each shape `fp8_up_wide_tiles` timed, the rules choose the row's first
    configuration: 192 columns in halves where the promotion overlaps, 128 where it waits."""
    rows = tuning._BY_NAME["fp8_up_wide_tiles"].evidence
    for row in rows:
        assert fp8_up_chosen(row.shape) == row.timings[0].config, row.shape
    assert {row.timings[0].config.split()[0] for row in rows} == {"128x192", "128x128"}


def test_the_plain_fp8_gemm_stores_as_its_rows_pick(decide):
    """At each shape `fp8_gemm_whole_tile` timed alone, the rules choose the row's first
    configuration (whole tiles), and without the decision its second (the ring); the
    up-projection storing h alone keeps the ring."""
    from jax_dsrelu.quantization.schema import E4M3

    def down_chosen(shape):
        _, d, f, num_experts = shape
        chosen = config.choose_gemm_config(RaggedMatmulRequest(num_experts, f, d, "nk", E4M3, BF16, "none",
                                                               block_scaled=True))
        return tuning.describe(dataclasses.asdict(chosen), False)

    rows = [row for row in tuning._BY_NAME["fp8_gemm_whole_tile"].evidence if row.gemm == "down"]
    assert len(rows) == 3
    for row in rows:
        assert down_chosen(row.shape) == row.timings[0].config, row.shape
        assert not fp8_up_chosen(row.shape).endswith("whole"), row.shape
    decide("fp8_gemm_whole_tile", False)
    for row in rows:
        assert down_chosen(row.shape) == row.timings[1].config, row.shape

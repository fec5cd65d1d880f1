"""QuACK's SM90 GEMMs as the `quack` variant of bench_gemms.py: the six GEMMs of a layer step by another CuTe DSL
library (deterministic too: one CTA writes each output tile), on the same operands through DLPack (`gemm_call`).
Each of CONFIGS is compiled on its first call, checked as ours are, and timed by CUPTI; the variant's time is the
fastest config that passes. Needs torch and quack-kernels (with apache-tvm-ffi, torch-c-dlpack-ext, einops);
without them the variant is an error entry.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import run_record
import timing

# (tile_m, tile_n, pingpong, cluster_m, cluster_n) from QuACK's SM90 space: its default (ping-pong,
# clusters along M), then the two cooperative shapes nearest ours.
CONFIGS = [(128, 192, True, 2, 1), (128, 256, False, 2, 1), (256, 128, False, 1, 2)]


def key_cute_dsl_references() -> None:
    """QuACK 0.6.5 keys each epilogue function by all it references and refuses what it cannot key:
    beside CuTe DSL 4.8.1, a ContextVar and code.co_positions of the DSL's op decorators (no part
    of the math), so none of its epilogue GEMMs would build. Those are keyed here by type and name;
    two refused objects alike in both would share a kernel, which the check before timing catches."""
    from quack.gemm_runtime import identity

    if getattr(identity, "keys_cute_dsl_references", False):
        return
    quack_key = identity.semantic_value_key
    def key(value, seen):
        try:
            return quack_key(value, seen)
        except TypeError:
            name = getattr(value, "__qualname__", None) or getattr(value, "name", None)
            if name is None:
                raise
            return ("refused_by_quack", type(value).__module__, type(value).__qualname__, name)
    identity.semantic_value_key = key  # looked up by name at every (recursive) call
    identity.keys_cute_dsl_references = True


def gemm_call(gemm: str, t: dict, offsets, out_dtype):
    """(run(config), outputs): run launches QuACK's kernels for `gemm` into `outputs`."""
    import torch
    from quack import gemm_interface as q

    m, d = t["x"].shape
    num_experts, _, f = t["w1"].shape
    empty = lambda *shape, dtype=t["x"].dtype: torch.empty(shape, dtype=dtype, device=t["x"].device)  # noqa: E731
    plain = q.gemm_tuned.fn  # the GEMM without the autotuner, taking a config
    if gemm == "up":
        outputs = (empty(m, f), empty(m, f))
        return lambda config: q.gemm_act(t["x"], t["w1"], bias=t["b1"], activation="relu_sq", preact_out=outputs[0],
                                         postact_out=outputs[1], cu_seqlens_m=offsets, config=config), outputs
    if gemm == "dsrelu":
        outputs = [empty(m, f), empty(m, f)]
        def dsrelu(config):
            # dprob comes back as a new tensor (QuACK adds its per-tile partial sums).
            *_, dprob = q.gemm_dact(
                t["dy"], t["w2"].mT, t["h"], activation="relu_sq", dx_out=outputs[0], postact_out=outputs[1],
                colvec_scale=t["prob"], colvec_reduce=True, cu_seqlens_m=offsets, config=config)
            outputs[2:] = [dprob]
        return dsrelu, outputs
    if gemm in ("down", "dx"):
        lhs, rhs = ("act", t["w2"]) if gemm == "down" else ("dh", t["w1"].mT)
        outputs = (empty(m, d),)
        return lambda config: plain(t[lhs], rhs, outputs[0], cu_seqlens_m=offsets, config=config), outputs
    lhs, rhs = ("x", "dh") if gemm == "dw1" else ("act", "dy")
    a, b = t[lhs].shape[1], t[rhs].shape[1]
    outputs = (empty(num_experts, a, b, dtype=getattr(torch, np.dtype(out_dtype).name)),)
    # lhs^T as QuACK's varlen-K A: (a, total rows), read in place (m-major).
    return lambda config: plain(t[lhs].T, t[rhs], outputs[0], cu_seqlens_k=offsets, config=config), outputs


def bench_entry(gemm, operands, check, passes, reps, clock, out_dtype) -> dict:
    """Every config of CONFIGS built, checked (check(JAX outputs) -> checks; passes(checks)) and
    timed: the fastest passing one's entry, each config's time or error under "configs"."""
    try:
        import torch
        from quack import gemm_interface  # noqa: F401
        from quack.gemm_config import GemmConfig

        key_cute_dsl_references()
        if clock != timing.CUPTI:
            raise RuntimeError(f"QuACK runs on a GPU only (clock {clock!r})")
    except Exception as error:
        return run_record.error_entry(error, "build")
    t = {name: torch.from_dlpack(operands[name]) for name in ("x", "dy", "h", "act", "dh", "w1", "w2", "b1", "prob")}
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(np.asarray(operands["group_sizes"], np.int64))]),
                           dtype=torch.int32, device=t["x"].device)
    tried = []
    for described in CONFIGS:
        print(f"  quack {gemm} {described}", flush=True)
        stage = "build"
        try:
            # As QuACK's own SM90 list builds them (gemm_config._get_sm90_configs).
            config = GemmConfig(**dict(zip(("tile_m", "tile_n", "pingpong", "cluster_m", "cluster_n"), described)),
                                swap_ab=False, device_capacity=9, is_dynamic_persistent=False, use_tma_gather=False)
            run, outputs = gemm_call(gemm, t, offsets, out_dtype)
            stage = "first call"  # QuACK compiles the kernel in it
            for output in outputs:
                output.fill_(float("nan"))  # poisoned: a value the kernel leaves unwritten fails the check
            run(config)
            torch.cuda.synchronize()
            stage = "check"
            checks = check([jnp.from_dlpack(output) for output in outputs])
            entry = dict(config=list(described), check=checks)
            if not passes(checks):
                print(f"  quack {described} disagrees with XLA: {checks}", flush=True)
                tried.append(dict(entry, error="result outside the tolerance: not timed", stage="check"))
                continue
            stage = "timing"
            entry.update(timing.time_launches(lambda: run(config), torch.cuda.synchronize, reps).record())
            tried.append(entry)
        except Exception as error:  # recorded; the next config runs
            tried.append(dict(run_record.error_entry(error, stage), config=list(described)))
    return run_record.best_of(tried)

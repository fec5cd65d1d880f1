#!/bin/bash
# One batch of GPU work for the sm90 backend, run on the H200 from the repository root:
#
#   bash benchmarks/device_run.sh STAGES COMMIT
#
# STAGES is a comma-separated list of:
#   prebuild  benchmarks/prebuild_kernels.py --jobs 14 on the machine's CPUs, for whatever
#             the carried cache lacks
#   smoke     one small case with a hard time limit (a hang stops everything here)
#   tests     the whole GPU tier: python -m pytest -m gpu tests/
#   dsrelu_tests  the fused kernel's GPU tier: tests/test_sm90.py
#   gemm_tests  the GPU tier of the grouped-GEMM family and of what runs on it:
#             test_sm90_gemms.py (the contraction's 20-run bitwise check included),
#             test_moe_mlp_sm90.py, test_determinism_gpu.py's deterministic cases
#   examples  EXAMPLES (examples/train_moe.py and expert_parallel.py) in bfloat16 on the GPU,
#             each run EXAMPLE_RUNS (2) times with --deterministic (the digests must agree)
#   lm        examples/train_lm.py with its docstring's GPU command (LM_STEPS steps, 2000),
#             --deterministic, run LM_RUNS (2) times (the digests must agree); Flax and
#             optax from the machine's image, or, where it lacks them, from a carried
#             lm_deps.tar.zst of pure-Python packages
#   moe_block benchmarks/bench_moe_block.py: the Nemotron-3-Nano block's step, every variant
#   gemms     benchmarks/bench_gemms.py: the six grouped GEMMs of a layer step (estimated 3-5 min)
#   layer     benchmarks/bench_layer.py: moe_mlp's step and forward, every variant, the bf16
#             baselines among them (estimated 5-8 min)
#   determinism_parallel  benchmarks/determinism_parallel.sh: for each of PARALLEL_MODES
#             (default "warm"; "warm fresh" runs both at once), PARALLEL_PROCESSES_<MODE> (4)
#             processes of each script side by side, kernels from the carried cache (warm) or
#             compiled in each process (fresh), with the caller's XLA_FLAGS; JSON named
#             PARALLEL_NAME_<mode>
#   sweep_gemm, sweep_contract  benchmarks/sweep_configs.py --kernel gemm or contract
#             (SWEEP_GEMM_ARGS, SWEEP_CONTRACT_ARGS for --gemms or --shapes)
#   sanitize  every kernel's boundary cases in the GPU tests under compute-sanitizer's
#             memcheck and racecheck
#
# Kernels come precompiled (benchmarks/prebuild_kernels.py, .kernels/ carried along). Logs
# and records go to $OUT, each record named as benchmarks/results/ names it (copied there,
# it replaces the current one); tracebacks to $OUT/<script>.err. Extra arguments: GEMMS_ARGS,
# LAYER_ARGS, MOE_BLOCK_ARGS (e.g. GEMMS_ARGS="--label fine_grained ..."). A device call runs
# at most 10 minutes (give layer and determinism_parallel a call each) and brings back at
# most 8 files, so it ends by packing $OUT into one archive:
#
#   source .gpu/activate.sh && timeout 560 bash benchmarks/device_run.sh STAGES COMMIT;
#   tar -C "$OUT" -czf /tmp/out.tgz . && find "$OUT" -mindepth 1 -delete && mv /tmp/out.tgz "$OUT/device_output.tgz"
set -o pipefail
stages=",$1,"
commit="$2"
source .gpu/activate.sh
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export JAX_DSRELU_KERNEL_CACHE="$PWD/.kernels/cache"
export PYTHONUNBUFFERED=1
log="$OUT/run.log"
# The kernel cache compresses about 20x, and a call carries at most 64 MiB.
if [[ -f .kernels.tar.zst ]]; then
  .gpu/zstd -dc .kernels.tar.zst | tar -xf -
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a "$log"

if [[ $stages == *,prebuild,* ]]; then
  start=$(date +%s)
  timeout 300 python3 benchmarks/prebuild_kernels.py --jobs 14 2>&1 \
    | grep -v -e DSLOptimizationWarning -e "for v in" | tail -5 | tee -a "$log"
  echo "prebuild exit $? in $(( $(date +%s) - start ))s" | tee -a "$log"
fi

if [[ $stages == *,smoke,* ]]; then
  timeout 180 python3 -m pytest -x -q -p no:cacheprovider tests/test_sm90.py -m gpu \
    -k "test_matches_float64_contract and one_row and bf16 and False" 2>&1 | tee -a "$log"
  status=$?
  echo "smoke exit $status" | tee -a "$log"
  [[ $status == 0 ]] || exit $status
fi

if [[ $stages == *,tests,* ]]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -rs --durations=8 -m gpu \
    tests/ 2>&1 | tee -a "$log"
  echo "tests exit $?" | tee -a "$log"
fi

if [[ $stages == *,gemm_tests,* ]]; then
  timeout 540 python3 -m pytest -q -p no:cacheprovider -rs --durations=5 -m gpu tests/test_sm90_gemms.py \
    tests/test_moe_mlp_sm90.py tests/test_determinism_gpu.py -k "not default_mode_varies" 2>&1 | tee -a "$log"
  echo "gemm_tests exit $?" | tee -a "$log"
fi

if [[ $stages == *,dsrelu_tests,* ]]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs --durations=5 -m gpu tests/test_sm90.py 2>&1 | tee -a "$log"
  echo "dsrelu_tests exit $?" | tee -a "$log"
fi

if [[ $stages == *,examples,* ]]; then
  for example in ${EXAMPLES:-train_moe expert_parallel}; do
    for run in $(seq "${EXAMPLE_RUNS:-2}"); do
      echo "== $example run $run" >> "$OUT/examples.log"
      timeout 120 python3 "examples/$example.py" --dtype bfloat16 --deterministic 2>&1 \
        | tee -a "$OUT/examples.log" | tail -3 | tee -a "$log"
      echo "$example run $run exit $?" | tee -a "$log"
    done
  done
fi

if [[ $stages == *,lm,* ]]; then
  lm_path=$PYTHONPATH
  if ! python3 -c "import flax, optax" 2>/dev/null; then
    mkdir -p /tmp/lm_deps && .gpu/zstd -dc lm_deps.tar.zst | tar -xf - -C /tmp/lm_deps
    lm_path="$PYTHONPATH:/tmp/lm_deps"
  fi
  for run in $(seq "${LM_RUNS:-2}"); do
    PYTHONPATH="$lm_path" timeout 300 python3 examples/train_lm.py --dtype bfloat16 --backend sm90 \
      --d-model 512 --layers 4 --experts 8 --d-ff 1024 --seq-len 256 --batch 64 --steps ${LM_STEPS:-2000} \
      --deterministic --plot "$OUT/train_lm_gpu.png" > "$OUT/train_lm_gpu_$run.log" 2>&1
    echo "lm run $run exit $?" | tee -a "$log"
    tail -12 "$OUT/train_lm_gpu_$run.log" | tee -a "$log"
  done
fi

if [[ $stages == *,moe_block,* ]]; then
  timeout 240 python3 benchmarks/bench_moe_block.py --commit "$commit" --out "$OUT" $MOE_BLOCK_ARGS 2> "$OUT/bench_moe_block.err" \
    | tee -a "$log"
  echo "moe_block exit $?" | tee -a "$log"
fi

if [[ $stages == *,gemms,* ]]; then
  timeout 540 python3 benchmarks/bench_gemms.py --commit "$commit" --out "$OUT" $GEMMS_ARGS \
    2> "$OUT/bench_gemms.err" | tee -a "$log"
  echo "gemms exit $?" | tee -a "$log"
fi

if [[ $stages == *,layer,* ]]; then
  timeout 560 python3 benchmarks/bench_layer.py --commit "$commit" --out "$OUT" $LAYER_ARGS \
    2> "$OUT/bench_layer.err" | tee -a "$log"
  echo "layer exit $?" | tee -a "$log"
fi

if [[ $stages == *,determinism_parallel,* ]]; then
  # Each mode in PARALLEL_MODES runs at the same time as the others (a fresh process spends
  # most of its time compiling on the CPUs, a warm one on the GPU).
  for mode in ${PARALLEL_MODES:-warm}; do
    processes_var="PARALLEL_PROCESSES_${mode^^}"
    timeout 560 bash benchmarks/determinism_parallel.sh "${!processes_var:-4}" "$commit" "$mode" \
      "${PARALLEL_NAME:-determinism_parallel}_$mode" > "$OUT/determinism_parallel_$mode.out" 2>&1 &
  done
  wait
  for mode in ${PARALLEL_MODES:-warm}; do
    tail -3 "$OUT/determinism_parallel_$mode.out" | tee -a "$log"
  done
  echo "determinism_parallel done" | tee -a "$log"
fi

for kernel in gemm contract; do
  if [[ $stages == *,sweep_$kernel,* ]]; then
    extra="SWEEP_${kernel^^}_ARGS"
    timeout 300 python3 benchmarks/sweep_configs.py --kernel $kernel --commit "$commit" --out "$OUT" ${!extra} 2>&1 \
      | tee -a "$log"
    echo "sweep_$kernel exit $?" | tee -a "$log"
  fi
done

if [[ $stages == *,sanitize,* ]]; then
  # Boundary cases of every kernel, first under memcheck, then racecheck: the fused kernel
  # in both modes with negative sizes and one row, alone and in cluster pairs (with rows
  # owned by no expert); the grouped-GEMM family, alone and in pairs, with negative sizes,
  # sums past m, one-row experts and an expert of exactly one tile; the contraction at
  # many experts of widths no tile multiple, 512 experts, and its configs of either walk.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  for check in \
      "memcheck|tests/test_sm90_gemms.py|(contraction_matches and bfloat16 and (many_experts or experts_512)) or (each_contraction_config and a_fastest)" \
      "racecheck|tests/test_sm90_gemms.py|(contraction_matches and bfloat16 and experts_512) or (each_contraction_config and a_fastest and exact_tile)" \
      "memcheck|tests/test_sm90_gemms.py|(bfloat16 and (negative or exact_tile or past_m)) or (clusters_of_each_size and (negative or exact_tile or past_m) and 2) or (_pairs and (negative or exact_tile))" \
      "racecheck|tests/test_sm90_gemms.py|(bfloat16 and (exact_tile or past_m) and (dx_nk or up_srelu_bias or contraction)) or (clusters_of_each_size and (exact_tile or past_m) and (dx_nk or up_srelu_bias) and 2) or (_pairs and exact_tile)" \
      "memcheck|tests/test_sm90.py|(test_matches_float64_contract and bf16 and negative) or (clusters_of_each_size and negative_and_unowned)" \
      "racecheck|tests/test_sm90.py|(test_matches_float64_contract and bf16 and one_row) or (clusters_of_each_size and one_row and 2)"; do
    IFS="|" read -r tool file selection <<<"$check"
    timeout 120 compute-sanitizer --tool "$tool" --print-limit 20 python3 -m pytest -q -rs \
      -p no:cacheprovider -m gpu "$file" -k "$selection" 2>&1 | tail -6 | tee -a "$log"
    echo "$tool $file exit $?" | tee -a "$log"
  done
fi

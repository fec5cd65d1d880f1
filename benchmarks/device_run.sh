#!/bin/bash
# One batch of GPU work for the sm90 backend, run on the GPU machine from the repository root:
#   bash benchmarks/device_run.sh STAGES COMMIT
# docs/performance.md ("One batch of device work") lists the stages, their variables and the call.
set -o pipefail
stages=",$1," commit="$2"
source .gpu/activate.sh
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export JAX_DSRELU_KERNEL_CACHE="$PWD/.kernels/cache" PYTHONUNBUFFERED=1
log="$OUT/run.log"
# The kernel cache compresses about 20x, and a call carries at most 64 MiB.
[[ -f .kernels.tar.zst ]] && { .gpu/zstd -dc .kernels.tar.zst | tar -xf -; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a "$log"

selected() { [[ $stages == *,$1,* ]]; }
# run NAME LIMIT COMMAND...: COMMAND within LIMIT seconds, its output to the log and its
# tracebacks to $OUT/NAME.err; then NAME's exit status, logged and returned.
run() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" 2> "$OUT/$name.err" | tee -a "$log"
  local status=$?
  echo "$name exit $status" | tee -a "$log"
  return $status
}
# carried ARCHIVE IMPORT: PYTHONPATH, plus ARCHIVE's packages (unpacked under /tmp) where python3 cannot IMPORT.
carried() {
  if python3 -c "$2" 2>/dev/null || [[ ! -f $1 ]]; then
    echo "$PYTHONPATH"
    return
  fi
  [[ -d /tmp/$1.d ]] || { mkdir -p "/tmp/$1.d" && .gpu/zstd -dc "$1" | tar -xf - -C "/tmp/$1.d"; }
  echo "$PYTHONPATH:/tmp/$1.d"
}

# GPU_TEST_WORKERS: pytest-xdist processes side by side on the GPU (the tier's time goes mostly
# to its float64 references on the CPUs), each allocating only what it uses.
gpu_tests="python3 -m pytest -q -p no:cacheprovider -rs -m gpu"
if [[ -n $GPU_TEST_WORKERS ]]; then
  gpu_tests="env XLA_PYTHON_CLIENT_PREALLOCATE=false $gpu_tests -n $GPU_TEST_WORKERS"
fi
selected gathered_tests && run gathered_tests 200 $gpu_tests --durations=5 tests/test_sm90_gathered.py
selected tests && run tests "${TESTS_LIMIT:-480}" $gpu_tests --durations=8 --ignore=tests/test_sm90_gathered.py ${TEST_FILES:-tests/}
selected check_gathered && run check_gathered 240 python3 benchmarks/check_gathered.py --commit "$commit" \
  --out "$OUT" --runs "${CHECK_RUNS:-20}"

if selected examples; then
  for example in ${EXAMPLES:-train_moe expert_parallel}; do
    for run in $(seq "${EXAMPLE_RUNS:-2}"); do
      echo "== $example run $run" >> "$OUT/examples.log"
      timeout 120 python3 "examples/$example.py" --dtype bfloat16 --deterministic 2>&1 \
        | tee -a "$OUT/examples.log" | tail -3 | tee -a "$log"
      echo "$example run $run exit $?" | tee -a "$log"
    done
  done
fi

if selected lm; then
  for run in $(seq "${LM_RUNS:-2}"); do
    PYTHONPATH="$(carried lm_deps.tar.zst "import flax, optax")" timeout 300 python3 examples/train_lm.py \
      --dtype bfloat16 --backend ${LM_BACKEND:-sm90} --d-model 512 --layers 4 --experts 8 --d-ff 1024 --seq-len 256 --batch 64 \
      --steps ${LM_STEPS:-2000} --deterministic $LM_ARGS --plot "$OUT/train_lm_gpu$LM_LABEL.png" > "$OUT/train_lm_gpu${LM_LABEL}_$run.log" 2>&1
    echo "lm run $run exit $?" | tee -a "$log"
    tail -12 "$OUT/train_lm_gpu${LM_LABEL}_$run.log" | tee -a "$log"
  done
fi

selected moe_block && PYTHONPATH="$(carried tokamax_deps.tar.zst "import tokamax")" run bench_moe_block 550 \
  python3 benchmarks/bench_moe_block.py --commit "$commit" --out "$OUT" $MOE_BLOCK_ARGS
selected gemms && run bench_gemms 540 python3 benchmarks/bench_gemms.py --commit "$commit" --out "$OUT" $GEMMS_ARGS
selected fp8_gemms && run bench_fp8_gemms 300 python3 benchmarks/bench_fp8_gemms.py --commit "$commit" --out "$OUT" $FP8_GEMMS_ARGS
# ncu's sections for kernels matching NCU_KERNELS in PROFILE_SCRIPT PROFILE_ARGS (--cpu: no CUPTI): its process only, XLA autotuning off.
selected profile && XLA_FLAGS="--xla_gpu_autotune_level=0 $XLA_FLAGS" run profile "${PROFILE_LIMIT:-400}" ncu --clock-control none --target-processes application-only -k "regex:${NCU_KERNELS:-BlockScaled(Contract|Dsrelu)Sm90}" -c "${NCU_COUNT:-6}" --csv --page ${NCU_PAGE:-details} $NCU_ARGS \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
  --log-file "$OUT/ncu.csv" python3 "benchmarks/${PROFILE_SCRIPT:-bench_layer.py}" --commit "$commit" --out "$OUT/profile" --cpu ${PROFILE_ARGS:---variants sm90_fp8 --modes step --reps 1 --shapes 16384,4096,2048,8}
selected layer && run bench_layer 560 python3 benchmarks/bench_layer.py --commit "$commit" --out "$OUT" $LAYER_ARGS
selected step_ab && run step_ab 400 bash benchmarks/step_ab.sh .kernels/old_tree "${STEP_AB_OLD:?}" "$commit" "${STEP_AB_ROUNDS:-1}"
if selected determinism_parallel; then
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
  extra="SWEEP_${kernel^^}_ARGS"
  selected sweep_$kernel && run sweep_$kernel 300 python3 benchmarks/sweep_configs.py --kernel $kernel --commit "$commit" --out "$OUT" ${!extra}
done
if selected sanitize; then
  # Boundary cases (sizes < 0, one row, past m, one tile, pairs, many E) under memcheck and racecheck, a process each (the
  # tool crashed on several at FP8), no XLA autotuning, kernels named by SANITIZE_KERNELS (a part) only, into a file.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_autotune_level=0 $XLA_FLAGS"
  for check in \
      "memcheck|tests/test_sm90_gemms.py|(contraction_matches and bfloat16 and (many_experts or experts_512)) or (each_contraction_config and a_fastest)" \
      "racecheck|tests/test_sm90_gemms.py|(contraction_matches and bfloat16 and experts_512) or (each_contraction_config and a_fastest and exact_tile)" \
      "memcheck|tests/test_sm90_gemms.py|(bfloat16 and (negative or exact_tile or past_m)) or (clusters_of_each_size and (negative or exact_tile or past_m) and 2) or (_pairs and (negative or exact_tile))" \
      "racecheck|tests/test_sm90_gemms.py|(bfloat16 and (exact_tile or past_m) and (dx_nk or up_srelu_bias or contraction)) or (clusters_of_each_size and (exact_tile or past_m) and (dx_nk or up_srelu_bias) and 2) or (_pairs and exact_tile)" \
      "memcheck|tests/test_sm90.py|(test_matches_float64_contract and bf16 and negative) or (clusters_of_each_size and negative_and_unowned)" \
      "racecheck|tests/test_sm90.py|(test_matches_float64_contract and bf16 and one_row) or (clusters_of_each_size and one_row and 2)" \
      "memcheck|tests/test_sm90_gathered.py|not nano_widths and (gathered_matmul or gathered_dsrelu or (gathered_contraction and f32) or (gather_sum_is and bf16))" \
      "racecheck|tests/test_sm90_gathered.py|(one_token or ragged_with_empty) and (up_srelu_bias or (gathered_dsrelu and True) or (gathered_contraction and f32 and both)) or (gather_sum_is and bf16)" \
      "memcheck|tests/test_sm90_fp8_contract.py|k_major_copy_kernel" "memcheck|tests/test_sm90_fp8_quantize.py|computes_its_formula" \
      "memcheck|tests/test_sm90_fp8.py|(matmul and (past_m-plain or fewer_rows or short_of_m-plain-whole) and not overlapped) or (fused and (short_of_m-True or ragged_with_empty-True-overlapped)) or up_h_alone or (storing_bf16 and True-ragged)" \
      "memcheck|tests/test_sm90_fp8_contract.py|matches_float64 and (past_m or fewer_rows)" \
      "racecheck|tests/test_sm90_fp8_contract.py|(matches_float64 and fewer_rows) or (k_major_copy_kernel and fewer)" \
      "memcheck|tests/test_sm90_fp8_weights.py|computes_the_recipe" "racecheck|tests/test_sm90_fp8_weights.py|computes_the_recipe and (partial_both-bf16 or narrow)" \
      "racecheck|tests/test_sm90_fp8_quantize.py|computes_its_formula and (fewer or past_m)" "racecheck|tests/test_sm90_fp8.py|past_m-srelu or past_m-plain-wide or short_of_m-plain-whole or (fused and (past_m-True or ragged_with_empty-False-overlapped)) or up_h_alone or (storing_bf16 and False-ragged)" \
      "memcheck|tests/test_sm90_fp8_rows.py|squared_relu_form_computes or (row_quantizer_computes and (partial_last-bf16 or ragged_cta))" \
      "racecheck|tests/test_sm90_fp8_rows.py|squared_relu_form_computes or (row_quantizer_computes and (partial_last-bf16 or ragged_cta))"; do
    IFS="|" read -r tool file selection <<<"$check"
    [[ $file =~ ${SANITIZE_FILES:-.} ]] || continue
    python3 -m pytest -q --collect-only -p no:cacheprovider -m gpu $file -k "$selection" | grep :: | while read -r test; do
      timeout -k 10 "${SANITIZE_LIMIT:-180}" compute-sanitizer --tool "$tool" --print-limit 20 ${SANITIZE_KERNELS:+--kernel-name \
        kns=$SANITIZE_KERNELS} python3 -m pytest -q -rs -p no:cacheprovider "$test" >> "$OUT/sanitize.out" 2>&1
      echo "$tool $test exit $?: $(tail -2 "$OUT/sanitize.out" | tr '\n' ' ')" | tee -a "$log"
    done
  done
fi

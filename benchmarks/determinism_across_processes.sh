#!/bin/bash
# Bitwise reproducibility across processes on the GPU, from the repository root:
#
#   bash benchmarks/determinism_across_processes.sh
#
# Each process compiles anew. benchmarks/process_digests.py is run twice with XLA's
# default flags and twice with GEMM autotuning off, and examples/train_moe.py twice with
# autotuning off; logs go to $OUT/determinism.log.
set -o pipefail
source .gpu/activate.sh
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export JAX_DSRELU_KERNEL_CACHE="$PWD/.kernels/cache"
log="$OUT/determinism.log"
for flags in "" "--xla_gpu_autotune_level=0"; do
  for run in 1 2; do
    XLA_FLAGS="$flags" timeout 150 python3 benchmarks/process_digests.py --label "run$run" 2>&1 \
      | tail -1 | tee -a "$log"
  done
done
for run in 1 2; do
  XLA_FLAGS="--xla_gpu_autotune_level=0" timeout 120 python3 examples/train_moe.py --dtype bfloat16 \
    --deterministic 2>&1 | tail -2 | tee -a "$log"
done

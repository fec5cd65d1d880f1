#!/bin/bash
# Two commits' moe_mlp steps on one GPU, rounds alternating the commits, so that the spread
# between machines (a few percent between H200s) cannot pass for a change:
#   bash benchmarks/step_ab.sh OLD_TREE OLD_COMMIT NEW_COMMIT [ROUNDS]
#
# STEP_AB_MORE ("TREE:COMMIT TREE:COMMIT", trees made as OLD_TREE is) adds commits to each
# round, between the old and the new; their records are bench_layer_step_ab_<commit>_r<r>.json.
# STEP_AB_SHAPES (bench_layer.py's --shapes) narrows the run, STEP_AB_VARIANTS (sm90,sm90_det
# unless set: sm90_fp8 for the FP8 step; a variant means what each tree's bench_layer.py says,
# and sm90_fp8 before f3c2955 quantized dW's operands on XLA, sm90_fp8_quantize the way
# sm90_fp8 does since) picks the variants. OLD_TREE holds the older
# commit's jax_dsrelu, benchmarks and tests (git archive OLD_COMMIT ... | tar -x -C OLD_TREE);
# the working tree is NEW_COMMIT; both commits' kernels come from the carried cache
# (prebuild_kernels.py --only bench_layer in each tree: the keys digest each tree's sources).
# Round r of a commit writes $OUT/<commit>-<r>/bench_layer.json and its copy as the record
# benchmarks/results/ names it, bench_layer_step_ab_{old,new}_r<r>.json (the next A/B replaces it).
set -o pipefail
old_tree="$1" old_commit="$2" new_commit="$3" rounds="${4:-2}"
shapes="${STEP_AB_SHAPES:-16384,4096,2048,8;32768,7168,2048,8;65536,2048,1024,32;49152,2688,1856,128;65536,2048,768,128;65536,2048,512,128;32768,7168,2048,32;65536,2048,768,256}"
source .gpu/activate.sh
export JAX_DSRELU_KERNEL_CACHE="$PWD/.kernels/cache" PYTHONUNBUFFERED=1
base="$PYTHONPATH"
for round in $(seq 1 "$rounds"); do
  for entry in "$old_tree:$old_commit" $STEP_AB_MORE ".:$new_commit"; do
    tree="$(cd "${entry%:*}" && pwd)" commit="${entry##*:}" || { echo "no tree ${entry%:*}"; exit 1; }
    case $commit in "$old_commit") side=old ;; "$new_commit") side=new ;; *) side=$commit ;; esac
    mkdir -p "$OUT/$commit-$round"
    (cd "$tree" && PYTHONPATH="$tree:$tree/tests:$tree/benchmarks${base:+:$base}" \
      timeout 100 python3 benchmarks/bench_layer.py --commit "$commit" --out "$OUT/$commit-$round" \
        --modes step --variants "${STEP_AB_VARIANTS:-sm90,sm90_det}" --reps 5 --shapes "$shapes" \
        > "$OUT/$commit-$round/layer.log" 2> "$OUT/$commit-$round/layer.err")
    echo "$commit round $round exit $?"
    for f in "$OUT/$commit-$round"/bench_layer.json*; do cp "$f" "$OUT/bench_layer_step_ab_${side}_r$round${f##*/bench_layer}"; done
  done
done

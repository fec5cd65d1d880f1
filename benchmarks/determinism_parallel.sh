#!/bin/bash
# Bitwise reproducibility across processes, with the processes run side by side on one GPU
# (faster than one after another; a process's result does not depend on its neighbours).
#
#   bash benchmarks/determinism_parallel.sh PROCESSES COMMIT
#
# Starts PROCESSES fresh processes of benchmarks/process_digests.py (every output of
# moe_mlp's deterministic step on the sm90 kernels, 20 calls each) and as many of
# examples/train_moe.py --dtype bfloat16 --deterministic, kernels from the carried cache,
# with the caller's XLA_FLAGS (none: XLA's defaults). Writes their output and $OUT/determinism_parallel.json.
processes="$1"
commit="$2"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
digests="python3 benchmarks/process_digests.py --backends sm90 --runs 20"
example="python3 examples/train_moe.py --dtype bfloat16 --deterministic"
for i in $(seq "$processes"); do
  timeout 240 $digests --label "process $i" > "$OUT/digests_$i.txt" 2> "$OUT/digests_$i.err" &
  timeout 240 $example > "$OUT/train_moe_$i.txt" 2> "$OUT/train_moe_$i.err" &
done
wait
python3 - "$processes" "$commit" "$digests" "$example" <<'PY'
import json, os, re, subprocess, sys
processes, commit, digests, example = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
out = os.environ["OUT"]
device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
record = dict(device=device, commit=commit, processes=processes, xla_flags=os.environ.get("XLA_FLAGS", "") or "default",
              commands=dict(digests=digests, example=example), digests=[], example_digests=[])
for i in range(1, processes + 1):
    lines = [l for l in open(f"{out}/digests_{i}.txt") if l.startswith("{")]
    record["digests"].append(json.loads(lines[-1]) if lines else None)
    found = re.findall(r"parameter digest: (\w+)", open(f"{out}/train_moe_{i}.txt").read())
    record["example_digests"].append(found[-1] if found else None)
def canonical(line):
    return None if line is None else json.dumps(line["results"], sort_keys=True)
record["digests_distinct_across_processes"] = len({canonical(d) for d in record["digests"]})
record["example_digests_distinct_across_processes"] = len(set(record["example_digests"]))
json.dump(record, open(f"{out}/determinism_parallel.json", "w"), indent=1)
print(json.dumps({k: record[k] for k in ("digests_distinct_across_processes", "example_digests_distinct_across_processes", "example_digests")}))
PY

#!/bin/bash
# Bitwise reproducibility across processes, run side by side on one GPU (a process's result
# does not depend on its neighbours):
#
#   bash benchmarks/determinism_parallel.sh PROCESSES COMMIT MODE NAME
#
# Starts PROCESSES fresh processes of benchmarks/process_digests.py and as many of
# examples/train_moe.py --dtype bfloat16 --deterministic, with the caller's XLA_FLAGS. MODE:
# warm, kernels from the carried disk cache (JAX_DSRELU_KERNEL_CACHE); fresh, a new empty
# cache per process. Writes their output under $OUT/NAME/ and the summary to $OUT/NAME.json.
processes="$1" commit="$2" mode="$3" name="$4"
[[ $mode == warm || $mode == fresh ]] || { echo "MODE must be warm or fresh, got '$mode'" >&2; exit 2; }
[[ -n $name ]] || { echo "NAME (the JSON's name) is missing" >&2; exit 2; }
export XLA_PYTHON_CLIENT_PREALLOCATE=false
logs="$OUT/$name"
mkdir -p "$logs"
limit=$([[ $mode == warm ]] && echo 240 || echo 420)
digests="python3 benchmarks/process_digests.py --backends sm90 --runs 20"
example="python3 examples/train_moe.py --dtype bfloat16 --deterministic"
for i in $(seq "$processes"); do
  for script in digests train_moe; do
    if [[ $mode == fresh ]]; then export JAX_DSRELU_KERNEL_CACHE="$(mktemp -d)"; fi
    command=$([[ $script == digests ]] && echo "$digests --label process_$i" || echo "$example")
    timeout $limit $command > "$logs/${script}_$i.txt" 2> "$logs/${script}_$i.err" &
  done
done
wait
python3 - "$processes" "$commit" "$digests" "$example" "$mode" "$logs" <<'PY'
import json, os, re, subprocess, sys
processes, commit, digests, example, mode, out = int(sys.argv[1]), *sys.argv[2:]
device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
record = dict(device=device, commit=commit, processes=processes, kernel_cache=mode,
              xla_flags=os.environ.get("XLA_FLAGS", "") or "default",
              commands=dict(digests=digests, example=example), digests=[], example_digests=[])
for i in range(1, processes + 1):
    lines = [l for l in open(f"{out}/digests_{i}.txt") if l.startswith("{")]
    record["digests"].append(json.loads(lines[-1]) if lines else None)
    output = open(f"{out}/train_moe_{i}.txt").read()
    record["example_digests"].append((re.findall(r"parameter digest: (\w+)", output) or [None])[-1])
    if options := re.findall(r"compiler options: (\{.*\})", output):
        record["example_compiler_options"] = json.loads(options[0])
results = [json.dumps(d["results"], sort_keys=True) if d else None for d in record["digests"]]
record["digests_distinct_across_processes"] = len(set(results))
record["example_digests_distinct_across_processes"] = len(set(record["example_digests"]))
names = sorted({name for d in record["digests"] if d for name in d["results"]})
record["distinct_across_processes_by_computation"] = {
    name: len({json.dumps(d["results"].get(name), sort_keys=True) for d in record["digests"] if d}) for name in names}
json.dump(record, open(f"{out}.json", "w"), separators=(",", ":"))
print(json.dumps({k: record[k] for k in ("kernel_cache", "xla_flags", "distinct_across_processes_by_computation",
                                         "example_digests_distinct_across_processes", "example_digests")}))
PY

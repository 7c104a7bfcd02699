#!/usr/bin/env bash
# cpdispatch-plan on tiny hostile inputs: each must end in exit status 2 with
# one line naming the plan's sizes, in well under a second and a few MB.
# Prints, per input: wall seconds, peak RSS, exit status, the message.
#   benchmarks/hostile_inputs.sh [path/to/cpdispatch-plan]
set -euo pipefail
plan=${1:-build/bin/cpdispatch-plan}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

one_document() {  # W
  printf '{"kind":"qkv","world_size":%s,"documents":[{"shards":[{"rank":0,"len":5,"dst":0}]}]}' "$1"
}
one_document 1000000000 > "$dir/billion.json"
one_document 30000 > "$dir/w30000.json"
one_document 4611686018427387904 > "$dir/w2pow62.json"
printf '{"world_size":1000000000,"max_cp_degree":2,"documents":[{"pieces":[{"rank":0,"len":5}]}]}' > "$dir/balance.json"
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
open(d + "/deep.json", "w").write("[" * 1000000 + "]" * 1000000)
shards = [{"rank": 0, "len": 1, "dst": 0} for _ in range(20000)]
open(d + "/shards.json", "w").write(json.dumps({"kind": "qkv", "world_size": 1, "documents": [{"shards": shards}]}))
W = 30000
open(d + "/query.json", "w").write(json.dumps({"kind": "query", "world_size": W, "seq_len": [[1]] * W, "dispatch": [[0]] * W}))
PY

printf '%-44s %8s %10s %4s  %s\n' input seconds peak_KB exit message
run() {  # label, args...
  local label=$1
  shift
  local status=0
  /usr/bin/time -f '%e %M' -o "$dir/time" "$plan" "$@" > /dev/null 2> "$dir/err" || status=$?
  read -r seconds kb < <(tail -1 "$dir/time")
  printf '%-44s %8s %10s %4s  %.110s\n' "$label" "$seconds" "$kb" "$status" "$(head -1 "$dir/err")"
}
run "W=1e9, one document, --summary" "$dir/billion.json" --summary
run "W=1e9, one document, --rank 0" "$dir/billion.json" --rank 0
run "W=1e9, one document, JSON" "$dir/billion.json"
run "W=1e9, one document, --dedup --rank 0" "$dir/billion.json" --dedup --rank 0
run "W=2^62, one document, --summary" "$dir/w2pow62.json" --summary
run "W=30000, one document, --summary" "$dir/w30000.json" --summary
run "W=30000, one document, JSON" "$dir/w30000.json"
run "W=30000, one document, --rank 0 (valid)" "$dir/w30000.json" --rank 0
run "balance W=1e9, one piece" balance "$dir/balance.json"
run "balance W=1e9, one piece, --summary" balance "$dir/balance.json" --summary
run "one document of 20000 shards, --summary" "$dir/shards.json" --summary
run "query plan W=30000, --summary" "$dir/query.json" --summary
run "nesting 1000000 deep" "$dir/deep.json"

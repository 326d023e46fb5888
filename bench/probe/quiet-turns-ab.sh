#!/usr/bin/env bash
# Issue 18: does the stock's 1 ms quiet (QUIET_MS) lengthen the daemon's longest turn with 16 clients? The
# concurrency section with QUIET_MS 1 (as built) and 5 (bench/probe/ab-before/stock.js), alternated, the daemon
# run with --trace-gc: each run's turn target and its longest GC pauses. Usage: quiet-turns-ab.sh BUNDLE OUT [ROUNDS]
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-2}
mkdir -p "$out"; out=$(cd "$out" && pwd); logs=$(mktemp -d)
here=$(cd "$(dirname "$0")/../.." && pwd)
read -r q1 q5 < <(bash "$here/bench/probe/ab-unpack.sh" "$bundle" stock.js:dist/server/backends)
grep -c "QUIET_MS = 5;" "$q5/vmmd/dist/server/backends/stock.js"; grep -c "QUIET_MS = 1;" "$q1/vmmd/dist/server/backends/stock.js"
for r in $(seq 1 "$rounds"); do
  for v in q1 q5; do
    eval "w=\$$v"; cd "$w/vmmd"
    echo "== round $r: $v"
    PATH="$w:$PATH" node dist/bench/run.js --backend cuda --only concurrency --daemon-node-args "--trace-gc" > "$logs/$v-$r.log" 2>&1
    grep -E "^target|^\| 16 \| cold" "$logs/$v-$r.log"
    echo "longest GC pauses (ms): $(grep -oE 'MB, [0-9.]+ / [0-9.]+ ms' "$logs/$v-$r.log" | awk '{print $2}' | sort -g | tail -5 | tr '\n' ' ') of $(grep -c 'MB, ' "$logs/$v-$r.log") collections"
  done
done
tar -C "$logs" -czf "$out/quiet-turns-ab-logs.tgz" .

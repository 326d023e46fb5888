#!/usr/bin/env bash
# Issue 18: does the daemon's wake-up make a cold cycle's round trip slow? The cold and session-ops sections
# with the daemon's busy poll at 200 us (the default) and longer budgets, alternated on one lease; then one
# run of each section with the daemon's CPU profile (top functions by self and inclusive time).
# Usage: bench/probe/busy-poll-ab.sh BUNDLE OUT [ROUNDS [BUDGETS]]   (BUDGETS default "200 1000 5000")
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-3}; budgets=${4:-200 1000 5000}
mkdir -p "$out"; out=$(cd "$out" && pwd); json=$(mktemp -d)
here=$(cd "$(dirname "$0")/../.." && pwd)
w=$(bash "$here/scripts/gpu-unpack.sh" "$bundle"); cd "$w/vmmd"; export PATH="$w:$PATH"
echo "host: $(uname -srm), $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
for r in $(seq 1 "$rounds"); do
  for us in $budgets; do
    echo "== round $r: daemon busy poll $us us"
    node dist/bench/run.js --backend cuda --only cold,session-ops --daemon-args "--busy-poll-us $us" --json "$json/poll$us-$r.json" 2>&1 \
      | grep -E "across processes \||across processes, 2 ms|same steps in one process \||ping|allocate 2 MiB|release 2 MiB|open a|target" | grep -v "p50 < 400"
  done
done
for s in cold session-ops; do
  mkdir -p "$out/profile-$s"
  node dist/bench/run.js --backend cuda --only "$s" --profile "$out/profile-$s" > "$out/profile-$s/run.log" 2>&1
  echo "== daemon CPU profile, section $s"
  node "$here/bench/probe/profile-top.js" "$out/profile-$s"/*.cpuprofile 40
done
tar -C "$json" -czf "$out/busy-poll-ab-json.tgz" .

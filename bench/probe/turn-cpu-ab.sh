#!/usr/bin/env bash
# Issue 18: what the turn meter's CPU clock costs the cold path on this host: the cold and session-ops sections
# with turns by wall clock only (--turn-cpu off) and by CPU time too (--turn-cpu on, the default), alternated; then the clock's and the
# answer's descriptor costs alone. Usage: bench/probe/turn-cpu-ab.sh BUNDLE OUT [ROUNDS]
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-3}
mkdir -p "$out"; out=$(cd "$out" && pwd); json=$(mktemp -d)
here=$(cd "$(dirname "$0")/../.." && pwd)
w=$(bash "$here/scripts/gpu-unpack.sh" "$bundle"); cd "$w/vmmd"; export PATH="$w:$PATH"
echo "host: $(uname -srm), $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
node "$here/bench/probe/clock-cost.js" "$w/vmmd"
node "$here/bench/probe/fd-costs.js" "$w/vmmd"
for r in $(seq 1 "$rounds"); do
  for v in wall cpu; do
    args=(--daemon-args "--turn-cpu on"); [ "$v" = wall ] && args=(--daemon-args "--turn-cpu off")
    echo "== round $r: turns by $v"
    node dist/bench/run.js --backend cuda --only cold,session-ops "${args[@]}" --json "$json/$v-$r.json" 2>&1 | grep -E "across processes \||same steps in one process \||ping|allocate 2 MiB|release 2 MiB|open a|target" | grep -v "target MET: cold 2 MiB memalloc across processes, p50 < 400"
  done
done
tar -C "$json" -czf "$out/turn-cpu-ab-json.tgz" .

#!/usr/bin/env bash
# Issue 18: the cold section before ("before": a client's unmaps wait up to 2 ms; the stock's quiet is 5 ms) and
# after ("after": unmaps go at the end of the turn they are freed in; quiet is 1 ms), alternated on one lease.
# bench/probe/ab-before/ holds the two compiled files of before. Usage: bench/probe/unmap-quiet-ab.sh BUNDLE OUT [ROUNDS]
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-3}
mkdir -p "$out"; out=$(cd "$out" && pwd); json=$(mktemp -d)
here=$(cd "$(dirname "$0")/../.." && pwd)
read -r after before < <(bash "$here/bench/probe/ab-unpack.sh" "$bundle" unmap-batch.js:dist/native stock.js:dist/server/backends)
grep -c "UNMAP_DELAY_MS = 2" "$before/vmmd/dist/native/unmap-batch.js"; grep -c "QUIET_MS = 1;" "$after/vmmd/dist/server/backends/stock.js"
for r in $(seq 1 "$rounds"); do
  for v in before after; do
    eval "w=\$$v"; cd "$w/vmmd"
    echo "== round $r: $v"
    PATH="$w:$PATH" node dist/bench/run.js --backend cuda --only cold --json "$json/$v-$r.json" 2>&1 | grep -E "across processes|same steps in one process \|" | grep -v "1 GiB"
  done
done
tar -C "$json" -czf "$out/unmap-quiet-ab-json.tgz" .

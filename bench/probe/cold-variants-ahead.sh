#!/usr/bin/env bash
# Issue 18 experiment, with allocations ahead (after 6085443): the cold section (bench --only cold) under four
# variants, alternated on one lease, to tell which background driver work keeps 2 MiB above the one process:
#   A  the code as built;
#   B  the daemon makes no driver call during a loop (a stock 1024 deep, frees held until quiet);
#   C  B, and the client's unmaps wait too (until the section's settle flushes them): nothing overlaps;
#   D  only the client's unmaps wait (the daemon as built).
# Usage: bench/probe/cold-variants-ahead.sh BUNDLE OUT [ROUNDS]
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-2}
mkdir -p "$out"; out=$(cd "$out" && pwd); json=$(mktemp -d)
here=$(cd "$(dirname "$0")/../.." && pwd)
for v in A B C D; do
  d=$(bash "$here/scripts/gpu-unpack.sh" "$bundle"); eval "W$v=$d"
done
daemon_quiet() {
  sed -i 's/^exports.RELEASE_BATCH = 16;/exports.RELEASE_BATCH = 1000000;/' "$1/vmmd/dist/server/backends/held-releases.js"
  sed -i 's/^exports.MAX_REFILL_DELAY_MS = 100;/exports.MAX_REFILL_DELAY_MS = 1000000;/' "$1/vmmd/dist/server/backends/stock.js"
  sed -i 's/match\[2\], 1, 64)/match[2], 1, 4096)/' "$1/vmmd/dist/server/config.js"
}
client_unmaps_wait() {
  sed -i 's/^exports.UNMAP_BATCH = 16;/exports.UNMAP_BATCH = 4096;/; s/^            this.flushIfIdle();$/            ;/' "$1/vmmd/dist/native/unmap-batch.js"
  sed -i 's/(0, mapping_1.flushUnmapsIfIdle)();/;/' "$1/vmmd/dist/client/session.js"
}
daemon_quiet "$WB"; daemon_quiet "$WC"; client_unmaps_wait "$WC"; client_unmaps_wait "$WD"
for w in "$WB" "$WC"; do grep -c "1000000;\|4096)" "$w/vmmd/dist/server/backends/held-releases.js" "$w/vmmd/dist/server/backends/stock.js" "$w/vmmd/dist/server/config.js"; done
for w in "$WC" "$WD"; do grep -c "= 4096;\|^            ;$" "$w/vmmd/dist/native/unmap-batch.js"; done
for r in $(seq 1 "$rounds"); do
  for v in A B C D; do
    eval "w=\$W$v"; cd "$w/vmmd"
    stock=(); case $v in B|C) stock=(env VMMD_STOCK=2MiB:1024,32MiB:2,64MiB:256);; esac
    echo "== round $r variant $v"
    PATH="$w:$PATH" "${stock[@]}" "$w/node" dist/bench/run.js --backend cuda --only cold --json "$json/cold-$v-$r.json" 2>&1 | grep -E "across processes|same steps in one|target|rror" | grep -v "step:"
  done
done
tar -C "$json" -czf "$out/cold-variants-ahead-json.tgz" .

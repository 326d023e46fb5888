#!/usr/bin/env bash
# Issue 18 experiment: the cold section (bench --only cold) under three variants, alternated on one lease:
#   A  the code as built;
#   B  the daemon does no driver work during a back-to-back loop (a deep stock, frees held until quiet);
#   C  B, and the client's unmaps wait too (1 s or 4096 of them): the floor with nothing overlapping.
# Usage: bench/probe/cold-variants.sh BUNDLE OUT [ROUNDS]
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-3}
mkdir -p "$out"; out=$(cd "$out" && pwd); json=$(mktemp -d)
here=$(cd "$(dirname "$0")/../.." && pwd)
for v in A B C; do
  d=$(bash "$here/scripts/gpu-unpack.sh" "$bundle"); eval "W$v=$d"
done
cd "$WB/vmmd" && sed -i 's/^exports.RELEASE_BATCH = 16;/exports.RELEASE_BATCH = 1000000;/' dist/server/backends/held-releases.js \
  && sed -i 's/^exports.MAX_REFILL_DELAY_MS = 100;/exports.MAX_REFILL_DELAY_MS = 1000000;/' dist/server/backends/stock.js
sed -i 's/match\[2\], 1, 64)/match[2], 1, 4096)/' "$WB/vmmd/dist/server/config.js"; cp "$WB/vmmd/dist/server/config.js" "$WC/vmmd/dist/server/"
cp "$WB/vmmd/dist/server/backends/held-releases.js" "$WC/vmmd/dist/server/backends/"
cp "$WB/vmmd/dist/server/backends/stock.js" "$WC/vmmd/dist/server/backends/"
cd "$WC/vmmd" && sed -i 's/^exports.UNMAP_DELAY_MS = 2;/exports.UNMAP_DELAY_MS = 1000;/; s/^exports.UNMAP_BATCH = 16;/exports.UNMAP_BATCH = 4096;/' dist/native/unmap-batch.js \
  && sed -i 's/(0, mapping_1.flushUnmapsIfIdle)();/;/' dist/client/session.js
grep -c "1000000" "$WB/vmmd/dist/server/backends/held-releases.js" "$WB/vmmd/dist/server/backends/stock.js"
grep -c "= 4096;" "$WC/vmmd/dist/native/unmap-batch.js"; grep -c "flushUnmapsIfIdle)()" "$WC/vmmd/dist/client/session.js"
for r in $(seq 1 "$rounds"); do
  for v in A B C; do
    eval "w=\$W$v"; cd "$w/vmmd"
    stock=(); [ "$v" != A ] && stock=(env VMMD_STOCK=2MiB:1024,32MiB:2,64MiB:256)
    echo "== round $r variant $v"
    PATH="$w:$PATH" "${stock[@]}" "$w/node" dist/bench/run.js --backend cuda --only cold --json "$json/cold-$v-$r.json" 2>&1 | grep -E "across processes|same steps in one|target|rror" | grep -v "step:"
  done
done
tar -C "$json" -czf "$out/cold-variants-json.tgz" .

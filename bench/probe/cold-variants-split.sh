#!/usr/bin/env bash
# split of variant B: B1 frees held (batch and max delay unbounded, stock as built), B2 deep stock only (frees as built)
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-2}
mkdir -p "$out"; out=$(cd "$out" && pwd)
here=$(pwd)
for v in A B1 B2; do d=$(bash "$here/scripts/gpu-unpack.sh" "$bundle"); eval "W$v=$d"; done
sed -i 's/^exports.RELEASE_BATCH = 16;/exports.RELEASE_BATCH = 1000000;/' "$WB1/vmmd/dist/server/backends/held-releases.js"
sed -i 's/^exports.MAX_REFILL_DELAY_MS = 100;/exports.MAX_REFILL_DELAY_MS = 1000000;/' "$WB1/vmmd/dist/server/backends/stock.js"
sed -i 's/match\[2\], 1, 64)/match[2], 1, 4096)/' "$WB2/vmmd/dist/server/config.js"
for r in $(seq 1 "$rounds"); do
  for v in A B1 B2; do
    eval "w=\$W$v"; cd "$w/vmmd"
    stock=(); case $v in B2) stock=(env VMMD_STOCK=2MiB:1024,32MiB:2,64MiB:256);; esac
    echo "== round $r variant $v"
    PATH="$w:$PATH" "${stock[@]}" "$w/node" dist/bench/run.js --backend cuda --only cold 2>&1 | grep -E "target (MET|MISSED): cold (2|64) MiB across processes p50 ≤ (the|1.2)"
  done
done

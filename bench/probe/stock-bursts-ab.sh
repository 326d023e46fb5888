#!/usr/bin/env bash
# Issue 18: the stock as deep as the bursts it serves, its frees held until quiet (as built) against the
# stock and frees of 6085443 (bench/probe/ab-before-6085443/: stock.js, held-releases.js compiled there),
# alternated on one lease: the cold and session-ops sections, ROUNDS rounds.
# Usage: bench/probe/stock-bursts-ab.sh BUNDLE OUT [ROUNDS] [SECTIONS]
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-2}; sections=${4:-cold,session-ops}
mkdir -p "$out"; out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")/../.." && pwd)
new=$(bash "$here/scripts/gpu-unpack.sh" "$bundle"); old=$(bash "$here/scripts/gpu-unpack.sh" "$bundle")
cp "$here/bench/probe/ab-before-6085443/"*.js "$old/vmmd/dist/server/backends/"
for r in $(seq 1 "$rounds"); do
  for side in new old; do
    eval "w=\$$side"; cd "$w/vmmd"
    echo "== round $r: $side"
    PATH="$w:$PATH" "$w/node" dist/bench/run.js --backend cuda --only "$sections" --json "$out/$side-$r.json" 2>&1 | grep -E "target (MET|MISSED)"
  done
done

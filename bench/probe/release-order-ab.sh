#!/usr/bin/env bash
# Issue 18 experiment: a free's release sent after the next allocation's request, not before it. A free followed at
# once by a memalloc (the cold loop) sends release, then allocate; the daemon answers the allocate only after the
# release. Variant R defers the release to the end of the turn (setImmediate), so the allocate goes first. The cold
# section (alternated rounds inside) runs in A (as built) and R, alternated. (Not safe as it stands: a session at its
# quota would be refused the allocate that the release was to make room for.)
# Usage: bench/probe/release-order-ab.sh BUNDLE OUT [ROUNDS]
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-3}
mkdir -p "$out"; out=$(cd "$out" && pwd); json=$(mktemp -d)
here=$(cd "$(dirname "$0")/../.." && pwd)
for v in A R; do d=$(bash "$here/scripts/gpu-unpack.sh" "$bundle"); eval "W$v=$d"; done
sed -i 's/const released = this.client.vmm.release({ allocationId: lease.allocationId })/const released = new Promise((resolve) => setImmediate(resolve)).then(() => this.client.vmm.release({ allocationId: lease.allocationId }))/' "$WR/vmmd/dist/client/emm/vmmd-manager.js"
grep -c "setImmediate(resolve)).then(() => this.client.vmm.release" "$WR/vmmd/dist/client/emm/vmmd-manager.js"
echo "host: $(uname -srm), $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
for r in $(seq 1 "$rounds"); do
  for v in A R; do
    eval "w=\$W$v"; cd "$w/vmmd"
    echo "== round $r variant $v"
    PATH="$w:$PATH" "$w/node" dist/bench/run.js --backend cuda --only cold --json "$json/cold-$v-$r.json" 2>&1 | grep -E "across processes \||across processes, 2 ms|same steps in one process \||rounds|target|rror" | grep -v "p50 < 400"
    "$w/node" -e "const j=require('$json/cold-$v-$r.json'); for (const n of j.sections.find((s) => s.id === 'cold').notes) if (n.includes('rounds')) console.log(n)"
  done
done
tar -C "$json" -czf "$out/release-order-ab-json.tgz" .

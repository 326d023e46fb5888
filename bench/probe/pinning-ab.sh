#!/usr/bin/env bash
# Issue 18: is the cold cycle's spread (the same build ×1.1 to ×2.3 on one lease) where the scheduler puts the
# daemon and the client? The cold and session-ops sections alternated in three placements:
#   free    nothing pinned (as the bench runs);
#   split   the daemon on CPUs 8-11, the bench and its section processes on 2-5;
#   shared  both on CPUs 2-5.
# Usage: bench/probe/pinning-ab.sh BUNDLE OUT [ROUNDS [DAEMON_ARGS]]
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-3}; dargs=${4:-}
mkdir -p "$out"; out=$(cd "$out" && pwd); json=$(mktemp -d)
here=$(cd "$(dirname "$0")/../.." && pwd)
w=$(bash "$here/scripts/gpu-unpack.sh" "$bundle"); cd "$w/vmmd"; export PATH="$w:$PATH"
echo "host: $(uname -srm), $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
for r in $(seq 1 "$rounds"); do
  for v in free split shared; do
    case $v in
      free) pin=(); daemon=() ;;
      split) pin=(taskset -c 2-5); daemon=(--daemon-cpus 8-11) ;;
      shared) pin=(taskset -c 2-5); daemon=(--daemon-cpus 2-5) ;;
    esac
    echo "== round $r: $v"
    "${pin[@]}" node dist/bench/run.js --backend cuda --only cold,session-ops "${daemon[@]}" ${dargs:+--daemon-args "$dargs"} --json "$json/$v-$r.json" 2>&1 \
      | grep -E "across processes \||across processes, 2 ms|same steps in one process \||ping|allocate 2 MiB|target" | grep -v "p50 < 400"
  done
done
tar -C "$json" -czf "$out/pinning-ab-json.tgz" .

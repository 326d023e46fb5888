#!/usr/bin/env bash
# The Python client's session round trip, its reading (on the caller's thread, spinning first) against the client
# BEFORE (its reader thread handing each answer over), alternated on one lease with one cuda daemon: the session
# ping, cold 2 MiB allocations from one process and from 8 at once (bench/python/bench_python.py --only).
# Usage: [VARIANTS='after after-nospin before'] bench/probe/python-session-ab.sh BUNDLE OUT [ROUNDS [BEFORE]]
#   BEFORE: a directory holding python/src of the client to compare with (default BUNDLE/python-before, made by
#   `git archive REV python/src | tar -x -C .gpu/python-before` after scripts/gpu-bundle.sh).
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; rounds=${3:-3}; before=$(cd "${4:-$bundle/python-before}" && pwd)
mkdir -p "$out"; out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")/../.." && pwd)
w=$(bash "$here/scripts/gpu-unpack.sh" "$bundle"); cd "$w/vmmd"; export PATH="$w:$PATH"
echo "host: $(uname -srm), $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); $(python3 --version)"
sock="$w/sock"; mkdir -p "$sock"
node bin/vmmd.js --backend cuda --socket-dir "$sock" --log-level warn > "$out/daemon.log" 2>&1 &
daemon=$!
export VMMD_SOCKET_DIR="$sock"
for _ in $(seq 1 150); do
  PYTHONPATH=python/src python3 -c "import vmmd; vmmd.connect().close()" 2>/dev/null && break
  sleep 0.2
done
for r in $(seq 1 "$rounds"); do
  for v in ${VARIANTS:-after before}; do
    # after-nospin: the new reading without the spin (VMMD_CLIENT_BUSY_POLL_US=0)
    src=python/src; [ "$v" = before ] && src="$before/python/src"
    [ "$v" = mid ] && src="$bundle/python-mid/python/src"  # a third client: BUNDLE/python-mid, made as python-before
    spin=200; [ "$v" = after-nospin ] && spin=0
    echo "== round $r: $v"
    VMMD_CLIENT_BUSY_POLL_US=$spin PYTHONPATH="$src" python3 bench/python/bench_python.py "$out/$v-$r.json" --only session_ping,cold_2mib_one_process,cold_2mib_across_processes 2>&1 | grep "\[bench\]"
  done
done
kill "$daemon"

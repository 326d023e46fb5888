#!/usr/bin/env bash
# Runs the cold-path diagnostic (bench/cold-probe.ts) on the cuda backend
# from the bundle that scripts/gpu-bundle.sh made, with the driver trace of the
# daemon and the client, and lines them up (bench/cold_timeline.py).
# Usage: scripts/gpu-probe-cold.sh [BUNDLE_DIR [OUTPUT_DIR [probe options]]]
#   Writes OUTPUT_DIR/cold-probe/{calls.json,daemon-trace.txt,client-trace.txt,timeline.json,timeline.txt}.
#   PROBE_PROFILE=1: also V8 CPU profiles of the client and the daemon (OUTPUT_DIR/cold-probe/profiles).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=${1:-.gpu}
out=${2:-${OUT:-gpu-results}}
shift 2 2>/dev/null || shift $#
mkdir -p "$out/cold-probe"
out=$(cd "$out/cold-probe" && pwd)
work=$("$here/gpu-unpack.sh" "$bundle") || exit 1
export PATH="$work:$PATH"
cd "$work/vmmd"
profile=()
[ "${PROBE_PROFILE:-0}" = 1 ] && profile=(--cpu-prof --cpu-prof-dir="$out/profiles")
[ "${PROBE_PROFILE:-0}" = 1 ] && set -- "$@" --profile "$out/profiles"
VMMD_DRIVER_TRACE=1 node "${profile[@]}" dist/bench/cold-probe.js --backend cuda --out "$out" "$@" 2> "$out/client-trace.txt"
echo "probe exit: $?"
python3 bench/cold_timeline.py "$out" | tee "$out/timeline.txt"
# The profiles go back as one file (the device returns a bounded number of files).
[ -d "$out/profiles" ] && tar -C "$out" -czf "$out/profiles.tgz" profiles && rm -rf "$out/profiles"
exit 0

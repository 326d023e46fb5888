#!/usr/bin/env bash
# Runs the benchmarks on the cuda backend from the bundle that
# scripts/gpu-bundle.sh made, with CuPy and Numba measured in the same run
# (python3 with cupy and numba on the host).
# Usage: scripts/gpu-bench.sh [BUNDLE_DIR [OUTPUT_DIR [run.js options]]]
#   (defaults: .gpu, $OUT or ./gpu-results). Writes OUTPUT_DIR/bench-cuda.json and bench-cuda.log.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=${1:-.gpu}
out=${2:-${OUT:-gpu-results}}
shift 2 2>/dev/null || shift $#
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$("$here/gpu-unpack.sh" "$bundle") || exit 1
export PATH="$work:$PATH"
cd "$work/vmmd"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm), $(nproc) cores"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  node dist/bench/run.js --backend cuda --json "$out/bench-cuda.json" "$@" 2>&1
  echo "exit: $?"
} | tee "$out/bench-cuda.log"

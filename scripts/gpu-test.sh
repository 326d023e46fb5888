#!/usr/bin/env bash
# Runs the GPU test suite from the bundle that scripts/gpu-bundle.sh made.
# Usage: scripts/gpu-test.sh [BUNDLE_DIR [OUTPUT_DIR [PATTERN]]]  (defaults: .gpu, $OUT or ./gpu-results,
# every test; PATTERN is jest's test path pattern, e.g. 'registry-cuda|security-cuda')
# The output goes to OUTPUT_DIR/gpu-tests.log with the date, device and driver, and
# the reliability figures to OUTPUT_DIR/figures.jsonl.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${2:-${OUT:-gpu-results}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$("$here/gpu-unpack.sh" "${1:-.gpu}") || exit 1
export PATH="$work:$PATH"
cd "$work/vmmd"
# The reliability figures of the GPU tests (crashes, faults, security), one JSON line each.
export VMMD_FIGURES="$out/figures.jsonl"
rm -f "$VMMD_FIGURES"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm), $(nproc) cores"
  echo "node: $(node --version)"
  nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  echo
  node node_modules/jest/bin/jest.js -c jest.gpu.config.js --ci ${3:+"$3"} 2>&1
  echo "exit: $?"
} | tee "$out/gpu-tests.log"

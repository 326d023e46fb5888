#!/usr/bin/env bash
# `npm test` N times in a row on this machine (the reliability target: 20 green runs on the 2-core build machine).
#   scripts/test-loop.sh [N=20] [LOGDIR=test-loop-logs]
# Each run's output goes to LOGDIR/run-K.log and a line per run (commit, exit status, seconds, load) to LOGDIR/summary.txt;
# it stops at the first red run, whose log says what failed. Run it with nothing else on the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
logs=${2:-test-loop-logs}
mkdir -p "$logs"
for run in $(seq 1 "$runs"); do
  started=$(date +%s)
  npm test > "$logs/run-$run.log" 2>&1
  status=$?
  echo "run $run $(git rev-parse --short HEAD) exit=$status $(( $(date +%s) - started ))s load=$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$logs/summary.txt"
  if [ "$status" -ne 0 ]; then
    echo "run $run was red: $logs/run-$run.log" >&2
    exit "$status"
  fi
done
echo "$runs green runs in a row" | tee -a "$logs/summary.txt"

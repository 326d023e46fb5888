#!/usr/bin/env bash
# What the open lifecycle and contract work still needs of a GPU host, in three calls of at most 10 minutes each,
# from the bundles that scripts/gpu-bundle.sh made (AFTER: this tree's; BEFORE: the commit to compare with).
#   scripts/gpu-round.sh lifecycle .gpu OUT          parking, resume, restart and take-over on cuda; sleep/wake and
#                                                    the pools (jest and pytest); the restart, take-over and
#                                                    sleep-wake benchmarks
#   scripts/gpu-round.sh ab BEFORE .gpu OUT          session-socket ratios and the cold path, before and after
#                                                    alternated (gpu-ab.sh), and a CPU profile of the daemon's allocate
#   scripts/gpu-round.sh suite .gpu OUT              the whole GPU suite (the file kept in test/gpu/results)
# Each step has a time limit and the call goes on after a failure; OUT/round/steps.txt lists each step's exit status.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
stage=$1
shift
case $stage in
  lifecycle | suite) after=$1 out=$2 ;;
  ab) before=$1 after=$2 out=$3 ;;
  *) echo "gpu-round: unknown stage '$stage' (lifecycle, ab or suite)" >&2; exit 2 ;;
esac
mkdir -p "$out/round"
steps="$out/round/steps.txt"
step() { # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$out/round/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$steps"
}
work=""
bench() { # bench NAME SECONDS SCRIPT ARGS...: a benchmark of the AFTER bundle (unpacked once)
  local name=$1 limit=$2; shift 2
  [ -n "$work" ] || work=$("$here/gpu-unpack.sh" "$after") || return 1
  step "$name" "$limit" bash -c 'cd "$1/vmmd" && PATH="$1:$PATH" exec node "${@:2}"' _ "$work" "$@"
}
case $stage in
  lifecycle)
    step jest-lifecycle 240 "$here/gpu-test.sh" "$after" "$out/lifecycle" 'park-cuda|resume-cuda|restart|sleep-wake-cuda|emm-cuda|emm-ahead-cuda'
    VMMD_STEPS=pytest VMMD_PYTEST_SECONDS=200 VMMD_PYTEST_TARGETS="test/gpu/python/test_sleep_gpu.py test/gpu/python/test_pools_gpu.py" \
      step pytest-lifecycle 220 "$here/gpu-python.sh" "$after" "$out/lifecycle"
    bench bench-restart 60 dist/bench/restart.js --backend cuda --objects 10000 --rounds 3
    bench bench-take-over 40 dist/bench/take-over.js --backend cuda --objects 6000
    bench bench-sleep-wake 40 dist/bench/sleep-wake.js --backend cuda
    ;;
  ab)
    step ab 420 "$here/gpu-ab.sh" "$before" "$after" "$out" 3 session-ops,cold
    mkdir -p "$out/round/profile"
    bench session-cpu 90 dist/bench/session-cpu.js --backend cuda --count 4000 --profile "$(cd "$out/round/profile" && pwd)"
    ;;
  suite)
    step jest-suite 560 "$here/gpu-test.sh" "$after" "$out/suite"
    ;;
esac

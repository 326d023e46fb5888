#!/usr/bin/env bash
# Evidence for the write-then-close rule (no unmap under a copy in flight) on a GPU host, from the bundle (scripts/gpu-bundle.sh):
# the write-then-close loop in 4 and 32 processes with a given addon, every
# client tracing its worker-thread driver calls (VMMD_DRIVER_TRACE=1), plus one
# client under compute-sanitizer. Run it once with the addon built before the
# fix and once with the bundle's own to compare.
#   test/gpu/evidence/write-close.sh BUNDLE_DIR OUT_DIR LABEL [ADDON.node]
set -uo pipefail
bundle=$1 out=$2 label=$3 addon=${4:-}
# gpu-unpack.sh beside this script (a copy in the bundle) or in the repository's scripts/.
unpack=$(dirname "$0")/gpu-unpack.sh
[ -x "$unpack" ] || unpack=$(dirname "$0")/../../../scripts/gpu-unpack.sh
work=$("$unpack" "$bundle") || exit 1
[ -n "$addon" ] && cp "$addon" "$work/vmmd/build/Release/vmmd_native.node"
export PATH="$work:$PATH"
cd "$work/vmmd"
mkdir -p "$out/$label"
dir=$(mktemp -d)
node bin/vmmd.js --backend cuda --socket-dir "$dir" --log-level warn > "$out/$label/daemon.log" 2>&1 &
daemon=$!
for i in $(seq 50); do [ -S "$dir/vmmd.session.sock" ] && break; sleep 0.1; done
for n in 4 32; do
  for i in $(seq "$n"); do
    VMMD_SOCKET_DIR=$dir VMMD_DRIVER_TRACE=1 node dist/test/reliability/fixtures/write-close.js 20 awaited \
      > "$out/$label/p$n-c$i.json" 2> "$out/$label/p$n-c$i.trace" &
  done
  wait $(jobs -p | grep -v "^$daemon$") 2>/dev/null
  failed=$(grep -L '"errors":{}' "$out/$label"/p$n-c*.json | wc -l)
  echo "$label: $n processes x 20 iterations: $failed clients with errors" | tee -a "$out/summary.txt"
  # The first failing client's report and its driver calls up to its first failed one.
  first=$(grep -L '"errors":{}' "$out/$label"/p$n-c*.json | head -1)
  if [ -n "$first" ]; then
    {
      echo "== $label, $n processes: $(basename "$first"): $(cat "$first")"
      awk '{ print } / result=[1-9]/ { exit }' "${first%.json}.trace" | tail -10
    } >> "$out/excerpt.txt"
  fi
done
# One client under compute-sanitizer while 15 others load the copy engine.
for i in $(seq 15); do VMMD_SOCKET_DIR=$dir node dist/test/reliability/fixtures/write-close.js 20 awaited > /dev/null 2>&1 & done
VMMD_SOCKET_DIR=$dir timeout 120 compute-sanitizer --tool memcheck --print-limit 20 node dist/test/reliability/fixtures/write-close.js 20 awaited \
  > "$out/$label/sanitizer.log" 2>&1
echo "$label: sanitizer exit $?, $(grep -c 'Program hit' "$out/$label/sanitizer.log") API errors reported" | tee -a "$out/summary.txt"
wait $(jobs -p | grep -v "^$daemon$") 2>/dev/null
kill "$daemon"; wait "$daemon" 2>/dev/null
tar -C "$out" -czf "$out/$label.tar.gz" "$label" && rm -rf "${out:?}/$label"
rm -rf "$dir" "$work"

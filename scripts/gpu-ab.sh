#!/usr/bin/env bash
# Runs bench sections of two bundles (scripts/gpu-bundle.sh) alternated on one GPU host, so that
# before and after meet the same machine, and prints each target's measurement per round.
# Usage: scripts/gpu-ab.sh BEFORE_BUNDLE AFTER_BUNDLE OUTPUT_DIR [ROUNDS (3)] [SECTIONS (session-ops,cold)]
# Writes OUTPUT_DIR/ab/{before,after}-N.json and OUTPUT_DIR/ab/summary.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
before=$("$here/gpu-unpack.sh" "$1") || exit 1
after=$("$here/gpu-unpack.sh" "$2") || exit 1
out=$3/ab
rounds=${4:-3}
sections=${5:-session-ops,cold}
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  # Alternate which goes first, so neither always meets a warmer machine.
  if [ $((round % 2)) -eq 1 ]; then order="before after"; else order="after before"; fi
  for tag in $order; do
    work=$before; [ "$tag" = after ] && work=$after
    (cd "$work/vmmd" && PATH="$work:$PATH" node dist/bench/run.js --backend cuda --only "$sections" --json "$out/$tag-$round.json" > "$out/$tag-$round.log" 2>&1)
    echo "round $round $tag: exit $?"
  done
done
python3 - "$out" "$rounds" <<'PY' | tee "$out/summary.txt"
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for tag in ("before", "after"):
    for round in range(1, rounds + 1):
        try:
            data = json.load(open(f"{out}/{tag}-{round}.json"))
        except (OSError, ValueError) as error:
            print(f"{tag} {round}: no result ({error})")
            continue
        for section in data["sections"]:
            for target in section.get("targets", []):
                print(f"{tag} {round} | {target['target']} | {target['measured']} | met {target['met']}")
PY

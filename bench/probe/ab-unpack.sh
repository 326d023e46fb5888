#!/usr/bin/env bash
# The two sides of an A/B probe on one lease: unpacks BUNDLE twice and puts the named compiled files of
# bench/probe/ab-before/ into the second copy. Prints "AS_BUILT_DIR BEFORE_DIR".
#   read -r after before < <(bench/probe/ab-unpack.sh BUNDLE stock.js:dist/server/backends [FILE:DIR ...])
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
bundle=$1; shift
after=$(bash "$here/scripts/gpu-unpack.sh" "$bundle"); before=$(bash "$here/scripts/gpu-unpack.sh" "$bundle")
for pair in "$@"; do
  cp "$here/bench/probe/ab-before/${pair%%:*}" "$before/vmmd/${pair#*:}/"
done
echo "$after $before"

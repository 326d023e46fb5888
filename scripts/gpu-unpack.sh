#!/usr/bin/env bash
# Unpacks the bundle that scripts/gpu-bundle.sh made into a new directory and
# prints its path (node on PATH is then $DIR/node). Used by gpu-test.sh and gpu-bench.sh.
#   work=$(scripts/gpu-unpack.sh BUNDLE_DIR)
set -euo pipefail
bundle=$(cd "${1:-.gpu}" && pwd)
work=$(mktemp -d)
xz -dc "$bundle/node.xz" > "$work/node" && chmod +x "$work/node"
tar -C "$work" -xJf "$bundle/vmmd.tar.xz"
echo "$work"

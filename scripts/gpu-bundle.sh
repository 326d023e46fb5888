#!/usr/bin/env bash
# Builds .gpu/: a self-contained bundle that runs vmmd and its GPU test suite
# on an offline GPU host with no Node.js and no network.
#   .gpu/node.xz         this machine's Node binary, xz-compressed
#   .gpu/vmmd.tar.xz     package.json, bin/, dist/ (compiled code and tests),
#                        proto/, the built addon, and node_modules with the
#                        production dependencies plus jest (no TypeScript)
# Then, on the GPU host: scripts/gpu-test.sh (the test suite), scripts/gpu-bench.sh
# (the benchmarks) or scripts/gpu-python.sh (the Python client: its GPU tests, Numba's
# suite under vmmd.numba, shared weights, Python benchmarks); each unpacks the bundle
# with gpu-unpack.sh.
# Needs `npm ci` done here; x86-64 only (the addon is built here).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(uname -m)" = x86_64 ] || { echo "gpu-bundle: build on x86-64, the GPU hosts are x86-64" >&2; exit 1; }
# A clean dist/: files of sources since moved or deleted would otherwise ship and shadow the new ones.
rm -rf dist
npm run build >/dev/null || { echo "gpu-bundle: the build failed (npm run build)" >&2; exit 1; }
[ -f build/Release/vmmd_native.node ] || { echo "gpu-bundle: the addon is not built; run npm ci" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/vmmd/build/Release" "$stage/vmmd/test"
cp -r package.json package-lock.json README.md docs bin dist proto jest.gpu.config.js "$stage/vmmd/"
cp test/summary-reporter.js test/setup-symbols.js "$stage/vmmd/test/"
mkdir -p "$stage/vmmd/bench"
cp -r bench/echo.proto bench/reference bench/cold_timeline.py "$stage/vmmd/bench/"
cp build/Release/vmmd_native.node "$stage/vmmd/build/Release/"
# The Python client (pure Python and the descriptor set generated from proto/;
# its C allocation library is built there) and its GPU tests and benchmarks.
mkdir -p "$stage/vmmd/python" "$stage/vmmd/test/gpu" "$stage/vmmd/bench"
cp -r python/pyproject.toml python/MANIFEST.in python/README.md python/src python/tests "$stage/vmmd/python/"
cp -r test/gpu/python "$stage/vmmd/test/gpu/"
# The Python client of the resume scenario (test/gpu/resume-cuda.test.ts).
mkdir -p "$stage/vmmd/test/reliability/fixtures"
cp test/reliability/fixtures/resume_worker.py "$stage/vmmd/test/reliability/fixtures/"
cp -r bench/python "$stage/vmmd/bench/"
find "$stage/vmmd/python" "$stage/vmmd/test/gpu/python" "$stage/vmmd/bench/python" \( -name __pycache__ -o -name '*.egg-info' -o -name '*.so' \) -prune -exec rm -rf {} +
# Production dependencies and jest's runtime; no compiler, no type packages, no linters.
cp -r node_modules "$stage/vmmd/node_modules"
rm -rf "$stage/vmmd/node_modules/"{typescript,ts-jest,@types,.cache,eslint,@eslint,typescript-eslint,@typescript-eslint,dependency-cruiser,prettier} "$stage/vmmd/node_modules/.bin"
# The bundle must load its addon as the GPU host will (a node_modules that lags
# package.json once shipped without node-gyp-build and the daemon could not start there).
(cd "$stage/vmmd" && node -e "require('./dist/native/index.js')") \
  || { echo "gpu-bundle: the bundled daemon cannot load its addon; run npm ci" >&2; exit 1; }

rm -rf .gpu && mkdir -p .gpu
xz -T2 -c "$(command -v node)" > .gpu/node.xz
tar -C "$stage" -cf - vmmd | xz -T2 -6 > .gpu/vmmd.tar.xz
cp scripts/gpu-unpack.sh scripts/gpu-test.sh scripts/gpu-bench.sh scripts/gpu-python.sh scripts/gpu-probe-cold.sh scripts/gpu-ab.sh scripts/gpu-round.sh .gpu/
du -sh .gpu/* | sed 's/^/gpu-bundle: /'

#!/usr/bin/env bash
# The Python client on a GPU host, from the bundle that scripts/gpu-bundle.sh made:
#   1. starts vmmd from the bundle on the cuda backend;
#   2. the Python GPU tests (test/gpu/python, pytest);
#   3. Numba's own CUDA tests (the whole cudadrv and cudapy packages, in shards:
#      VMMD_NUMBA_SHARD) with NUMBA_CUDA_MEMORY_MANAGER=default and =vmmd.numba,
#      side by side, and the difference of their pass sets;
#   4. the shared-weights case (8 GiB store, 8 PyTorch openers; a MemPool model;
#      the copy baseline);
#   5. the Python benchmarks.
# Every step logs, has a time limit, and the run goes on after a failure.
# Usage: scripts/gpu-python.sh [BUNDLE_DIR [OUTPUT_DIR]]   (defaults: .gpu, $OUT or ./gpu-results)
# VMMD_STEPS picks steps (default "pytest numba weights bench"; also pools-bench, sleep-bench): calls of
# "pytest", "numba" and "weights bench" each stay inside a 10-minute limit.
# VMMD_PYTEST_TARGETS narrows the pytest step (files or node ids), VMMD_PYTEST_STACK_SECONDS is when a slow test dumps its stacks (150), VMMD_PYTEST_SECONDS bounds it (420: the GPU tests with the sleep cycles take ~300 s; give pytest a call of its own).
# Writes OUTPUT_DIR/python/: gpu-python.log (everything), steps.txt, pytest.log, pytest-failures.log,
# numba-compare.json (+ numba/default, numba/vmmd per module), shared-weights.json,
# bench-python.json, daemon.log. Python: $PYTHON or python3, with torch, cupy,
# numba-cuda, cuda-bindings, grpcio, protobuf and pytest installed; no network needed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${2:-${OUT:-gpu-results}}/python
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$("$here/gpu-unpack.sh" "${1:-.gpu}") || exit 1
export PATH="$work:$PATH"
cd "$work/vmmd"
PY=${PYTHON:-python3}
exec > >(tee -a "$out/gpu-python.log") 2>&1
: > "$out/steps.txt"

steps=" ${VMMD_STEPS:-pytest numba weights bench} "
want() { [[ $steps == *" $1 "* ]]; }

step() { # step NAME SECONDS COMMAND...: runs with a time limit, logs start, end and exit status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name: start ($(date -u +%H:%M:%S), limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  echo "$name exit=$rc seconds=$((SECONDS - start))" >> "$out/steps.txt"
  return 0
}

echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "host: $(uname -srm), $(nproc) cores"
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,memory.used --format=csv,noheader 2>&1 | sed 's/^/gpu: /'

# What numba-cuda 0.30.4 needs on this image: numpy.row_stack (gone in numpy 2.5)
# for kernels to compile, and a module `filecheck` for its test modules to load.
shim="$work/pyshim"
mkdir -p "$shim/filecheck"
cat > "$shim/sitecustomize.py" <<'PY'
import numpy
if not hasattr(numpy, "row_stack"):
    numpy.row_stack = numpy.vstack  # NOTE: numba-cuda 0.30.4 overloads np.row_stack, which numpy 2.5 removed
PY
for module in matcher options parser finput; do
  cat > "$shim/filecheck/$module.py" <<'PY'
# A stand-in for the filecheck package (absent here): numba-cuda's testing
# module imports these names; tests that really use FileCheck fail alike
# under either memory manager.
class _Absent:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("filecheck is not installed on this host")
Matcher = Options = Parser = FInput = _Absent
def pattern_for_opts(*args, **kwargs):
    raise RuntimeError("filecheck is not installed on this host")
PY
done
touch "$shim/filecheck/__init__.py"
export PYTHONPATH="$work/vmmd/python/src:$shim${PYTHONPATH:+:$PYTHONPATH}"
export VMMD_CACHE_DIR="$work/cache"
$PY - <<'PY'
import importlib, sys
print("python:", sys.version.split()[0])
for name in ("numpy", "numba", "numba_cuda", "cupy", "torch", "cuda.bindings", "grpc", "google.protobuf", "pytest", "vmmd"):
    try:
        module = importlib.import_module(name)
        print(f"  {name}: {getattr(module, '__version__', '?')}")
    except Exception as error:
        print(f"  {name}: not importable ({type(error).__name__}: {error})")
PY
step build-torch-allocator 60 $PY -c "from vmmd import _allocator_lib; print(_allocator_lib.library_path())"

# 1. The daemon, cuda backend.
sock="$work/sock"
mkdir -p "$sock"
node bin/vmmd.js --backend "${VMMD_BACKEND:-cuda}" --socket-dir "$sock" --log-level warn > "$out/daemon.log" 2>&1 &
daemon=$!
export VMMD_SOCKET_DIR="$sock"
for _ in $(seq 1 150); do
  $PY -c "import vmmd; vmmd.connect().close()" 2>/dev/null && break
  kill -0 "$daemon" 2>/dev/null || { echo "vmmd exited:"; cat "$out/daemon.log"; exit 1; }
  sleep 0.2
done
$PY -c "import vmmd; c = vmmd.connect(); print('daemon:', c.backend, [(d.name, d.uuid) for d in c.devices.list_devices().devices]); c.close()"

# 2. The Python GPU tests.
if want pytest; then
  # Each failure is written as it happens (conftest.py) to pytest-failures.log as well as the log, and a test
  # running past VMMD_PYTEST_STACK_SECONDS dumps every thread's stack: a run cut by its bound keeps both.
  : > "$out/pytest-failures.log"
  export VMMD_PYTEST_FAILURES="$out/pytest-failures.log"
  step pytest "${VMMD_PYTEST_SECONDS:-420}" $PY -m pytest -p no:cacheprovider -v -s -rs \
    -o faulthandler_timeout="${VMMD_PYTEST_STACK_SECONDS:-150}" ${VMMD_PYTEST_TARGETS:-test/gpu/python} 2>&1 | tee "$out/pytest.log"
fi

# 3. Numba's suite: the whole cudadrv and cudapy packages, with NUMBA_CUDA_MEMORY_MANAGER=default
#    and =vmmd.numba at once, each module in its own process. VMMD_NUMBA_SHARD=K/N runs every N-th
#    module from the K-th (1-based) so that N calls each fit a 10-minute limit; results of several
#    shards land in the same OUTPUT_DIR/python/numba/ and the comparison covers what is there.
#    VMMD_NUMBA_JOBS processes per manager (default 7: 14 of 16 cores), VMMD_NUMBA_MODULE_SECONDS each.
if want numba; then
mkdir -p "$out/numba/default" "$out/numba/vmmd"
# VMMD_NUMBA_MODULES names the modules instead (e.g. numba.cuda.tests.cudapy.test_ipc).
modules=${VMMD_NUMBA_MODULES:-}
[ -n "$modules" ] || modules=$(VMMD_NUMBA_SHARD="${VMMD_NUMBA_SHARD:-1/1}" $PY - <<'PY'
import glob, os
import numba.cuda.tests.cudadrv as drv, numba.cuda.tests.cudapy as py
names = []
for package in (drv, py):
    names += [f"{package.__name__}.{os.path.basename(p)[:-3]}" for p in sorted(glob.glob(os.path.join(os.path.dirname(package.__file__), "test_*.py")))]
k, n = (int(x) for x in os.environ["VMMD_NUMBA_SHARD"].split("/"))
print(" ".join(names[k - 1 :: n]))
PY
)
echo "numba modules (shard ${VMMD_NUMBA_SHARD:-1/1}): $modules"
run_suite() { # run_suite MANAGER DIR: every module in its own process
  printf '%s\n' $modules | xargs -P "${VMMD_NUMBA_JOBS:-7}" -I{} sh -c "touch '$out/numba/$2/{}.started'; NUMBA_CUDA_MEMORY_MANAGER=$1 timeout --kill-after=5 ${VMMD_NUMBA_MODULE_SECONDS:-240} $PY test/gpu/python/numba_suite.py '$out/numba/$2/{}.json' {} > '$out/numba/$2/{}.log' 2>&1"
}
step numba-suites "${VMMD_NUMBA_SECONDS:-480}" bash -c "$(declare -f run_suite); modules='$modules'; out='$out'; PY='$PY'; run_suite default default & run_suite vmmd.numba vmmd & wait"
step numba-compare 60 $PY test/gpu/python/compare_numba.py "$out/numba/default" "$out/numba/vmmd" "$out/numba-compare.json"
fi

# 4. Shared weights: 8 GiB, 8 PyTorch openers; a MemPool model; the copy baseline.
want weights && step shared-weights 240 $PY test/gpu/python/shared_weights.py "$out" --gib "${VMMD_SHARED_GIB:-8}" --openers "${VMMD_OPENERS:-8}" --work "$work"

# 5. Benchmarks.
want bench && step bench 150 $PY bench/python/bench_python.py "$out/bench-python.json"
want pools-bench && step pools-bench 240 $PY bench/python/pools_bench.py "$out/pools-bench.json"
want sleep-bench && step sleep-bench 300 $PY bench/python/sleep_bench.py "$out/sleep-bench.json" --gib "${VMMD_SLEEP_GIB:-16}" --discard-gib "${VMMD_DISCARD_GIB:-64}"

kill "$daemon" 2>/dev/null
wait "$daemon" 2>/dev/null
echo "=== steps"
cat "$out/steps.txt"
echo "results in $out"

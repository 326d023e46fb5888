#!/usr/bin/env bash
# The Python client's tests (python/tests, pytest) against the daemon of this
# checkout (bin/vmmd.js: run after `npm run build`, as `npm test` does).
# ruff and mypy check the sources first. The interpreter is the venv VMMD_PYTHON_VENV (default .venv at the root);
# when it is missing it is made here, with `pip install ./python[test]`, and the
# package is reinstalled whenever python/ changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VMMD_PYTHON_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "test-python: making the venv $venv (python3 -m venv; pip install ./python[test])"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --retries 0 "./python[test]"
fi
stamp=$(find python/pyproject.toml python/src -type f -newer "$venv/.vmmd-installed" 2>/dev/null | head -1 || true)
if [ ! -f "$venv/.vmmd-installed" ] || [ -n "$stamp" ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall ./python
  touch "$venv/.vmmd-installed"
fi
# Lint and type-check first (python/pyproject.toml: ruff's pyflakes rules, mypy over the package).
if [ ! -x "$venv/bin/ruff" ] || [ ! -x "$venv/bin/mypy" ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check --retries 0 "ruff>=0.6" "mypy>=1.10"
fi
bin="$(cd "$venv" && pwd)/bin"
(cd python && "$bin/ruff" check --quiet src tests && "$bin/mypy" --no-error-summary src/vmmd)
# The installed package, not the sources: the tests run what `pip install ./python` gives.
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q --durations=8 python/tests "$@"

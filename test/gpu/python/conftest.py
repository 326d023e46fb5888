"""GPU tests of the Python client: a vmmd daemon on the cuda backend, named by
VMMD_SOCKET_DIR (scripts/gpu-python.sh starts one from the bundle). Without
a GPU, cuda-bindings or such a daemon, every test here is skipped, saying why.

A failure's report is written the moment the test fails (to stdout and, where
VMMD_PYTEST_FAILURES names a file, appended there), not only in pytest's
summary at the end: a run cut by its time bound keeps every traceback it had.
A child process (run_python) that hangs dumps its threads' stacks and exits
before its bound, and pytest itself dumps them when the bound's SIGTERM comes,
so a hang shows where it waits."""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from typing import Any, Dict, Iterator, Optional

import pytest

import vmmd

MiB = 1 << 20
# Seconds before run_python's bound at which a child dumps its stacks and exits.
CHILD_STACKS_BEFORE = 10


def _text(output: Any) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _why_not() -> Optional[str]:
    if not os.environ.get("VMMD_SOCKET_DIR"):
        return "VMMD_SOCKET_DIR names no daemon: run scripts/gpu-python.sh, which starts vmmd --backend cuda"
    try:
        from cuda.bindings import driver  # noqa: F401  (the test needs it)
    except ImportError as error:
        return f"cuda-bindings is not installed ({error})"
    try:
        with vmmd.connect() as client:
            if client.backend != "cuda":
                return f"the daemon at {client.socket_dir} runs the {client.backend} backend, not cuda"
    except vmmd.VmmdError as error:
        return f"no daemon: {error}"
    return None


WHY_NOT = _why_not()
# The time bound's SIGTERM shows where every thread was before pytest goes.
faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)


def pytest_collection_modifyitems(config: Any, items: Any) -> None:
    if WHY_NOT is not None:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=WHY_NOT))


def pytest_runtest_logreport(report: Any) -> None:
    if not report.failed:
        return
    text = f"\n=== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n=== end of {report.nodeid}\n"
    # The real stdout: pytest may capture sys.stdout here, and the log must have it now.
    sys.__stdout__.write(text)
    sys.__stdout__.flush()
    path = os.environ.get("VMMD_PYTEST_FAILURES")
    if path:
        with open(path, "a") as failures:
            failures.write(text)
            failures.flush()
            os.fsync(failures.fileno())


@pytest.fixture
def client() -> Iterator[vmmd.VmmdClient]:
    with vmmd.connect() as c:
        yield c


def run_python(code: str, env: Optional[Dict[str, str]] = None, timeout: float = 180) -> Any:
    """Runs `code` in a new Python process (the same interpreter and
    environment); its last stdout line is JSON, returned parsed. A child still
    running `CHILD_STACKS_BEFORE` seconds before `timeout` dumps every thread's
    stack and exits, and its output is in the failure."""
    # A file, not -c: multiprocessing's spawn re-imports the main module by path.
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(f"import faulthandler; faulthandler.dump_traceback_later({max(1.0, timeout - CHILD_STACKS_BEFORE)}, exit=True)\n")
        script.write(textwrap.dedent(code))
    try:
        result = subprocess.run(
            [sys.executable, script.name],
            capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(f"child ran past {timeout} s:\n{_text(expired.stdout)[-3000:]}\n{_text(expired.stderr)[-5000:]}") from None
    finally:
        os.unlink(script.name)
    if result.returncode != 0:
        raise AssertionError(f"child failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])

"""GPU tests of the Python client: a vmmd daemon on the cuda backend, named by
VMMD_SOCKET_DIR (scripts/gpu-python.sh starts one from the bundle). Without
a GPU, cuda-bindings or such a daemon, every test here is skipped, saying why."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Any, Dict, Iterator, Optional

import pytest

import vmmd

MiB = 1 << 20


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


def pytest_collection_modifyitems(config: Any, items: Any) -> None:
    if WHY_NOT is not None:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=WHY_NOT))


@pytest.fixture
def client() -> Iterator[vmmd.VmmdClient]:
    with vmmd.connect() as c:
        yield c


def run_python(code: str, env: Optional[Dict[str, str]] = None, timeout: float = 180) -> Any:
    """Runs `code` in a new Python process (the same interpreter and
    environment); its last stdout line is JSON, returned parsed."""
    # A file, not -c: multiprocessing's spawn re-imports the main module by path.
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(textwrap.dedent(code))
    try:
        result = subprocess.run(
            [sys.executable, script.name],
            capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
        )
    finally:
        os.unlink(script.name)
    if result.returncode != 0:
        raise AssertionError(f"child failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])

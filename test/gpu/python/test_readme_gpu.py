"""The GPU examples of docs/PYTHON.md (CuPy, shared weights, sleep and wake), run as written."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import vmmd

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def examples() -> list:
    """The README's Python quick start, then docs/PYTHON.md's examples (as python/tests/test_readme.py)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index("## Quick start: Python")
    page = open(os.path.join(ROOT, "docs", "PYTHON.md")).read()
    return re.findall(r"```python\n(.*?)```", text[start : text.index("\n## ", start)], re.S) + re.findall(r"```python\n(.*?)```", page, re.S)


def run(code: str, cwd: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_cupy_example(tmp_path: object) -> None:
    assert int(run(examples()[1], str(tmp_path))) == sum(range(1 << 20))


def test_the_shared_weights_example(tmp_path: object) -> None:
    import numpy

    numpy.ones(1 << 20, dtype="<f2").tofile(os.path.join(str(tmp_path), "weights.bin"))
    try:
        assert float(run(examples()[2], str(tmp_path))) == float(1 << 20)
    finally:
        with vmmd.connect() as client:
            client.stores.detach("my-weights")


def test_the_sleep_example(tmp_path: object) -> None:
    assert run(examples()[3], str(tmp_path)).strip() == "True"

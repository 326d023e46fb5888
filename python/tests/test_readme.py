"""The Python examples of the README (the client one, run here on the host
backend) and of docs/PYTHON.md (CuPy, shared weights, sleep and wake: they need a GPU and
run in test/gpu/python); all compile."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT, Daemon


def python_examples() -> list:
    """The README's Python quick start, then docs/PYTHON.md's examples, in order."""
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index("## Quick start: Python")
    section = text[start : text.index("\n## ", start)]
    page = open(os.path.join(ROOT, "docs", "PYTHON.md")).read()
    return re.findall(r"```python\n(.*?)```", section, re.S) + re.findall(r"```python\n(.*?)```", page, re.S)


def test_the_examples_compile_and_the_install_command_is_what_ci_runs() -> None:
    examples = python_examples()
    assert len(examples) == 4
    for code in examples:
        compile(code, "README.md or docs/PYTHON.md", "exec")
    section = open(os.path.join(ROOT, "README.md")).read().split("## Quick start: Python")[1]
    assert "pip install ./python" in section and "./python[test]" in open(os.path.join(ROOT, ".ci", "run")).read()


def test_the_client_example_runs(daemon: Daemon) -> None:
    code = python_examples()[0]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=daemon.env(), timeout=60)
    assert result.returncode == 0, result.stderr
    allocated, shared = result.stdout.split()
    assert int(allocated) >= 2 << 20 and shared == "True"

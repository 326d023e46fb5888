"""The README's Python examples: the client one runs here (host backend);
the CuPy and weights ones need a GPU and run in test/gpu/python; all compile."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT, Daemon


def python_examples() -> list:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("### Python") : text.index("## Layout")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_examples_compile_and_the_install_command_is_what_ci_runs() -> None:
    examples = python_examples()
    assert len(examples) == 3
    for code in examples:
        compile(code, "README.md", "exec")
    section = open(os.path.join(ROOT, "README.md")).read().split("### Python")[1]
    assert "pip install ./python" in section and "./python[test]" in open(os.path.join(ROOT, ".ci", "run")).read()


def test_the_client_example_runs(daemon: Daemon) -> None:
    code = python_examples()[0]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=daemon.env(), timeout=60)
    assert result.returncode == 0, result.stderr
    allocated, shared = result.stdout.split()
    assert int(allocated) >= 2 << 20 and shared == "True"

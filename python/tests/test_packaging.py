"""The package as users install it: one pure-Python wheel (py3-none-any)
that installs and imports in a fresh venv, an sdist without the repository's
tests, one version (package.json's), the PyTorch allocation library built at
first use as a plain shared library (NO_COMPILER where no compiler is found,
nothing half-built left in the cache), and a clear ImportError when Numba's
built-in numba.cuda is used instead of numba-cuda."""
from __future__ import annotations

import ctypes
import glob
import importlib
import json
import os
import subprocess
import sys
import tarfile
import types
import zipfile
from typing import Any

import pytest

import vmmd

from conftest import ROOT

PYTHON_DIR = os.path.join(ROOT, "python")


def test_the_version_is_package_jsons() -> None:
    with open(os.path.join(ROOT, "package.json")) as file:
        expected = json.load(file)["version"]
    assert vmmd.__version__ == expected
    with open(os.path.join(PYTHON_DIR, "pyproject.toml")) as file:
        pyproject = file.read()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "vmmd.__version__"' in pyproject


def fresh_env() -> Any:
    """The environment without a PYTHONPATH that would show the sources' vmmd to the fresh venv."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def test_one_pure_python_wheel_installs_and_imports_in_a_fresh_venv(tmp_path: Any) -> None:
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", PYTHON_DIR, "-w", str(wheels)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    [wheel] = glob.glob(str(wheels / "vmmd-*.whl"))
    assert wheel.endswith(f"vmmd-{vmmd.__version__}-py3-none-any.whl"), os.path.basename(wheel)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(name for name in names if name.endswith("/WHEEL"))).decode()
    assert "Root-Is-Purelib: true" in metadata and not any(name.endswith(".so") for name in names), names
    assert "vmmd/_torch_allocator.c" in names and "vmmd/_cupy_allocator.c" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "--retries", "0", wheel], capture_output=True, text=True, timeout=300, env=fresh_env())
    assert installed.returncode == 0, installed.stderr
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", "import vmmd, vmmd.weights; print(vmmd.__version__, vmmd.__file__)"], capture_output=True, text=True, cwd=str(tmp_path), timeout=120, env=fresh_env())
    assert imported.returncode == 0, imported.stderr
    version, path = imported.stdout.split()
    assert version == vmmd.__version__ and path.startswith(str(venv))


def test_the_sdist_leaves_the_repositorys_tests_out(tmp_path: Any) -> None:
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"
    built = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PYTHON_DIR, timeout=300)
    assert built.returncode == 0, built.stderr
    name = built.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as archive:
        names = archive.getnames()
    assert not [entry for entry in names if "/tests/" in entry], [entry for entry in names if "/tests/" in entry]
    assert any(entry.endswith("src/vmmd/session.py") for entry in names)


def test_the_allocation_library_is_built_once_as_a_plain_shared_library(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vmmd import _allocator_lib

    monkeypatch.setenv("VMMD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    path = _allocator_lib.library_path()
    assert os.path.dirname(path) == str(tmp_path) and path.endswith(".so")
    library = ctypes.CDLL(path)
    assert library.vmmd_torch_malloc and library.vmmd_torch_free
    stat = os.stat(path)
    assert _allocator_lib.library_path() == path and os.stat(path).st_mtime_ns == stat.st_mtime_ns
    assert os.listdir(tmp_path) == [os.path.basename(path)]


@pytest.mark.parametrize("compiler", ["/no/such/cc", "false"])
def test_no_compiler_is_no_compiler_and_leaves_nothing_in_the_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, compiler: str) -> None:
    from vmmd import _allocator_lib

    monkeypatch.setenv("VMMD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    for _ in range(2):
        with pytest.raises(vmmd.VmmdError) as raised:
            _allocator_lib.library_path()
        assert (raised.value.code, raised.value.status_name) == ("NO_COMPILER", "FAILED_PRECONDITION")
        assert compiler in raised.value.message and "CC" in raised.value.message
    assert os.listdir(tmp_path) == []


def fake_numba(monkeypatch: pytest.MonkeyPatch, cuda_file: str) -> None:
    """numba and numba.cuda as far as the check goes: where numba.cuda's code lives."""
    numba = types.ModuleType("numba")
    cuda = types.ModuleType("numba.cuda")
    cuda.__file__ = cuda_file
    numba.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "numba", numba)
    monkeypatch.setitem(sys.modules, "numba.cuda", cuda)
    for name in ("vmmd.numba", "vmmd._numba_check"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_numbas_built_in_cuda_target_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_numba(monkeypatch, os.path.join(os.sep, "site-packages", "numba", "cuda", "__init__.py"))
    with pytest.raises(ImportError) as raised:
        importlib.import_module("vmmd.numba")
    assert "pip install numba-cuda" in str(raised.value) and "built into Numba" in str(raised.value)


def test_numba_cudas_target_passes_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_numba(monkeypatch, os.path.join(os.sep, "site-packages", "numba_cuda", "numba", "cuda", "__init__.py"))
    importlib.import_module("vmmd._numba_check")  # no ImportError

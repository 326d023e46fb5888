"""The Python package mirrors the TypeScript client file for file: each
client file's classes live in one Python module of the same job, no module
is over 500 lines, and what the public methods return is typed (no Any), so
a reader of either client finds the other's code where they expect it."""
from __future__ import annotations

import importlib
import inspect
import os
import re
from typing import List

import pytest

from conftest import ROOT

# Each TypeScript client file and the Python module that mirrors it.
MIRROR = {
    "rpc.ts": "vmmd._rpc",
    "connection.ts": "vmmd.client",  # the connection, with its DevicesApi and AdminApi
    "vmm.ts": "vmmd._vmm",
    "stores.ts": "vmmd._stores",
    "staging.ts": "vmmd._staging",
    "session.ts": "vmmd.session",
}
# The session socket's answers are still its JSON frames, returned as dicts, until both clients decode them from
# proto/vmmd/v1/session.proto; every other public result is a generated message or a class of the package.
RAW_FRAMES = {"ClientSession"}
SOURCES = os.path.join(ROOT, "python", "src", "vmmd")


def exported_classes(ts_file: str) -> List[str]:
    text = open(os.path.join(ROOT, "client", ts_file)).read()
    return re.findall(r"^export (?:abstract )?class (\w+)", text, re.M)


@pytest.mark.parametrize("ts_file", sorted(MIRROR))
def test_each_client_file_has_its_python_module_with_the_same_classes(ts_file: str) -> None:
    module = importlib.import_module(MIRROR[ts_file])
    missing = [name for name in exported_classes(ts_file) if not inspect.isclass(getattr(module, name, None))]
    assert not missing, f"client/{ts_file} exports {missing}, which {MIRROR[ts_file]} lacks"


def test_no_python_module_is_over_500_lines() -> None:
    over = {name: n for name in sorted(os.listdir(SOURCES)) if name.endswith(".py") for n in [sum(1 for _ in open(os.path.join(SOURCES, name)))] if n > 500}
    assert not over, f"split by concern: {over}"


@pytest.mark.parametrize("ts_file", sorted(MIRROR))
def test_public_results_are_typed(ts_file: str) -> None:
    module = importlib.import_module(MIRROR[ts_file])
    untyped = []
    for name in exported_classes(ts_file):
        if name in RAW_FRAMES:
            continue
        for attribute, member in vars(getattr(module, name)).items():
            function = member.fget if isinstance(member, property) else member
            if attribute.startswith("_") or not inspect.isfunction(function):
                continue
            returned = inspect.signature(function).return_annotation
            if returned is inspect.Signature.empty or re.search(r"\bAny\b", str(returned)):
                untyped.append(f"{name}.{attribute} -> {returned if returned is not inspect.Signature.empty else '(none)'}")
    assert not untyped, f"results typed Any or not at all: {untyped}"

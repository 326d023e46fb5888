"""One version for both packages: the Python package's (pyproject.toml and
vmmd.__version__) is the npm package's, so a bug report names one release."""
from __future__ import annotations

import json
import os
import re

import vmmd
from conftest import ROOT


def test_the_python_package_has_the_npm_package_version() -> None:
    npm = json.load(open(os.path.join(ROOT, "package.json")))["version"]
    pyproject = open(os.path.join(ROOT, "python", "pyproject.toml")).read()
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.M)
    if declared is not None:  # a version read from elsewhere at build time is checked through vmmd.__version__
        assert declared.group(1) == npm
    assert vmmd.__version__ == npm

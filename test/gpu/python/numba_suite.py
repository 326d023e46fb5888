"""Runs test modules of Numba's own CUDA suite with unittest (as `python3 -m
numba.runtests` does) and writes each test's outcome as JSON:

    python3 numba_suite.py OUT.json numba.cuda.tests.cudadrv.test_cuda_memory ...

The memory manager is whatever NUMBA_CUDA_MEMORY_MANAGER says; the caller
runs the same modules with the default and with vmmd.numba and compares
(compare_numba.py)."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
import unittest


class Recorder(unittest.TextTestResult):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.outcomes: dict = {}

    def _note(self, test, outcome: str, detail: str = "") -> None:  # type: ignore[no-untyped-def]
        self.outcomes[test.id()] = {"outcome": outcome, "detail": detail[-2000:]}

    def addSuccess(self, test):  # type: ignore[no-untyped-def]
        super().addSuccess(test)
        self._note(test, "pass")

    def addFailure(self, test, err):  # type: ignore[no-untyped-def]
        super().addFailure(test, err)
        self._note(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):  # type: ignore[no-untyped-def]
        super().addError(test, err)
        self._note(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):  # type: ignore[no-untyped-def]
        super().addSkip(test, reason)
        self._note(test, "skip", str(reason))

    def addExpectedFailure(self, test, err):  # type: ignore[no-untyped-def]
        super().addExpectedFailure(test, err)
        self._note(test, "xfail")

    def addUnexpectedSuccess(self, test):  # type: ignore[no-untyped-def]
        super().addUnexpectedSuccess(test)
        self._note(test, "xpass")


def main() -> int:
    out, modules = sys.argv[1], sys.argv[2:]
    loader = unittest.TestLoader()
    results: dict = {"manager": os.environ.get("NUMBA_CUDA_MEMORY_MANAGER", "default"), "modules": {}, "tests": {}}
    for name in modules:
        start = time.monotonic()
        try:
            suite = loader.loadTestsFromName(name)
        except Exception:
            results["modules"][name] = {"loaded": False, "error": traceback.format_exc()[-3000:]}
            continue
        runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=Recorder)
        result = runner.run(suite)
        results["tests"].update(result.outcomes)  # type: ignore[attr-defined]
        results["modules"][name] = {"loaded": True, "seconds": round(time.monotonic() - start, 1), "run": result.testsRun}
        with open(out, "w") as f:  # written after each module: a timeout keeps what ran
            json.dump(results, f, indent=1)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compares Numba's CUDA suite run with its default memory manager and with
vmmd.numba (numba_suite.py outputs): every test that passes with the default
must pass with vmmd. Prints the table and writes OUT.json; exit 1 if any
test passes only with the default, except those Numba itself skips for every
external memory manager (its `skip_if_external_memmgr`, by their reasons below),
which are listed apart.

    python3 compare_numba.py default.json vmmd.json OUT.json"""
from __future__ import annotations

import collections
import json
import os
import sys


def load(path: str) -> dict:
    """One numba_suite.py output, or a directory of them (one per module), merged."""
    if not os.path.isdir(path):
        return json.load(open(path))
    merged: dict = {"modules": {}, "tests": {}}
    for name in sorted(os.listdir(path)):
        if name.endswith(".json"):
            try:
                part = json.load(open(os.path.join(path, name)))
            except ValueError:
                merged["modules"][name[:-5]] = {"loaded": False, "error": "no result (killed by its timeout?)"}
                continue
            merged["modules"].update(part["modules"])
            merged["tests"].update(part["tests"])
        elif name.endswith(".started"):
            module = name[: -len(".started")]
            if not os.path.exists(os.path.join(path, module + ".json")):
                merged["modules"][module] = {"loaded": False, "error": "no result (killed by its timeout?)"}
    return merged


# The reasons numba-cuda's own `skip_if_external_memmgr` gives: these tests
# check Numba's built-in deallocation queue or ownership, which no NBEP 7
# manager has, so Numba skips them whatever the external manager is.
NUMBA_SKIPS_FOR_EXTERNAL_MANAGERS = (
    "Deallocation specific to Numba memory management",
    "Ownership not relevant with external memmgr",
)


def skipped_by_numba_for_external_managers(outcome: dict) -> bool:
    detail = outcome.get("detail", "").strip()
    return outcome["outcome"] == "skip" and detail in NUMBA_SKIPS_FOR_EXTERNAL_MANAGERS


def main() -> int:
    default = load(sys.argv[1])
    vmmd = load(sys.argv[2])
    tests = sorted(set(default["tests"]) | set(vmmd["tests"]))
    regressions, gains, expected, counts = [], [], [], collections.Counter()
    for test in tests:
        a = default["tests"].get(test, {"outcome": "missing"})
        b = vmmd["tests"].get(test, {"outcome": "missing"})
        counts[(a["outcome"], b["outcome"])] += 1
        if a["outcome"] in ("pass", "xfail") and skipped_by_numba_for_external_managers(b):
            expected.append({"test": test, "default": a["outcome"], "vmmd": b["outcome"], "reason": b.get("detail", "").strip()})
        elif a["outcome"] in ("pass", "xfail") and b["outcome"] not in ("pass", "xfail"):
            regressions.append({"test": test, "default": a["outcome"], "vmmd": b["outcome"], "detail": b.get("detail", "")})
        if b["outcome"] == "pass" and a["outcome"] != "pass":
            gains.append({"test": test, "default": a["outcome"], "vmmd": b["outcome"]})
    summary = {
        "tests": len(tests),
        "passed_default": sum(1 for t in tests if default["tests"].get(t, {}).get("outcome") == "pass"),
        "passed_vmmd": sum(1 for t in tests if vmmd["tests"].get(t, {}).get("outcome") == "pass"),
        "outcomes_default_to_vmmd": {f"{a}->{b}": n for (a, b), n in sorted(counts.items())},
        "passed_only_with_default": regressions,
        "skipped_by_numba_for_external_managers": expected,
        "passed_only_with_vmmd": gains,
        "modules_not_loaded": {
            "default": [m for m, r in default["modules"].items() if not r.get("loaded")],
            "vmmd": [m for m, r in vmmd["modules"].items() if not r.get("loaded")],
        },
    }
    json.dump(summary, open(sys.argv[3], "w"), indent=1)
    print(f"numba suite: {summary['tests']} tests; passed with default {summary['passed_default']}, with vmmd.numba {summary['passed_vmmd']}")
    for key, n in summary["outcomes_default_to_vmmd"].items():
        print(f"  {key}: {n}")
    for r in regressions:
        print(f"  PASSES ONLY WITH DEFAULT: {r['test']} ({r['vmmd']}): {r['detail'].strip().splitlines()[-1] if r['detail'].strip() else ''}")
    for r in expected:
        print(f"  skipped by Numba for any external manager: {r['test']}: {r['reason']}")
    for m, names in summary["modules_not_loaded"].items():
        if names:
            print(f"  modules not loaded ({m}): {', '.join(names)}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())

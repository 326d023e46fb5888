#!/usr/bin/env python3
"""Lines up bench/cold-probe.ts's memallocs with the driver trace of
the daemon and the client (VMMD_DRIVER_TRACE=1 lines, CLOCK_MONOTONIC):
for each schedule and size, the p50 of each step of the client's path
(the allocate round trip up to the import, the import, map and set access,
the return), and how the memallocs that overlap other driver work (the
daemon's, or the client's own background unmaps and releases) compare with
those that do not.

    python3 bench/cold_timeline.py DIR   (DIR: the probe's --out)
Prints a text report; writes DIR/timeline.json.
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"vmmd-trace pid=(\d+) tid=(\d+) begin=(\d+) end=(\d+) result=(-?\d+) address=0x([0-9a-f]+) call=(.*)$")


def read_trace(path):
    calls = []
    if not path.exists():
        return calls
    for line in path.read_text(errors="replace").splitlines():
        found = LINE.search(line)
        if found:
            pid, tid, begin, end, result, _address, call = found.groups()
            calls.append({"pid": int(pid), "tid": int(tid), "begin": int(begin), "end": int(end), "result": int(result), "call": call})
    calls.sort(key=lambda c: c["begin"])
    return calls


def p50(values):
    return round(statistics.median(values) / 1000, 1) if values else None


def short(call):
    return re.sub(r"\(\d+\)", "", call).replace(" (inline)", "")


def main():
    out = Path(sys.argv[1])
    probe = json.loads((out / "calls.json").read_text())
    trace = read_trace(out / "daemon-trace.txt") + read_trace(out / "client-trace.txt")
    trace.sort(key=lambda c: c["begin"])
    client_pid = probe["pid"]
    groups = defaultdict(list)
    for call in probe["calls"]:
        groups[(call["size"], call["schedule"])].append(call)
    report = {}
    begins = [c["begin"] for c in trace]
    import bisect

    for (size, schedule), calls in groups.items():
        steps = defaultdict(list)
        overlapped = defaultdict(list)
        totals = {"quiet": [], "overlapped": []}
        for memalloc in calls:
            b, e = int(memalloc["begin"]), int(memalloc["end"])
            lo = bisect.bisect_left(begins, b - 50_000_000)
            hi = bisect.bisect_right(begins, e)
            inside = [c for c in trace[lo:hi] if c["end"] > b and c["begin"] < e]
            own = [c for c in inside if c["pid"] == client_pid and (c["call"].endswith("(inline)") or c["call"].startswith("session:") or c["call"].startswith("mark:")) and c["begin"] >= b]
            # The daemon's handling of this memalloc's request: inside the client's round trip.
            served = []
            for c in own:
                if c["call"].startswith("session:"):
                    served += [d for d in inside if d["pid"] != client_pid and d["call"] == c["call"] and d["begin"] >= c["begin"] and d["end"] <= c["end"]]
            for d in served[:1]:
                trip = next(c for c in own if c["call"] == d["call"])
                steps["  of the round trip: client send to daemon receipt"].append(d["begin"] - trip["begin"])
                steps["  of the round trip: the daemon's handling"].append(d["end"] - d["begin"])
                answered = [m for m in inside if m["pid"] == d["pid"] and m["call"].startswith("mark:") and d["begin"] <= m["begin"] <= d["end"]]
                if answered:
                    steps["    of the daemon's handling: up to the answer"].append(answered[0]["begin"] - d["begin"])
                    steps["    of the daemon's handling: sending it"].append(d["end"] - answered[0]["begin"])
                steps["  of the round trip: daemon send to client answer"].append(trip["end"] - d["end"])
            others = [c for c in inside if c not in own and c not in served and not c["call"].startswith(("session:", "mark:"))]
            # The client's inline steps, in order: import, map, set access.
            mark = b
            for c in own:
                steps["gap before " + short(c["call"])].append(c["begin"] - mark)
                steps[short(c["call"])].append(c["end"] - c["begin"])
                mark = c["end"]
            steps["after the last step, to the caller"].append(e - mark)
            steps["whole memalloc"].append(e - b)
            for c in others:
                who = "daemon" if c["pid"] != client_pid else "client (driver thread)"
                overlapped[f"{who}: {short(c['call'])}"].append(min(c["end"], e) - max(c["begin"], b))
            totals["overlapped" if others else "quiet"].append(e - b)
        report[f"{size} {schedule}"] = {
            "count": len(calls),
            "steps_p50_us": {k: p50(v) for k, v in steps.items()},
            "overlapping_calls": {k: {"memallocs": len(v), "overlap_p50_us": p50(v)} for k, v in sorted(overlapped.items(), key=lambda kv: -len(kv[1]))},
            "whole_p50_us": {k: {"count": len(v), "p50": p50(v)} for k, v in totals.items()},
        }
    pings = [int(p["end"]) - int(p["begin"]) for p in probe.get("pings", [])]
    report["session ping (reference)"] = {"count": len(pings), "steps_p50_us": {"round trip": p50(pings)}, "overlapping_calls": {}, "whole_p50_us": {}}
    served = [c["end"] - c["begin"] for c in trace if c["pid"] != client_pid and c["call"] == "session:ping"]
    report["session ping (reference)"]["steps_p50_us"]["the daemon's handling"] = p50(served)
    (out / "timeline.json").write_text(json.dumps(report, indent=1))
    for name, entry in report.items():
        print(f"== {name} ({entry['count']} memallocs)")
        for k, v in entry["steps_p50_us"].items():
            print(f"   {k:55s} {v} us")
        for k, v in entry["whole_p50_us"].items():
            print(f"   whole, {k:48s} {v['p50']} us ({v['count']})")
        for k, v in entry["overlapping_calls"].items():
            print(f"   overlapping {k:43s} in {v['memallocs']} memallocs, p50 {v['overlap_p50_us']} us of overlap")


if __name__ == "__main__":
    main()

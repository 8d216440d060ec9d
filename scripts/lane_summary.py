"""The GPU lane's closing table: one line per step, the soak's verdict, then the test counts
(printed last, so the device tool's output tail always holds it). Also writes $OUT/lane.json, the
lane's run record."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    steps = [s.split("|") for s in sys.argv[2:]]
    record: dict = {
        "kind": "gpu-lane",
        "commit": os.environ.get("FLASHCUDA_COMMIT", "unknown"),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "steps": [{"step": s, "rc": int(rc), "seconds": int(sec)} for s, rc, sec in steps],
    }
    info = out / "info.txt"
    if info.exists():
        record["info"] = info.read_text().splitlines()
    junit = out / "gpu-tests.xml"
    if junit.exists():
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        record["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        record["tests"]["seconds"] = float(suite.get("time", 0))
        record["failed"] = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ][:50]
    lat = out / "latency.jsonl"
    if lat.exists():
        record["latency"] = [json.loads(line) for line in lat.read_text().splitlines() if line.strip()]
    soaks = sorted(out.glob("soak-*.json"))
    if soaks:
        record["soak"] = soak_summary(json.loads(soaks[-1].read_text()), soaks[-1].name)
    (out / "lane.json").write_text(json.dumps(record, indent=1))

    print("\n== GPU lane summary ==  commit", record["commit"][:12])
    for s in record["steps"]:
        print(f"  {s['step']:10s} {'ok' if s['rc'] == 0 else 'FAIL rc=' + str(s['rc']):10s} {s['seconds']:5d}s")
    for item in record.get("latency", []):
        print(f"  latency {item['kernel']:6s} cold {item['cold_seconds']:.3f}s  cache-hit {item['warm_seconds'] * 1e3:.1f} ms")
    if "soak" in record:
        print("  " + record["soak"]["line"])
    if "tests" in record:
        t = record["tests"]
        print(f"  tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped, {t['seconds']:.0f}s")
        for f in record.get("failed", [])[:15]:
            print("    FAILED", f)


def soak_summary(soak: dict, name: str) -> dict:
    """The lane's view of a scripts/soak.py record: verdict, counts, worst error, memory."""
    counts = soak.get("counts", {})
    worst = {k: v.get("ratio") for k, v in (soak.get("worst") or {}).items()}
    top = max(worst.items(), key=lambda kv: float("inf") if kv[1] is None else kv[1],
              default=None)
    memory = soak.get("memory", {})
    seconds = (soak.get("seconds") or {}).get("total") or 0.0
    worst_txt = "-" if top is None else (f"{top[0]} {top[1]:.2f}" if top[1] is not None
                                         else f"{top[0]} inf")
    verdict = str(memory.get("verdict", ""))
    mem_txt = ("NOT flat" if not memory.get("flat") else
               "flat" if verdict.startswith("flat") else "not measured")
    line = (f"soak: {str(soak.get('status', '?')).upper()} {counts.get('calls', 0)}/"
            f"{soak.get('config', {}).get('calls', '?')} calls (bwd {counts.get('backward', 0)}), "
            f"checked {counts.get('checked', 0)}, failures {soak.get('failure_count', '?')}, "
            f"worst/bound {worst_txt}, memory {mem_txt}, "
            f"{seconds:.0f}s")
    return {"file": name, "status": soak.get("status"), "calls": counts.get("calls"),
            "checked": counts.get("checked"), "failure_count": soak.get("failure_count"),
            "worst_ratio": worst, "memory_flat": memory.get("flat"),
            "memory_verdict": memory.get("verdict"), "seconds": seconds, "line": line,
            "failures": (soak.get("failures") or [])[:5]}


if __name__ == "__main__":
    main()

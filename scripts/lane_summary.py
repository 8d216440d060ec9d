"""The GPU lane's closing table: one line per step, then the test counts (printed last, so the
device tool's output tail always holds it). Also writes $OUT/lane.json, the lane's run record."""

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
    (out / "lane.json").write_text(json.dumps(record, indent=1))

    print("\n== GPU lane summary ==  commit", record["commit"][:12])
    for s in record["steps"]:
        print(f"  {s['step']:10s} {'ok' if s['rc'] == 0 else 'FAIL rc=' + str(s['rc']):10s} {s['seconds']:5d}s")
    for item in record.get("latency", []):
        print(f"  latency {item['kernel']:6s} cold {item['cold_seconds']:.3f}s  cache-hit {item['warm_seconds'] * 1e3:.1f} ms")
    if "tests" in record:
        t = record["tests"]
        print(f"  tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped, {t['seconds']:.0f}s")
        for f in record.get("failed", [])[:15]:
            print("    FAILED", f)


if __name__ == "__main__":
    main()

"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's source page.

    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python scripts/ncu_source_summary.py sass.csv [--top 40] [--hot N]

Reads the CSV (one row per SASS instruction; ncu's column names vary between versions, so the
columns are found by substring: the source text, and the warp-stall sampling counts) and prints
(1) the instructions with the most stall samples, with their share of all samples, (2) the same
samples summed by opcode, (3) when ncu gives per-reason sample columns, each reason's total, and
(4) when it gives "Instructions Executed", the warp instructions executed per opcode (the count
that told a polling loop from a busy one in session 25: 51.6 M executions, 0 samples), and (5)
with `--hot N`, the instructions executed between N and 4 N times (a kernel's steady loop: N
about its warps' loop trips; the upper bound leaves polling loops out), their count, stall
samples and both per opcode, so two kernels' loops compare side by side.
Unknown layouts print the header so the next run can be adapted.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys


def _number(text: str) -> float:
    text = (text or "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def _find(header: list[str], *needles: str) -> int | None:
    for i, name in enumerate(header):
        low = name.lower()
        if all(n in low for n in needles):
            return i
    return None


def summarize(rows: list[list[str]], top: int, hot: float = 0.0) -> str:
    """The report for a CSV already split into rows (header first)."""
    # ncu may print a few lines before the table; the header is the first row naming "Source"
    start = next((i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r)), None)
    if start is None:
        return "no 'Source' column found; first rows:\n" + "\n".join(",".join(r) for r in rows[:3])
    header, body = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
    src = header.index(next(c for c in header if c.strip() == "Source"))
    total_col = _find(header, "warp stall sampling", "all")
    if total_col is None:
        total_col = _find(header, "stall", "sampl")
    if total_col is None:
        return "no warp-stall sampling column; header:\n" + ", ".join(header)
    samples = [(_number(r[total_col]), r[src].strip()) for r in body]
    grand = sum(s for s, _ in samples) or 1.0
    out = [f"{len(body)} instructions, {grand:.0f} stall samples ({header[total_col]})", "",
           f"top {top} instructions:"]
    for s, text in sorted(samples, key=lambda x: -x[0])[:top]:
        out.append(f"  {100 * s / grand:5.1f}%  {s:9.0f}  {text[:110]}")
    def opcode(text: str) -> str:
        m = re.search(r"([A-Z][A-Z0-9_]+)(\.[A-Z0-9_.]+)?", re.sub(r"^@!?U?P\w+\s+", "", text))
        return m.group(1) if m else "?"

    by_op: dict[str, float] = collections.Counter()
    for s, text in samples:
        by_op[opcode(text)] += s
    out += ["", "by opcode:"]
    for op, s in sorted(by_op.items(), key=lambda x: -x[1])[:25]:
        out.append(f"  {100 * s / grand:5.1f}%  {op}")
    reasons = [(i, h) for i, h in enumerate(header)
               if "stall" in h.lower() and i != total_col and "not-issued" not in h.lower()]
    if reasons:
        out += ["", "by reason (columns of the source page):"]
        totals = sorted(((sum(_number(r[i]) for r in body), h) for i, h in reasons),
                        key=lambda x: -x[0])
        for s, h in totals:
            if s > 0:
                out.append(f"  {100 * s / grand:5.1f}%  {h}")
    executed_col = next((i for i, h in enumerate(header) if h.strip() == "Instructions Executed"),
                        None)
    if executed_col is not None:
        executed: dict[str, float] = collections.Counter()
        for r in body:
            executed[opcode(r[src].strip())] += _number(r[executed_col])
        total = sum(executed.values())
        out += ["", f"warp instructions executed: {total / 1e6:.2f} M; by opcode (M):"]
        for op, n in sorted(executed.items(), key=lambda x: -x[1])[:25]:
            out.append(f"  {n / 1e6:9.2f}  {op}")
        if hot > 0:
            loop = [(s, text) for (s, text), r in zip(samples, body, strict=True)
                    if hot <= _number(r[executed_col]) < 4 * hot]
            count: dict[str, int] = collections.Counter(opcode(t) for _, t in loop)
            stalls: dict[str, float] = collections.Counter()
            for s, text in loop:
                stalls[opcode(text)] += s
            loop_samples = sum(s for s, _ in loop)
            out += ["", f"hot loop (executed {hot:.0f} to {4 * hot:.0f} times): {len(loop)} "
                    f"instructions, {loop_samples:.0f} stall samples; by opcode "
                    "(instructions, samples):"]
            for op, s in sorted(stalls.items(), key=lambda x: -x[1]):
                out.append(f"  {count[op]:5d}  {s:9.0f}  {op}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--hot", type=float, default=0.0,
                    help="also list the instructions executed N to 4N times (the steady loop)")
    a = ap.parse_args()
    with open(a.csv, newline="", encoding="utf-8", errors="replace") as f:
        rows = list(csv.reader(f))
    print(summarize(rows, a.top, a.hot))


if __name__ == "__main__":
    sys.exit(main())

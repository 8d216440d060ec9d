"""What two kernels execute, instruction by instruction, from Nsight Compute's source pages.

    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv   (each kernel)
    python scripts/ncu_instruction_mix.py ours.csv[.gz] theirs.csv[.gz] [--top 25]

Reads the "Instructions Executed" column (warp instructions) of each CSV (the `ncu-source` step
of scripts/gpu_lane.sh writes one; `.gz` is read as is) and prints
(1) each kernel's total and its code regions — runs of consecutive SASS instructions executed
    the same number of times, i.e. once per warp and CTA, once per step, once per masked step —
    with their length and commonest opcodes, so a per-CTA cost reads apart from a per-step one
    (session 36: at d64 512 non-causal ours executes 666 instructions per consumer warp and
    step against FlashAttention 4's 647, but 478 per warp and CTA against 296);
(2) the executed count per opcode in both, sorted by the difference (first minus second).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
import sys


def opcode(text: str) -> str:
    """The opcode of a SASS line without its predicate or modifiers ('@!P0 BRA 0x10' -> BRA)."""
    m = re.search(r"([A-Z][A-Z0-9_]+)", re.sub(r"^\s*@!?U?P\w+\s+", "", text))
    return m.group(1) if m else "?"


def _number(text: str) -> int:
    try:
        return int(float((text or "").replace(",", "").strip()))
    except ValueError:
        return 0


def executed(rows: list[list[str]]) -> list[tuple[str, int]]:
    """(SASS text, warp instructions executed) per instruction, in address order."""
    start = next((i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r)), None)
    if start is None:
        raise ValueError("no 'Source' column: not an ncu source page")
    header = [c.strip() for c in rows[start]]
    if "Instructions Executed" not in header:
        raise ValueError("no 'Instructions Executed' column (ncu --section SourceCounters)")
    src, ex = header.index("Source"), header.index("Instructions Executed")
    return [(r[src].strip(), _number(r[ex])) for r in rows[start + 1:]
            if len(r) == len(header)]


def regions(ins: list[tuple[str, int]], min_len: int = 8) -> list[tuple[int, int, int, list]]:
    """(first index, length, count, commonest opcodes) of each run of at least `min_len`
    consecutive instructions executed `count` times each."""
    out, i = [], 0
    while i < len(ins):
        j = i
        while j < len(ins) and ins[j][1] == ins[i][1]:
            j += 1
        if j - i >= min_len:
            ops = collections.Counter(opcode(t) for t, _ in ins[i:j]).most_common(6)
            out.append((i, j - i, ins[i][1], ops))
        i = j
    return out


def report(a: list[tuple[str, int]], b: list[tuple[str, int]], names: tuple[str, str],
           top: int) -> str:
    out = []
    for name, ins in zip(names, (a, b), strict=True):
        total = sum(n for _, n in ins)
        out.append(f"{name}: {len(ins)} instructions, {total / 1e6:.2f} M executed; regions "
                   "(first, length, times each, commonest opcodes):")
        for first, length, count, ops in regions(ins):
            out.append(f"  [{first:5d} +{length:4d}] x{count:9d}  "
                       + " ".join(f"{op}:{k}" for op, k in ops))
    per_op = [collections.Counter(), collections.Counter()]
    for c, ins in zip(per_op, (a, b), strict=True):
        for text, n in ins:
            c[opcode(text)] += n
    out.append(f"executed per opcode (M), {names[0]} - {names[1]}:")
    for op in sorted(set(per_op[0]) | set(per_op[1]), key=lambda o: -(per_op[0][o] - per_op[1][o]))[:top]:
        x, y = per_op[0][op], per_op[1][op]
        out.append(f"  {op:12s} {x / 1e6:8.3f} {y / 1e6:8.3f}  {(x - y) / 1e6:+8.3f}")
    return "\n".join(out)


def _read(path: str) -> list[list[str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="", encoding="utf-8", errors="replace") as f:
        return list(csv.reader(f))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    print(report(executed(_read(a.first)), executed(_read(a.second)), (a.first, a.second),
                 a.top))


if __name__ == "__main__":
    sys.exit(main())

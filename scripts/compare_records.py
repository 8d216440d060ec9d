"""Side-by-side flashcuda TFLOP/s of several bench records (A/B runs), one row per sweep point.

    python scripts/compare_records.py LABEL=DIR_OR_JSON [LABEL=...] [--direction fwd|bwd]

A label given several records (a directory with several JSON files) shows the median over them;
the best peer of the first record is shown for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(path: Path) -> list[dict]:
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    return [json.loads(f.read_text()) for f in files]


def point_key(p: dict) -> tuple:
    return (p["headdim"], p["seqlen"], p["causal"])


def tflops(rec: dict, direction: str, impl: str = "flashcuda") -> dict[tuple, float]:
    out = {}
    for p in rec["points"]:
        r = p["results"].get(impl, {}).get(direction, {})
        if r.get("tflops"):
            out[point_key(p)] = r["tflops"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="LABEL=PATH")
    ap.add_argument("--direction", default="fwd", choices=("fwd", "bwd"))
    args = ap.parse_args()
    cols: dict[str, dict[tuple, float]] = {}
    peers: dict[tuple, tuple[str, float]] = {}
    for item in args.runs:
        label, _, path = item.partition("=")
        recs = load(Path(path))
        per_point: dict[tuple, list[float]] = {}
        for rec in recs:
            for k, v in tflops(rec, args.direction).items():
                per_point.setdefault(k, []).append(v)
            if not peers:
                for p in rec["points"]:
                    best = max(((n, r.get(args.direction, {}).get("tflops") or 0)
                                for n, r in p["results"].items() if n != "flashcuda"),
                               key=lambda x: x[1], default=("-", 0))
                    peers[point_key(p)] = best
        cols[label] = {k: statistics.median(v) for k, v in per_point.items()}
    labels = list(cols)
    print(f"{args.direction} TFLOP/s (median over each label's records)")
    print(f"{'hd':>4} {'seqlen':>7} {'causal':>6} " + " ".join(f"{x:>12}" for x in labels)
          + "   best peer")
    for k in sorted({k for c in cols.values() for k in c}):
        row = " ".join(f"{cols[x].get(k, float('nan')):12.0f}" for x in labels)
        name, val = peers.get(k, ("-", 0))
        print(f"{k[0]:>4} {k[1]:>7} {str(k[2]):>6} {row}   {val:.0f} {name}")


if __name__ == "__main__":
    main()

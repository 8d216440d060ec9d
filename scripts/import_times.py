"""The modules imported between two stderr markers of `python -X importtime` output, heaviest
(cumulative) first: what a first call pays for importing.

    python -X importtime scripts/first_call_profile.py 2> imports.log
    python scripts/import_times.py imports.log "== start first forward" "== start first backward"
"""

from __future__ import annotations

import sys


def main() -> None:
    path, start, end = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
    rows, inside = [], False
    for line in open(path, encoding="utf-8", errors="replace"):
        if line.startswith(start):
            inside = True
            continue
        if end and line.startswith(end):
            break
        if inside and line.startswith("import time:") and "|" in line:
            self_us, cum_us, name = line[len("import time:"):].rstrip("\n").split("|")
            if self_us.strip().isdigit():
                depth = (len(name) - len(name.lstrip()) - 1) // 2
                rows.append((int(cum_us), int(self_us), depth, name.strip()))
    top = sum(cum for cum, _, depth, _ in rows if depth == 0)
    print(f"{len(rows)} modules, {top / 1e3:.1f} ms at top level")
    for cum, own, depth, name in sorted(rows, reverse=True)[:40]:
        print(f"{cum / 1e3:8.1f} ms {own / 1e3:8.1f} ms self  {'  ' * depth}{name}")


if __name__ == "__main__":
    main()

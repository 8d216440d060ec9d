"""`flashcuda bench`: timings against the peers and the hardware ceilings, run records, plots.

The method is PERFORMANCE.md's; command.py says what a run does, docs/runs/README.md what a run
record holds. `main(argv) -> int` is what `flashcuda bench ...` calls (argv without "bench").
Importing this package needs neither a GPU nor any peer.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run `flashcuda bench` with `argv` (e.g. ["--quick"], ["ladder"]); returns the exit status."""
    from .command import main as _main

    return _main(argv)


bench_main = main

__all__ = ["bench_main", "main"]

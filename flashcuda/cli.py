"""Command line: `flashcuda info | demo | check | bench` (also `python -m flashcuda ...`)."""

from __future__ import annotations

import argparse
import sys


def _info(args: argparse.Namespace) -> int:
    from .info import collect, render

    for line in render(collect()):
        print(line)
    return 0


def _check(args: argparse.Namespace) -> int:
    """Compile every kernel variant for the given targets and report resources (no GPU needed)."""
    from .jit import all_variants, compile_spec

    failures = 0
    variants = all_variants()
    print(f"compiling {len(variants)} kernel variants for {', '.join(args.arch)}")
    for spec, archs in variants:
        for arch in args.arch:
            if arch not in archs:
                continue
            try:
                res = compile_spec(spec, arch)
            except Exception as exc:
                failures += 1
                print(f"FAIL {spec.name} {arch}: {exc}")
                continue
            r = res.resources().get(spec.entry_name)
            # PERF (ptxas serialised the wgmma) fails the check; SPILLS is said, not failed:
            # some sm80 variants spill a few bytes by design, within budgets the CPU lane holds
            status = ("NOREP" if r is None else "PERF" if res.performance_notes()
                      else "SPILLS" if r.spills else "ok")
            failures += status in ("NOREP", "PERF")
            regs = (f"{r.registers:3d} regs, {r.spill_stores} B spill stores, {r.stack_bytes} B "
                    "stack" if r else "no ptxas report")
            print(f"{status:6s} {spec.name:60s} {arch:7s} {regs}  {res.seconds:.1f}s")
    return 1 if failures else 0


def _bench(argv: list[str]) -> int:
    from .bench import main as bench_main

    return bench_main(argv)


def _demo(argv: list[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # bench and demo own their argument parsing.
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "demo":
        return _demo(argv[1:])
    parser = argparse.ArgumentParser(prog="flashcuda", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU, kernel cache").set_defaults(func=_info)
    p = sub.add_parser("check", help="compile every kernel variant with NVRTC (no GPU needed)")
    p.add_argument("--arch", nargs="+", default=["sm_80", "sm_90a"])
    p.set_defaults(func=_check)
    sub.add_parser("demo", help="the main job: check and time attention against PyTorch")
    sub.add_parser("bench", help="benchmarks against the ceilings and the peers")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

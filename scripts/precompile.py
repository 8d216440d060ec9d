"""Compile every registered kernel variant for one arch into a cache directory, in parallel.

    FLASHCUDA_CACHE_DIR=.kcache python scripts/precompile.py [--arch sm_90a] [--only SUBSTRING]

Used before a device call: the GPU machine then finds every cubin in the carried cache (the
NVRTC version is part of the key, so this only helps when both sides have the same NVRTC).
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor

from flashcuda.jit.registry import all_variants
from flashcuda.jit.runtime import build_cubin


def _build(args: tuple[str, str]) -> tuple[str, bool, float]:
    name, arch = args
    spec = next(s for s, _ in all_variants() if s.name == name)
    _, hit, seconds = build_cubin(spec, arch)
    return name, hit, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--only", default="", help="names containing this substring")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    todo = [(spec.name, args.arch) for spec, archs in all_variants()
            if args.only in spec.name and (args.arch in archs or
                                           args.arch.rstrip("a") in archs)]
    start = time.perf_counter()
    built = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        for name, hit, seconds in pool.map(_build, todo):
            built += not hit
            if not hit:
                print(f"compiled {name} for {args.arch} in {seconds:.1f}s", flush=True)
    print(f"{len(todo)} variants, {built} compiled, {len(todo) - built} cached, "
          f"{time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()

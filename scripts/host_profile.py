"""Host time of flashcuda's calls on the device, by function (cProfile): where the Python time of
a call goes (validation, dispatch, tensor maps, the launch). A diagnostic for the device.

    PYTHONPATH=. python3 scripts/host_profile.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import flashcuda


def profile(label: str, fn, calls: int) -> None:
    with torch.no_grad():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
    print(f"=== {label}: {host * 1e6:.1f} us of host time per call (no profiler)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    n = ap.parse_args().calls
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    k, v = (torch.randn(1, 1024, 8, 128, dtype=q.dtype, device="cuda", generator=g)
            for _ in range(2))
    profile("decode flash_attn_func b1 1k", lambda: flashcuda.flash_attn_func(q, k, v), n)
    profile("decode flash_attn_with_kvcache b1 1k",
            lambda: flashcuda.flash_attn_with_kvcache(q, k, v), n)
    qq, kk, vv = (torch.randn(2, 512, 16, 128, dtype=torch.bfloat16, device="cuda", generator=g)
                  for _ in range(3))
    profile("fwd 2x512x16x128", lambda: flashcuda.flash_attn_func(qq, kk, vv), n)


if __name__ == "__main__":
    main()

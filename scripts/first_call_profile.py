"""Where the first forward and the first backward of a new process spend their time (cProfile,
top entries by cumulative time). Run with a warm kernel cache to see everything but NVRTC.

    FLASHCUDA_CACHE_DIR=... python scripts/first_call_profile.py

Under `python -X importtime` the script marks on stderr where each call starts ("== start
<label>"), so the modules a call imports can be told from those imported before it.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

import flashcuda


def main() -> None:
    torch.zeros(1, device="cuda")
    q, k, v = (torch.randn(1, 1024, 16, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    for label, fn in [("first forward", lambda: flashcuda.flash_attn_func(q, k, v, causal=True)),
                      ("first backward", None)]:
        print(f"== start {label}", file=sys.stderr, flush=True)
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        if fn is not None:
            out = fn()
        else:
            out.backward(dout)
        torch.cuda.synchronize()
        prof.disable()
        print(f"== {label}: {time.perf_counter() - t:.3f} s")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()

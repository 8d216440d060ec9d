"""Host-side cost of one flashcuda call (validation, custom op, dispatch, launch), on a GPU.

    python scripts/host_overhead.py        # prints per-call microseconds and a cProfile top list

A tiny problem, so the GPU work is negligible: the wall time per call is the host overhead that
limits short-sequence throughput (PERFORMANCE.md: cuDNN wins there on launch efficiency).
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

import flashcuda


def main() -> None:
    q = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        flashcuda.flash_attn_func(q, q, q, causal=True)
    torch.cuda.synchronize()
    # 300 distinct tensors in turn: more than the tensor-map cache holds (256), so every sm90 call
    # encodes its maps, as in training where each step brings new activations.
    pool = [torch.randn_like(q) for _ in range(300)]
    turn = iter(range(10**9))

    def fresh():
        x = pool[next(turn) % len(pool)]
        return flashcuda.flash_attn_func(x, x, x, causal=True)

    for label, fn in [
        ("flash_attn_func", lambda: flashcuda.flash_attn_func(q, q, q, causal=True)),
        ("  new tensors", fresh),
        ("sdpa (torch)", lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), is_causal=True)),
    ]:
        n = 500
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        print(f"{label:20s} {(time.perf_counter() - t) / n * 1e6:8.1f} us per call (host-bound)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        flashcuda.flash_attn_func(q, q, q, causal=True)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

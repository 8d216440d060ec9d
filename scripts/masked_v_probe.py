"""Where the sm90 masked-V variant's cost comes from: same-process, interleaved forward timings.

    python scripts/masked_v_probe.py [--shapes 1,16384,16,64 4,4096,16,128 ...] [--rounds 7]
        [--arms causal,causal-mv] [--extra 'u4:FLASHCUDA_SM90_FWD_MASKED_V=1;VAR=VALUE' ...]

For each shape (B,S,H,D, bf16) it times the forward of these arms, switched through the
environment within one process (every switch is part of fwd_sm90's plan key):
    full              no mask (the plain kernel)
    causal            the default kernel, causal
    causal-mv         FLASHCUDA_SM90_FWD_MASKED_V=1 (scans masked tiles, clean copy when poisoned)
    window            window_size=(-1, seqlen_k): every key visible, so no tile needs a mask
                      (the windowed kernel runs its unmasked loop over every key tile)
    window-mv         the same call through the masked-V variant: its scans never run
If causal-mv costs what window-mv costs over window, the price is structural (code / schedule),
not the scans. (Session 9's causal-pad arm, the default kernel with the masked-V footprint,
read 0.99-1.00x: the footprint is not the price; its FLASHCUDA_SM90_SMEM_PAD went in session 39.)
`--arms` keeps only the named arms; each `--extra NAME:VAR=VALUE[;VAR=VALUE]` adds a causal arm
run with those environment variables (e.g. a kernel knob through FLASHCUDA_SM90_FWD_DEFINES).
Timing: CUDA events around `--calls` back-to-back calls (GPU-bound at these sizes), arms
interleaved per round, median over rounds; ratios are against the first arm of each pair.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import flashcuda
from flashcuda.bench.timing import events_ms
from flashcuda.ops import fwd_sm90


def _shape(text: str) -> tuple[int, int, int, int]:
    b, s, h, d = (int(x) for x in text.split(","))
    return b, s, h, d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", type=_shape,
                    default=[(1, 16384, 16, 64), (4, 4096, 16, 64), (1, 16384, 16, 128),
                             (4, 4096, 16, 128), (1, 2048, 32, 128)])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--arms", default="", help="comma list of the arms to keep (default: all)")
    ap.add_argument("--extra", action="append", default=[],
                    help="NAME:VAR=VALUE[;VAR=VALUE]: one more causal arm with that environment "
                         "(a NAME starting with 'full' runs without a mask)")
    a = ap.parse_args()
    extra = {}
    for item in a.extra:
        name, _, spec = item.partition(":")
        extra[name] = (dict(kv.split("=", 1) for kv in spec.split(";") if kv),
                       dict() if name.startswith("full") else dict(causal=True))
    print(f"{torch.cuda.get_device_name()}  forward ms per call (median of {a.rounds} rounds of "
          f"{a.calls} calls), ratio to the arm it is paired with")
    for b, s, h, d in a.shapes:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        arms = {
            "full": ({}, dict()),
            "causal": ({}, dict(causal=True)),
            "causal-mv": ({fwd_sm90.MASKED_V_ENV: "1"}, dict(causal=True)),
            "window": ({}, dict(window_size=(-1, s))),
            "window-mv": ({fwd_sm90.MASKED_V_ENV: "1"}, dict(window_size=(-1, s))),
        }
        arms.update(extra)
        if a.arms:
            keep = set(a.arms.split(",")) | set(extra)
            arms = {name: arm for name, arm in arms.items() if name in keep}
        times: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(a.rounds + 1):  # round 0 compiles and warms up
            for name, (env, kw) in arms.items():
                os.environ.update(env)
                try:
                    t = events_ms(
                        lambda kw=kw, qkv=(q, k, v): flashcuda.flash_attn_func(*qkv, **kw),
                        a.calls)
                finally:
                    for key in env:
                        os.environ.pop(key, None)
                if r:
                    times[name].append(t)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        flops = 4 * b * h * s * s * d
        print(f"-- {b}x{s}x{h} d{d}")
        for name, m in med.items():
            base = ("window" if name.startswith("window") else
                    "full" if name.startswith("full") else "causal")
            if base not in med:
                base = next(iter(med))
            f = flops / (2 if base == "causal" else 1)
            spread = max(times[name]) / min(times[name]) - 1
            print(f"  {name:11s} {m:8.4f} ms  {f / m / 1e9:6.1f} TFLOP/s  x{m / med[base]:.3f}"
                  f"  (spread {100 * spread:.1f}%)")


if __name__ == "__main__":
    main()

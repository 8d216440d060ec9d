"""One attention call shape, run a few times, for a profiler to capture (ncu, scripts/gpu_lane.sh
step `ncu`).

    python scripts/profile_call.py --shape 4 4096 16 128 [--causal] [--window L R] [--bwd]
                                   [--repeats 3] [--impl flashcuda|fa4]

Runs flash_attn_func (and with --bwd its backward) `repeats` times on fresh bf16 inputs, then
synchronises. --impl fa4: FlashAttention 4's flash_attn_func instead (found as the bench finds
it, FLASHCUDA_BENCH_SITE; no window), for profiling the peer's kernels at the same shape. The
first repeat compiles / loads the kernels; a profiler should skip it
(`ncu --launch-skip`): ncu's kernel filter (-k regex:flash_fwd_sm90 / flash_bwd_sm90) and
--launch-skip 1 --launch-count 1 pick the second call's kernel.
"""

from __future__ import annotations

import argparse

import torch

import flashcuda


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=[4, 4096, 16, 128],
                    metavar=("B", "S", "H", "D"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                    help="window_size (FlashAttention's; -1 unbounded)")
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--fwd-only", action="store_true", help="no backward, even with --bwd")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impl", choices=("flashcuda", "fa4"), default="flashcuda")
    a = ap.parse_args()
    attend = lambda q, k, v: flashcuda.flash_attn_func(  # noqa: E731
        q, k, v, causal=a.causal, window_size=tuple(a.window))
    if a.impl == "fa4":
        from flashcuda.bench import peers

        if tuple(a.window) != (-1, -1):
            raise SystemExit("--impl fa4 takes no --window")
        impl = peers.load_fa4()
        if impl.status != "ok":
            raise SystemExit(f"fa4 is {impl.status}: {impl.detail}")
        attend = lambda q, k, v: impl.forward(q, k, v, a.causal, q.shape[-1] ** -0.5)  # noqa: E731
    b, s, h, d = a.shape
    a.bwd = a.bwd and not a.fwd_only
    for _ in range(a.repeats):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=a.bwd) for _ in range(3))
        out = attend(q, k, v)
        if a.bwd:
            out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"profiled {a.impl} shape {tuple(a.shape)} causal={a.causal} window={tuple(a.window)} "
          f"bwd={a.bwd}: "
          f"{a.repeats} calls done")


if __name__ == "__main__":
    main()

"""What recording a call for autograd costs on the host, piece by piece, on a GPU.

    python scripts/autograd_cost.py [--shape B S H D] [--causal]

host_overhead.py found the training forward ~45 us slower than the same call without grad on the
H200's host (torch's Function machinery), where a CPU-only process pays ~5 us for a Function
around the same body. This times, with the GPU kept busy by a spin kernel (so nothing waits for
it): empty bodies through torch.autograd.Function with and without saving tensors, the same on
CPU tensors, flashcuda's forward without grad, its _EagerAttention.apply, and flash_attn_func with
grad — median host microseconds per call, each with the previous call's result dropped first (the
graph's teardown is part of a training loop's cost).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashcuda
from flashcuda.ops import attention


class _Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, wl, wr, det):
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)

    @staticmethod
    def backward(ctx, dout, dlse):
        return None, None, None, None, None, None, None


class _Saving(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, wl, wr, det):
        out, lse = q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)
        attention._setup_context(ctx, (q, k, v, scale, wl, wr, det), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return None, None, None, None, None, None, None


def per_call_us(fn, calls: int = 300) -> float:
    torch.cuda.synchronize()
    rate = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 2_000_000
    torch.cuda._sleep(int(300.0 * rate))
    samples, keep = [], None
    for _ in range(calls):
        keep = None  # the previous call's graph goes first, outside the timed region
        t = time.perf_counter()
        keep = fn()
        samples.append((time.perf_counter() - t) * 1e6)
    del keep
    torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[16, 1024, 16, 128])
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    shape = tuple(args.shape)
    wr = 0 if args.causal else None
    scale = shape[-1] ** -0.5
    cuda = [torch.randn(shape, dtype=torch.bfloat16, device="cuda").requires_grad_()
            for _ in range(3)]
    plain = [t.detach() for t in cuda]
    cpu = [torch.randn(2, 8, 2, 16).requires_grad_() for _ in range(3)]
    rows = [
        ("Function, empty body, cpu tensors", lambda: _Bare.apply(*cpu, scale, None, wr, False)),
        ("Function, empty body, cuda", lambda: _Bare.apply(*cuda, scale, None, wr, False)),
        ("Function, body saves (as ours), cuda",
         lambda: _Saving.apply(*cuda, scale, None, wr, False)),
        ("the body alone, cuda", lambda: (plain[0].new_empty(shape),
                                          plain[0].new_empty(shape[:3], dtype=torch.float32))),
        ("flashcuda _fwd_impl (no grad)",
         lambda: attention._fwd_impl(*plain, scale, None, wr)),
        ("flashcuda _EagerAttention.apply",
         lambda: attention._EagerAttention.apply(*cuda, scale, None, wr, False)),
        ("flash_attn_func, no grad", lambda: flashcuda.flash_attn_func(*plain, causal=args.causal)),
        ("flash_attn_func, with grad", lambda: flashcuda.flash_attn_func(*cuda, causal=args.causal)),
    ]
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; shape {shape} bf16 "
          f"causal={args.causal}; host us per call (median), GPU kept busy")
    for _ in range(2):  # the second round is the one to read (the first warms every path)
        for name, fn in rows:
            print(f"  {name:<40} {per_call_us(fn):7.1f}")
        print()


if __name__ == "__main__":
    main()

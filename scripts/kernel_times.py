"""GPU time of each kernel a forward + backward launches, flashcuda against SDPA's backends.

    python scripts/kernel_times.py [--shapes "32 512 16 128" 1,2048,32,128 ...] [--causal both|yes|no]
        [--impls flashcuda sdpa_flash sdpa_cudnn fa4]

The bench measures a call between events, so host time can hide inside it; this lists what the
GPU itself spends, per kernel (torch.profiler's CUDA activity, mean of `--repeats` calls after a
warm-up), and the sum per direction. Shapes are B S H D, bf16, BSHD for flashcuda and
FlashAttention 4 (`fa4`: flash_attn.cute, found as the bench finds it, FLASHCUDA_BENCH_SITE; listed
by default when it imports): where each backward's preprocess / main / postprocess time goes.
"""

from __future__ import annotations

import argparse
import collections
import re

import torch
from torch.profiler import ProfilerActivity, profile

import flashcuda
from flashcuda.bench import peers

BACKENDS = {"sdpa_flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
            "sdpa_cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION}


def _calls(name: str, shape, causal: bool):
    b, s, h, d = shape
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = (mk().requires_grad_() for _ in range(3))
    dout = mk()
    if name == "flashcuda":
        def fwd():
            return flashcuda.flash_attn_func(q, k, v, causal=causal)
        grad, leaves = dout, (q, k, v)
    elif name == "fa4":
        impl = peers.load_fa4()
        if impl.status != "ok":
            raise RuntimeError(f"fa4 is {impl.status}: {impl.detail}")
        scale = d ** -0.5

        def fwd():
            return impl.forward(q, k, v, causal, scale)
        grad, leaves = dout, (q, k, v)
    else:
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))

        def fwd():
            with torch.nn.attention.sdpa_kernel(BACKENDS[name]):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                        is_causal=causal)
        grad, leaves = dout.transpose(1, 2), (qt, kt, vt)
    return fwd, grad, leaves


def kernel_table(name: str, shape, causal: bool, repeats: int) -> dict[str, list[float]]:
    """{direction: [(kernel, mean us)]} for one implementation at one shape. The backward is
    torch.autograd.grad: repeated .backward() calls add each call's gradients into the leaves'
    .grad, an elementwise add kernel (~140 us at 32 x 512 x 16 x 128) that is no part of the
    attention backward (it showed in every implementation's list, session 15; the bench clears
    .grad before each timed call instead)."""
    fwd, grad, leaves = _calls(name, shape, causal)
    for _ in range(3):  # compile / load, and autotuning where a backend has it
        torch.autograd.grad(fwd(), leaves, grad)
    torch.cuda.synchronize()
    result = {}
    for direction in ("fwd", "bwd"):
        outs = [fwd() for _ in range(repeats)] if direction == "bwd" else None
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(repeats):
                if direction == "fwd":
                    fwd()
                else:
                    torch.autograd.grad(outs[i], leaves, grad)
            torch.cuda.synchronize()
        total = collections.defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                total[ev.name] += ev.time_range.elapsed_us()
        result[direction] = sorted(((k, t / repeats) for k, t in total.items()),
                                   key=lambda kv: -kv[1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["32 512 16 128", "32 512 32 64", "4 4096 16 128"])
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="yes")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--impls", nargs="+", default=None,
                    help="default: flashcuda sdpa_flash sdpa_cudnn, and fa4 when it imports")
    a = ap.parse_args()
    if a.impls is None:
        a.impls = ["flashcuda", "sdpa_flash", "sdpa_cudnn"]
        if peers.load_fa4().status == "ok":
            a.impls.append("fa4")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    for spec in a.shapes:
        shape = tuple(int(x) for x in re.split(r"[\s,x]+", spec.strip()))
        for causal in causals:
            print(f"\n== shape (B, S, H, D) = {shape} bf16 causal={causal}: GPU us per call")
            for name in a.impls:
                try:
                    table = kernel_table(name, shape, causal, a.repeats)
                except Exception as exc:  # noqa: BLE001 - a backend may refuse a shape
                    print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                for direction, rows in table.items():
                    print(f"  {name:10s} {direction}  total {sum(t for _, t in rows):8.1f}")
                    for kname, t in rows:
                        print(f"      {t:8.1f}  {kname[:100]}")


if __name__ == "__main__":
    main()

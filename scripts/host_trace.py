"""Host time of every call of a fresh process, by call index and by stage, on a GPU.

    python scripts/host_trace.py [--shape B S H D] [--causal] [--calls N] [--window W]

host_overhead.py measures each piece in a loop of its own; this follows the forward's own
sequence of stages call after call (flash_attn_func's checks, the allocation, the plan lookups,
the tensor maps, the argument packing, the driver call) from the first call of the process, so a
cost that only the full sequence pays (or that fades after the first second) shows. The stream
is synchronised every 10 calls, outside the timed regions, so the launch queue stays short (a
deep queue can make a launch wait for room). Prints the median microseconds of each
stage per window of `--window` calls, then the whole call next to SDPA's flash and cuDNN
backends timed the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashcuda
from flashcuda import api, validate
from flashcuda.ops import attention, dispatch, fwd_sm90
from flashcuda.ops.call import FwdCall


def staged_call(q, k, v, causal: bool, marks: list[float]) -> None:
    """flash_attn_func's forward path, stage by stage, appending perf_counter marks."""
    now = time.perf_counter
    marks.append(now())
    validate.check_fa_unsupported(dropout_p=0.0, softcap=0.0, alibi_slopes=None)
    q, k, v = api._checked_qkv(q, k, v)
    window_left, window_right = validate.fa_window((-1, -1), causal)
    scale = validate.softmax_scale(None, q.shape[-1])
    marks.append(now())
    out, lse = attention._empty_fwd(q)
    marks.append(now())
    call = FwdCall(q, k, v, out, lse, scale, window_left, window_right)
    key = dispatch._plan_key(call, "fwd")
    module = dispatch._plans[key]
    marks.append(now())
    plan = fwd_sm90._plan(call)
    cfg = plan.cfg
    marks.append(now())
    maps = [m.raw for m in fwd_sm90._maps(call, cfg)]
    marks.append(now())
    fwd_sm90.launch_plan(plan, call, maps)  # (both passes of a causal call)
    marks.append(now())
    assert module is fwd_sm90


STAGES = ("checks", "alloc", "dispatch key", "family plan", "tensor maps", "launch")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 2048, 32, 128],
                    metavar=("B", "S", "H", "D"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--window", type=int, default=500)
    a = ap.parse_args()
    b, s, h, d = a.shape
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = mk(), mk(), mk()
    t0 = time.perf_counter()
    flashcuda.flash_attn_func(q, k, v, causal=a.causal)  # compile / load, plan
    torch.cuda.synchronize()
    print(f"first call {1e3 * (time.perf_counter() - t0):.1f} ms; shape {tuple(a.shape)} bf16 "
          f"causal={a.causal}; host us per call, GPU kept busy, median per window of "
          f"{a.window} calls")

    # the stages follow fwd_sm90's path; another family (FLASHCUDA_ENABLE_SM90=0, another GPU)
    # gets the whole call timed only
    stages = any(m is fwd_sm90 for m in dispatch._plans.values())
    print(f"family: {'fwd_sm90' if stages else 'not fwd_sm90: whole calls only'}")
    whole, staged = [], []
    for i in range(a.calls):
        if i % 10 == 0:
            torch.cuda.synchronize()
        if i % 2 or not stages:
            t = time.perf_counter()
            flashcuda.flash_attn_func(q, k, v, causal=a.causal)
            whole.append((time.perf_counter() - t) * 1e6)
        else:
            marks: list[float] = []
            staged_call(q, k, v, a.causal, marks)
            staged.append([(y - x) * 1e6 for x, y in zip(marks, marks[1:], strict=False)])
    torch.cuda.synchronize()

    if not stages:
        print(f"{'calls':>12s} {'whole':>8s}")
        for w in range(0, len(whole), a.window):
            ws = whole[w:w + a.window]
            print(f"{w:5d}-{w + len(ws) - 1:<6d} {statistics.median(ws):8.1f}")
    half = a.window // 2
    if stages:
        print(f"{'calls':>12s} {'whole':>8s} {'staged':>8s} "
              + " ".join(f"{n:>12s}" for n in STAGES))
    for w in range(0, len(staged), half):
        ws, ss = whole[w:w + half], staged[w:w + half]
        cols = [statistics.median(c) for c in zip(*ss, strict=True)]
        print(f"{2 * w:5d}-{2 * (w + len(ws)) - 1:<6d} {statistics.median(ws):8.1f} "
              f"{statistics.median(sum(r) for r in ss):8.1f} "
              + " ".join(f"{c:12.1f}" for c in cols))

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    for name, backend in (("sdpa flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION),
                          ("sdpa cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION)):
        with torch.nn.attention.sdpa_kernel(backend):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
            torch.cuda.synchronize()
            samples = []
            for i in range(1000):
                if i % 10 == 0:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
                samples.append((time.perf_counter() - t) * 1e6)
            torch.cuda.synchronize()
        print(f"{name}: median {statistics.median(samples):.1f} us, first 100 "
              f"{statistics.median(samples[:100]):.1f}, last 500 {statistics.median(samples[500:]):.1f}")


if __name__ == "__main__":
    main()

"""Diagnose the sm90 backward's GEMM layouts on a GPU, one case per process (a hang costs only its
own timeout): prints, per case, the error map of a gradient by 8-row x 8-column block ('.' ok,
'X' wrong, 'n' NaN / unwritten), and a few structural hints (transposed, wrong scale, only one
consumer's keys). Used while bringing up flash_bwd_sm90.cu.

    FLASHCUDA_ENABLE_SM90_BWD=1 timeout 60 python scripts/sm90_bwd_probe.py CASE [head_dim]

CASE:
    dv     Q = 0 (uniform P): dV = column mean of dO     -> S^T / P^T fragments, dO MN-major
    dk     random, one query block: dK vs the oracle     -> dP^T (V, dO K-major), dS^T, Q MN-major
    dq     K = identity rows: dQ = scale * dS            -> dS store layout, dQ descriptors
    tile   random, one query block: dq, dk, dv
    steps  random, 7 query blocks, causal: dq, dk, dv    -> ring stages, phases, dS double buffer
(dS stored [key][query], read with transposed A: the 64 / 128-query kernels' layout; the
[query][key] one of the 80-query dQ^T kernel runs with FLASHCUDA_SM90_BWD_SWAP=1 at d128.)
The watchdog variant runs unless FLASHCUDA_SM90_BWD_WATCHDOG=0: a barrier wait that gives up
after 2 s leaves NaN in dK / dV (printed as 'n' blocks) instead of hanging.
"""

from __future__ import annotations

import os
import sys

import torch

os.environ.setdefault("FLASHCUDA_ENABLE_SM90_BWD", "1")
os.environ.setdefault("FLASHCUDA_SM90_BWD_WATCHDOG", "1")  # a stuck barrier: NaN dK/dV, no hang
from flashcuda.ops import bwd_sm90  # noqa: E402
from flashcuda.ops.call import BwdCall  # noqa: E402
from flashcuda.reference import attention_ref  # noqa: E402


def run(q, k, v, dout, window=(None, None)):
    """(dq, dk, dv) of bwd_sm90 and of the float64 oracle, head 0 of batch 0, float64."""
    scale = q.shape[-1] ** -0.5
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_ref(q64, k64, v64, scale, window=window)
    out64.backward(dout.double())
    grads = [torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device) for t in (q, k, v)]
    call = BwdCall(q, k, v, out64.detach().to(q.dtype), dout, lse64.detach().float(), *grads,
                   scale, window[0], window[1], False)
    why = bwd_sm90.can_implement(call)
    assert why is None, why
    bwd_sm90.run(call)
    torch.cuda.synchronize()
    ours = [g[0, :, 0].double() for g in grads]
    refs = [g[0, :, 0] for g in (q64.grad, k64.grad, v64.grad)]
    return ours, refs


def block_map(err: torch.Tensor, tol: float) -> str:
    r, c = err.shape
    rows = []
    for i in range(0, r, 8):
        cells = []
        for j in range(0, c, 8):
            e = err[i:i + 8, j:j + 8].max().item()
            cells.append("." if e < tol else ("n" if e != e else "X"))
        rows.append(f"{i:5d} " + "".join(cells))
    return "\n".join(rows)


def report(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item() or 1.0
    tol = 2e-2 * scale
    err = (got - want).abs()
    print(f"{name}: max err {err.nan_to_num(1e9).max().item():.3e} (|ref| max {scale:.3e}), "
          f"NaN {got.isnan().sum().item()} of {got.numel()}")
    print(block_map(err.nan_to_num(1e9), tol))
    if want.shape[0] == want.shape[1]:
        print(f"  vs transposed: {(got - want.T).abs().max().item():.3e}")
    ratio = (got * want).sum() / (want * want).sum()
    print(f"  least-squares factor got / ref: {ratio.item():.4f}")
    if got.shape[0] >= 128:
        for half in range(2):  # the two consumer warpgroups' keys (dk / dv) or query tiles
            sl = slice(64 * half, 64 * half + 64)
            print(f"  rows {64 * half}..{64 * half + 63}: max err "
                  f"{err[sl].nan_to_num(1e9).max().item():.3e}")


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "tile"
    d = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    bm = bwd_sm90.BLOCK_M[d]
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dt, generator=g)

    cfg = bwd_sm90.select_config(dt, d)
    layout = "[query][key]" if cfg.ds_k_major else "[key][query]"
    print(f"{cfg.name}: case {case}, block_m {bm}, dS {layout}, watchdog {cfg.watchdog}")
    if case == "dv":
        q = torch.zeros(1, bm, 1, d, device="cuda", dtype=dt)
        k, v, dout = rnd(1, 128, 1, d), rnd(1, 128, 1, d), rnd(1, bm, 1, d)
        (_, _, dv), _ = run(q, k, v, dout)
        mean = dout[0, :, 0].double().sum(0).expand(128, d) / 128
        report(f"dv d{d} (= column mean of dO)", dv, mean)
    elif case == "dq":
        q, v, dout = rnd(1, bm, 1, d), rnd(1, d, 1, d), rnd(1, bm, 1, d)
        k = torch.eye(d, device="cuda", dtype=dt)[None, :, None, :].contiguous()
        (dq, _, _), (rq, _, _) = run(q, k, v, dout)
        report(f"dq d{d} (K = I: dQ = scale * dS)", dq, rq)
    elif case in ("dk", "tile", "steps"):
        sq = bm if case != "steps" else 7 * bm
        q, k, v, dout = rnd(1, sq, 1, d), rnd(1, 128, 1, d), rnd(1, 128, 1, d), rnd(1, sq, 1, d)
        window = (None, 0) if case == "steps" else (None, None)
        ours, refs = run(q, k, v, dout, window)
        names = ("dk",) if case == "dk" else ("dq", "dk", "dv")
        for name in names:
            i = ("dq", "dk", "dv").index(name)
            report(f"{name} d{d}", ours[i], refs[i])
    else:
        raise SystemExit(f"unknown case {case!r}: dv, dk, dq, tile or steps")


if __name__ == "__main__":
    main()

"""Diagnose the sm90 forward's GEMM layouts on a GPU, one case per process (a hang costs only its
own timeout): prints, per case, the error map by 8-row x 8-column block, and whether the output
matches a transposed or chunk-permuted expectation. Used while bringing up a wgmma kernel.

    FLASHCUDA_ENABLE_SM90=1 python scripts/sm90_probe.py [scores|pv|tile] [head_dim]
"""

from __future__ import annotations

import os
import sys

import torch

os.environ.setdefault("FLASHCUDA_ENABLE_SM90", "1")
from flashcuda.ops import fwd_sm90  # noqa: E402
from flashcuda.ops.call import FwdCall  # noqa: E402


def run(q, k, v, window=(None, None)):
    B, Sq, H, D = q.shape
    out = torch.full((B, Sq, H, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, Sq), float("nan"), dtype=torch.float32, device=q.device)
    call = FwdCall(q, k, v, out, lse, D ** -0.5, window[0], window[1])
    why = fwd_sm90.can_implement(call)
    assert why is None, why
    fwd_sm90.run(call)
    torch.cuda.synchronize()
    return out[0, :, 0].double(), lse[0, 0].double()


def block_map(err: torch.Tensor) -> str:
    r, c = err.shape
    rows = []
    for i in range(0, r, 8):
        cells = []
        for j in range(0, c, 8):
            e = err[i:i + 8, j:j + 8].max().item()
            cells.append("." if e < 1e-2 else ("n" if e != e else "X"))
        rows.append("".join(cells))
    return "\n".join(rows)


def report(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs()
    print(f"{name}: max err {err.max().item():.3e}, NaN {got.isnan().sum().item()}")
    print(block_map(err.nan_to_num(1e9)))
    if want.shape[0] == want.shape[1]:
        print(f"  vs transposed: {(got - want.T).abs().max().item():.3e}")


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "scores"
    d = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    g = torch.Generator(device="cuda").manual_seed(1)
    dt = torch.bfloat16
    if case == "scores":
        q = torch.randn(1, 128, 1, d, device="cuda", dtype=dt, generator=g)
        k = torch.randn(1, d, 1, d, device="cuda", dtype=dt, generator=g)
        v = torch.eye(d, device="cuda", dtype=dt)[None, :, None, :].contiguous()
        out, lse = run(q, k, v)
        s = (q[0, :, 0].double() @ k[0, :, 0].double().T) * d ** -0.5
        report(f"scores d{d} (out = P)", out, torch.softmax(s, -1))
        print(f"  lse err {(lse - torch.logsumexp(s, -1)).abs().max().item():.3e}")
    elif case == "pv":
        k = torch.randn(1, 128, 1, d, device="cuda", dtype=dt, generator=g)
        v = torch.randn(1, 128, 1, d, device="cuda", dtype=dt, generator=g)
        q = torch.zeros(1, 128, 1, d, device="cuda", dtype=dt)
        out, _ = run(q, k, v)
        mean = v[0, :, 0].double().mean(0).expand(128, d)
        report(f"pv d{d} (out = mean V)", out, mean)
        # V = one-hot rows: key j carries value j in column j % d -> which keys landed where
        v2 = torch.zeros(1, 128, 1, d, device="cuda", dtype=dt)
        for j in range(128):
            v2[0, j, 0, j % d] = 1.0
        out2, _ = run(q, k, v2)
        print("  one-hot V: out row 0 * 128 (keys per column):",
              [round(x) for x in (out2[0] * 128).tolist()[:16]])
    else:
        q = torch.randn(1, 128, 1, d, device="cuda", dtype=dt, generator=g)
        k = torch.randn(1, 128, 1, d, device="cuda", dtype=dt, generator=g)
        v = torch.randn(1, 128, 1, d, device="cuda", dtype=dt, generator=g)
        out, _ = run(q, k, v)
        s = (q[0, :, 0].double() @ k[0, :, 0].double().T) * d ** -0.5
        report(f"tile d{d}", out, torch.softmax(s, -1) @ v[0, :, 0].double())


if __name__ == "__main__":
    main()

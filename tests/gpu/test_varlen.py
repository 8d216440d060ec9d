"""flash_attn_varlen_func on the GPU: each packed sequence against the float64 oracle run on
that sequence alone (DESIGN.md §7's rules: out / lse within 2x, gradients within 3x of torch's
same-dtype error), with whatever families dispatch picks (sm90 on an H200 for fp16 / bf16)."""

from __future__ import annotations

import pytest
import torch

from flashcuda import flash_attn_varlen_func
from tests.gpu import boundary

pytestmark = pytest.mark.gpu

# (lengths_q, lengths_k, nheads, nheads_kv, headdim, causal, window_size)
CASES = [
    ((129, 1, 300), (129, 77, 300), 4, 2, 64, True, (-1, -1)),
    ((0, 65, 17), (33, 0, 200), 2, 1, 128, False, (-1, -1)),
    ((256, 100), (256, 513), 4, 4, 128, False, (64, 0)),
]


def _packed(lengths, h, d, dtype, g):
    return torch.randn(sum(lengths), h, d, device="cuda", generator=g).to(dtype)


def _cu(lengths):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets, torch.tensor(offsets, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_varlen_matches_the_oracle_per_sequence(case, dtype):
    lq, lk, h, hkv, d, causal, window = case
    g = torch.Generator(device="cuda").manual_seed(5)
    q = _packed(lq, h, d, dtype, g).requires_grad_()
    k = _packed(lk, hkv, d, dtype, g).requires_grad_()
    v = _packed(lk, hkv, d, dtype, g).requires_grad_()
    (cq, cu_q), (ck, cu_k) = _cu(lq), _cu(lk)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                      window_size=window, return_lse=True)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for i in range(len(lq)):
        sq, sk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        qi, ki, vi = q.detach()[sq][None], k.detach()[sk][None], v.detach()[sk][None]
        boundary.check_forward(out.detach()[sq][None], lse[:, sq][None], qi, ki, vi, causal,
                               window)
        ref, base = boundary.oracle_grads(qi, ki, vi, dout[sq][None], causal, window)
        # dk / dv of sequence i come from sequence i's queries only
        boundary.check_grads((dq[sq][None], dk[sk][None], dv[sk][None]), ref, base, dtype)


@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_paged_varlen_matches_the_oracle_per_sequence(case):
    """block_table: the keys / values in shuffled 16-position pages (NaN where no sequence owns
    a position), bf16; each sequence against the oracle on its own keys, no autograd."""
    lq, lk, h, hkv, d, causal, window = case
    dtype, page = torch.bfloat16, 16
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = _packed(lq, h, d, dtype, g), _packed(lk, hkv, d, dtype, g), _packed(lk, hkv, d, dtype, g)
    (cq, cu_q), (ck, cu_k) = _cu(lq), _cu(lk)
    blocks = max(-(-n // page) for n in lk)
    order = torch.randperm(len(lk) * blocks + 2, device="cuda", generator=g)
    table = order[:len(lk) * blocks].view(len(lk), blocks).to(torch.int32)
    pools = [torch.full((len(lk) * blocks + 2, page, hkv, d), float("nan"), device="cuda",
                        dtype=dtype) for _ in range(2)]
    for i, n in enumerate(lk):
        pos = torch.arange(n, device="cuda")
        for pool, t in zip(pools, (k, v), strict=True):
            pool[table[i, pos // page].long(), pos % page] = t[ck[i]:ck[i + 1]]
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(q, *pools, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                          window_size=window, block_table=table, return_lse=True)
    for i in range(len(lq)):
        sq, sk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        boundary.check_forward(out[sq][None], lse[:, sq][None], q[sq][None], k[sk][None],
                               v[sk][None], causal, window)

"""Ladder rungs 9-12, naive attention: scaled Q Kᵀ scores, row softmax, P·V, and the composed
O(S²) pipeline that the flash kernels are measured against.

Layout (as flash_attn_func): q (batch, seqlen_q, nheads, headdim); k, v (batch, seqlen_k,
nheads_kv, headdim) with nheads % nheads_kv == 0 (grouped-query attention: query head h reads
key/value head h // (nheads // nheads_kv)). q, k, v and p may have any strides (views of a packed
qkv tensor work without a copy); outputs are contiguous. Scores and probabilities are float32
(batch, nheads, seqlen_q, seqlen_k): the S² intermediates the flash kernels never materialise.

Causal is aligned bottom-right, as in FlashAttention (DESIGN.md §3): query i sees key j iff
j <= i + seqlen_k - seqlen_q. A query that sees no key (or seqlen_k == 0) gets an all-zero
probability row and output 0, never NaN. softmax_scale defaults to headdim ** -0.5.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _checks as check
from ._kernels import FLOATS, full_grid, kernel_for, softmax_plan, softmax_spec
from .matrix import launch_gemm


def _kv(name: str, t: object, q: torch.Tensor, seqlen_k: int | None = None) -> torch.Tensor:
    """k or v: 4-D, q's dtype, (batch, seqlen_k, nheads_kv, headdim) matching q."""
    t = check.tensor(name, t, ndim=4)
    check.same_dtype(name, t, "q", q)
    batch, _, nheads, head_dim = q.shape
    if t.shape[0] != batch or t.shape[3] != head_dim:
        raise ValueError(
            f"{name}: expected shape (batch={batch}, seqlen_k, nheads_kv, headdim={head_dim}) "
            f"to match q {tuple(q.shape)}, got {tuple(t.shape)}"
        )
    _group(name, nheads, t.shape[2])
    if seqlen_k is not None and t.shape[1] != seqlen_k:
        raise ValueError(f"{name}: expected seqlen_k = {seqlen_k} (as k), got shape {tuple(t.shape)}")
    return t


def _group(name: str, nheads: int, nheads_kv: int) -> int:
    if nheads_kv == 0 and nheads == 0:
        return 1
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(
            f"{name}: expected nheads_kv to divide nheads = {nheads} (grouped-query attention), "
            f"got nheads_kv = {nheads_kv}"
        )
    return nheads // nheads_kv


def _scale(softmax_scale: object, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5 if head_dim > 0 else 1.0
    return check.real("softmax_scale", softmax_scale)


def _strides_bshd(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(row = position, column = headdim, batch, head) strides of a (B, S, H, D) tensor."""
    return t.stride(1), t.stride(3), t.stride(0), t.stride(2)


def attention_scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None = None, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """scores[b, h, i, j] = softmax_scale * sum_d q[b, i, h, d] * k[b, j, h // group, d], as
    float32 (batch, nheads, seqlen_q, seqlen_k), fp32 accumulation. No masking here: causal
    masking is softmax's."""
    check.tensor("q", q, ndim=4)
    _kv("k", k, q)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = _group("k", nheads, nheads_kv)
    scale = _scale(softmax_scale, head_dim)
    shape = (batch, nheads, seqlen_q, seqlen_k)
    if out is not None:
        out = check.out(out, shape, torch.float32, "(batch, nheads, seqlen_q, seqlen_k) float32")
    device = check.cuda_devices(q=q, k=k, out=out)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=device)
    check.no_overlap(out, q=q, k=k)
    if out.numel() == 0:
        return out
    launch_gemm(
        "attention_scores", q.dtype, device, q, k, out, seqlen_q, seqlen_k, head_dim,
        a_strides=_strides_bshd(q),
        # b[d, j] = k[b, j, h, d]: the k-index (d) walks k's last dimension, the column (j) its rows.
        b_strides=(k.stride(3), k.stride(1), k.stride(0), k.stride(2)),
        c_strides=(seqlen_k, 1, nheads * seqlen_q * seqlen_k, seqlen_q * seqlen_k),
        batch=batch, heads=nheads, b_group=group, alpha=scale,
    )
    return out


def softmax(x: torch.Tensor, *, causal: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dimension, max-subtracted, in fp32; result in x.dtype.

    causal: x is (..., seqlen_q, seqlen_k) and entry (i, j) is kept iff
    j <= i + seqlen_k - seqlen_q (bottom-right aligned); masked entries become 0 and are never
    read. A row with no kept entry, or whose kept entries are all -inf, becomes all zeros.
    `out` may be x itself (in place)."""
    causal = check.flag("causal", causal)
    check.tensor("x", x, min_ndim=2 if causal else 1)
    if out is not None:
        out = check.out(out, x.shape, x.dtype, "the shape and dtype of x")
    check.contiguous("x", x)
    check.cuda_devices(x=x, out=out)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    check.no_overlap(out, allow_alias=True, x=x)
    if x.numel() == 0:
        return out
    cols = x.shape[-1]
    rows = x.numel() // cols
    if causal:
        seqlen_q = x.shape[-2]
        period, offset = seqlen_q, cols - seqlen_q + 1
    else:
        period, offset = 1, cols
    plan = softmax_plan(cols, x.dtype, x.data_ptr(), out.data_ptr())
    kernel = kernel_for(softmax_spec(x.dtype, plan.in_registers), x.device)
    grid = full_grid(kernel, plan.threads * plan.rows_per_block, plan.blocks(rows))
    kernel.launch((grid, 1, 1), plan.block, x, out, np.int64(rows), np.int64(cols),
                  np.int64(period), np.int64(offset))
    return out


def attention_pv(p: torch.Tensor, v: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[b, i, h, d] = sum_j p[b, h, i, j] * v[b, j, h // group, d] for float32 probabilities
    p (batch, nheads, seqlen_q, seqlen_k) and v (batch, seqlen_k, nheads_kv, headdim); out
    (batch, seqlen_q, nheads, headdim) in v.dtype, fp32 accumulation. seqlen_k == 0 gives 0."""
    check.tensor("p", p, dtypes=(torch.float32,), ndim=4)
    check.tensor("v", v, dtypes=FLOATS, ndim=4)
    batch, nheads, seqlen_q, seqlen_k = p.shape
    if v.shape[0] != batch or v.shape[1] != seqlen_k:
        raise ValueError(
            f"v: expected shape (batch={batch}, seqlen_k={seqlen_k}, nheads_kv, headdim) to match "
            f"p {tuple(p.shape)}, got {tuple(v.shape)}"
        )
    group = _group("v", nheads, v.shape[2])
    head_dim = v.shape[3]
    shape = (batch, seqlen_q, nheads, head_dim)
    if out is not None:
        out = check.out(out, shape, v.dtype, "(batch, seqlen_q, nheads, headdim) in v's dtype")
    device = check.cuda_devices(p=p, v=v, out=out)
    if out is None:
        out = torch.empty(shape, dtype=v.dtype, device=device)
    check.no_overlap(out, p=p, v=v)
    if out.numel() == 0:
        return out
    launch_gemm(
        "attention_pv", v.dtype, device, p, v, out, seqlen_q, head_dim, seqlen_k,
        a_strides=(p.stride(2), p.stride(3), p.stride(0), p.stride(1)),
        b_strides=(v.stride(1), v.stride(3), v.stride(0), v.stride(2)),
        c_strides=(nheads * head_dim, 1, seqlen_q * nheads * head_dim, head_dim),
        batch=batch, heads=nheads, b_group=group, alpha=1.0,
    )
    return out


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    softmax_scale: float | None = None, causal: bool = False, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ · softmax_scale) v, composed from the three rungs above: scores (float32,
    batch x nheads x seqlen_q x seqlen_k — the O(S²) memory), softmax in place, then P·V.
    Returns (batch, seqlen_q, nheads, headdim) in q.dtype."""
    check.tensor("q", q, ndim=4)
    _kv("k", k, q)
    _kv("v", v, q, seqlen_k=k.shape[1])
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v: expected nheads_kv = {k.shape[2]} (as k), got shape {tuple(v.shape)}")
    causal = check.flag("causal", causal)
    scale = _scale(softmax_scale, q.shape[3])
    if out is not None:
        out = check.out(out, q.shape, q.dtype, "the shape and dtype of q")
    device = check.cuda_devices(q=q, k=k, v=v, out=out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    check.no_overlap(out, q=q, k=k, v=v)
    if out.numel() == 0:
        return out
    scores = attention_scores(q, k, scale)
    softmax(scores, causal=causal, out=scores)
    return attention_pv(scores, v, out=out)

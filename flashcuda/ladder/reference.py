"""The float64 oracle of every ladder rung: same signatures and semantics as the entry points,
computed in float64 with plain torch on the inputs' device, returning float64 tensors.

Tests compare a rung against these; DESIGN.md §7's tolerance rule compares our error against the
error of the same computation done by torch in the input dtype.
"""

from __future__ import annotations

import torch


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _f64(x) + _f64(y)


def scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha is rounded to float32 first, as the rung does."""
    alpha32 = float(torch.tensor(alpha, dtype=torch.float32))
    return _f64(x) * alpha32


def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(_f64(x))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    return _f64(x).sum(dim=-1)


def dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (_f64(x) * _f64(y)).sum()


def transpose(x: torch.Tensor) -> torch.Tensor:
    return _f64(x).t().contiguous()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _f64(a) @ _f64(b)


def _expand_kv(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, H, S, D), query head h reading kv head h // (H // Hkv)."""
    t = _f64(t).permute(0, 2, 1, 3)
    if t.shape[1] and t.shape[1] != nheads:
        t = t.repeat_interleave(nheads // t.shape[1], dim=1)
    return t


def attention_scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    head_dim = q.shape[3]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5 if head_dim > 0 else 1.0
    qh = _f64(q).permute(0, 2, 1, 3)  # (B, H, Sq, D)
    kh = _expand_kv(k, q.shape[2])
    return (qh @ kh.transpose(-1, -2)) * softmax_scale


def causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """True where query i sees key j: j <= i + seqlen_k - seqlen_q (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def softmax(x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Masked entries and rows with nothing visible (or only -inf) are 0, never NaN."""
    s = _f64(x)
    if causal:
        visible = causal_mask(x.shape[-2], x.shape[-1], x.device)
        s = s.masked_fill(~visible, float("-inf"))
    if s.numel() == 0:
        return s.clone()
    m = s.amax(dim=-1, keepdim=True)
    empty = m == float("-inf")
    e = torch.exp(s - torch.where(empty, torch.zeros_like(m), m))
    total = e.sum(dim=-1, keepdim=True)
    return torch.where(empty, torch.zeros_like(e), e / torch.where(empty, torch.ones_like(total), total))


def attention_pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, H, Sq, Sk) x (B, Sk, Hkv, D) -> (B, Sq, H, D)."""
    vh = _expand_kv(v, p.shape[1])
    return (_f64(p) @ vh).permute(0, 2, 1, 3).contiguous()


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    softmax_scale: float | None = None, causal: bool = False) -> torch.Tensor:
    p = softmax(attention_scores(q, k, softmax_scale), causal=causal)
    return attention_pv(p, v)

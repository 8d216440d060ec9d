"""References for attention: a float64 oracle and a pure-torch tiled implementation.

`attention_ref` is the oracle every kernel is checked against (DESIGN.md §7): the whole score
matrix, float64 (or the input dtype, for "what PyTorch's own error is" baselines), differentiable
with torch.autograd.

`attention_tiled` / `attention_tiled_backward` run the same tile loop as the CUDA kernels — key
tiles restricted to [key_begin, key_end) of mask.cuh, masking only the tiles `tile_needs_mask`
flags, the online softmax of online_softmax.cuh in the log2 domain with its guards, deferred
normalisation — in fp32 (fp64 for fp64 inputs). They are the portable path when no usable GPU is
present, and the CPU lane proves they equal the oracle.

Visibility (mask.cuh, bottom-right aligned): query row i sees key j iff
    i + shift - window_left <= j <= i + shift + window_right,   shift = seqlen_k - seqlen_q,
with None meaning an unbounded side. FlashAttention's causal is (None, 0); PyTorch SDPA's
top-left causal is (None, seqlen_q - seqlen_k). A row that sees no key has out 0 and lse -inf.
"""

from __future__ import annotations

import math

import torch

from .ops.call import LOG2E, kernel_windows

LN2 = math.log(2.0)
_NEG_INF = float("-inf")


def visible_mask(seqlen_q: int, seqlen_k: int, window_left: int | None,
                 window_right: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: which key each query row sees (None = unbounded side)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    d = j - i - (seqlen_k - seqlen_q)
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_right is not None:
        vis &= d <= window_right
    if window_left is not None:
        vis &= d >= -window_left
    return vis


def _fa_window(causal: bool, window_size: tuple[int, int]) -> tuple[int | None, int | None]:
    left, right = window_size
    return (None if left < 0 else left), (0 if causal else (None if right < 0 else right))


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  softmax_scale: float | None = None, causal: bool = False,
                  window_size: tuple[int, int] = (-1, -1), upcast: bool = True, *,
                  window: tuple[int | None, int | None] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the whole score matrix: the oracle.

    q (B, Sq, H, D); k, v (B, Sk, Hkv, D), H % Hkv == 0. Returns out (B, Sq, H, D) and lse
    (B, H, Sq), natural log.
    Mask: FlashAttention's arguments (causal bottom-right; window_size (left, right), -1 =
    unbounded), or `window=(left, right)` in kernel terms (None = unbounded, right may be
    negative), which overrides both.
    upcast=True: computed and returned in float64 (the oracle). upcast=False: the matmuls in the
    input dtype, the softmax in float32 and P rounded to the input dtype, as PyTorch's own
    same-dtype attention does; out in the input dtype, lse float32 (the error baseline).
    Rows that see no key give out 0 and lse -inf, and zero gradients, never NaN.
    """
    wl, wr = window if window is not None else _fa_window(causal, window_size)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    dtype = torch.float64 if upcast else q.dtype
    sdtype = torch.float64 if upcast else torch.float32
    if seqlen_k == 0:
        out = torch.zeros(q.shape, dtype=dtype, device=q.device)
        lse = torch.full((batch, nheads, seqlen_q), _NEG_INF, dtype=sdtype, device=q.device)
        return out, lse
    group = nheads // nheads_kv
    qd = q.to(dtype)
    kd = k.to(dtype).repeat_interleave(group, dim=2)
    vd = v.to(dtype).repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd).to(sdtype) * softmax_scale
    vis = visible_mask(seqlen_q, seqlen_k, wl, wr, q.device)
    s = s.masked_fill(~vis, _NEG_INF)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(m == _NEG_INF, torch.zeros_like(m), m)  # the same guard as online_softmax
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))
    p = e / safe_total
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(dtype), vd)
    lse = torch.where(seen, torch.log(safe_total) + m, torch.full_like(m, _NEG_INF))
    return out, lse.squeeze(-1)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """Rotary embedding in float64, as complex products: each pair (a, b) of x's first
    2 * cos.shape[1] features -> (a + ib)(cos + i sin) at row positions[b, s] of the tables;
    pairs (0, 1), (2, 3), ... when interleaved, (0, half), (1, half + 1), ... otherwise.
    x (batch, seqlen, nheads, headdim); positions (batch, seqlen) int64. The oracle of
    flashcuda.kvcache.rotary."""
    x = x.double()
    half = cos.shape[1]
    c, s = (t.double()[positions].unsqueeze(2) for t in (cos, sin))
    r = x[..., :2 * half]
    a, b = (r[..., 0::2], r[..., 1::2]) if interleaved else (r[..., :half], r[..., half:])
    w = torch.complex(a, b) * torch.complex(c, s)
    y = torch.stack((w.real, w.imag), -1).flatten(-2) if interleaved else torch.cat(
        (w.real, w.imag), -1)
    return torch.cat((y, x[..., 2 * half:]), -1)


def _tile_needs_mask(row0: int, rows: int, col0: int, cols: int, seqlen_q: int, seqlen_k: int,
                     wl: int, wr: int) -> bool:
    """mask.cuh Mask::tile_needs_mask, line for line."""
    shift = seqlen_k - seqlen_q
    row_last = min(row0 + rows - 1, seqlen_q - 1)
    col_last = col0 + cols - 1
    if col_last >= seqlen_k:
        return True
    if col_last > row0 + shift + wr:
        return True
    return col0 < row_last + shift - wl


def key_range(row0: int, row_end: int, seqlen_q: int, seqlen_k: int, wl: int,
              wr: int) -> tuple[int, int]:
    """mask.cuh key_begin(row0), key_end(row_end): the keys rows [row0, row_end) visit (wl, wr as
    kernel_windows gives them; also the sm90 forward's schedule model, fwd_sm90)."""
    shift = seqlen_k - seqlen_q
    begin = max(row0 + shift - wl, 0)
    end = min(max(row_end - 1 + shift + wr + 1, 0), seqlen_k)
    return begin, end


def _query_range(col0: int, col_end: int, seqlen_q: int, seqlen_k: int, wl: int,
                 wr: int) -> tuple[int, int]:
    """The rows that can see some key of [col0, col_end): the backward's loop over query tiles."""
    shift = seqlen_k - seqlen_q
    begin = max(col0 - shift - wr, 0)
    end = min(max(col_end - 1 - shift + wl + 1, 0), seqlen_q)
    return begin, end


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_grouped(t: torch.Tensor, nheads_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, S, H, D) -> (B, Hkv, G, S, D): query head h = hkv * G + g uses kv head hkv."""
    b, s, h, d = t.shape
    return t.to(dtype).reshape(b, s, nheads_kv, h // nheads_kv, d).permute(0, 2, 3, 1, 4)


def _weighted_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p @ v where a weight of exactly 0 contributes exactly 0, also against a NaN / Inf value
    (a plain matmul gives 0 x NaN = NaN: a masked key's V would reach rows that do not see it).
    Non-finite values are taken out of the product and put back with IEEE's rules on the rows
    that give them a nonzero weight (weights are >= 0): any NaN, or +Inf with -Inf, gives NaN;
    +Inf alone +Inf; -Inf alone -Inf."""
    bad = ~torch.isfinite(v)
    if not bool(bad.any()):
        return torch.matmul(p, v)
    out = torch.matmul(p, torch.where(bad, torch.zeros_like(v), v))
    seen = (p != 0).to(p.dtype)

    def reached(mask: torch.Tensor) -> torch.Tensor:
        return torch.matmul(seen, mask.to(p.dtype)) > 0

    pos, neg, nan = reached(v == math.inf), reached(v == -math.inf), reached(torch.isnan(v))
    out = torch.where(pos, torch.full_like(out, math.inf), out)
    out = torch.where(neg, torch.full_like(out, -math.inf), out)
    return torch.where(nan | (pos & neg), torch.full_like(out, math.nan), out)


def _kv_tile(t: torch.Tensor, c0: int, c1: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, Sk, Hkv, D)[:, c0:c1] -> (B, Hkv, 1, n, D)."""
    return t[:, c0:c1].to(dtype).permute(0, 2, 1, 3).unsqueeze(2)


def _tile_scores(q_t: torch.Tensor, k_t: torch.Tensor, scale_log2: float, r0: int, c0: int,
                 block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, wl: int,
                 wr: int) -> torch.Tensor:
    """Scaled log2-domain scores of one (query tile, key tile), masked when the tile needs it."""
    s = torch.matmul(q_t, k_t.transpose(-1, -2)) * scale_log2
    if _tile_needs_mask(r0, block_m, c0, block_n, seqlen_q, seqlen_k, wl, wr):
        rows, cols = s.shape[-2], s.shape[-1]
        i = torch.arange(r0, r0 + rows, device=s.device)[:, None]
        j = torch.arange(c0, c0 + cols, device=s.device)[None, :]
        d = j - i - (seqlen_k - seqlen_q)
        vis = (j < seqlen_k) & (d <= wr) & (d >= -wl)
        s = s.masked_fill(~vis, _NEG_INF)
    return s


def attention_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                    window_left: int | None = None, window_right: int | None = None,
                    block_m: int = 64, block_n: int = 64, *, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash forward, tile by tile, in torch: the portable path.

    q (B, Sq, H, D); k, v (B, Sk, Hkv, D); windows in kernel terms (None = unbounded).
    Returns out (B, Sq, H, D) in q's dtype and lse (B, H, Sq) float32 (float64 for float64
    inputs), written into `out` / `lse` when given.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    acc_dtype = _acc_dtype(q.dtype)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((batch, nheads, seqlen_q), dtype=acc_dtype, device=q.device)
    wl, wr = (int(w) for w in kernel_windows(seqlen_q, seqlen_k, window_left, window_right))
    scale_log2 = softmax_scale * LOG2E
    grid = (batch, nheads_kv, group)
    for r0 in range(0, seqlen_q, block_m):
        r1 = min(r0 + block_m, seqlen_q)
        q_t = _heads_grouped(q[:, r0:r1], nheads_kv, acc_dtype)  # (B, Hkv, G, m, D)
        m = torch.full((*grid, r1 - r0), _NEG_INF, dtype=acc_dtype, device=q.device)
        row_sum = torch.zeros_like(m)
        acc = torch.zeros((*grid, r1 - r0, head_dim), dtype=acc_dtype, device=q.device)
        key_begin, key_end = key_range(r0, r1, seqlen_q, seqlen_k, wl, wr)
        for c0 in range(key_begin // block_n * block_n, key_end, block_n):
            c1 = min(c0 + block_n, seqlen_k)
            s = _tile_scores(q_t, _kv_tile(k, c0, c1, acc_dtype), scale_log2, r0, c0, block_m,
                             block_n, seqlen_q, seqlen_k, wl, wr)
            # OnlineSoftmax::update: corr = exp2(m_old - m_new), 1 while the row is still empty.
            m_new = torch.maximum(m, s.amax(dim=-1))
            corr = torch.where(m_new == _NEG_INF, torch.ones_like(m), torch.exp2(m - m_new))
            row_sum = row_sum * corr
            m = m_new
            ref = torch.where(m == _NEG_INF, torch.zeros_like(m), m)  # OnlineSoftmax::ref
            p = torch.exp2(s - ref[..., None])
            row_sum = row_sum + p.sum(dim=-1)
            acc = acc * corr[..., None] + _weighted_values(p, _kv_tile(v, c0, c1, acc_dtype))
        # Deferred normalisation (OnlineSoftmax::inv_sum, ::lse): an empty row gives 0 and -inf.
        seen = row_sum > 0
        safe_sum = torch.where(seen, row_sum, torch.ones_like(row_sum))
        inv_sum = torch.where(seen, 1.0 / safe_sum, torch.zeros_like(row_sum))
        o = (acc * inv_sum[..., None]).permute(0, 3, 1, 2, 4)
        out[:, r0:r1] = o.reshape(batch, r1 - r0, nheads, head_dim).to(out.dtype)
        row_lse = torch.where(seen, m * LN2 + torch.log2(safe_sum) * LN2,
                              torch.full_like(row_sum, _NEG_INF))
        lse[:, :, r0:r1] = row_lse.reshape(batch, nheads, r1 - r0).to(lse.dtype)
    return out, lse


def attention_tiled_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             softmax_scale: float, window_left: int | None = None,
                             window_right: int | None = None, block_m: int = 64,
                             block_n: int = 64, *, dq: torch.Tensor | None = None,
                             dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash backward, tile by tile, in torch (FA2's loop: key tiles outside, query tiles inside).

    P is recomputed from lse (p = exp2(s * scale * log2e - lse * log2e); rows with lse -inf get
    p = 0); D = rowsum(dout * out); dS = P * (dP - D). dK, dV of a kv head sum the contributions
    of its query heads (GQA). Returns dq, dk, dv in the inputs' dtypes (written into dq/dk/dv
    when given).
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    acc_dtype = _acc_dtype(q.dtype)
    wl, wr = (int(w) for w in kernel_windows(seqlen_q, seqlen_k, window_left, window_right))
    scale_log2 = softmax_scale * LOG2E
    do_g = _heads_grouped(dout, nheads_kv, acc_dtype)  # (B, Hkv, G, Sq, D)
    q_g = _heads_grouped(q, nheads_kv, acc_dtype)
    delta = (do_g * _heads_grouped(out, nheads_kv, acc_dtype)).sum(dim=-1)  # (B, Hkv, G, Sq)
    lse_g = lse.to(acc_dtype).reshape(batch, nheads_kv, nheads // nheads_kv, seqlen_q)
    # exp2(s - lse*log2e); an empty row (lse -inf) uses +inf so that every p is exactly 0.
    lse_g = torch.where(lse_g == _NEG_INF, torch.full_like(lse_g, float("inf")), lse_g * LOG2E)
    dq_acc = torch.zeros_like(q_g)
    dk_acc = torch.zeros((batch, nheads_kv, seqlen_k, head_dim), dtype=acc_dtype, device=q.device)
    dv_acc = torch.zeros_like(dk_acc)
    for c0 in range(0, seqlen_k, block_n):
        c1 = min(c0 + block_n, seqlen_k)
        k_t = _kv_tile(k, c0, c1, acc_dtype)  # (B, Hkv, 1, n, D)
        v_t = _kv_tile(v, c0, c1, acc_dtype)
        row_begin, row_end = _query_range(c0, c1, seqlen_q, seqlen_k, wl, wr)
        for r0 in range(row_begin // block_m * block_m, row_end, block_m):
            r1 = min(r0 + block_m, seqlen_q)
            q_t = q_g[..., r0:r1, :]
            do_t = do_g[..., r0:r1, :]
            s = _tile_scores(q_t, k_t, scale_log2, r0, c0, block_m, block_n, seqlen_q, seqlen_k,
                             wl, wr)
            p = torch.exp2(s - lse_g[..., r0:r1, None])  # (B, Hkv, G, m, n)
            dv_acc[:, :, c0:c1] += torch.matmul(p.transpose(-1, -2), do_t).sum(dim=2)
            dp = torch.matmul(do_t, v_t.transpose(-1, -2))
            ds = p * (dp - delta[..., r0:r1, None])
            dq_acc[..., r0:r1, :] += torch.matmul(ds, k_t) * softmax_scale
            dk_acc[:, :, c0:c1] += torch.matmul(ds.transpose(-1, -2), q_t).sum(dim=2) \
                * softmax_scale
    dq_val = dq_acc.permute(0, 3, 1, 2, 4).reshape(q.shape)
    dk_val = dk_acc.permute(0, 2, 1, 3)
    dv_val = dv_acc.permute(0, 2, 1, 3)
    results = []
    for given, val, like in ((dq, dq_val, q), (dk, dk_val, k), (dv, dv_val, v)):
        if given is None:
            results.append(val.to(like.dtype).contiguous())
        else:
            given.copy_(val)
            results.append(given)
    return results[0], results[1], results[2]


def max_error(actual: torch.Tensor, oracle: torch.Tensor) -> float:
    """max |actual - oracle| in float64, where infinities must match exactly (a -inf lse against
    a -inf oracle is no error; anything against a different infinity, or NaN, is an infinite one).

    The tolerance rule of DESIGN.md §7 is then
        max_error(ours, oracle) <= 2 * max_error(torch_same_dtype, oracle)   (3x for gradients).
    """
    if actual.shape != oracle.shape:
        raise ValueError(f"actual: expected shape {tuple(oracle.shape)}, got {tuple(actual.shape)}")
    if actual.numel() == 0:
        return 0.0
    a, o = actual.double(), oracle.double().to(actual.device)
    if a.isnan().any() or o.isnan().any():
        return float("inf")
    inf_a, inf_o = torch.isinf(a), torch.isinf(o)
    if not torch.equal(inf_a, inf_o) or not torch.equal(a[inf_a], o[inf_o]):
        return float("inf")
    finite = ~inf_o
    return (a[finite] - o[finite]).abs().max().item() if finite.any() else 0.0


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """FlashAttention-3's absolute tolerance floor: twice the error of merely rounding values near
    the reference to `dtype` (added to the DESIGN.md §7 rule where the reference is near 0)."""
    finite = ref[torch.isfinite(ref)]
    if finite.numel() == 0:
        return 0.0
    rounded = (finite.to(dtype) + 0.3 - 0.3).double()
    return 2 * (rounded - finite).abs().max().item()

"""Decoding: one query row per (batch entry, head) that sees every one of its keys, run in the
shape the GPU needs.

    kernel        the decode kernels (family fwd_decode, ops/fwd_decode.py: split-KV with
                  fp32 partials and a combine, a KV head's query group in one CTA) wherever
                  they take the call (CUDA, sm >= 80, fp16 / bf16, head_dim a multiple of 8 up
                  to 256).
Elsewhere (fp32, other head dims, CPU tensors) the forward kernels run on other views of the
call:
    packed_gqa    with GQA, a KV head's `group` query heads become `group` query rows of one
                  head (a view of q, no copy): the kernels read each KV head's keys once for
                  the group, as FlashAttention's pack_gqa / FA2's seqlenq_ngroups_swapped do,
                  instead of once per query head in a tile of one real row.
    split         one entry over many keys (from SPLIT_MIN_KEYS): the keys cut into pieces of
                  a multiple of SPLIT_CHUNK keys (at least SPLIT_MIN_CHUNK), enough pieces for
                  one work tile per SM, run side by side as one call's batch (views of the
                  keys; the rest a second call), then combined by their lse:
                  out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i. Exact up to the
                  rounding of each piece's out to q's dtype (one rounding more than one call).

ops.attention applies it to eager calls that need no gradient (inference); the autograd and
torch.compile paths run the call as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from . import dispatch, fwd_decode

KERNEL = True
PACK_GQA = True
SPLIT_MIN_KEYS = 8192
SPLIT_MIN_CHUNK = 1024
SPLIT_CHUNK = 128

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def _sms(device: torch.device) -> int:
    """The SMs of a CUDA device (0 elsewhere, or without a usable GPU — fake CUDA tensors on a
    CPU machine: no split pays off there)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def kernel_allowed() -> bool:
    """The decode kernels may run: KERNEL is on and FLASHCUDA_FORCE_KERNEL names no forward
    family, or names fwd_decode among them (a test forcing fwd_simt gets fwd_simt)."""
    if not KERNEL:
        return False
    forward = dispatch.families("fwd")
    return forward == dispatch.FWD_FAMILIES or "fwd_decode" in forward


def sees_all_keys(window_left: int | None, window_right: int | None, keys: int) -> bool:
    """A single query row (the last position, bottom-right aligned) sees all of `keys` keys
    under this window: none left of it is cut, and the row itself is not masked out."""
    return ((window_left is None or window_left >= keys - 1)
            and (window_right is None or window_right >= 0))


def packed_gqa(q: torch.Tensor, nheads_kv: int) -> torch.Tensor:
    """q (batch, 1, nheads, headdim) seen as (batch, group, nheads_kv, headdim), group =
    nheads / nheads_kv: query head kv * group + j becomes query row j of KV head kv (a view).
    Exact wherever the query sees every key (a packed call's rows share no position)."""
    b, _, h, d = q.shape
    return q.view(b, nheads_kv, h // nheads_kv, d).transpose(1, 2)


def split_chunk(keys: int, heads: int, sms: int) -> int:
    """Keys per piece for one entry's query rows over `keys` keys and `heads` KV heads (the
    work tiles of one piece), or 0 for no split: pieces enough for one work tile per SM, each
    at least SPLIT_MIN_CHUNK keys, a multiple of SPLIT_CHUNK."""
    if keys < SPLIT_MIN_KEYS or not heads:
        return 0
    pieces = min(-(-sms // heads), keys // SPLIT_MIN_CHUNK)
    if pieces < 2:
        return 0
    return -(-keys // (pieces * SPLIT_CHUNK)) * SPLIT_CHUNK


def split_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int,
                 run: Forward) -> tuple[torch.Tensor, torch.Tensor]:
    """run(q, k, v) without a mask for one entry (q (1, rows, heads, d), k / v (1, keys,
    heads_kv, d)) as pieces of `chunk` keys: the whole pieces as one call's batch (views of k /
    v), the rest as a second call; combined by their lse (module docstring)."""
    whole = k.shape[1] // chunk
    qs = q.expand(whole, *q.shape[1:]).contiguous()
    parts = [run(qs, *(t[0, :whole * chunk].unflatten(0, (whole, chunk)) for t in (k, v)),
                 scale, None, None)]
    if k.shape[1] > whole * chunk:
        parts.append(run(q, k[:, whole * chunk:], v[:, whole * chunk:], scale, None, None))
    out = torch.cat([o for o, _ in parts])  # (pieces, rows, heads, d)
    lse = torch.cat([x for _, x in parts])  # (pieces, heads, rows)
    total = torch.logsumexp(lse, dim=0, keepdim=True)  # every piece has keys: finite unless NaN
    weight = torch.exp(lse - total).transpose(1, 2).unsqueeze(-1)
    return (out.float() * weight).sum(0, keepdim=True).to(out.dtype), total


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            window_left: int | None, window_right: int | None,
            run: Forward) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, lse) of a decoding call through packed_gqa and / or the split, each kernel call
    made by `run` (ops.attention's forward body); None for any other call (then run it as it
    is): more than one query row, no keys, a window that hides a key, or nothing to gain (MHA
    that does not split)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    keys, nheads_kv = k.shape[1], k.shape[2]
    if seqlen_q != 1 or keys == 0 or batch == 0:
        return None
    if not sees_all_keys(window_left, window_right, keys):
        return None
    if kernel_allowed() and fwd_decode.can_take(q, k, v) is None:
        return fwd_decode.attention(q, k, v, scale)
    pack = PACK_GQA and nheads > nheads_kv
    rows = packed_gqa(q, nheads_kv) if pack else q
    chunk = split_chunk(keys, rows.shape[2], _sms(q.device)) if batch == 1 else 0
    if not pack and not chunk:
        return None
    if chunk:
        out, lse = split_pieces(rows, k, v, scale, chunk, run)
    else:
        out, lse = run(rows, k, v, scale, None, None)
    if pack:
        out = out.transpose(1, 2).reshape(batch, 1, nheads, head_dim)
        lse = lse.reshape(batch, nheads, 1)
    return out, lse

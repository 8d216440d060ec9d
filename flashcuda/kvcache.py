"""FlashAttention's inference entry point, flash_attn_with_kvcache: attention of new queries over
a KV cache, the new keys appended in place first, optionally rotated (rotary embeddings), the
cache contiguous per row or paged (a block table), optionally left-padded.

Everything here is host-side orchestration around the kernels of flashcuda.ops: the
arguments are checked by name before anything is written; the append and the rotation are
PyTorch operations; a decode step (one query per entry, unpaged, not left-padded, entries on
consecutive cache rows; with SPANS_ON_DEVICE any of those) is one call of the decode kernels
(ops/fwd_decode.py) with the entries' key counts (spans, rows, block table) as device tensors;
otherwise the attention is one kernel call per run of batch entries that see the same keys'
span (views of the caches; a paged cache's pages are gathered into a contiguous copy first), a
decoding run going through ops.decode like any inference call. The kernels rotate nothing
themselves.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import validate
from .api import _checked_qkv, _last_dim_contiguous
from .ops import decode, fwd_decode
from .ops.attention import attention

# A paged run's gathered keys and values (both) are copied at most this many bytes at a time
# (more entries of the run wait for the next gather).
GATHER_BYTES = 256 << 20


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, nheads, headdim) rotated by the angles of row positions[b, s] of cos /
    sin (seqlen_ro, rotary_dim / 2): the first rotary_dim features of each head, as pairs —
    (0, 1), (2, 3), ... when interleaved (GPT-J), (0, rotary_dim / 2), (1, rotary_dim / 2 + 1),
    ... otherwise (GPT-NeoX) — each pair (a, b) -> (a cos - b sin, a sin + b cos), computed in
    float32 (float64 for float64 x) and rounded once to x's dtype; the other features copied."""
    half = cos.shape[1]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos[positions].to(work).unsqueeze(2)  # (batch, seqlen, 1, half)
    s = sin[positions].to(work).unsqueeze(2)
    r = x[..., :2 * half].to(work)
    a, b = (r[..., 0::2], r[..., 1::2]) if interleaved else (r[..., :half], r[..., half:])
    ra, rb = a * c - b * s, a * s + b * c
    rotated = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _rotary_tables(rotary_cos: object, rotary_sin: object, q: torch.Tensor,
                   appended: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """rotary_cos / rotary_sin checked: both or neither, (seqlen_ro, rotary_dim / 2) with
    rotary_dim <= headdim, q's dtype and device, only with new keys (FlashAttention's rule)."""
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos, rotary_sin: expected both (the rotation's angles) or "
                         f"neither, got {'rotary_cos' if rotary_cos is not None else 'rotary_sin'}"
                         " alone")
    if not appended:
        raise ValueError("rotary_cos: expected new keys k / v with rotary embeddings (they "
                         "rotate q and the appended keys), got k = v = None")
    cos = validate.check_shape_dtype_device(rotary_cos, "rotary_cos", dtype=q.dtype,
                                            device=q.device)
    if cos.dim() != 2 or cos.shape[1] < 1 or 2 * cos.shape[1] > q.shape[-1]:
        raise ValueError(f"rotary_cos: expected shape (seqlen_ro, rotary_dim / 2) with 1 <= "
                         f"rotary_dim / 2 <= headdim / 2 = {q.shape[-1] // 2}, got "
                         f"{tuple(cos.shape)}")
    sin = validate.check_shape_dtype_device(rotary_sin, "rotary_sin", shape=cos.shape,
                                            dtype=q.dtype, device=q.device)
    return cos, sin


def _new_keys(k: object, v: object, batch: int, k_cache: torch.Tensor) -> int:
    """k / v checked (both or neither, (batch, seqlen_new, nheads_kv, headdim), the caches'
    dtype and device); returns seqlen_new (0 without them)."""
    if (k is None) != (v is None):
        raise ValueError("k, v: expected both (new keys to append) or neither, got "
                         f"{'k' if k is not None else 'v'} alone")
    if k is None:
        return 0
    k = validate.check_tensor(k, "k")
    new = k.shape[1] if k.dim() == 4 else -1
    shape = (batch, new, *k_cache.shape[2:])
    if new < 0 or tuple(k.shape) != shape:
        raise ValueError(f"k: expected shape (batch, seqlen_new, nheads_kv, headdim) = "
                         f"{shape if new >= 0 else '4 dims'}, got {tuple(k.shape)}")
    validate.check_shape_dtype_device(k, "k", dtype=k_cache.dtype, device=k_cache.device)
    validate.check_shape_dtype_device(v, "v", shape=shape, dtype=k_cache.dtype,
                                      device=k_cache.device)
    return new


def _append_slots(lengths: list[int], new: int, rows: list[int], pages: torch.Tensor | None,
                  page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slots the appended keys go to, entry by entry, position by position: (rows,
    positions), or (blocks, offsets) when paged (page_size > 0); two int64 CPU tensors."""
    if not new or not lengths:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    pos = torch.tensor(lengths, dtype=torch.long).unsqueeze(1) + torch.arange(new)
    if pages is not None:
        return pages.gather(1, pos // page_size).flatten(), (pos % page_size).flatten()
    return torch.tensor(rows, dtype=torch.long).repeat_interleave(new), pos.flatten()


class _Entries(NamedTuple):
    """Where each batch entry's keys live and which it sees: its cache row (rows) or its row of
    the page table (pages, an int64 CPU tensor), and the span [starts[b], ends[b]) of positions
    it attends to, lengths[b] of them already cached before the append."""

    rows: list[int]
    pages: torch.Tensor | None
    lengths: list[int]
    starts: list[int]
    ends: list[int]


def _entries(batch: int, new: int, k_cache: torch.Tensor, device: torch.device,
             cache_seqlens: object, cache_batch_idx: object, cache_leftpad: object,
             block_table: object) -> _Entries:
    """cache_seqlens / cache_batch_idx / cache_leftpad / block_table checked (read on the host)
    into _Entries; paged, the slots the appended keys go to checked distinct."""
    paged = block_table is not None
    pages: torch.Tensor | None = None
    rows: list[int] = []
    page_size = k_cache.shape[1]
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: expected None with block_table (a paged cache's "
                             "entries are their block_table rows)")
        pages = validate.page_table(block_table, batch, device)
        seqlen_cache = pages.shape[1] * page_size
    else:
        seqlen_cache = k_cache.shape[1]
        if cache_batch_idx is None:
            rows = list(range(batch))
            if k_cache.shape[0] < batch:
                raise ValueError(f"k_cache: expected at least batch = {batch} rows without "
                                 f"cache_batch_idx, got {k_cache.shape[0]}")
        else:
            rows = validate.host_ints(cache_batch_idx, "cache_batch_idx", batch, device)
            if any(not 0 <= r < k_cache.shape[0] for r in rows):
                raise ValueError(f"cache_batch_idx: expected rows in [0, {k_cache.shape[0]}) "
                                 f"(k_cache.shape[0]), got {rows}")
            if new and len(set(rows)) != batch:
                raise ValueError(f"cache_batch_idx: expected distinct rows when k / v are "
                                 f"appended, got {rows}")
    if cache_seqlens is None:
        lengths = [seqlen_cache] * batch
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lengths = [cache_seqlens] * batch
    else:
        lengths = validate.host_ints(cache_seqlens, "cache_seqlens", batch, device)
    if any(not 0 <= n <= seqlen_cache - new for n in lengths):
        where = "max_blocks_per_seq * page_size" if paged else "seqlen_cache"
        raise ValueError(f"cache_seqlens: expected values in [0, {seqlen_cache - new}] "
                         f"({where} - seqlen_new), got {lengths}")
    starts = [0] * batch
    if cache_leftpad is not None:
        starts = validate.host_ints(cache_leftpad, "cache_leftpad", batch, device)
        if any(not 0 <= s <= n for s, n in zip(starts, lengths, strict=True)):
            raise ValueError(f"cache_leftpad: expected 0 <= cache_leftpad[b] <= "
                             f"cache_seqlens[b] = {lengths}, got {starts}")
    ends = [n + new for n in lengths]  # each entry sees keys [starts[b], ends[b])
    if paged:
        validate.pages_in_pool(pages, ends, page_size, k_cache.shape[0])
    if paged and new and batch:
        blocks, offsets = _append_slots(lengths, new, rows, pages, page_size)
        flat = blocks * page_size + offsets
        if torch.unique(flat).numel() != flat.numel():
            raise ValueError("block_table: expected the appended positions of different entries "
                             "on distinct (block, offset) slots, got entries sharing a slot")
    return _Entries(rows, pages, lengths, starts, ends)


# A decode step whose entries are paged, left-padded or on cache rows out of order, or that has
# up to fwd_decode.MAX_QUERY_ROWS queries per entry, runs as one call of the decode kernels
# (they read the block table, the spans and the rows on the device) when this is on; off, such
# a step runs as before (runs of entries, a paged run on a gathered copy). On since the
# kernels' paged / span / row / several-row tests (tests/gpu/test_decode.py) passed on a GPU
# (session 44); off is the fallback if a kernel of that kind misbehaves.
SPANS_ON_DEVICE = True


def _one_call_window(seqlen_q: int, window_left: int | None, window_right: int | None,
                     keys: int) -> bool:
    """A step of seqlen_q queries per entry may run on the decode kernels under this window:
    one query that sees all of its `keys` keys, or several, causal (bottom-right) or seeing
    every key."""
    if seqlen_q == 1:
        return decode.sees_all_keys(window_left, window_right, keys)
    return window_left is None and window_right in (None, 0)


def _one_call_span(q: torch.Tensor, ent: _Entries, window_left: int | None,
                   window_right: int | None) -> tuple[int, bool] | None:
    """(positions, causal) of a step the decode kernels may run as one call — the keys of the
    longest entry, and whether its query rows are causal — or None. One query per entry: each
    entry sees its whole span (no window hides one of its keys). With SPANS_ON_DEVICE also up
    to fwd_decode.MAX_QUERY_ROWS per entry (speculative decoding's drafts, a short chunk),
    causal (bottom-right) or seeing every key, and paged / left-padded / reordered entries;
    without it the entries are on consecutive cache rows from their first key."""
    batch, seqlen_q = q.shape[0], q.shape[1]
    if batch == 0 or not max(ent.ends) or not decode.kernel_allowed():
        return None
    if not SPANS_ON_DEVICE and (seqlen_q != 1 or ent.pages is not None or any(ent.starts) or
                                ent.rows != list(range(ent.rows[0], ent.rows[0] + batch))):
        return None
    longest = max(e - s for s, e in zip(ent.starts, ent.ends, strict=True))
    if seqlen_q > fwd_decode.MAX_QUERY_ROWS or not _one_call_window(seqlen_q, window_left,
                                                                     window_right, longest):
        return None
    return max(ent.ends), window_right == 0  # (causal: fwd_decode ignores it for one query)


def _one_call_views(k_cache: torch.Tensor, v_cache: torch.Tensor, ent: _Entries, batch: int,
                    keys: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The caches as the decode kernels read them for _one_call_span's step: entries' consecutive
    cache rows (their first `keys` positions), or all rows / the whole page pool; and whether
    the entries' rows (or pages) are looked up on the device."""
    if ent.pages is None and ent.rows == list(range(ent.rows[0], ent.rows[0] + batch)):
        r0 = ent.rows[0]
        return k_cache[r0:r0 + batch, :keys], v_cache[r0:r0 + batch, :keys], False
    if ent.pages is None:
        return k_cache[:, :keys], v_cache[:, :keys], True
    return k_cache, v_cache, True


def _decode_in_one_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        scale: float, ent: _Entries, keys: int, causal: bool,
                        block_table: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """_one_call_span's step as one call of the decode kernels, each entry's span [starts[b],
    ends[b]), its cache row or its pages as device tensors (however ragged); None where the
    kernels do not take these tensors."""
    batch = q.shape[0]
    kc, vc, looked_up = _one_call_views(k_cache, v_cache, ent, batch, keys)
    if fwd_decode.can_take(q, kc, vc):
        return None
    # ends, starts and rows in one upload, from pinned memory on a GPU (a pageable copy waits
    # for the stream: the work queued before the call would be exposed as host time)
    host = torch.tensor([ent.ends, ent.starts, ent.rows or [0] * batch], dtype=torch.int32)
    spans = (host.pin_memory() if q.is_cuda else host).to(q.device, non_blocking=True)
    starts = spans[1] if any(ent.starts) else None
    rows = spans[2] if looked_up and ent.pages is None else None
    table = None
    if ent.pages is not None:  # (the columns the longest entry reaches)
        table = _unit_rows(block_table[:, :-(-keys // k_cache.shape[1])].to(q.device,
                                                                            torch.int32))
    return fwd_decode.attention(q, kc, vc, scale, spans[0], starts, rows, table, causal)


def _capturing(q: torch.Tensor) -> bool:
    """A CUDA graph is being captured on q's device's current stream."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _decode_step_captured(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          k: torch.Tensor | None, v: torch.Tensor | None, new: int,
                          tables: tuple[torch.Tensor, torch.Tensor] | None, interleaved: bool,
                          cache_seqlens: object, cache_batch_idx: object, cache_leftpad: object,
                          block_table: object, softmax_scale: object, causal: object,
                          window_size: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step while a CUDA graph is captured: nothing read on the host (no copy between
    host and device may run in a capture), so the graph replays with whatever cache_seqlens
    (and cache_batch_idx, cache_leftpad, block_table) hold then. Entry b's cache row b
    (cache_batch_idx[b]), or its pages (block_table[b]); the new keys written at
    cache_seqlens[b] ..; the decode kernels over its positions [cache_leftpad[b],
    cache_seqlens[b] + seqlen_new) (device tensors). cache_batch_idx / cache_leftpad /
    block_table only with SPANS_ON_DEVICE. The values cannot be checked here: positions past
    the cache (or past the rotary tables), rows and pages past the cache are clamped to its
    last slot (row, page), never written or read out of bounds — keeping them in range is the
    caller's part, as with FlashAttention, which does not check them either. The shapes,
    dtypes and devices are checked as outside a capture, before anything is written."""
    batch, seqlen_q = q.shape[0], q.shape[1]
    given = [name for name, t in (("block_table", block_table),
                                  ("cache_batch_idx", cache_batch_idx),
                                  ("cache_leftpad", cache_leftpad)) if t is not None]
    if given and not SPANS_ON_DEVICE:
        raise ValueError(f"{', '.join(given)}: not supported while a CUDA graph is "
                         "captured (they are read on the host); pass None")
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: expected None with block_table (a paged cache's "
                         "entries are their block_table rows)")
    most = fwd_decode.MAX_QUERY_ROWS if SPANS_ON_DEVICE else 1
    if not 1 <= seqlen_q <= most:
        what = (f"1 to {most} queries per entry" if most > 1 else
                f"one query per entry (seqlen_q = 1: a decode step; up to "
                f"{fwd_decode.MAX_QUERY_ROWS} with kvcache.SPANS_ON_DEVICE)")
        raise ValueError(f"q: expected {what} while a CUDA graph is captured, got seqlen_q = "
                         f"{seqlen_q}")
    table = rows = starts = None
    if block_table is not None:
        table = validate.device_page_table(block_table, batch, q.device)
        capacity = table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            rows = validate.batch_ints(cache_batch_idx, "cache_batch_idx", batch, q.device)
        elif k_cache.shape[0] < batch:
            raise ValueError(f"k_cache: expected at least batch = {batch} rows, got "
                             f"{k_cache.shape[0]}")
    if cache_leftpad is not None:
        starts = validate.batch_ints(cache_leftpad, "cache_leftpad", batch, q.device)
    if new > capacity:
        where = "max_blocks_per_seq * page_size" if table is not None else "seqlen_cache"
        raise ValueError(f"k: expected seqlen_new <= {where} = {capacity} (the new keys fit "
                         f"the cache), got {new}")
    if cache_seqlens is None:
        seqlens = q.new_full((batch,), capacity - new, dtype=torch.int64)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - new:
            raise ValueError(f"cache_seqlens: expected values in [0, {capacity - new}] "
                             f"(seqlen_cache - seqlen_new), got {cache_seqlens}")
        seqlens = q.new_full((batch,), cache_seqlens, dtype=torch.int64)
    else:
        seqlens = validate.batch_ints(cache_seqlens, "cache_seqlens", batch, q.device).long()
    window_left, window_right = validate.fa_window(window_size, causal)
    if not _one_call_window(seqlen_q, window_left, window_right, capacity):
        raise ValueError(f"window_size: expected a window that hides no cached key (with several "
                         f"queries: causal or none) while a CUDA graph is captured (the keys' "
                         f"count is on the device), got {window_size}")
    q_moves = window_left is not None or window_right is not None  # FlashAttention's rule
    scale = validate.softmax_scale(softmax_scale, q.shape[-1])
    if table is not None or rows is not None:  # all rows / the page pool, read where told
        kc, vc = k_cache, v_cache
        stand_in = tuple(t[:1, :1].expand(batch, capacity, *t.shape[2:]) for t in (kc, vc))
    else:
        kc, vc = k_cache[:batch], v_cache[:batch]
        stand_in = (kc, vc)
    _checked_qkv(q, *stand_in, names=("q", "k_cache", "v_cache"))
    q = _last_dim_contiguous(q, "q")
    reason = fwd_decode.can_take(q, kc, vc) or (
        None if decode.kernel_allowed() else "the decode kernels are off")
    if reason:
        raise ValueError(f"q, k_cache, v_cache: a decode step while a CUDA graph is captured "
                         f"runs on the decode kernels, which cannot take this call: {reason}")
    with torch.no_grad():
        if rows is not None:
            rows = rows.clamp(0, k_cache.shape[0] - 1)
        if table is not None:
            table = table.clamp(0, k_cache.shape[0] - 1)
        if new:
            pos = (seqlens.unsqueeze(1) + torch.arange(new, device=q.device)).clamp(0, capacity - 1)
            if tables is not None:
                ro = tables[0].shape[0] - 1
                q_pos = seqlens.unsqueeze(1) + (torch.arange(seqlen_q, device=q.device)
                                                 if q_moves else 0)
                q = rotary(q, *tables, q_pos.clamp(0, ro).expand(batch, seqlen_q), interleaved)
                k = rotary(k, *tables, pos.clamp(max=ro), interleaved)
            if table is not None:  # (page, row in the page) of each new key
                page = k_cache.shape[1]
                where = (table.long().gather(1, pos // page), pos % page)
            else:
                at = torch.arange(batch, device=q.device) if rows is None else rows.long()
                where = (at.unsqueeze(1).expand(batch, new), pos)
            k_cache[where] = k
            v_cache[where] = v
        counts = (seqlens + new).clamp(0, capacity).int()
        return fwd_decode.attention(q, kc, vc, scale, counts,
                                    None if starts is None else starts.int(),
                                    None if rows is None else rows.int(),
                                    None if table is None else _unit_rows(table.int()),
                                    window_right == 0)


def _unit_rows(table: torch.Tensor) -> torch.Tensor:
    """The block table with a unit last stride, as the decode kernels read it."""
    return table if table.stride(-1) == 1 else table.contiguous()


def _runs(batch: int, same) -> list[tuple[int, int]]:
    """[b, e) runs of consecutive batch entries with same(e - 1, e)."""
    runs, b = [], 0
    while b < batch:
        e = b + 1
        while e < batch and same(e - 1, e):
            e += 1
        runs.append((b, e))
        b = e
    return runs


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            rotary_cos: torch.Tensor | None = None,
                            rotary_sin: torch.Tensor | None = None,
                            cache_seqlens: int | torch.Tensor | None = None,
                            cache_batch_idx: torch.Tensor | None = None,
                            cache_leftpad: torch.Tensor | None = None,
                            block_table: torch.Tensor | None = None,
                            softmax_scale: float | None = None, causal: bool = False,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True,
                            alibi_slopes: torch.Tensor | None = None, num_splits: int = 0,
                            return_softmax_lse: bool = False):
    """Attention of q over a KV cache, appending new keys first (FlashAttention's
    flash_attn_with_kvcache, for inference: no autograd).

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_kv, headdim), or with block_table
            (num_blocks, page_size, nheads_kv, headdim) (any page_size >= 1); same dtype and
            device as q, a contiguous last dimension; nheads % nheads_kv == 0.
        k, v: optional (batch, seqlen_new, nheads_kv, headdim): written into the caches in place
            at positions cache_seqlens[b] .. + seqlen_new of entry b's cache row (rotated first
            with rotary_cos / sin) before the attention, which then sees them (cache_seqlens is
            then required; the positions written must be distinct across the batch).
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2), q's dtype, rotary_dim <=
            headdim; only with k / v. The appended key at position p and q are rotated by row p
            of the tables (flashcuda.kvcache.rotary; rotary_interleaved picks the pairs: (0, 1),
            (2, 3), ... when True, (0, rotary_dim / 2), ... when False). Query i of entry b is
            at position cache_seqlens[b] + i when causal or windowed, else every query at
            cache_seqlens[b]. Positions count from the cache row's start (left padding
            included), as FlashAttention's; every position used must be < seqlen_ro.
        cache_seqlens: int, or (batch,) int32 / int64 tensor: the end of the keys already in
            each cache row (the attention sees up to cache_seqlens[b] + seqlen_new); None: the
            whole cache (seqlen_cache, or max_blocks_per_seq * page_size when paged).
        cache_batch_idx: optional (batch,) int tensor: the cache row of each batch entry
            (default 0 .. batch - 1; distinct when k / v are appended; not with block_table).
        cache_leftpad: optional (batch,) int tensor: where each entry's keys start in its row
            (0 .. cache_seqlens[b]); the keys before it are not attended to.
        block_table: optional (batch, max_blocks_per_seq) int tensor: a paged cache; logical
            position p of entry b lives at k_cache[block_table[b, p // page_size],
            p % page_size]. Only the blocks that hold positions below cache_seqlens[b] +
            seqlen_new are read, and must be in [0, num_blocks).
        softmax_scale, causal, window_size: as flash_attn_func, with seqlen_k the keys each
            entry sees (cache_seqlens[b] + seqlen_new - cache_leftpad[b]; causal: bottom-right
            aligned, so the new queries are the last positions).
        num_splits: a performance hint in FlashAttention; accepted and ignored.
        softcap, alibi_slopes: not implemented (NotImplementedError unless left at their
            defaults).
        return_softmax_lse: return (out, lse) with lse (batch, nheads, seqlen_q) float32.

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype (and lse), computed without autograd.

    How it runs: the rotation and the append are PyTorch operations (one indexed write per
    cache). A decode step (one query per entry; unpaged, not left-padded, entries on consecutive
    cache rows; fp16 / bf16, head_dim a multiple of 8 up to 256) is one call of the decode
    kernels (flashcuda.ops.fwd_decode: split-KV, the entries' key counts as a device tensor,
    however ragged). Otherwise one kernel call per run of consecutive batch entries that see the
    same span of keys — on views of the caches when the entries are on consecutive cache rows,
    on a gathered contiguous copy of their pages when paged (the copy costs a read and a write of
    the keys and values seen: a paged cache is correct here, not fast); host-bound when many
    entries differ. With kvcache.SPANS_ON_DEVICE (on by default), a paged,
    left-padded or row-reordered decode step is one call of the decode kernels too (they read
    the block table, the spans and the rows on the device, and the pages in place), and so is
    a step of up to 16 queries per entry (speculative decoding's drafts; causal or seeing
    every key).
    cache_seqlens, cache_batch_idx, cache_leftpad and block_table tensors are read on the host
    (device-to-host copies, which wait for the GPU), and their values checked.

    While a CUDA graph is captured (torch.cuda.graph), a decode step (seqlen_q = 1, no
    block_table / cache_batch_idx / cache_leftpad, no window hiding a cached key — with
    SPANS_ON_DEVICE those three and up to 16 queries per entry, causal or none — fp16 / bf16
    with head_dim a multiple of 8 up to 256) is captured instead with
    nothing read on the host: the append, the rotation and the decode kernels take
    cache_seqlens (and those three) from the device, so each replay uses the values they hold
    then. Those values cannot be checked in a capture; positions past the cache or the rotary
    tables, rows and pages past the cache are clamped to the last slot / row / page (keeping
    them in range is the caller's part, as with FlashAttention). Other calls raise ValueError
    during a capture, naming what they would read on the host.
    """
    validate.check_fa_unsupported(softcap=softcap, alibi_slopes=alibi_slopes)
    interleaved = validate.check_flag(rotary_interleaved, "rotary_interleaved")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0, got {num_splits!r}")
    return_softmax_lse = validate.check_flag(return_softmax_lse, "return_softmax_lse")
    paged = block_table is not None
    cache_dims = ("num_blocks, page_size" if paged else "batch_cache, seqlen_cache")
    for t, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if validate.check_tensor(t, name).dim() != 4:
            dims = "batch, seqlen, nheads, headdim" if name == "q" else \
                f"{cache_dims}, nheads_kv, headdim"
            raise ValueError(f"{name}: expected 4 dims ({dims}), got shape {tuple(t.shape)}")
    batch = q.shape[0]
    validate.check_shape_dtype_device(v_cache, "v_cache", shape=k_cache.shape, dtype=k_cache.dtype,
                                      device=k_cache.device)
    new = _new_keys(k, v, batch, k_cache)
    if new and cache_seqlens is None:
        raise ValueError("cache_seqlens: required with k / v (where to append them), got None")
    tables = _rotary_tables(rotary_cos, rotary_sin, q, k is not None)
    if _capturing(q):
        out, lse = _decode_step_captured(q, k_cache, v_cache, k, v, new, tables, interleaved,
                                         cache_seqlens, cache_batch_idx, cache_leftpad,
                                         block_table, softmax_scale, causal, window_size)
        return (out, lse) if return_softmax_lse else out

    ent = _entries(batch, new, k_cache, q.device, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table)
    rows, lengths, starts, ends = ent.rows, ent.lengths, ent.starts, ent.ends
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.stride(-1) != 1 and t.shape[-1] != 1:  # (written in place: never copied)
            raise ValueError(f"{name}: expected a contiguous last dimension (the cache is "
                             f"written in place), got strides {t.stride()}")
    window_left, window_right = validate.fa_window(window_size, causal)
    scale = validate.softmax_scale(softmax_scale, q.shape[-1])
    q_moves = window_left is not None or window_right is not None  # FlashAttention's rule
    if tables is not None:
        q_span = q.shape[1] if q_moves else min(q.shape[1], 1)
        last = max((n + max(new, q_span) - 1 for n in lengths), default=-1)
        if last >= tables[0].shape[0]:
            raise ValueError(f"rotary_cos: expected at least {last + 1} rows (the largest "
                             f"position rotated is {last}), got seqlen_ro = "
                             f"{tables[0].shape[0]}")

    # one call per run of consecutive entries seeing the same span (and, unpaged, on consecutive
    # cache rows: views of the caches, through which the append below shows); every call's
    # operands checked before anything is written (a paged run's by a stand-in of its copy)
    def same(a: int, b: int) -> bool:
        return (ends[a], starts[a]) == (ends[b], starts[b]) and (paged or rows[b] == rows[a] + 1)

    runs = _runs(batch, same)
    if paged:
        row_bytes = math.prod(k_cache.shape[2:]) * k_cache.element_size()
        entry_bytes = 2 * max(ends, default=0) * row_bytes
        per_gather = max(1, GATHER_BYTES // max(entry_bytes, 1))
        runs = [(c, min(c + per_gather, e)) for b, e in runs for c in range(b, e, per_gather)]
    names = ("q", "k_cache", "v_cache")
    if batch == 0:
        _checked_qkv(q, k_cache[:0, :0], v_cache[:0, :0], names=names)
    one_call = _one_call_span(q, ent, window_left, window_right)
    if one_call is not None:  # one check of the whole span stands for the runs' (same tensors)
        keys = one_call[0]
        kc, vc, looked_up = _one_call_views(k_cache, v_cache, ent, batch, keys)
        if looked_up:  # (stride-0 stand-ins: (batch, keys, nheads_kv, headdim))
            kc, vc = (t[:1, :1].expand(batch, keys, *t.shape[2:]) for t in (k_cache, v_cache))
        _checked_qkv(q, kc, vc, names=names)

    for b, e in ([] if one_call is not None else runs):
        span = slice(starts[b], ends[b])
        if paged:  # stride-0 stand-ins of the gathered copy's (e - b, span, nheads_kv, headdim)
            shape = (e - b, ends[b] - starts[b], *k_cache.shape[2:])
            kc, vc = (t.new_empty((1, 1, *t.shape[2:])).expand(shape) for t in (k_cache, v_cache))
        else:
            kc, vc = (t[rows[b]:rows[b] + e - b, span] for t in (k_cache, v_cache))
        _checked_qkv(q[b:e], kc, vc, names=names)

    q = _last_dim_contiguous(q, "q")  # (checked above but for its last stride)
    with torch.no_grad():
        if tables is not None:
            base = torch.tensor(lengths, dtype=torch.long, device=q.device).unsqueeze(1)
            q_pos = base + (torch.arange(q.shape[1], device=q.device) if q_moves else 0)
            k_pos = base + torch.arange(new, device=q.device)
            q = rotary(q, *tables, q_pos.expand(batch, q.shape[1]), interleaved)
            k = rotary(k, *tables, k_pos, interleaved)
        if new and batch:  # append in place: one write per cache
            r0, n0 = (rows or [0])[0], lengths[0]
            if rows == list(range(r0, r0 + batch)) and lengths == [n0] * batch:  # one block
                k_cache[r0:r0 + batch, n0:n0 + new] = k
                v_cache[r0:r0 + batch, n0:n0 + new] = v
            else:  # one indexed write
                slots = _append_slots(lengths, new, rows, ent.pages, k_cache.shape[1])
                index = tuple(t.to(k_cache.device) for t in slots)
                k_cache[index] = k.reshape(-1, *k.shape[2:])
                v_cache[index] = v.reshape(-1, *v.shape[2:])
        one = None if one_call is None else _decode_in_one_call(q, k_cache, v_cache, scale,
                                                                ent, *one_call, block_table)
        if one is not None:
            results, runs = [one], []
        elif batch == 0:
            results = [attention(q, k_cache[:0, :0], v_cache[:0, :0], scale, window_left,
                                 window_right)]
        else:
            results = []
        for b, e in runs:
            if paged:
                blocks = block_table[b:e, :-(-ends[b] // k_cache.shape[1])].long()
                kc, vc = (t[blocks].flatten(1, 2)[:, starts[b]:ends[b]]
                          for t in (k_cache, v_cache))
            else:
                kc, vc = (t[rows[b]:rows[b] + e - b, starts[b]:ends[b]]
                          for t in (k_cache, v_cache))
            # (a decoding run: GQA packed, one entry's long span split, by ops.decode)
            results.append(attention(q[b:e], kc, vc, scale, window_left, window_right))
    out = torch.cat([o for o, _ in results]) if len(results) > 1 else results[0][0]
    lse = torch.cat([x for _, x in results]) if len(results) > 1 else results[0][1]
    return (out, lse) if return_softmax_lse else out

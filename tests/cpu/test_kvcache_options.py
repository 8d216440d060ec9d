"""flash_attn_with_kvcache's options on CPU tensors (the portable path) against the float64
oracle: rotary embeddings (both pair layouts, part or all of headdim, queries at one position or
moving with causal / windowed calls), left-padded caches, paged caches (a block table over
permuted pages of an odd size, the positions nothing may read poisoned with NaN), all three at
once; and their argument errors by name, before any write.

Tolerances: the kernels' path is float32 here (2e-6 as in test_kvcache.py) plus, with rotary
embeddings, what rounding the rotation to float32 can move: an element of a rotated pair
(a, b) is within 2u(|a| + |b|) max(|cos|, |sin|) of the exact rotation (u = 2^-24: two products
and one sum, each rounded once), so a score moves by at most ds = scale * sum_d (dq |k| + |q| dk
+ dq dk), the lse by ds and the output by 2 ds max|v| (the softmax's weights move by at most 2 ds
in l1 norm)."""

from __future__ import annotations

import pytest
import torch

import flashcuda
from flashcuda import kvcache
from flashcuda.reference import attention_ref, rotary_ref

U = 2.0 ** -24  # float32's unit roundoff


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen)


def rotate_ref(x, cos, sin, pos, interleaved):
    """The float64 rotation (reference.rotary_ref) and the float32 rounding bound of each
    element (module docstring)."""
    half = cos.shape[1]
    c, s = (t.double()[pos].unsqueeze(2) for t in (cos, sin))
    r = x.double()[..., :2 * half]
    a, b = (r[..., 0::2], r[..., 1::2]) if interleaved else (r[..., :half], r[..., half:])
    slack = 2 * U * (a.abs() + b.abs()) * torch.maximum(c.abs(), s.abs())
    pair = torch.stack((slack, slack), -1).flatten(-2) if interleaved else torch.cat(
        (slack, slack), -1)
    bound = torch.cat((pair, torch.zeros_like(x[..., 2 * half:], dtype=torch.float64)), -1)
    return rotary_ref(x, cos, sin, pos, interleaved), bound


def score_slack(q, dq, k, dk, scale):
    """ds: the largest change of a score q·k * scale when q, k move by at most dq, dk."""
    rep = q.shape[2] // k.shape[2]
    k, dk = (t.repeat_interleave(rep, dim=2) for t in (k, dk))
    s = (torch.einsum("bqhd,bkhd->bhqk", dq, k.abs()) + torch.einsum("bqhd,bkhd->bhqk", q.abs(), dk)
         + torch.einsum("bqhd,bkhd->bhqk", dq, dk))
    return scale * float(s.max()) if s.numel() else 0.0


def check(out, lse, q, k, v, scale, causal, window, ds=0.0, pieces=0):
    """out / lse against the oracle: 2e-6, the rotation's share (ds, module docstring) and, for
    a split call's `pieces`, its combine in float32: each weight exp(lse_i - lse) is off by at
    most (3 max|lse| + 2) u relative (the difference of two lse values rounded, then exp), and
    the weighted sum adds a rounding per piece, all of outputs bounded by max|v|."""
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), scale, causal=causal,
                                 window_size=window)
    vmax = float(v.abs().max()) if v.numel() else 0.0
    finite_lse = ref_lse[torch.isfinite(ref_lse)]
    lmax = float(finite_lse.abs().max()) if finite_lse.numel() else 0.0
    combine = (3 * lmax + 2 + pieces) * U * vmax if pieces else 0.0
    torch.testing.assert_close(out.double(), ref, atol=2e-6 + 2 * ds * vmax + combine, rtol=0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=2e-6 + ds, rtol=0)


def angles(rows, half, gen):
    theta = torch.rand(rows, half, generator=gen) * 6.2832
    return torch.cos(theta), torch.sin(theta)


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("half", [8, 16], ids=["part", "whole"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (4, 1))],
                         ids=["causal", "full", "window"])
def test_rotary(interleaved, half, causal, window):
    """q and the appended keys rotated at their positions (the queries all at cache_seqlens when
    neither causal nor windowed); the cache holds the rotated keys."""
    g = torch.Generator().manual_seed(11 + half + 3 * causal + 5 * interleaved)
    B, Sq, new, H, Hk, D, cap = 3, 3, 2, 4, 2, 32, 24
    q = rand(B, Sq, H, D, gen=g)
    k_cache, v_cache = rand(5, cap, Hk, D, gen=g), rand(5, cap, Hk, D, gen=g)
    k, v = rand(B, new, Hk, D, gen=g), rand(B, new, Hk, D, gen=g)
    cos, sin = angles(cap + 2, half, g)
    lengths, rows = [7, 0, 19], [4, 0, 2]
    before = k_cache.clone()
    out, lse = flashcuda.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
        cache_batch_idx=torch.tensor(rows, dtype=torch.int32), causal=causal, window_size=window,
        rotary_interleaved=interleaved, return_softmax_lse=True)
    moves = causal or window != (-1, -1)
    for b, (n, r) in enumerate(zip(lengths, rows, strict=True)):
        k_pos = torch.arange(n, n + new).unsqueeze(0)
        q_pos = (torch.arange(n, n + Sq) if moves else torch.full((Sq,), n)).unsqueeze(0)
        k_rot, k_bound = rotate_ref(k[b:b + 1], cos, sin, k_pos, interleaved)
        q_rot, q_bound = rotate_ref(q[b:b + 1], cos, sin, q_pos, interleaved)
        got = k_cache[r:r + 1, n:n + new].double()
        assert ((got - k_rot).abs() <= k_bound).all(), "a rotated key beyond its rounding bound"
        assert torch.equal(v_cache[r, n:n + new], v[b]), "values are appended unrotated"
        assert torch.equal(k_cache[r, :n], before[r, :n]), "the cached keys are not touched"
        keys = torch.cat((before[r:r + 1, :n].double(), k_rot), dim=1)
        dk = torch.cat((torch.zeros_like(before[r:r + 1, :n], dtype=torch.float64), k_bound), 1)
        ds = score_slack(q_rot, q_bound, keys, dk, D ** -0.5)
        check(out[b:b + 1], lse[b:b + 1], q_rot, keys, v_cache[r:r + 1, :n + new], D ** -0.5,
              causal, window, ds)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_left_padded_cache(causal, monkeypatch):
    """Entry b attends to keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new) of its row; the
    entries on consecutive rows with the same span are one kernel call."""
    calls = []
    real = kvcache.attention
    monkeypatch.setattr(kvcache, "attention",
                        lambda q, k, *rest: calls.append(k.shape[:2]) or real(q, k, *rest))
    g = torch.Generator().manual_seed(21 + causal)
    B, Sq, new, H, Hk, D, cap = 4, 2, 2, 4, 1, 16, 20
    q = rand(B, Sq, H, D, gen=g)
    k_cache, v_cache = rand(B, cap, Hk, D, gen=g), rand(B, cap, Hk, D, gen=g)
    k, v = rand(B, new, Hk, D, gen=g), rand(B, new, Hk, D, gen=g)
    lengths, pads = [9, 9, 14, 0], [2, 2, 14, 0]
    out, lse = flashcuda.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
        cache_leftpad=torch.tensor(pads, dtype=torch.int32), causal=causal,
        return_softmax_lse=True)
    assert calls == [(2, 9), (1, 2), (1, 2)]
    for b, (n, p) in enumerate(zip(lengths, pads, strict=True)):
        assert torch.equal(k_cache[b, n:n + new], k[b]) and torch.equal(v_cache[b, n:n + new], v[b])
        check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, p:n + new],
              v_cache[b:b + 1, p:n + new], D ** -0.5, causal, (-1, -1))


def page_table(B, cap, page, gen, spare=3):
    """A block table for B entries of cap positions in pages of `page`: a random permutation of
    num_blocks = B * blocks + spare blocks. Returns (table, num_blocks)."""
    blocks = -(-cap // page)
    perm = torch.randperm(B * blocks + spare, generator=gen)
    return perm[:B * blocks].view(B, blocks).to(torch.int32), B * blocks + spare


def paged(logical, lengths, table, num_blocks, page):
    """logical (B, cap, Hk, D) laid out through `table`; every position at or past an entry's
    length, and every spare block, NaN (nothing there may be read)."""
    cache = torch.full((num_blocks, page, *logical.shape[2:]), float("nan"))
    for b in range(logical.shape[0]):
        for p in range(lengths[b]):
            cache[table[b, p // page], p % page] = logical[b, p]
    return cache


def test_paged_cache_with_left_padding_and_rotary(monkeypatch):
    """A block table over permuted 5-position pages, ragged lengths (one entry empty), left
    padding, new keys rotated and appended through the table, GQA, causal; against the oracle
    on each entry's logical keys. The gather is forced into one entry at a time for one run."""
    g = torch.Generator().manual_seed(31)
    B, Sq, new, H, Hk, D, cap, page = 5, 3, 3, 6, 2, 32, 23, 5
    q = rand(B, Sq, H, D, gen=g)
    lk, lv = rand(B, cap, Hk, D, gen=g), rand(B, cap, Hk, D, gen=g)
    k, v = rand(B, new, Hk, D, gen=g), rand(B, new, Hk, D, gen=g)
    lengths, pads = [11, 11, 11, 0, 17], [3, 3, 3, 0, 0]
    table, num_blocks = page_table(B, cap, page, g)
    k_cache, v_cache = (paged(t, lengths, table, num_blocks, page) for t in (lk, lv))
    cos, sin = angles(cap + page, 12, g)
    calls = []
    real = kvcache.attention
    monkeypatch.setattr(kvcache, "attention",
                        lambda q, k, *rest: calls.append(k.shape[:2]) or real(q, k, *rest))
    monkeypatch.setattr(kvcache, "GATHER_BYTES", 2 * (2 * 20 * Hk * D * 4))  # two entries a gather
    out, lse = flashcuda.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
        cache_leftpad=torch.tensor(pads, dtype=torch.int32), block_table=table, causal=True,
        rotary_interleaved=False, return_softmax_lse=True)
    assert calls == [(2, 11), (1, 11), (1, 3), (1, 20)]
    for b, (n, p) in enumerate(zip(lengths, pads, strict=True)):
        k_rot, k_bound = rotate_ref(k[b:b + 1], cos, sin, torch.arange(n, n + new)[None], False)
        q_rot, q_bound = rotate_ref(q[b:b + 1], cos, sin, torch.arange(n, n + Sq)[None], False)
        slots = [(int(table[b, i // page]), i % page) for i in range(n, n + new)]
        got = torch.stack([k_cache[s] for s in slots]).double()[None]
        assert ((got - k_rot).abs() <= k_bound).all()
        assert torch.equal(torch.stack([v_cache[s] for s in slots]), v[b])
        keys = torch.cat((lk[b:b + 1, p:n].double(), k_rot), dim=1)
        dk = torch.cat((torch.zeros(1, n - p, Hk, D, dtype=torch.float64), k_bound), dim=1)
        values = torch.cat((lv[b:b + 1, p:n], v[b:b + 1]), dim=1)
        ds = score_slack(q_rot, q_bound, keys, dk, D ** -0.5)
        check(out[b:b + 1], lse[b:b + 1], q_rot, keys, values, D ** -0.5, True, (-1, -1), ds)


def test_paged_cache_whole_table_without_new_keys():
    """cache_seqlens None with a block table: every entry sees max_blocks_per_seq * page_size
    positions, read through its own pages (one gather for the batch)."""
    g = torch.Generator().manual_seed(41)
    B, cap, page = 3, 12, 4
    q = rand(B, 2, 2, 16, gen=g)
    lk, lv = rand(B, cap, 2, 16, gen=g), rand(B, cap, 2, 16, gen=g)
    table, num_blocks = page_table(B, cap, page, g, spare=0)
    k_cache, v_cache = (paged(t, [cap] * B, table, num_blocks, page) for t in (lk, lv))
    out, lse = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table,
                                                 return_softmax_lse=True)
    check(out, lse, q, lk, lv, 16 ** -0.5, False, (-1, -1))


def test_option_arguments_are_checked_by_name_before_any_write():
    g = torch.Generator().manual_seed(51)
    q = rand(2, 1, 2, 16, gen=g)
    kc, vc = rand(2, 8, 2, 16, gen=g), rand(2, 8, 2, 16, gen=g)
    k1 = rand(2, 1, 2, 16, gen=g)
    cos, sin = angles(8, 4, g)
    i32 = dict(dtype=torch.int32)
    before = kc.clone(), vc.clone()
    call = flashcuda.flash_attn_with_kvcache

    def refused(exc, match, *args, **kwargs):
        with pytest.raises(exc, match=match):
            call(q, kc, vc, *args, **kwargs)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), match

    refused(ValueError, "rotary_cos, rotary_sin: expected both", k1, k1, rotary_cos=cos,
            cache_seqlens=1)
    refused(ValueError, "rotary_cos: expected new keys", rotary_cos=cos, rotary_sin=sin)
    refused(TypeError, "rotary_cos: expected dtype float32", k1, k1, rotary_cos=cos.half(),
            rotary_sin=sin.half(), cache_seqlens=1)
    refused(ValueError, "rotary_cos: expected shape \\(seqlen_ro, rotary_dim / 2\\)", k1, k1,
            rotary_cos=torch.ones(8, 9), rotary_sin=torch.ones(8, 9), cache_seqlens=1)
    refused(ValueError, "rotary_sin: expected shape \\(8, 4\\)", k1, k1, rotary_cos=cos,
            rotary_sin=sin[:7], cache_seqlens=1)
    refused(ValueError, "rotary_cos: expected at least 8 rows", k1, k1, rotary_cos=cos[:7],
            rotary_sin=sin[:7], cache_seqlens=7)
    refused(TypeError, "rotary_interleaved: expected a bool", k1, k1, rotary_cos=cos,
            rotary_sin=sin, cache_seqlens=1, rotary_interleaved=1)
    refused(ValueError, "cache_leftpad: expected 0 <= cache_leftpad\\[b\\] <= cache_seqlens", k1,
            k1, cache_seqlens=torch.tensor([3, 3], **i32), cache_leftpad=torch.tensor([0, 4], **i32))
    refused(TypeError, "cache_leftpad: expected dtype int32 or int64", k1, k1, cache_seqlens=3,
            cache_leftpad=torch.zeros(2))
    refused(ValueError, "cache_leftpad: expected shape \\(2,\\)", k1, k1, cache_seqlens=3,
            cache_leftpad=torch.zeros(3, **i32))
    # paged: kc / vc as 2 blocks of 8 positions
    table = torch.tensor([[0], [1]], **i32)
    refused(TypeError, "block_table: expected dtype int32 or int64", k1, k1, cache_seqlens=1,
            block_table=table.float())
    refused(ValueError, "block_table: expected shape \\(batch = 2, max_blocks_per_seq\\)", k1, k1,
            cache_seqlens=1, block_table=table[:1])
    refused(ValueError, "cache_batch_idx: expected None with block_table", k1, k1,
            cache_seqlens=1, block_table=table, cache_batch_idx=torch.tensor([0, 1], **i32))
    refused(ValueError, "block_table: expected the blocks of entry 1's first 2 positions in "
            "\\[0, 2\\)", k1, k1, cache_seqlens=1, block_table=torch.tensor([[0], [2]], **i32))
    refused(ValueError, "block_table: expected the appended positions of different entries on "
            "distinct", k1, k1, cache_seqlens=1, block_table=torch.tensor([[1], [1]], **i32))
    refused(ValueError, "cache_seqlens: expected values in \\[0, 7\\] \\(max_blocks_per_seq \\* "
            "page_size - seqlen_new\\)", k1, k1, cache_seqlens=8, block_table=table)
    with pytest.raises(ValueError, match="k_cache: expected 4 dims \\(num_blocks, page_size"):
        call(q, kc[0], vc[0], block_table=table)
    # a table entry past the blocks an entry uses is never read: not checked
    ok = call(q, kc, vc, k1, k1, cache_seqlens=1, block_table=torch.tensor([[0, 99], [1, -1]], **i32))
    assert ok.shape == q.shape


def test_query_with_a_strided_last_dimension_is_copied_then_attends(monkeypatch):
    """q whose last dimension is strided (a transposed view) is copied, as flash_attn_func does,
    after its checks: the kernels get a unit last stride (the CUDA ones need it)."""
    real = kvcache.attention

    def unit_last_stride(q, k, v, *rest):
        assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
        return real(q, k, v, *rest)

    monkeypatch.setattr(kvcache, "attention", unit_last_stride)
    g = torch.Generator().manual_seed(101)
    q = rand(2, 1, 16, 4, gen=g).transpose(-1, -2)  # (2, 1, 4, 16), stride(-1) == 4
    assert q.stride(-1) != 1
    k_cache, v_cache = rand(2, 30, 2, 16, gen=g), rand(2, 30, 2, 16, gen=g)
    out, lse = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=25,
                                                 return_softmax_lse=True)
    check(out, lse, q, k_cache[:, :25], v_cache[:, :25], 0.25, False, (-1, -1))


def test_empty_page_pool_with_entries_that_see_no_key():
    """A pool of no blocks is a valid paged cache for entries with no keys: out 0, lse -inf."""
    q = torch.randn(2, 1, 2, 16)
    pool = torch.randn(0, 4, 2, 16)
    out, lse = flashcuda.flash_attn_with_kvcache(q, pool, pool, cache_seqlens=0,
                                                 block_table=torch.zeros(2, 1, dtype=torch.int32),
                                                 return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()

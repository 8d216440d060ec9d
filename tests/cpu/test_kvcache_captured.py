"""flash_attn_with_kvcache's decode step as captured in a CUDA graph (kvcache._decode_step_captured:
nothing read on the host), on CPU tensors: the capture forced, the decode kernels replaced by the
float64 oracle over each entry's first seqused[b] keys (fwd_decode.attention's contract; the
kernels themselves are checked on the GPU: tests/gpu/test_decode.py). Checked against the
checked path (the same call outside a capture): the caches bit for bit after the append and the
rotation, and out / lse within 1e-5 (the oracle here against the portable float32 path there);
no tensor value read on the host; positions past the cache clamped, never out of bounds; the
calls a capture cannot run refused by name before any write."""

from __future__ import annotations

import contextlib

import pytest
import torch

import flashcuda
from flashcuda import kvcache
from flashcuda.ops import fwd_decode
from flashcuda.reference import attention_ref


def oracle_decode(q, k, v, scale, seqused=None, seqstart=None, cache_rows=None,
                  block_table=None, causal=False):
    """fwd_decode.attention's contract in float64: sequence b over positions [seqstart[b],
    seqused[b]) of cache row cache_rows[b] (default b), or of its pages in block_table; its Sq
    query rows the last positions (causal: row i ends Sq - 1 - i positions earlier)."""
    host = torch._C.TensorBase.tolist  # (the kernels read these on the device)
    batch, sq = q.shape[:2]
    cap = k.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    ends = [cap] * batch if seqused is None else host(seqused)
    starts = [0] * batch if seqstart is None else host(seqstart)
    rows = list(range(batch)) if cache_rows is None else host(cache_rows)
    out = q.new_zeros(q.shape)
    lse = torch.full((batch, q.shape[2], sq), float("-inf"))
    for b, (s, e) in enumerate(zip(starts, ends, strict=True)):
        if block_table is not None:
            kb, vb = (t[block_table[b].long()].flatten(0, 1)[None] for t in (k, v))
        else:
            kb, vb = k[rows[b]:rows[b] + 1], v[rows[b]:rows[b] + 1]
        for i in range(sq):
            end = e - (sq - 1 - i) if causal else e
            if end > s:
                o, x = attention_ref(q[b:b + 1, i:i + 1].double(), kb[:, s:end].double(),
                                     vb[:, s:end].double(), softmax_scale=scale)
                out[b, i], lse[b, :, i] = o[0, 0].to(q.dtype), x[0, :, 0].float()
    return out, lse


@pytest.fixture
def captured(monkeypatch):
    """Force the captured path, the decode kernels replaced by the oracle; reading a tensor's
    values on the host fails (as it would during a capture)."""
    monkeypatch.setattr(fwd_decode, "can_take", lambda q, k, v: None)
    monkeypatch.setattr(fwd_decode, "attention", oracle_decode)

    def no_host_read(*args, **kwargs):
        raise AssertionError("a tensor's values were read on the host during a capture")

    class Capture:
        def __enter__(self):
            monkeypatch.setattr(kvcache, "_capturing", lambda q: True)
            for name in ("tolist", "item", "__int__", "__index__", "__bool__"):
                monkeypatch.setattr(torch.Tensor, name, no_host_read)

        def __exit__(self, *exc):
            for name in ("tolist", "item", "__int__", "__index__", "__bool__"):
                monkeypatch.setattr(torch.Tensor, name, getattr(torch._C.TensorBase, name))
            monkeypatch.setattr(kvcache, "_capturing", lambda q: False)

    return Capture()


def tables(rows, half, gen):
    theta = torch.rand(rows, half, generator=gen, dtype=torch.float64) * 6.3
    return theta.cos().float(), theta.sin().float()


@pytest.mark.parametrize("rotary", [None, True, False], ids=["plain", "gptj", "neox"])
@pytest.mark.parametrize("new", [0, 1, 3])
@pytest.mark.parametrize("seqlens", ["tensor", "int", "none"])
def test_captured_step_matches_the_checked_path(captured, rotary, new, seqlens):
    gen = torch.Generator().manual_seed(new + 7 * (rotary is None))
    B, cap, H, Hk, D = 3, 40, 8, 2, 16
    if seqlens == "none":
        lengths = [cap - new] * B
    elif seqlens == "int":
        lengths = [17] * B
    else:
        lengths = [0, 23, cap - new]
    k_cache = torch.randn(B + 1, cap, Hk, D, generator=gen)
    v_cache = torch.randn(B + 1, cap, Hk, D, generator=gen)
    q = torch.randn(B, 1, H, D, generator=gen)
    k = v = None
    if new:
        k, v = (torch.randn(B, new, Hk, D, generator=gen) for _ in range(2))
    cos = sin = None
    if rotary is not None and new:
        cos, sin = tables(cap + 2, 6, gen)
    arg = {"tensor": torch.tensor(lengths, dtype=torch.int32), "int": 17, "none": None}[seqlens]
    kw = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=arg, causal=True,
              rotary_interleaved=bool(rotary), return_softmax_lse=True)
    if seqlens == "none" and new:  # refused in and out of a capture alike
        with captured, pytest.raises(ValueError, match="cache_seqlens: required"):
            flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
        return
    kc1, vc1 = k_cache.clone(), v_cache.clone()
    out1, lse1 = flashcuda.flash_attn_with_kvcache(q, kc1, vc1, **kw)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    with captured:
        out2, lse2 = flashcuda.flash_attn_with_kvcache(q, kc2, vc2, **kw)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    assert torch.allclose(out2, out1, atol=1e-5, rtol=0)
    assert torch.allclose(lse2, lse1, atol=1e-5, rtol=0)


def test_positions_past_the_cache_are_clamped_not_written_out_of_bounds(captured):
    """cache_seqlens = seqlen_cache with one new key (the caller's error, which a capture
    cannot see): the new key lands in the last slot, the entry sees the whole row, nothing
    else changes."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(2, 10, 1, 8, generator=gen) for _ in range(2))
    q = torch.randn(2, 1, 2, 8, generator=gen)
    k, v = (torch.randn(2, 1, 1, 8, generator=gen) for _ in range(2))
    before = k_cache.clone()
    with captured:
        out = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                cache_seqlens=torch.tensor([10, 3]))
    assert torch.equal(k_cache[0, 9], k[0, 0]) and torch.equal(k_cache[0, :9], before[0, :9])
    assert torch.equal(k_cache[1, 3], k[1, 0]) and torch.equal(k_cache[1, 4:], before[1, 4:])
    ref, _ = oracle_decode(q[:1], k_cache[:1], v_cache[:1], 8 ** -0.5)
    assert torch.allclose(out[:1], ref, atol=1e-6)


@pytest.mark.parametrize("case,match", [
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "block_table"),
    (dict(cache_batch_idx=torch.tensor([1, 0])), "cache_batch_idx"),
    (dict(cache_leftpad=torch.tensor([0, 1])), "cache_leftpad"),
    (dict(q_len=2), "q: expected one query per entry"),
    (dict(window_size=(4, 0)), "window_size"),
    (dict(cache_seqlens=torch.tensor([1.0, 2.0])), "cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), "cache_seqlens"),
    (dict(cache_seqlens=12), "cache_seqlens"),
    (dict(kernels_off=True), "the decode kernels"),
    (dict(new_len=13), "seqlen_new <= seqlen_cache"),
    (dict(q_len=17, spans_on_device=True), "q: expected 1 to 16 queries per entry"),
    (dict(q_len=3, window_size=(4, 0), spans_on_device=True), "window_size"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32),
          cache_batch_idx=torch.tensor([1, 0]), spans_on_device=True), "cache_batch_idx"),
])
def test_calls_a_capture_cannot_run_are_refused_by_name_before_any_write(captured, monkeypatch,
                                                                         case, match):
    """(With SPANS_ON_DEVICE off unless the case turns it on: the refusals of each mode.)"""
    from flashcuda.ops import decode

    monkeypatch.setattr(kvcache, "SPANS_ON_DEVICE", case.pop("spans_on_device", False))

    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = (torch.randn(2, 12, 1, 8, generator=gen) for _ in range(2))
    q = torch.randn(2, case.pop("q_len", 1), 2, 8, generator=gen)
    new = case.pop("new_len", 1)
    k, v = (torch.randn(2, new, 1, 8, generator=gen) for _ in range(2))
    if case.pop("kernels_off", False):
        monkeypatch.setattr(decode, "KERNEL", False)
    case.setdefault("cache_seqlens", torch.tensor([3, 4], dtype=torch.int32))
    before = k_cache.clone(), v_cache.clone()
    with captured, pytest.raises((ValueError, TypeError), match=match):
        flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **case)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def one_call_eager_and_captured(captured, monkeypatch, q, k_cache, v_cache, kw):
    """flash_attn_with_kvcache(q, caches, **kw) three ways — the runs path (the decode kernels
    off: portable float32), then with SPANS_ON_DEVICE eagerly and as a CUDA graph captures it
    (one call of the kernels each: the oracle) — the caches bit for bit and out / lse within
    1e-5 of the runs'; returns the kernels' two calls' arguments."""
    from flashcuda.ops import decode

    calls = []
    monkeypatch.setattr(fwd_decode, "attention", lambda *a: calls.append(a) or oracle_decode(*a))
    monkeypatch.setattr(decode, "KERNEL", False)
    monkeypatch.setattr(kvcache, "SPANS_ON_DEVICE", False)
    kc1, vc1 = k_cache.clone(), v_cache.clone()
    out1, lse1 = flashcuda.flash_attn_with_kvcache(q, kc1, vc1, **kw)
    assert not calls
    monkeypatch.setattr(decode, "KERNEL", True)
    monkeypatch.setattr(kvcache, "SPANS_ON_DEVICE", True)
    for capture in (False, True):
        kc, vc = k_cache.clone(), v_cache.clone()
        with captured if capture else contextlib.nullcontext():
            out, lse = flashcuda.flash_attn_with_kvcache(q, kc, vc, **kw)
        assert len(calls) == 1 + capture  # one call of the decode kernels
        assert torch.equal(kc1, kc) and torch.equal(vc1, vc)
        assert torch.allclose(out, out1, atol=1e-5, rtol=0)
        assert torch.allclose(lse, lse1, atol=1e-5, rtol=0)
    return calls


@pytest.mark.parametrize("layout", ["paged", "leftpad", "rows", "paged_leftpad"])
@pytest.mark.parametrize("new,rotary", [(0, False), (1, False), (1, True)])
def test_spans_on_device_match_the_runs(captured, monkeypatch, layout, new, rotary):
    """With SPANS_ON_DEVICE, a decode step over a paged cache (shuffled pages of 5), left-padded
    entries or cache rows out of order is one call of the decode kernels (the oracle here: the
    block table, spans and rows as it receives them), and gives the caches bit for bit and out /
    lse within 1e-5 of the runs path (SPANS_ON_DEVICE off: runs of entries, a paged run on a
    gathered copy, the portable float32 attention)."""
    gen = torch.Generator().manual_seed(new + 3 * rotary + len(layout))
    B, H, Hk, D, page, blocks = 4, 8, 2, 16, 5, 9
    paged = layout.startswith("paged")
    if paged:
        pool = torch.randn(B * blocks + 3, page, Hk, D, generator=gen)
        k_cache, v_cache = pool, torch.randn(pool.shape, generator=gen)
        table = torch.randperm(B * blocks + 3, generator=gen)[:B * blocks].view(B, blocks).int()
    else:
        k_cache, v_cache = (torch.randn(B + 2, blocks * page, Hk, D, generator=gen)
                            for _ in range(2))
        table = None
    lengths = [0, 7, 44 - new, 31]
    kw = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32), block_table=table,
              causal=True, return_softmax_lse=True)
    if layout.endswith("leftpad"):
        kw["cache_leftpad"] = torch.tensor([0, 3, 10, 31], dtype=torch.int32)
    if layout == "rows":
        kw["cache_batch_idx"] = torch.tensor([5, 1, 0, 3], dtype=torch.int32)
    q = torch.randn(B, 1, H, D, generator=gen)
    if new:
        kw["k"], kw["v"] = (torch.randn(B, new, Hk, D, generator=gen) for _ in range(2))
    if rotary:
        kw["rotary_cos"], kw["rotary_sin"] = tables(blocks * page + 2, 4, gen)
    calls = one_call_eager_and_captured(captured, monkeypatch, q, k_cache, v_cache, kw)
    assert (calls[0][7] is not None) == paged  # the block table reached the kernels


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("layout", ["rows", "paged_leftpad"])
@pytest.mark.parametrize("seqlen_q,causal", [(2, True), (4, True), (3, False)])
def test_several_queries_per_entry_in_one_call(captured, monkeypatch, layout, seqlen_q, causal,
                                               rotary):
    """With SPANS_ON_DEVICE, seqlen_q new queries per entry (speculative decoding's drafts)
    appended with as many keys: one call of the decode kernels (the oracle here), causal rows
    ending Sq - 1 - i positions early, eagerly and as a CUDA graph captures it, equal to the
    runs path (portable float32) — caches bit for bit, out / lse within 1e-5."""
    gen = torch.Generator().manual_seed(seqlen_q + 5 * causal + len(layout))
    B, H, Hk, D, page, blocks = 4, 8, 2, 16, 5, 9
    monkeypatch.setattr(fwd_decode, "can_take", lambda q, k, v: None)
    kw = dict(causal=causal, return_softmax_lse=True)
    if layout == "rows":
        k_cache, v_cache = (torch.randn(B + 2, blocks * page, Hk, D, generator=gen)
                            for _ in range(2))
        kw["cache_batch_idx"] = torch.tensor([5, 1, 0, 3], dtype=torch.int32)
    else:
        k_cache, v_cache = (torch.randn(B * blocks + 3, page, Hk, D, generator=gen)
                            for _ in range(2))
        kw["block_table"] = torch.randperm(B * blocks + 3, generator=gen)[:B * blocks] \
            .view(B, blocks).int()
        kw["cache_leftpad"] = torch.tensor([0, 2, 6, 30], dtype=torch.int32)
    lengths = [0, 6, 40 - seqlen_q, 31]
    kw["cache_seqlens"] = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(B, seqlen_q, H, D, generator=gen)
    kw["k"], kw["v"] = (torch.randn(B, seqlen_q, Hk, D, generator=gen) for _ in range(2))
    if rotary:  # (causal: the queries at their own positions; else all at cache_seqlens)
        kw["rotary_cos"], kw["rotary_sin"] = tables(blocks * page + 2, 4, gen)
    calls = one_call_eager_and_captured(captured, monkeypatch, q, k_cache, v_cache, kw)
    assert calls[0][8] == calls[1][8] == causal

"""flash_attn_with_kvcache on random calls (hypothesis, derandomised) against the float64 oracle
on each entry's logical keys: batch 0-4, 0-9 queries, 0-3 new keys, GQA ratios, caches by row
(permuted by cache_batch_idx) or paged (page sizes 1 / 3 / 8, shuffled pages), left padding,
causal / windows, fp32 / bf16, and packed / split decoding (the split forced with small limits
and 132 SMs). Rule as tests/cpu/test_reliability.py's: max error <= 2 x PyTorch's same-dtype
error + the rounding floor (+ 1e-6), plus, where split_decode ran, one rounding of its pieces'
outputs to the dtype (2^-8 max|v| for bf16, 2^-22 for fp32); the appended keys checked in their
slots bit for bit."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashcuda
from flashcuda.ops import decode
from flashcuda.reference import attention_ref, max_error, rounding_floor


@st.composite
def calls(draw):
    split = draw(st.booleans())  # decoding calls that split_decode may take (forced limits)
    batch = draw(st.integers(0, 4))
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.sampled_from((1, 2, 4)))
    sq = 1 if split else draw(st.sampled_from((0, 1, 1, 2, 5, 9)))
    new = draw(st.integers(0, 3))
    cap = draw(st.integers(max(new, 8) if split else new, 40))
    least = max(0, 8 - new) if split else 0
    lengths = [draw(st.integers(least, cap - new)) for _ in range(batch)]
    if batch > 1 and draw(st.booleans()):
        lengths = [lengths[0]] * batch  # runs of several entries
    leftpad = [draw(st.integers(0, n)) for n in lengths] if draw(st.booleans()) else None
    page = draw(st.sampled_from((None, 1, 3, 8)))
    causal = draw(st.booleans())
    lefts = (-1, 30) if split else (-1, 0, 2, 30)
    window = (draw(st.sampled_from(lefts)), draw(st.sampled_from((-1, 0, 3))))
    return dict(batch=batch, h=h, hkv=hkv, d=draw(st.sampled_from((8, 16))), sq=sq, new=new,
                cap=cap, lengths=lengths, leftpad=leftpad, page=page, causal=causal,
                window=window, dtype=draw(st.sampled_from((torch.float32, torch.bfloat16))),
                permute=draw(st.booleans()), split=split,
                seed=draw(st.integers(0, 2 ** 16)))


@settings(derandomize=True, deadline=None, max_examples=150, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_random_calls_match_the_oracle(p):
    g = torch.Generator().manual_seed(p["seed"])
    B, H, Hk, D, cap, new, dt = (p[n] for n in ("batch", "h", "hkv", "d", "cap", "new", "dtype"))

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dt)

    q = rand(B, p["sq"], H, D)
    logical_k, logical_v = rand(B, cap, Hk, D), rand(B, cap, Hk, D)
    k, v = (rand(B, new, Hk, D), rand(B, new, Hk, D)) if new else (None, None)
    kwargs = dict(cache_seqlens=torch.tensor(p["lengths"], dtype=torch.int32),
                  causal=p["causal"], window_size=p["window"], return_softmax_lse=True)
    if p["leftpad"] is not None:
        kwargs["cache_leftpad"] = torch.tensor(p["leftpad"], dtype=torch.int32)
    page = p["page"]
    if page:  # the logical caches laid out through a shuffled table over a pool with 2 spares
        blocks = -(-cap // page)
        order = torch.randperm(B * blocks + 2, generator=g)
        table = order[:B * blocks].view(B, blocks).to(torch.int32)
        k_cache = torch.full((B * blocks + 2, page, Hk, D), float("nan"), dtype=dt)
        v_cache = k_cache.clone()
        for b in range(B):
            for i in range(cap):
                k_cache[table[b, i // page], i % page] = logical_k[b, i]
                v_cache[table[b, i // page], i % page] = logical_v[b, i]
        kwargs["block_table"] = table

        def slot(b, i):
            return int(table[b, i // page]), i % page
    else:
        rows = torch.randperm(B + 1, generator=g)[:B] if p["permute"] else torch.arange(B)
        k_cache, v_cache = torch.zeros(B + 1, cap, Hk, D, dtype=dt), torch.zeros(B + 1, cap, Hk, D,
                                                                                 dtype=dt)
        k_cache[rows], v_cache[rows] = logical_k, logical_v
        kwargs["cache_batch_idx"] = rows.to(torch.int32)

        def slot(b, i):
            return int(rows[b]), i
    split = {}
    if p["split"]:  # split_decode wherever a run of one entry has one query over 8+ keys
        split = dict(_sms=lambda device: 132, SPLIT_MIN_KEYS=8, SPLIT_MIN_CHUNK=4, SPLIT_CHUNK=2)
    with mock.patch.multiple(decode, **split) if split else mock.patch.object(decode, "PACK_GQA",
                                                                              True):
        out, lse = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    assert out.shape == q.shape and lse.shape == (B, H, p["sq"])
    for b, n in enumerate(p["lengths"]):
        start = p["leftpad"][b] if p["leftpad"] is not None else 0
        for i in range(new):  # appended in place, bit for bit
            assert torch.equal(k_cache[slot(b, n + i)], k[b, i])
            assert torch.equal(v_cache[slot(b, n + i)], v[b, i])
        keys, values = logical_k[b:b + 1, start:n], logical_v[b:b + 1, start:n]
        if new:
            keys = torch.cat((logical_k[b:b + 1, start:n], k[b:b + 1]), dim=1)
            values = torch.cat((logical_v[b:b + 1, start:n], v[b:b + 1]), dim=1)
        ref, ref_lse = attention_ref(q[b:b + 1], keys, values, causal=p["causal"],
                                     window_size=p["window"])
        base, _ = attention_ref(q[b:b + 1], keys, values, causal=p["causal"],
                                window_size=p["window"], upcast=False)
        vmax = float(values.abs().max()) if values.numel() else 0.0
        extra = (2.0 ** -8 if dt == torch.bfloat16 else 2.0 ** -22) * vmax if split else 0.0
        err, berr = max_error(out[b:b + 1], ref), max_error(base, ref)
        assert err <= 2 * berr + rounding_floor(ref, dt) + 1e-6 + extra, (b, err, berr)
        dead = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse[b:b + 1]), dead)
        assert (out[b:b + 1].permute(0, 2, 1, 3)[dead] == 0).all()
        if (~dead).any():
            diff = (lse[b:b + 1].double() - ref_lse)[~dead].abs()
            assert (diff <= 1e-4 * (1 + ref_lse[~dead].abs())).all(), diff.max().item()

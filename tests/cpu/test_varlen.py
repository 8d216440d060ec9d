"""flash_attn_varlen_func on CPU tensors (the portable path): each packed sequence against the
float64 oracle run on that sequence alone, gradients, empty sequences, and every malformed
argument refused before any work, naming the argument (docs/GUARANTEES.md §3)."""

from __future__ import annotations

import re

import pytest
import torch

from flashcuda import flash_attn_varlen_func
from flashcuda.reference import attention_ref, max_error

# (lengths_q, lengths_k, nheads, nheads_kv, headdim, causal, window_size)
CASES = [
    ((17, 5, 33), (17, 5, 33), 4, 4, 32, False, (-1, -1)),
    ((40, 1, 9), (10, 64, 9), 4, 2, 16, True, (-1, -1)),  # Sq > Sk, decoding, Sq == Sk
    ((0, 23, 7), (5, 0, 30), 2, 1, 24, False, (-1, -1)),  # an empty query side, an empty key side
    ((31, 12), (31, 50), 6, 2, 40, False, (8, 3)),
    ((), (), 2, 2, 16, True, (-1, -1)),  # batch 0
]
DTYPES = [torch.float32, torch.bfloat16]


def _cu(lengths):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32)


def _inputs(case, dtype, seed=0, requires_grad=False):
    lq, lk, h, hkv, d = case[:5]
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad)

    return r(sum(lq), h, d), r(sum(lk), hkv, d), r(sum(lk), hkv, d), _cu(lq), _cu(lk)


def _per_sequence(fn, q, k, v, cu_q, cu_k):
    """fn on each sequence as a (1, S, H, D) batch; outputs concatenated in varlen layout."""
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i]:cu_q[i + 1]].unsqueeze(0)
        ki, vi = (t[cu_k[i]:cu_k[i + 1]].unsqueeze(0) for t in (k, v))
        o, lse = fn(qi, ki, vi)
        outs.append(o[0])
        lses.append(lse[0])
    h = q.shape[1]
    return (torch.cat(outs) if outs else q[:0], torch.cat(lses, 1) if lses else
            torch.empty(h, 0, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_sequence_matches_the_oracle(case, dtype):
    q, k, v, cu_q, cu_k = _inputs(case, dtype)
    causal, window = case[5], case[6]
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(case[0], default=0),
                                      max(case[1], default=0), causal=causal,
                                      window_size=window, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    cq, ck = cu_q.tolist(), cu_k.tolist()
    ref, ref_lse = _per_sequence(lambda a, b, c: attention_ref(a, b, c, causal=causal,
                                                               window_size=window),
                                 q, k, v, cq, ck)
    base, base_lse = _per_sequence(lambda a, b, c: attention_ref(a, b, c, causal=causal,
                                                                 window_size=window, upcast=False),
                                   q, k, v, cq, ck)
    floor = 1e-6 if dtype == torch.float32 else 0.0
    assert max_error(out, ref) <= 2 * max_error(base, ref) + floor
    assert max_error(lse, ref_lse) <= 2 * max_error(base_lse, ref_lse) + 1e-5
    dead = torch.isneginf(ref_lse)  # rows that see no key: out 0, lse -inf, exactly
    assert torch.equal(torch.isneginf(lse), dead)
    assert (out.transpose(0, 1)[dead] == 0).all()


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_gradients_match_the_oracle(case):
    dtype = torch.float32
    q, k, v, cu_q, cu_k = _inputs(case, dtype, seed=1, requires_grad=True)
    causal, window = case[5], case[6]
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(case[0]), max(case[1]),
                                 causal=causal, window_size=window)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = _per_sequence(lambda a, b, c: attention_ref(a, b, c, causal=causal,
                                                             window_size=window),
                               *leaves, cu_q.tolist(), cu_k.tolist())
    ref = torch.autograd.grad(ref_out, leaves, dout.double(), allow_unused=True)
    for name, g, r, t in zip("qkv", grads, ref, (q, k, v), strict=True):
        r = torch.zeros_like(t, dtype=torch.float64) if r is None else r
        assert g.shape == t.shape and g.dtype == dtype
        assert max_error(g, r) <= 1e-5 * (1 + r.abs().max().item()), f"d{name}"


def test_equal_lengths_match_flash_attn_func():
    from flashcuda import flash_attn_func

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 19, 2, 16, generator=g) for _ in range(3))
    cu = _cu((19, 19, 19))
    out = flash_attn_varlen_func(q.reshape(-1, 2, 16), k.reshape(-1, 2, 16), v.reshape(-1, 2, 16),
                                 cu, cu, 19, 19, causal=True)
    ref = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, ref.reshape(-1, 2, 16), rtol=1e-6, atol=1e-6)


def test_runs_of_equal_lengths_are_one_call_each(monkeypatch):
    """Consecutive sequences of equal (query, key) lengths go to the kernels as one batch of
    views (one call per run, no copy), each run's out / lse in its sequences' varlen places."""
    from flashcuda import api

    calls = []
    real = api.attention

    def counting(q, k, v, *rest):
        calls.append((tuple(q.shape), tuple(k.shape), q.data_ptr(), k.data_ptr()))
        return real(q, k, v, *rest)

    monkeypatch.setattr(api, "attention", counting)
    lq, lk = (5, 5, 7, 7, 7, 5, 0, 0), (9, 9, 7, 7, 7, 9, 4, 4)
    case = (lq, lk, 4, 2, 16, True, (-1, -1))
    q, k, v, cu_q, cu_k = _inputs(case, torch.float32, seed=4)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 9, causal=True, return_lse=True)
    assert [(c[0], c[1]) for c in calls] == [((2, 5, 4, 16), (2, 9, 2, 16)),
                                             ((3, 7, 4, 16), (3, 7, 2, 16)),
                                             ((1, 5, 4, 16), (1, 9, 2, 16)),
                                             ((2, 0, 4, 16), (2, 4, 2, 16))]
    # views into q and k at each run's first sequence (no copies)
    assert [c[2] for c in calls] == [q[o].data_ptr() if o < q.shape[0] else c[2]
                                     for c, o in zip(calls, (0, 10, 31, 36), strict=True)]
    assert [c[3] for c in calls] == [k[o].data_ptr() for o in (0, 18, 39, 48)]
    ref, ref_lse = _per_sequence(lambda a, b, c: attention_ref(a, b, c, causal=True),
                                 q, k, v, cu_q.tolist(), cu_k.tolist())
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)
    live = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[live], ref_lse[live], atol=2e-6, rtol=0)


def test_return_forms():
    q, k, v, cu_q, cu_k = _inputs(CASES[0], torch.float32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 33)
    out2, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 33,
                                              return_attn_probs=True)
    assert probs is None and torch.equal(out, out2) and lse.shape == (4, q.shape[0])


def _bad(**changes):
    q, k, v, cu_q, cu_k = _inputs(CASES[1], torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40,
                max_seqlen_k=64)
    for key, fn in changes.items():
        args[key] = fn(args[key])
    return args


BAD = [
    ("cu_seqlens_q", TypeError, "cu_seqlens_q: expected dtype int32, got int64",
     dict(cu_seqlens_q=lambda c: c.long())),
    ("cu_seqlens_k", TypeError, "cu_seqlens_k: expected dtype int32",
     dict(cu_seqlens_k=lambda c: c.float())),
    ("cu not a tensor", TypeError, "cu_seqlens_q", dict(cu_seqlens_q=lambda c: c.tolist())),
    ("cu 2-D", ValueError, "cu_seqlens_q: expected a 1-D tensor",
     dict(cu_seqlens_q=lambda c: c.reshape(1, -1))),
    ("cu empty", ValueError, "cu_seqlens_k: expected a 1-D tensor",
     dict(cu_seqlens_k=lambda c: c[:0])),
    ("batch mismatch", ValueError, "cu_seqlens_k: expected 4 entries",
     dict(cu_seqlens_k=lambda c: c[:-1])),
    ("first not 0", ValueError, "cu_seqlens_q: expected the first entry 0, got 1",
     dict(cu_seqlens_q=lambda c: c + 1)),
    ("decreasing", ValueError, "cu_seqlens_q: expected non-decreasing offsets",
     dict(cu_seqlens_q=lambda c: torch.tensor([0, 41, 40, 50], dtype=torch.int32))),
    ("last != total", ValueError, "cu_seqlens_k: expected the last entry to equal k.shape[0] = 83",
     dict(cu_seqlens_k=lambda c: torch.tensor([0, 10, 74, 82], dtype=torch.int32))),
    ("max too small", ValueError, "max_seqlen_k: expected at least the longest sequence of "
     "cu_seqlens_k (64), got 63", dict(max_seqlen_k=lambda m: 63)),
    ("max not int", TypeError, "max_seqlen_q: expected an int", dict(max_seqlen_q=lambda m: 40.0)),
    ("device", ValueError, "cu_seqlens_q: expected device cpu (the device of q), got meta",
     dict(cu_seqlens_q=lambda c: c.to("meta"))),
    ("q 4-D", ValueError, "q: expected a 3-D tensor (total_q, nheads, headdim)",
     dict(q=lambda t: t.unsqueeze(0))),
    ("k rank 2", ValueError, "k: expected a 3-D tensor (total_k, nheads_kv, headdim)",
     dict(k=lambda t: t[:, 0])),
    ("heads", ValueError, "nheads_kv dividing nheads", dict(k=lambda t: t.repeat(1, 3, 1)[:, :3],
                                                             v=lambda t: t.repeat(1, 3, 1)[:, :3])),
    ("dtype", TypeError, "v: expected dtype float32 (the dtype of q), got float16",
     dict(v=lambda t: t.half())),
]


@pytest.mark.parametrize("label,exc,message,changes", BAD, ids=[b[0] for b in BAD])
def test_malformed_arguments_are_refused_by_name(label, exc, message, changes, monkeypatch):
    from flashcuda import api

    def no_work(*args, **kwargs):
        raise AssertionError("attention ran on malformed arguments")

    monkeypatch.setattr(api, "attention", no_work)
    with pytest.raises(exc, match=re.escape(message)):
        flash_attn_varlen_func(**_bad(**changes))


def test_unimplemented_arguments_are_refused():
    args = _bad()
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_func(**args, dropout_p=0.1)


def _paged(case, page, seed):
    """The case's keys / values laid into shuffled pages of `page` positions (2 spare blocks;
    every position no sequence owns NaN), with the block table; and the packed keys / values
    the oracle reads."""
    q, k, v, cu_q, cu_k = _inputs(case, torch.float32, seed=seed)
    lengths = case[1]
    blocks = max(-(-n // page) for n in lengths) if lengths else 1
    g = torch.Generator().manual_seed(seed + 7)
    order = torch.randperm(len(lengths) * blocks + 2, generator=g)
    table = order[:len(lengths) * blocks].view(len(lengths), blocks).to(torch.int32)
    pools = [torch.full((len(lengths) * blocks + 2, page, *k.shape[1:]), float("nan"))
             for _ in range(2)]
    for i, n in enumerate(lengths):
        for p in range(n):
            for pool, t in zip(pools, (k, v), strict=True):
                pool[table[i, p // page], p % page] = t[cu_k[i] + p]
    return q, k, v, cu_q, cu_k, pools, table


@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_keys_match_the_oracle(case, page):
    """block_table: each sequence's keys read through its pages (shuffled; NaN wherever no
    sequence owns the position) give the unpaged call's oracle result."""
    q, k, v, cu_q, cu_k, (pk, pv), table = _paged(case, page, seed=5)
    causal, window = case[5], case[6]
    out, lse = flash_attn_varlen_func(q, pk, pv, cu_q, cu_k, max(case[0], default=0),
                                      max(case[1], default=0), causal=causal, window_size=window,
                                      block_table=table, return_lse=True)
    ref, ref_lse = _per_sequence(lambda a, b, c: attention_ref(a, b, c, causal=causal,
                                                               window_size=window),
                                 q, k, v, cu_q.tolist(), cu_k.tolist())
    assert out.shape == q.shape and max_error(out, ref) <= 2e-6
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert max_error(lse[finite], ref_lse[finite]) <= 2e-6


def test_paged_gradients_reach_the_pages():
    """With block_table, dk / dv land in the pages each sequence read (autograd through the
    gather), the oracle's gradients of the packed keys put in their pages; other blocks 0."""
    case = CASES[1]
    q, k, v, cu_q, cu_k, pools, table = _paged(case, 4, seed=9)
    pk, pv = (torch.nan_to_num(t).requires_grad_() for t in pools)
    q.requires_grad_()
    out = flash_attn_varlen_func(q, pk, pv, cu_q, cu_k, max(case[0]), max(case[1]), causal=True,
                                 block_table=table)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    dq, dpk, dpv = torch.autograd.grad(out, (q, pk, pv), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = _per_sequence(lambda a, b, c: attention_ref(a, b, c, causal=True), *leaves,
                               cu_q.tolist(), cu_k.tolist())
    rq, rk, rv = torch.autograd.grad(ref_out, leaves, dout.double())
    want_k, want_v = torch.zeros_like(dpk, dtype=torch.float64), torch.zeros_like(dpv,
                                                                                 dtype=torch.float64)
    cu = cu_k.tolist()
    for i, n in enumerate(case[1]):
        for p in range(n):
            slot = (int(table[i, p // 4]), p % 4)
            want_k[slot], want_v[slot] = rk[cu[i] + p], rv[cu[i] + p]
    for name, got, want in (("dq", dq, rq), ("dk", dpk, want_k), ("dv", dpv, want_v)):
        assert max_error(got, want) <= 1e-5 * (1 + want.abs().max().item()), name


def test_paged_arguments_are_refused_by_name():
    case = CASES[0]
    q, k, v, cu_q, cu_k, (pk, pv), table = _paged(case, 8, seed=11)
    args = dict(q=q, k=pk, v=pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=33,
                max_seqlen_k=33)
    with pytest.raises(ValueError, match="k: expected a 4-D paged cache"):
        flash_attn_varlen_func(**{**args, "k": k, "v": v}, block_table=table)
    with pytest.raises(ValueError, match="v: expected shape"):
        flash_attn_varlen_func(**{**args, "v": pv[:, :4]}, block_table=table)
    with pytest.raises(TypeError, match="block_table: expected dtype int32 or int64"):
        flash_attn_varlen_func(**args, block_table=table.float())
    with pytest.raises(ValueError, match="block_table: expected shape \\(batch = 3"):
        flash_attn_varlen_func(**args, block_table=table[:2])
    with pytest.raises(ValueError, match="cu_seqlens_k: expected every sequence within"):
        flash_attn_varlen_func(**args, block_table=table[:, :2])
    bad = table.clone()
    bad[2, 4] = 99
    with pytest.raises(ValueError, match="block_table: expected the blocks of entry 2's first 33"):
        flash_attn_varlen_func(**args, block_table=bad)
    bad[2, 4] = table[2, 4]
    bad[0, 3] = -1  # past sequence 0's 17 keys (3 blocks of 8): never read
    assert flash_attn_varlen_func(**args, block_table=bad).shape == q.shape


def test_paged_empty_pool_with_sequences_that_see_no_key():
    """A pool of no blocks is a valid paged cache for sequences with no keys: out 0, lse -inf."""
    q = torch.randn(2, 2, 16)
    pool = torch.randn(0, 4, 2, 16)
    out, lse = flash_attn_varlen_func(q, pool, pool, _cu((1, 1)), _cu((0, 0)), 1, 0,
                                      block_table=torch.zeros(2, 1, dtype=torch.int32),
                                      return_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()

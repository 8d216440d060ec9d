"""flashcuda.ops.decode on CPU tensors (the portable path) against the float64 oracle: a
decoding call (one query row seeing all of its keys, no autograd) runs GQA packed by KV head
(the kernel calls' shapes checked) and one entry's long keys as pieces combined by their lse
(forced here with 132 SMs and small limits), through flash_attn_func, the SDPA shim and
flash_attn_with_kvcache; calls that need a gradient, see a cut window or SDPA's top-left causal
run as they are. Tolerances: test_kvcache_options.check (2e-6, plus the float32 combine's bound
for split calls)."""

from __future__ import annotations

import pytest
import torch

import flashcuda
from flashcuda.ops import attention as attention_ops
from flashcuda.ops import decode

from .test_kvcache_options import check


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The (q shape, k shape[:2], windows) of every kernel call (ops.attention's body)."""
    calls = []
    real = attention_ops._fwd_impl

    def recording(q, k, v, scale, left, right):
        calls.append((tuple(q.shape), tuple(k.shape[:2]), (left, right)))
        return real(q, k, v, scale, left, right)

    monkeypatch.setattr(attention_ops, "_fwd_impl", recording)
    return calls


@pytest.fixture
def forced_split(monkeypatch):
    monkeypatch.setattr(decode, "_sms", lambda device: 132)
    monkeypatch.setattr(decode, "SPLIT_MIN_KEYS", 64)
    monkeypatch.setattr(decode, "SPLIT_MIN_CHUNK", 32)
    monkeypatch.setattr(decode, "SPLIT_CHUNK", 16)


@pytest.mark.parametrize("window", [(-1, -1), (30, 0), (5, 0)], ids=["full", "wide", "cut"])
def test_kvcache_one_query_per_entry_runs_packed_by_kv_head(window, kernel_calls):
    """seqlen_q = 1 with GQA (6 query heads over 2 KV heads): each KV head's 3 query heads run as
    3 query rows of one call, unless a window cuts the row's keys; out and lse back in (batch,
    1, nheads, headdim) / (batch, nheads, 1)."""
    g = torch.Generator().manual_seed(61)
    B, H, Hk, D = 3, 6, 2, 16
    q = rand(B, 1, H, D, gen=g)
    k_cache, v_cache = rand(B, 24, Hk, D, gen=g), rand(B, 24, Hk, D, gen=g)
    k, v = rand(B, 1, Hk, D, gen=g), rand(B, 1, Hk, D, gen=g)
    lengths = [20, 20, 9]
    out, lse = flashcuda.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
        causal=True, window_size=window, return_softmax_lse=True)
    if window != (5, 0):
        assert kernel_calls == [((2, 3, 2, D), (2, 21), (None, None)),
                                ((1, 3, 2, D), (1, 10), (None, None))]
    else:
        assert kernel_calls == [((2, 1, H, D), (2, 21), (5, 0)), ((1, 1, H, D), (1, 10), (5, 0))]
    assert out.shape == q.shape and lse.shape == (B, H, 1)
    for b, n in enumerate(lengths):
        check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :n + 1],
              v_cache[b:b + 1, :n + 1], D ** -0.5, True, window)


@pytest.mark.parametrize("heads,keys,chunk", [((8, 2), 1000, 256), ((4, 4), 1024, 256),
                                              ((6, 3), 300, 128)],
                         ids=["gqa-tail", "mha-whole", "tail-only-one-whole"])
def test_split_pieces_combine_exactly(heads, keys, chunk, kernel_calls):
    """split_pieces: whole pieces as one call's batch plus a tail call, combined by their lse,
    against the oracle (packed rows as the kernels see them)."""
    g = torch.Generator().manual_seed(71 + keys)
    H, Hk = heads
    q = rand(1, 1, H, 32, gen=g)
    q = decode.packed_gqa(q, Hk) if H > Hk else q
    k, v = rand(1, keys, Hk, 32, gen=g) * 2, rand(1, keys, Hk, 32, gen=g)
    out, lse = decode.split_pieces(q, k, v, 0.3, chunk, attention_ops._fwd_impl)
    whole, tail = keys // chunk, keys % chunk
    assert kernel_calls == [((whole, *q.shape[1:]), (whole, chunk), (None, None))] + (
        [(tuple(q.shape), (1, tail), (None, None))] if tail else [])
    assert out.shape == q.shape and lse.shape == (1, q.shape[2], q.shape[1])
    check(out, lse, q, k, v, 0.3, False, (-1, -1), pieces=-(-keys // chunk))


def test_split_chunk_plan():
    """Pieces for one work tile per SM, at least SPLIT_MIN_CHUNK keys each, whole SPLIT_CHUNKs;
    no split below SPLIT_MIN_KEYS or where one piece would do."""
    assert decode.split_chunk(8191, 8, 132) == 0
    assert decode.split_chunk(16384, 8, 132) == 1024  # 16 pieces of 1024 (128 tiles)
    assert decode.split_chunk(65536, 8, 132) == 3968  # 17 pieces (136 tiles), the last shorter
    assert decode.split_chunk(20000, 32, 132) == 4096  # 5 pieces
    assert decode.split_chunk(8192, 132, 132) == 0  # the heads fill the GPU already
    assert decode.split_chunk(8192, 8, 0) == 0  # no GPU
    for keys, heads in ((8192, 1), (9000, 8), (40000, 2), (100000, 16)):
        c = decode.split_chunk(keys, heads, 132)
        pieces = -(-keys // c)
        assert c % 128 == 0 and c >= 1024 and 2 <= pieces <= max(2, -(-132 // heads) + 1)


@pytest.mark.parametrize("window", [(-1, -1), (3, 0)], ids=["all-keys", "cut"])
def test_kvcache_long_single_sequence_decode_runs_split(window, kernel_calls, forced_split):
    """A run of one entry with one query over many keys runs as pieces, ragged entries each on
    their own; a window that cuts the keys runs unsplit."""
    g = torch.Generator().manual_seed(81)
    B, H, Hk, D = 2, 4, 2, 16
    q = rand(B, 1, H, D, gen=g)
    k_cache, v_cache = rand(B, 200, Hk, D, gen=g), rand(B, 200, Hk, D, gen=g)
    k, v = rand(B, 1, Hk, D, gen=g), rand(B, 1, Hk, D, gen=g)
    lengths = [150, 70]
    out, lse = flashcuda.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
        causal=True, window_size=window, return_softmax_lse=True)
    if window == (-1, -1):  # 151 keys: 4 pieces of 48 (3 whole + 7); 71: 2 pieces of 48 (1 + 23)
        assert [c[:2] for c in kernel_calls] == [((3, 2, 2, D), (3, 48)), ((1, 2, 2, D), (1, 7)),
                                                 ((1, 2, 2, D), (1, 48)), ((1, 2, 2, D), (1, 23))]
    else:
        assert [c[:2] for c in kernel_calls] == [((1, 1, H, D), (1, 151)), ((1, 1, H, D), (1, 71))]
    for b, n in enumerate(lengths):
        check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :n + 1],
              v_cache[b:b + 1, :n + 1], D ** -0.5, True, window, pieces=4 * (window[0] < 0))


def test_kvcache_batch_seeing_equal_keys_is_one_call_not_split(kernel_calls, forced_split):
    """Entries that share their span are one call (their heads already several work tiles)."""
    g = torch.Generator().manual_seed(91)
    q = rand(3, 1, 4, 16, gen=g)
    k_cache, v_cache = rand(3, 120, 2, 16, gen=g), rand(3, 120, 2, 16, gen=g)
    out, lse = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=100,
                                                 return_softmax_lse=True)
    assert kernel_calls == [((3, 2, 2, 16), (3, 100), (None, None))]
    check(out, lse, q, k_cache[:, :100], v_cache[:, :100], 0.25, False, (-1, -1))


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_flash_attn_func_decoding_packed_and_split(heads, kernel_calls, forced_split):
    """flash_attn_func with one query (no autograd): GQA packed; batch 1 over many keys split;
    MHA with several entries as it is. Causal with seqlen_q = 1 sees every key (bottom-right)."""
    g = torch.Generator().manual_seed(101)
    H, Hk = heads
    q1, k1, v1 = rand(1, 1, H, 16, gen=g), rand(1, 100, Hk, 16, gen=g), rand(1, 100, Hk, 16, gen=g)
    out, lse = flashcuda.flash_attn_func(q1, k1, v1, causal=True, return_lse=True)
    rows = H // Hk
    assert [c[:2] for c in kernel_calls] == [((2, rows, Hk, 16), (2, 48)),
                                             ((1, rows, Hk, 16), (1, 4))]
    check(out, lse, q1, k1, v1, 0.25, True, (-1, -1), pieces=3)
    kernel_calls.clear()
    q3, k3, v3 = rand(3, 1, H, 16, gen=g), rand(3, 100, Hk, 16, gen=g), rand(3, 100, Hk, 16, gen=g)
    out, lse = flashcuda.flash_attn_func(q3, k3, v3, return_lse=True)
    assert [c[:2] for c in kernel_calls] == [((3, rows, Hk, 16) if H > Hk else (3, 1, H, 16),
                                              (3, 100))]
    check(out, lse, q3, k3, v3, 0.25, False, (-1, -1))


def test_calls_that_need_a_gradient_or_hide_keys_run_as_they_are(kernel_calls, forced_split):
    """Autograd, a left window that hides keys, SDPA's top-left causal (one query sees key 0
    only) and more than one query row: the call reaches the kernels unchanged."""
    g = torch.Generator().manual_seed(111)
    q, k, v = rand(1, 1, 8, 16, gen=g), rand(1, 100, 2, 16, gen=g), rand(1, 100, 2, 16, gen=g)
    qg = q.clone().requires_grad_()
    out = flashcuda.flash_attn_func(qg, k, v)
    out.sum().backward()
    flashcuda.flash_attn_func(q, k, v, window_size=(10, -1))
    sdpa = flashcuda.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=True,
                                                  enable_gqa=True)
    flashcuda.flash_attn_func(rand(1, 2, 8, 16, gen=g), k, v)
    assert [c[0] for c in kernel_calls[:1]] == [(1, 1, 8, 16)]  # the autograd forward
    assert [c[:2] for c in kernel_calls[-3:]] == [((1, 1, 8, 16), (1, 100)),
                                                  ((1, 1, 8, 16), (1, 100)),
                                                  ((1, 2, 8, 16), (1, 100))]
    # SDPA's top-left causal with one query: only key 0 is seen
    torch.testing.assert_close(sdpa.transpose(1, 2).double(),
                               v[:, :1].double().repeat_interleave(4, dim=2), atol=1e-6, rtol=0)


def test_sdpa_shim_decoding_is_packed(kernel_calls):
    """The SDPA shim without is_causal and one query (enable_gqa): packed by KV head."""
    g = torch.Generator().manual_seed(121)
    q, k, v = rand(2, 8, 1, 16, gen=g), rand(2, 2, 50, 16, gen=g), rand(2, 2, 50, 16, gen=g)
    out = flashcuda.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert [c[:2] for c in kernel_calls] == [((2, 4, 2, 16), (2, 50))]
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                           enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)


def test_sees_all_keys_at_the_window_edge():
    """The one rule decoding's paths share: the single (last) query row sees all `keys` keys
    when the left window reaches key 0 (window_left >= keys - 1) and the row is not masked out
    (window_right >= 0)."""
    assert decode.sees_all_keys(None, None, 5) and decode.sees_all_keys(None, 0, 5)
    assert decode.sees_all_keys(4, 0, 5) and decode.sees_all_keys(0, None, 1)
    assert not decode.sees_all_keys(3, 0, 5)
    assert not decode.sees_all_keys(None, -1, 5)

"""flash_attn_with_kvcache (FlashAttention's inference entry point) on CPU tensors (the portable
path) against the float64 oracle on the keys each batch entry sees: the whole cache, ragged
cache_seqlens, cache rows by cache_batch_idx, new keys appended in place first (the cache
checked element by element afterwards), causal / windows bottom-right aligned on the seen keys,
GQA, decoding (seqlen_q = 1), an entry that sees no key; and its argument errors by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashcuda
from flashcuda.reference import attention_ref


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen)


def oracle(q, k, v, scale, causal, window):
    out, lse = attention_ref(q.double(), k.double(), v.double(), scale, causal=causal,
                             window_size=window)
    return out, lse


def check(out, lse, q, k, v, scale=None, causal=False, window=(-1, -1)):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref_out, ref_lse = oracle(q, k, v, scale, causal, window)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=2e-6, rtol=0)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2))],
                         ids=["full", "causal", "window"])
def test_cache_without_new_keys(causal, window):
    g = torch.Generator().manual_seed(1)
    q = rand(3, 4, 4, 16, gen=g)
    k_cache, v_cache = rand(5, 40, 2, 16, gen=g), rand(5, 40, 2, 16, gen=g)  # GQA 4:2
    before = k_cache.clone(), v_cache.clone()
    for seqlens in (None, 23, torch.tensor([23, 0, 40], dtype=torch.int32)):
        out, lse = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                     causal=causal, window_size=window,
                                                     return_softmax_lse=True)
        assert out.shape == q.shape and lse.shape == (3, 4, 4) and not out.requires_grad
        lengths = {None: [40] * 3, 23: [23] * 3}.get(seqlens if not torch.is_tensor(seqlens)
                                                     else -1, [23, 0, 40])
        for b, n in enumerate(lengths):
            check(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :n],
                  v_cache[b:b + 1, :n], causal=causal, window=window)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])  # read only


def test_new_keys_are_appended_in_place_then_seen():
    g = torch.Generator().manual_seed(2)
    q = rand(2, 3, 4, 32, gen=g)
    k_cache, v_cache = rand(4, 20, 4, 32, gen=g), rand(4, 20, 4, 32, gen=g)
    k, v = rand(2, 3, 4, 32, gen=g), rand(2, 3, 4, 32, gen=g)
    seqlens = torch.tensor([5, 17], dtype=torch.int32)
    rows = torch.tensor([3, 1], dtype=torch.int32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for b, (row, n) in enumerate(((3, 5), (1, 17))):
        want_k[row, n:n + 3], want_v[row, n:n + 3] = k[b], v[b]
    out = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                            cache_batch_idx=rows, causal=True,
                                            softmax_scale=0.2)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    for b, (row, n) in enumerate(((3, 8), (1, 20))):
        ref, _ = oracle(q[b:b + 1], want_k[row:row + 1, :n], want_v[row:row + 1, :n], 0.2, True,
                        (-1, -1))
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=2e-6, rtol=0)


def test_decoding_step_by_step_equals_one_call_over_the_whole_sequence():
    """Prefill then one token at a time (seqlen_q = 1, causal, an int cache_seqlens: the fast
    path, one call for the batch) reproduces the causal attention of the whole sequence."""
    g = torch.Generator().manual_seed(3)
    B, S, H, D, prefill = 2, 12, 2, 16, 7
    q, k, v = rand(B, S, H, D, gen=g), rand(B, S, 1, D, gen=g), rand(B, S, 1, D, gen=g)
    k_cache, v_cache = torch.zeros(B, S, 1, D), torch.zeros(B, S, 1, D)
    outs = [flashcuda.flash_attn_with_kvcache(q[:, :prefill], k_cache, v_cache, k[:, :prefill],
                                              v[:, :prefill], cache_seqlens=0, causal=True)]
    for t in range(prefill, S):
        outs.append(flashcuda.flash_attn_with_kvcache(q[:, t:t + 1], k_cache, v_cache,
                                                      k[:, t:t + 1], v[:, t:t + 1],
                                                      cache_seqlens=t, causal=True))
    ref, _ = oracle(q, k, v, D ** -0.5, True, (-1, -1))
    torch.testing.assert_close(torch.cat(outs, dim=1).double(), ref, atol=2e-6, rtol=0)
    assert torch.equal(k_cache, k) and torch.equal(v_cache, v)


def test_runs_of_consecutive_rows_with_equal_keys_are_one_call_each(monkeypatch):
    """Entries on consecutive cache rows that see the same number of keys go to the kernels as
    one batch of cache views (one call per run); an empty batch is one empty call."""
    from flashcuda import kvcache

    calls = []
    real = kvcache.attention

    def counting(q, k, v, *rest):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return real(q, k, v, *rest)

    monkeypatch.setattr(kvcache, "attention", counting)
    g = torch.Generator().manual_seed(9)
    q = rand(5, 2, 4, 16, gen=g)
    k_cache, v_cache = rand(8, 12, 2, 16, gen=g), rand(8, 12, 2, 16, gen=g)
    rows = torch.tensor([0, 1, 2, 5, 6], dtype=torch.int32)
    seqlens = torch.tensor([4, 4, 9, 9, 9], dtype=torch.int32)
    out = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                            cache_batch_idx=rows, causal=True)
    assert calls == [((2, 2, 4, 16), (2, 4, 2, 16)), ((1, 2, 4, 16), (1, 9, 2, 16)),
                     ((2, 2, 4, 16), (2, 9, 2, 16))]
    for b, (row, n) in enumerate(zip(rows.tolist(), seqlens.tolist(), strict=True)):
        ref, _ = oracle(q[b:b + 1], k_cache[row:row + 1, :n], v_cache[row:row + 1, :n],
                        16 ** -0.5, True, (-1, -1))
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=2e-6, rtol=0)
    calls.clear()
    empty = flashcuda.flash_attn_with_kvcache(q[:0], k_cache, v_cache, cache_seqlens=3)
    assert empty.shape == (0, 2, 4, 16) and len(calls) == 1


def test_arguments_are_checked_by_name():
    q = torch.randn(2, 1, 2, 16)
    kc, vc = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    k1 = torch.randn(2, 1, 2, 16)
    call = flashcuda.flash_attn_with_kvcache
    with pytest.raises(ValueError, match="cache_seqlens: expected values in \\[0, 7\\]"):
        call(q, kc, vc, k1, k1, cache_seqlens=8)
    with pytest.raises(ValueError, match="cache_seqlens: required with k / v"):
        call(q, kc, vc, k1, k1)
    with pytest.raises(ValueError, match="k, v: expected both"):
        call(q, kc, vc, k1, cache_seqlens=1)
    with pytest.raises(TypeError, match="k: expected a torch.Tensor"):
        call(q, kc, vc, [k1], [k1], cache_seqlens=1)
    with pytest.raises(ValueError, match="k: expected shape"):
        call(q, kc, vc, k1[:, :, :1], k1[:, :, :1], cache_seqlens=1)
    with pytest.raises(TypeError, match="cache_seqlens: expected dtype int32"):
        call(q, kc, vc, cache_seqlens=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="cache_seqlens: expected shape \\(2,\\)"):
        call(q, kc, vc, cache_seqlens=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_batch_idx: expected rows in \\[0, 2\\)"):
        call(q, kc, vc, cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_batch_idx: expected distinct rows"):
        call(q, kc, vc, k1, k1, cache_seqlens=1,
             cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="k_cache: expected at least batch = 2 rows"):
        call(q, kc[:1], vc[:1])
    with pytest.raises(ValueError, match="v_cache: expected shape"):
        call(q, kc, vc[:, :4])
    with pytest.raises(TypeError, match="k_cache: expected dtype float16 .the dtype of q."):
        call(q.half(), kc, vc)
    with pytest.raises(NotImplementedError, match="softcap"):
        call(q, kc, vc, softcap=30.0)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        call(q, kc, vc, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="num_splits"):
        call(q, kc, vc, num_splits=-1)
    assert call(q, kc, vc, num_splits=4).shape == q.shape  # a performance hint: ignored
    # refused before anything is written into the caches
    before = kc.clone()
    with pytest.raises(TypeError, match="k_cache: expected dtype float16"):
        call(q.half(), kc, vc, k1, k1, cache_seqlens=3)
    with pytest.raises(ValueError, match="k_cache: expected a contiguous last dimension"):
        call(q, kc.transpose(1, 3).contiguous().transpose(1, 3), vc, k1, k1, cache_seqlens=3)
    with pytest.raises(ValueError, match="cache_batch_idx: expected distinct rows"):
        call(q, kc, vc, k1, k1, cache_seqlens=3,
             cache_batch_idx=torch.tensor([0, 0], dtype=torch.int32))
    assert torch.equal(kc, before)


@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
def test_generation_example_agrees_with_the_full_recompute(paged):
    """examples/generate_kvcache.py on the CPU: a prefill of ragged prompts then greedy decoding
    through the caches (rotary embeddings; paged: a block table over shuffled pages), every
    step's logits against SDPA recomputing the whole sequence."""
    example = Path(__file__).resolve().parents[2] / "examples" / "generate_kvcache.py"
    run = subprocess.run([sys.executable, str(example), "--device", "cpu", "--tokens", "6"]
                         + ["--paged"] * paged, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cached logits within" in run.stdout


def test_generation_example_graph_mode_needs_cuda():
    """--graph (the decode step replayed from a CUDA graph) on the CPU: refused by name."""
    example = Path(__file__).resolve().parents[2] / "examples" / "generate_kvcache.py"
    run = subprocess.run([sys.executable, str(example), "--device", "cpu", "--graph"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--graph needs a CUDA device" in run.stderr

"""The references: the float64 oracle against PyTorch, the tiled loop (forward and backward)
against the oracle on ragged shapes, and the mask.cuh helpers against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from flashcuda.reference import (
    _query_range,
    _tile_needs_mask,
    attention_ref,
    attention_tiled,
    attention_tiled_backward,
    key_range,
    visible_mask,
)

NEG_INF = float("-inf")

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim): ragged, Sq != Sk, GQA / MQA, empty.
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 17, 17, 4, 4, 16),
    (1, 17, 143, 4, 2, 40),
    (2, 143, 17, 6, 2, 24),
    (1, 143, 143, 2, 1, 72),
    (1, 1, 143, 4, 1, 8),
    (1, 0, 17, 2, 2, 8),
    (2, 17, 0, 2, 1, 8),
]


def windows_for(seqlen_q: int, seqlen_k: int) -> list[tuple[int | None, int | None]]:
    """Full, FA causal, SDPA top-left causal, sliding windows, a band that leaves rows empty, and
    one that hides every key."""
    return [(None, None), (None, 0), (None, seqlen_q - seqlen_k), (7, 3), (0, 0), (2, -5),
            (None, -seqlen_k - 1)]


def make(shape, dtype=torch.float64, requires_grad=False, seed=0):
    b, sq, sk, h, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(b, sk, hkv, d, generator=g, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def assert_lse_equal(lse, ref, atol):
    assert torch.equal(lse == NEG_INF, ref == NEG_INF)
    finite = ref != NEG_INF
    torch.testing.assert_close(lse[finite].double(), ref[finite].double(), atol=atol, rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("blocks", [(64, 64), (16, 32)], ids=str)
def test_tiled_forward_equals_oracle(shape, blocks):
    q, k, v = make(shape)
    scale = shape[-1] ** -0.5
    for window in windows_for(shape[1], shape[2]):
        ref_out, ref_lse = attention_ref(q, k, v, scale, window=window)
        out, lse = attention_tiled(q, k, v, scale, *window, *blocks)
        assert out.dtype == torch.float64 and lse.dtype == torch.float64
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0, msg=f"window {window}")
        assert_lse_equal(lse, ref_lse, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tiled_forward_low_precision(dtype):
    shape = (2, 143, 97, 4, 2, 40)
    q, k, v = make(shape, dtype)
    for window in [(None, None), (None, 0), (9, 0)]:
        ref_out, ref_lse = attention_ref(q, k, v, window=window)
        out, lse = attention_tiled(q, k, v, 40 ** -0.5, *window)
        assert out.dtype == dtype and lse.dtype == torch.float32
        # fp32 arithmetic, one rounding of out to the dtype.
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out.double(), ref_out, atol=max(2 * eps, 1e-5), rtol=0)
        assert_lse_equal(lse, ref_lse, 1e-5)


def test_fully_masked_rows_give_zero_and_neg_inf():
    # Bottom-right causal with Sq > Sk: rows i < Sq - Sk see no key at all.
    q, k, v = make((1, 40, 10, 2, 1, 16), requires_grad=True)
    out, lse = attention_ref(q, k, v, causal=True)
    empty = slice(0, 30)
    assert (out[:, empty] == 0).all() and (lse[:, :, empty] == NEG_INF).all()
    assert torch.isfinite(lse[:, :, 30:]).all()
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert not any(g.isnan().any() for g in grads)
    assert (grads[0][:, empty] == 0).all()
    t_out, t_lse = attention_tiled(q.detach(), k.detach(), v.detach(), 0.25, None, 0, 16, 16)
    assert (t_out[:, empty] == 0).all() and (t_lse[:, :, empty] == NEG_INF).all()
    t_grads = attention_tiled_backward(dout, q.detach(), k.detach(), v.detach(), t_out, t_lse,
                                       0.25, None, 0, 16, 16)
    for g, t in zip(grads, t_grads, strict=True):
        torch.testing.assert_close(t, g, atol=1e-12, rtol=0)


def test_tiles_outside_the_key_range_are_never_read():
    # Window (0, 0), Sq=16, Sk=200: the rows see keys 184..199 only; with 64-wide key tiles the
    # loop starts at key 128, so NaN in keys 0..127 must not reach the output.
    q, k, v = make((1, 16, 200, 2, 2, 8))
    k2, v2 = k.clone(), v.clone()
    k2[:, :128] = float("nan")
    v2[:, :128] = float("nan")
    out, lse = attention_tiled(q, k2, v2, 0.3, 0, 0)
    ref_out, ref_lse = attention_ref(q, k, v, 0.3, window=(0, 0))
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
    assert_lse_equal(lse, ref_lse, 1e-12)


def test_tiled_writes_into_given_buffers():
    q, k, v = make((1, 33, 20, 2, 2, 8), torch.float32)
    out = torch.full(q.shape, float("nan"))
    lse = torch.full((1, 2, 33), float("nan"))
    got_out, got_lse = attention_tiled(q, k, v, 0.3, out=out, lse=lse, block_m=16, block_n=16)
    assert got_out is out and got_lse is lse and not out.isnan().any()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tiled_backward_equals_autograd_of_oracle(shape):
    q, k, v = make(shape, requires_grad=True, seed=1)
    scale = 0.7 * shape[-1] ** -0.5
    for window in windows_for(shape[1], shape[2]):
        out, lse = attention_ref(q, k, v, scale, window=window)
        dout = torch.randn_like(out)
        if out.numel() and k.shape[1]:
            ref = torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
        else:
            ref = (None, None, None)
        ref = [torch.zeros_like(t) if g is None else g for g, t in zip(ref, (q, k, v), strict=True)]
        got = attention_tiled_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(),
                                       lse.detach(), scale, *window, block_m=32, block_n=16)
        for name, g, r, t in zip("qkv", got, ref, (q, k, v), strict=True):
            assert g.shape == t.shape and g.dtype == t.dtype
            torch.testing.assert_close(g, r, atol=1e-11, rtol=0, msg=f"d{name} window {window}")


def test_tiled_backward_fp32_and_given_buffers():
    q, k, v = make((2, 70, 45, 4, 2, 16), torch.float32, requires_grad=True)
    out, lse = attention_ref(q, k, v, causal=True)
    dout = torch.randn(q.shape, dtype=torch.float64)
    ref = torch.autograd.grad(out, (q, k, v), dout)
    bufs = [torch.full(t.shape, float("nan")) for t in (q, k, v)]
    out32, lse32 = attention_tiled(q.detach(), k.detach(), v.detach(), 0.25, None, 0)
    got = attention_tiled_backward(dout.float(), q.detach(), k.detach(), v.detach(), out32,
                                   lse32, 0.25, None, 0, dq=bufs[0], dk=bufs[1], dv=bufs[2])
    for g, b, r in zip(got, bufs, ref, strict=True):
        assert g is b
        torch.testing.assert_close(g.double(), r.double(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(17, 17), (5, 23), (23, 5)])
def test_oracle_matches_torch_sdpa(causal, sq, sk):
    # PyTorch's causal is top-left: window (None, Sq - Sk) in the bottom-right terms.
    q, k, v = make((2, sq, sk, 4, 2, 16))
    out, _ = attention_ref(q, k, v, window=(None, sq - sk if causal else None))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
    rows = slice(None) if not causal or sq <= sk else slice(0, sq)
    torch.testing.assert_close(out[:, rows], ref.transpose(1, 2)[:, rows], atol=1e-12, rtol=0)


def test_oracle_causal_is_bottom_right_and_window_is_fa():
    vis = visible_mask(3, 5, None, 0)
    assert vis.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    q, k, v = make((1, 3, 5, 1, 1, 4))
    a, _ = attention_ref(q, k, v, causal=True)
    b, _ = attention_ref(q, k, v, window=(None, 0))
    c, _ = attention_ref(q, k, v, causal=True, window_size=(1, 5))
    d, _ = attention_ref(q, k, v, window=(1, 0))
    assert torch.equal(a, b) and torch.equal(c, d)


def test_oracle_same_dtype_baseline():
    q, k, v = make((1, 31, 29, 2, 2, 32), torch.float16)
    out, lse = attention_ref(q, k, v, causal=True, upcast=False)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    err = (out.double() - ref).abs().max().item()
    assert 0 < err < 1e-2


def test_mask_helpers_agree_with_brute_force():
    """No visible key outside [key_begin, key_end); no visible (row, key) in a skipped tile; a tile
    `tile_needs_mask` calls clean is wholly visible; the backward's row range covers every row."""
    bm, bn = 8, 4
    for sq, sk in [(1, 1), (13, 13), (5, 19), (19, 5), (16, 16)]:
        for wl, wr in [(None, None), (None, 0), (None, sq - sk), (3, 2), (0, 0), (2, -4),
                       (0, -20), (30, 30)]:
            vis = visible_mask(sq, sk, wl, wr)
            big = sq + sk
            kl = big if wl is None else max(-big, min(wl, big))
            kr = big if wr is None else max(-big, min(wr, big))
            for r0 in range(0, sq, bm):
                r1 = min(r0 + bm, sq)
                begin, end = key_range(r0, r1, sq, sk, kl, kr)
                seen = vis[r0:r1].any(dim=0).nonzero().flatten().tolist()
                assert all(begin <= j < end for j in seen), (sq, sk, wl, wr, r0)
                for c0 in range(0, sk, bn):
                    tile = vis[r0:r1, c0:c0 + bn]
                    if not _tile_needs_mask(r0, bm, c0, bn, sq, sk, kl, kr):
                        assert tile.all() and c0 + bn <= sk, (sq, sk, wl, wr, r0, c0)
            for c0 in range(0, sk, bn):
                c1 = min(c0 + bn, sk)
                begin, end = _query_range(c0, c1, sq, sk, kl, kr)
                rows = vis[:, c0:c1].any(dim=1).nonzero().flatten().tolist()
                assert all(begin <= i < end for i in rows), (sq, sk, wl, wr, c0)


def test_tile_sizes_do_not_change_the_result():
    q, k, v = make((1, 50, 61, 2, 1, 8))
    base, _ = attention_tiled(q, k, v, 0.4, 5, 1, 64, 64)
    for bm, bn in itertools.product([1, 7, 16], [1, 5, 128]):
        out, _ = attention_tiled(q, k, v, 0.4, 5, 1, bm, bn)
        torch.testing.assert_close(out, base, atol=1e-13, rtol=0)

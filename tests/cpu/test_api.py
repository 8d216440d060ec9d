"""The public API on CPU tensors (the portable path): FlashAttention semantics and the SDPA shim
against the oracle and PyTorch, errors, the custom ops (opcheck, torch.compile), autograd and
dispatch."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import flashcuda
from flashcuda import _log, flash_attn_func, scaled_dot_product_attention
from flashcuda.ops import dispatch
from flashcuda.ops.call import BwdCall, FwdCall
from flashcuda.reference import attention_ref, attention_tiled, max_error

NEG_INF = float("-inf")

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, window_size)
CASES = [
    (2, 17, 17, 4, 4, 32, False, (-1, -1)),
    (1, 143, 97, 4, 2, 40, True, (-1, -1)),
    (2, 40, 10, 2, 1, 16, True, (-1, -1)),  # Sq > Sk: the first 30 rows see no key
    (1, 33, 143, 6, 2, 72, False, (16, 4)),
    (1, 1, 143, 4, 1, 64, True, (-1, -1)),  # decoding
    (1, 70, 70, 2, 2, 24, False, (0, 0)),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rand(*shape, dtype=torch.float32, gen=None, requires_grad=False):
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(requires_grad)


def inputs(case, dtype, seed=0, requires_grad=False):
    b, sq, sk, h, hkv, d = case[:6]
    g = torch.Generator().manual_seed(seed)
    return (rand(b, sq, h, d, dtype=dtype, gen=g, requires_grad=requires_grad),
            rand(b, sk, hkv, d, dtype=dtype, gen=g, requires_grad=requires_grad),
            rand(b, sk, hkv, d, dtype=dtype, gen=g, requires_grad=requires_grad))


def floor(dtype):
    """An absolute floor under the 2x rule for fp32, where both errors are near rounding."""
    return 1e-6 if dtype == torch.float32 else 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_flash_attn_func_matches_oracle(case, dtype):
    q, k, v = inputs(case, dtype)
    causal, window = case[6], case[7]
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window)
    base_out, base_lse = attention_ref(q, k, v, causal=causal, window_size=window, upcast=False)
    assert max_error(out, ref_out) <= 2 * max_error(base_out, ref_out) + floor(dtype)
    assert max_error(lse, ref_lse) <= 2 * max_error(base_lse, ref_lse) + 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_flash_attn_func_gradients_match_oracle(case, dtype):
    q, k, v = inputs(case, dtype, seed=1, requires_grad=True)
    causal, window = case[6], case[7]
    out = flash_attn_func(q, k, v, causal=causal, window_size=window)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_ref(*leaves, causal=causal, window_size=window)
    ref = torch.autograd.grad(ref_out, leaves, dout.double())
    base_out, _ = attention_ref(q, k, v, causal=causal, window_size=window, upcast=False)
    base = torch.autograd.grad(base_out, (q, k, v), dout)
    for name, g, r, b, t in zip("qkv", grads, ref, base, (q, k, v), strict=True):
        assert g.dtype == dtype and g.shape == t.shape
        assert max_error(g, r) <= 3 * max_error(b, r) + 10 * floor(dtype), f"d{name}"


def test_causal_is_bottom_right_aligned():
    # Sq=2, Sk=4: row 0 sees keys 0..2, row 1 sees keys 0..3.
    q = torch.zeros(1, 2, 1, 4)
    k = torch.zeros(1, 4, 1, 4)
    v = torch.arange(4.0).reshape(1, 4, 1, 1).expand(1, 4, 1, 4).contiguous()
    out = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out[0, :, 0, 0], torch.tensor([1.0, 1.5]))
    out = flash_attn_func(q, k, v, window_size=(1, 0))  # row 0: keys 1, 2; row 1: keys 2, 3
    torch.testing.assert_close(out[0, :, 0, 0], torch.tensor([1.5, 2.5]))


def test_return_forms_and_default_scale():
    q, k, v = inputs((1, 9, 11, 2, 1, 16), torch.float32)
    out = flash_attn_func(q, k, v)
    out2, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True)
    assert probs is None and torch.equal(out, out2)
    out3, lse3 = flash_attn_func(q, k, v, softmax_scale=16 ** -0.5, return_lse=True)
    assert torch.equal(out, out3) and torch.equal(lse, lse3)
    out4 = flash_attn_func(q, k, v, softmax_scale=0.5)
    torch.testing.assert_close(out4.double(), attention_ref(q, k, v, 0.5)[0], atol=1e-6, rtol=0)


def test_packed_qkv_views_and_gradients():
    packed = torch.randn(2, 37, 3, 4, 32, requires_grad=True)
    q, k, v = packed.unbind(dim=2)
    out = flash_attn_func(q, k, v, causal=True)
    ref = flash_attn_func(*(t.contiguous() for t in (q, k, v)), causal=True)
    assert torch.equal(out, ref)
    out.sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_ref(*leaves, causal=True)[0].sum().backward()
    torch.testing.assert_close(packed.grad.double(),
                               torch.stack([t.grad for t in leaves], dim=2), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_forms_are_flash_attn_func_on_their_views(dtype):
    """flash_attn_qkvpacked_func / _kvpacked_func (FlashAttention's packed forms) give what
    flash_attn_func gives on the views they unbind, bit for bit, and their gradients reach the
    packed tensor: its slices' gradients are flash_attn_func's (oracle-checked above)."""
    g = torch.Generator().manual_seed(5)
    qkv = rand(2, 37, 3, 4, 32, dtype=dtype, gen=g, requires_grad=True)
    q = rand(2, 21, 4, 32, dtype=dtype, gen=g, requires_grad=True)
    kv = rand(2, 37, 2, 2, 32, dtype=dtype, gen=g, requires_grad=True)
    dout = rand(2, 37, 4, 32, dtype=dtype, gen=g)
    out, lse = flashcuda.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(8, -1),
                                                   return_lse=True)
    leaves = [t.detach().clone().requires_grad_() for t in qkv.unbind(dim=2)]
    ref, ref_lse = flash_attn_func(*leaves, causal=True, window_size=(8, -1), return_lse=True)
    assert out.shape == (2, 37, 4, 32) and torch.equal(out, ref) and torch.equal(lse, ref_lse)
    out.backward(dout)
    ref.backward(dout)
    assert torch.equal(qkv.grad, torch.stack([t.grad for t in leaves], dim=2))
    out = flashcuda.flash_attn_kvpacked_func(q, kv, softmax_scale=0.3)  # GQA 4:2, Sq != Sk
    leaves = [t.detach().clone().requires_grad_() for t in (q, *kv.unbind(dim=2))]
    ref = flash_attn_func(*leaves, softmax_scale=0.3)
    assert torch.equal(out, ref)
    out.backward(dout[:, :21])
    ref.backward(dout[:, :21])
    assert torch.equal(q.grad, leaves[0].grad)
    assert torch.equal(kv.grad, torch.stack([t.grad for t in leaves[1:]], dim=2))


def test_varlen_packed_forms_are_the_varlen_func_on_their_views():
    g = torch.Generator().manual_seed(6)
    lengths = [5, 0, 17, 9]
    cu = torch.tensor([0, 5, 5, 22, 31], dtype=torch.int32)
    qkv = rand(31, 3, 2, 16, gen=g, requires_grad=True)
    out = flashcuda.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=True)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(dim=1))
    ref = flashcuda.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                           causal=True)
    assert out.shape == (31, 2, 16) and torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=1))
    q = rand(31, 2, 16, gen=g)
    kv = rand(40, 2, 1, 16, gen=g)  # MQA, other key lengths
    cu_k = torch.tensor([0, 10, 12, 30, 40], dtype=torch.int32)
    out, lse = flashcuda.flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 17, 18,
                                                         return_attn_probs=True)[:2]
    ref, ref_lse = flashcuda.flash_attn_varlen_func(q, *kv.unbind(dim=1), cu, cu_k, 17, 18,
                                                    return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_packed_forms_name_their_packed_argument():
    qkv = torch.randn(1, 8, 3, 2, 16)
    with pytest.raises(TypeError, match="qkv: expected a torch.Tensor"):
        flashcuda.flash_attn_qkvpacked_func([qkv])
    with pytest.raises(ValueError, match=r"qkv: expected shape \(batch, seqlen, 3, nheads, headdim\)"):
        flashcuda.flash_attn_qkvpacked_func(qkv[:, :, :2])
    with pytest.raises(ValueError, match="qkv: expected shape"):
        flashcuda.flash_attn_qkvpacked_func(qkv[0])
    with pytest.raises(ValueError, match=r"kv: expected shape \(batch, seqlen_k, 2, nheads_kv"):
        flashcuda.flash_attn_kvpacked_func(qkv[:, :, 0], qkv)
    with pytest.raises(TypeError, match=r"qkv\[:, :, 0\]: expected dtype"):
        flashcuda.flash_attn_qkvpacked_func(qkv.to(torch.int32))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flashcuda.flash_attn_qkvpacked_func(qkv, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"qkv: expected shape \(total, 3, nheads, headdim\)"):
        flashcuda.flash_attn_varlen_qkvpacked_func(qkv, torch.tensor([0, 8], dtype=torch.int32), 8)
    with pytest.raises(ValueError, match=r"kv: expected shape \(total_k, 2, nheads_kv, headdim\)"):
        flashcuda.flash_attn_varlen_kvpacked_func(qkv[0, :, 0], qkv[0], torch.tensor([0, 8]),
                                                  torch.tensor([0, 8]), 8, 8)


def test_strided_last_dim_is_copied_like_flash_attention():
    q, k, v = inputs((1, 12, 12, 2, 2, 16), torch.float32)
    wide = torch.randn(1, 12, 2, 32)
    qs = wide[..., ::2]
    out = flash_attn_func(qs, k, v)
    assert torch.equal(out, flash_attn_func(qs.contiguous(), k, v))


def test_empty_inputs_need_no_launch(monkeypatch):
    ran = []
    monkeypatch.setattr(dispatch, "_run_portable", lambda call: ran.append(call))
    for b, sq, sk in [(0, 5, 5), (2, 0, 5), (2, 5, 0)]:
        q, k, v = inputs((b, sq, sk, 4, 2, 16), torch.float32, requires_grad=True)
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert out.shape == q.shape and lse.shape == (b, 4, sq)
        assert (out == 0).all() and (lse == NEG_INF).all()
        out.sum().backward()
        for t in (q, k, v):
            assert t.grad.shape == t.shape and (t.grad == 0).all()
    assert ran == []


def test_masked_keys_never_reach_the_output():
    # NaN beyond seqlen_k in a larger buffer, and NaN in keys of tiles the window skips.
    q, k, v = inputs((1, 16, 200, 2, 2, 8), torch.float32)
    kb = torch.cat([k, torch.full((1, 50, 2, 8), float("nan"))], dim=1)[:, :200]
    vb = torch.cat([v, torch.full((1, 50, 2, 8), float("nan"))], dim=1)[:, :200]
    kb[:, :128] = float("nan")
    vb[:, :128] = float("nan")
    out = flash_attn_func(q, kb, vb, window_size=(0, 0))
    ref, _ = attention_ref(q, k, v, window_size=(0, 0))
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("value,expect", [(float("nan"), "nan"), (float("inf"), "inf"),
                                          (float("-inf"), "-inf")])
def test_nan_in_v_reaches_no_row_that_does_not_see_it(value, expect):
    """The CPU twin of tests/gpu/test_reliability.py's test, on the portable path: a non-finite
    V row at key 200 (causal, 256 x 256) reaches rows 200.. only (NaN; +-Inf stays +-Inf, with
    weights > 0), every other row and head bitwise as in a clean run; +Inf and -Inf in one
    column seen together give NaN."""
    q, k, v = inputs((1, 256, 256, 2, 2, 16), torch.float32)
    clean = flash_attn_func(q, k, v, causal=True)
    vn = v.clone()
    vn[0, 200, 1] = value
    out = flash_attn_func(q, k, vn, causal=True)
    seen = out[0, 200:, 1]
    assert (seen.isnan() if expect == "nan" else seen == float(expect)).all()
    assert torch.equal(out[0, :, 0], clean[0, :, 0])
    assert torch.equal(out[0, :200, 1], clean[0, :200, 1])
    vn[0, 230, 1] = -value  # rows 230.. see both signs (or NaN twice)
    out = flash_attn_func(q, k, vn, causal=True)
    assert out[0, 230:, 1].isnan().all() and torch.equal(out[0, :200, 1], clean[0, :200, 1])

@pytest.mark.parametrize("sq,sk", [(17, 17), (5, 23), (23, 5), (1, 1), (64, 130)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_shim_matches_torch(sq, sk, is_causal, gqa):
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    hkv = 2 if gqa else 4
    query = rand(2, 4, sq, 32, gen=g, requires_grad=True)
    key = rand(2, hkv, sk, 32, gen=g, requires_grad=True)
    value = rand(2, hkv, sk, 32, gen=g, requires_grad=True)
    out = scaled_dot_product_attention(query, key, value, is_causal=is_causal, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, enable_gqa=gqa)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (query, key, value), dout)
    ref_grads = torch.autograd.grad(ref, (query, key, value), dout)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_sdpa_shim_scale_and_no_input_copy(monkeypatch):
    query = torch.randn(1, 2, 9, 16)
    key = torch.randn(1, 2, 12, 16)
    seen = []
    real = dispatch._run_portable
    monkeypatch.setattr(dispatch, "_run_portable", lambda call: (seen.append(call), real(call)))
    out = scaled_dot_product_attention(query, key, key, scale=0.3)
    ref = F.scaled_dot_product_attention(query, key, key, scale=0.3)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)
    (call,) = seen
    assert call.q.data_ptr() == query.data_ptr() and call.k.data_ptr() == key.data_ptr()
    assert call.q.shape == (1, 9, 2, 16) and call.window_right is None


def test_sdpa_shim_errors():
    query, key = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        scaled_dot_product_attention(query, query, query, attn_mask=torch.ones(8, 8).bool())
    with pytest.raises(NotImplementedError, match="dropout_p"):
        scaled_dot_product_attention(query, query, query, dropout_p=0.5)
    with pytest.raises(ValueError, match="key: expected nheads_kv == nheads=4 .pass "
                                         "enable_gqa=True"):
        scaled_dot_product_attention(query, key, key)
    with pytest.raises(ValueError, match=r"query: expected a 4-D tensor \(batch, nheads, seqlen, "
                                         r"headdim\), got a 3-D tensor"):
        scaled_dot_product_attention(query[0], query[0], query[0])
    with pytest.raises(TypeError, match="query: expected dtype in"):
        scaled_dot_product_attention(query.double(), query.double(), query.double())
    with pytest.raises(ValueError, match="scale: expected a finite number, got inf"):
        scaled_dot_product_attention(query, query, query, scale=float("inf"))
    with pytest.raises(ValueError, match=r"key: expected nheads_kv dividing nheads=4"):
        scaled_dot_product_attention(query, key[:, :1].expand(1, 3, 8, 16), key[:, :1].expand(
            1, 3, 8, 16), enable_gqa=True)


def test_flash_attn_func_errors():
    q, k, v = inputs((1, 8, 8, 2, 2, 16), torch.float32)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_attn_func(q, k, v, softcap=50.0)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=torch.zeros(2))
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(-3, 0))
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        flash_attn_func(None, k, v)
    with pytest.raises(TypeError, match="k: expected dtype float32 .the dtype of q., got float16"):
        flash_attn_func(q, k.half(), v.half())
    with pytest.raises(TypeError, match="deterministic: expected a bool"):
        flash_attn_func(q, k, v, deterministic="yes")


@pytest.mark.parametrize("global_flag", [False, True])
def test_deterministic_reaches_the_backward(monkeypatch, global_flag):
    seen = []
    real = dispatch._run_portable
    monkeypatch.setattr(dispatch, "_run_portable", lambda call: (seen.append(call), real(call)))
    q, k, v = inputs((1, 8, 8, 2, 2, 16), torch.float32, requires_grad=True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(global_flag)
    try:
        flash_attn_func(q, k, v, deterministic=not global_flag).sum().backward()
    finally:
        torch.use_deterministic_algorithms(was)
    bwd = [c for c in seen if isinstance(c, BwdCall)]
    assert len(bwd) == 1 and bwd[0].deterministic


def test_lse_is_not_differentiable():
    q, k, v = inputs((1, 8, 8, 2, 2, 16), torch.float32, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad


def _op_args(requires_grad):
    g = torch.Generator().manual_seed(5)
    q = rand(2, 19, 4, 16, gen=g, requires_grad=requires_grad)
    k = rand(2, 23, 2, 16, gen=g, requires_grad=requires_grad)
    v = rand(2, 23, 2, 16, gen=g, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize("window", [(None, None), (None, 0), (3, -2)])
def test_opcheck(window):
    q, k, v = _op_args(requires_grad=True)
    torch.library.opcheck(torch.ops.flashcuda.fwd.default, (q, k, v, 0.25, *window, False))
    with torch.no_grad():
        out, lse = torch.ops.flashcuda.fwd(q, k, v, 0.25, *window, False)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flashcuda.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, 0.25, *window,
                           True))


def test_op_schemas():
    fwd = str(torch.ops.flashcuda.fwd.default._schema)
    bwd = str(torch.ops.flashcuda.bwd.default._schema)
    assert fwd == ("flashcuda::fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, "
                   "SymInt? window_left, SymInt? window_right, bool deterministic) -> "
                   "(Tensor, Tensor)")
    assert bwd.startswith("flashcuda::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                          "Tensor lse, float softmax_scale, SymInt? window_left, SymInt? "
                          "window_right, bool deterministic)")


def test_fake_shapes():
    q, k, v = (t.to("meta") for t in _op_args(requires_grad=False))
    out, lse = torch.ops.flashcuda.fwd(q, k, v, 0.25, None, 0, False)
    assert out.shape == q.shape and lse.shape == (2, 4, 19) and lse.dtype == torch.float32
    dq, dk, dv = torch.ops.flashcuda.bwd(out, q, k, v, out, lse, 0.25, None, 0, False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_torch_compile_fullgraph_flash_attn_func():
    torch._dynamo.reset()

    def fn(q, k, v):
        return flashcuda.flash_attn_func(q, k, v, causal=True, window_size=(8, -1)) * 2

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    q, k, v = _op_args(requires_grad=True)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = fn(q, k, v)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph_sdpa_dynamic_shapes():
    torch._dynamo.reset()

    def fn(query, key, value):
        return flashcuda.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                      enable_gqa=True)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for sq, sk in [(17, 22), (30, 9)]:
        query = torch.randn(2, 4, sq, 16, requires_grad=True)
        key = torch.randn(2, 2, sk, 16, requires_grad=True)
        out = compiled(query, key, key)
        ref = F.scaled_dot_product_attention(query, key, key, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)
        (g,) = torch.autograd.grad(out.sum(), (query,))
        (rg,) = torch.autograd.grad(ref.sum(), (query,))
        torch.testing.assert_close(g, rg, atol=2e-5, rtol=0)


def test_public_names():
    assert set(flashcuda.__all__) >= {"flash_attn_func", "scaled_dot_product_attention",
                                      "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                                      "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
                                      "flash_attn_varlen_kvpacked_func"}
    assert all(callable(getattr(flashcuda, name)) for name in flashcuda.__all__[1:])
    assert "flash_attn_func" in dir(flashcuda)
    with pytest.raises(AttributeError):
        flashcuda.no_such_name  # noqa: B018


# -- dispatch ---------------------------------------------------------------------------------


class FakeFamily:
    def __init__(self, reason):
        self.reason, self.ran = reason, []

    def can_implement(self, call):
        return self.reason

    def run(self, call):
        self.ran.append(call)


def _fwd_call():
    q, k, v = _op_args(requires_grad=False)
    out = torch.full(q.shape, float("nan"))
    lse = torch.full((2, 4, 19), float("nan"))
    return FwdCall(q, k, v, out, lse, 0.25, None, 0)


@pytest.fixture
def fake_families(monkeypatch):
    fams = {"fwd_sm90": "not built", "fwd_sm80": FakeFamily("needs fp16 or bf16"),
            "fwd_simt": FakeFamily(None), "bwd_sm90": "not built",
            "bwd_sm80": FakeFamily("needs sm80"),
            "bwd_simt": FakeFamily("head dim too large")}
    monkeypatch.setattr(dispatch, "_modules", dict(fams))
    monkeypatch.setattr(_log, "_said_once", set())
    monkeypatch.delenv(dispatch.FORCE_ENV, raising=False)
    return fams


def test_dispatch_runs_the_first_family_that_can(fake_families, caplog):
    caplog.set_level(logging.DEBUG, logger="flashcuda")
    call = _fwd_call()
    assert dispatch.run_families(call, "fwd") == "fwd_simt"
    assert fake_families["fwd_simt"].ran == [call]
    text = caplog.text
    assert "skipped fwd_sm90: not built" in text
    assert "skipped fwd_sm80: needs fp16 or bf16" in text
    assert "fp32 d16 causal gqa2 on cpu: running fwd_simt" in text
    assert dispatch.explain(call) == [("fwd_sm90", "not built"),
                                      ("fwd_sm80", "needs fp16 or bf16"), ("fwd_simt", None)]


def test_dispatch_lists_every_reason_when_none_can(fake_families):
    call = _fwd_call()
    bwd = BwdCall(call.q, call.k, call.v, call.out, call.out, call.lse, *(torch.empty_like(t)
                  for t in (call.q, call.k, call.v)), 0.25, None, 0, False)
    with pytest.raises(NotImplementedError, match="no flashcuda bwd kernel can run fp32 d16 "
                                                  "causal gqa2 on cpu: bwd_sm90: not built; "
                                                  "bwd_sm90_wide: dtype torch.float32 is not "
                                                  "fp16/bf16; bwd_sm80: needs sm80; "
                                                  "bwd_simt: head dim too large"):
        dispatch.run_families(bwd, "bwd")


def test_dispatch_force_override(fake_families, monkeypatch):
    monkeypatch.setenv(dispatch.FORCE_ENV, "fwd_sm80, bwd_simt")
    assert dispatch.families("fwd") == ("fwd_sm80",)
    assert dispatch.families("bwd") == ("bwd_simt",)
    with pytest.raises(NotImplementedError, match="fwd_sm80: needs fp16 or bf16$"):
        dispatch.run_families(_fwd_call(), "fwd")
    monkeypatch.setenv(dispatch.FORCE_ENV, "bwd_simt")
    assert dispatch.families("fwd") == dispatch.FWD_FAMILIES
    monkeypatch.setenv(dispatch.FORCE_ENV, "portable")
    call = _fwd_call()
    assert dispatch.run_families(call, "fwd") == "portable"
    ref_out, ref_lse = attention_tiled(call.q, call.k, call.v, 0.25, None, 0)
    assert torch.equal(call.out, ref_out) and torch.equal(call.lse, ref_lse)


def test_dispatch_absent_family_is_not_built(monkeypatch):
    monkeypatch.setattr(dispatch, "_modules", {})
    assert dispatch._family("fwd_no_such_family") == "not built"


def test_cpu_tensors_take_the_portable_path_and_say_so_once(monkeypatch, caplog):
    monkeypatch.setattr(_log, "_said_once", set())
    caplog.set_level(logging.INFO, logger="flashcuda")
    call = _fwd_call()
    assert dispatch.forward(call) == "portable"
    assert dispatch.forward(_fwd_call()) == "portable"
    warnings = [r for r in caplog.records if "the CUDA kernels need a CUDA GPU" in r.message]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert not call.out.isnan().any()


def test_bad_input_is_refused_before_a_strided_last_dimension_is_copied():
    # A (1, 4, 2, 10**9) view of one float (stride 0 everywhere): copying it would need 32 GB.
    # The head-dim limit must refuse it first, in both entry points.
    huge = torch.zeros(1).expand(1, 4, 2, 10**9)
    with pytest.raises(ValueError, match="headdim"):
        flashcuda.flash_attn_func(huge, huge, huge)
    with pytest.raises(ValueError, match="headdim"):
        flashcuda.scaled_dot_product_attention(huge, huge, huge)


def test_backward_gets_no_materialised_lse_gradient(monkeypatch):
    """lse is non-differentiable: the eager backward receives None for it, so autograd allocates
    and fills no zero (B, H, Sq) tensor on the backward's critical path; out's gradient arrives."""
    from flashcuda.ops import attention

    seen = []
    inner = attention._backward

    def spy(ctx, dout, dlse, backward_fn):
        seen.append((dout, dlse))
        return inner(ctx, dout, dlse, backward_fn=backward_fn)

    monkeypatch.setattr(attention, "_backward", spy)
    q, k, v = (torch.randn(1, 7, 2, 32, dtype=torch.float32, requires_grad=True) for _ in range(3))
    out, lse = attention._EagerAttention.apply(q, k, v, 32 ** -0.5, None, 0, False)
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, (q,), dout)
    assert len(seen) == 1
    assert seen[0][1] is None
    assert torch.equal(seen[0][0], dout)
    assert dq.shape == q.shape and torch.isfinite(dq).all()

"""The public API on CUDA against the float64 oracle, with FlashAttention's rule (DESIGN.md §7):
our max error <= 2x PyTorch's same-dtype error (3x for gradients), plus FA3's rounding floor.

Covers whatever family dispatch picks, then each family forced (FLASHCUDA_FORCE_KERNEL) on the
cases it can implement, with NaN-filled outputs; packed qkv views, the SDPA shim, autograd from
the main thread and from another thread, torch.compile(fullgraph=True) and CUDA-graph replay.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from flashcuda import flash_attn_func, scaled_dot_product_attention, validate
from flashcuda.ops import dispatch
from flashcuda.ops.call import BwdCall, FwdCall
from flashcuda.reference import attention_ref, max_error, rounding_floor

pytestmark = pytest.mark.gpu

NEG_INF = float("-inf")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, window_size)
CASES = [
    (2, 128, 128, 8, 8, 64, False, (-1, -1)),
    (1, 257, 257, 8, 2, 128, True, (-1, -1)),  # GQA, ragged
    (2, 113, 203, 4, 1, 64, True, (-1, -1)),  # MQA, Sq < Sk
    (1, 203, 113, 4, 4, 128, False, (32, 8)),  # window, Sq > Sk
    (1, 97, 143, 6, 3, 72, True, (-1, -1)),  # an unusual head dim
    (1, 300, 333, 4, 2, 256, True, (-1, -1)),  # the sm90 forward's d256 (session 26), GQA
    (2, 129, 100, 2, 2, 192, False, (-1, -1)),  # ... and d192, Sq > Sk
]



def make(case, dtype, requires_grad=False, seed=0):
    b, sq, sk, h, hkv, d = case[:6]
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype).requires_grad_(
            requires_grad)

    return r(b, sq, h, d), r(b, sk, hkv, d), r(b, sk, hkv, d)


def check_forward(out, lse, q, k, v, causal, window):
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window)
    base_out, base_lse = attention_ref(q, k, v, causal=causal, window_size=window, upcast=False)
    err, base = max_error(out, ref_out), max_error(base_out, ref_out)
    assert err <= 2 * base + rounding_floor(ref_out, q.dtype), f"out: {err:.3e} vs torch {base:.3e}"
    err, base = max_error(lse, ref_lse), max_error(base_lse, ref_lse)
    assert err <= 2 * base + 1e-5, f"lse: {err:.3e} vs torch {base:.3e}"


def oracle_grads(q, k, v, dout, causal, window):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_ref(*leaves, causal=causal, window_size=window)
    ref = torch.autograd.grad(ref_out, leaves, dout.double())
    same = [t.detach().requires_grad_() for t in (q, k, v)]
    base_out, _ = attention_ref(*same, causal=causal, window_size=window, upcast=False)
    base = torch.autograd.grad(base_out, same, dout)
    return ref, base


def check_grads(grads, ref, base, dtype):
    """FlashAttention's rule (3x torch's same-dtype error) plus rounding; for fp32 also the floor
    of tests/gpu/test_simt.py, 1e-5 x (1 + max|ref|): there both errors are a few ulps of sums over
    hundreds of terms (our sequential sums against cuBLAS's blocked ones) and their ratio is luck
    (session 9: bwd_simt's dv 1.7e-5 against torch's 3.9e-6 with one draw of dout)."""
    for name, g, r, b in zip("qkv", grads, ref, base, strict=True):
        err, berr = max_error(g, r), max_error(b, r)
        floor = rounding_floor(r, dtype)
        if dtype == torch.float32:
            floor += 1e-5 * (1 + r.abs().max().item())
        assert err <= 3 * berr + floor, f"d{name}: {err:.3e} vs torch {berr:.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_api_forward_and_backward_match_oracle(case, dtype):
    q, k, v = make(case, dtype, requires_grad=True)
    causal, window = case[6], case[7]
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    check_forward(out, lse, q, k, v, causal, window)
    dout = torch.randn_like(out)
    out.backward(dout)  # from the main thread: autograd runs it on its device thread
    for t in (q, k, v):
        assert t.grad.dtype == dtype and t.grad.shape == t.shape
    ref, base = oracle_grads(q, k, v, dout, causal, window)
    check_grads([q.grad, k.grad, v.grad], ref, base, dtype)


def _force(monkeypatch, family, call):
    monkeypatch.setenv(dispatch.FORCE_ENV, family)
    ((name, reason),) = dispatch.explain(call)
    assert name == family
    return reason


@pytest.mark.parametrize("family", [*dispatch.FWD_FAMILIES, *dispatch.BWD_FAMILIES])
def test_each_family_forced(family, monkeypatch):
    ran, reasons = 0, []
    # (the wide Hopper backward has only head dims 192 / 256: the last two cases)
    cases = CASES[5:7] if family == "bwd_sm90_wide" else CASES[1:4]
    for dtype in DTYPES:
        for case in cases:
            q, k, v = make(case, dtype, seed=3)
            causal, window = case[6], case[7]
            wl, wr = validate.fa_window(window, causal)
            scale = q.shape[-1] ** -0.5
            out = torch.full(q.shape, float("nan"), device="cuda", dtype=dtype)
            lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda")
            fwd = FwdCall(q, k, v, out, lse, scale, wl, wr)
            if family.startswith("fwd_"):
                reason = _force(monkeypatch, family, fwd)
                if reason is not None:
                    reasons.append(f"{dtype} {case[:6]}: {reason}")
                    continue
                assert dispatch.forward(fwd) == family
                check_forward(out, lse, q, k, v, causal, window)
                ran += 1
                continue
            monkeypatch.setenv(dispatch.FORCE_ENV, "portable")  # isolate the backward under test
            dispatch.forward(fwd)
            g = torch.Generator(device="cuda").manual_seed(4)
            dout = torch.randn(out.shape, device="cuda", generator=g).to(dtype)
            grads = [torch.full(t.shape, float("nan"), device="cuda", dtype=dtype)
                     for t in (q, k, v)]
            bwd = BwdCall(q, k, v, out, dout, lse, *grads, scale, wl, wr, dtype == torch.float16)
            reason = _force(monkeypatch, family, bwd)
            if reason is not None:
                reasons.append(f"{dtype} {case[:6]}: {reason}")
                continue
            assert dispatch.backward(bwd) == family
            ref, base = oracle_grads(q, k, v, dout, causal, window)
            check_grads(grads, ref, base, dtype)
            ran += 1
    if ran == 0:
        pytest.skip(f"{family} implements none of the cases: " + "; ".join(reasons))


def test_packed_qkv_views_without_copy():
    packed = torch.randn(2, 150, 3, 8, 64, device="cuda", dtype=torch.float16,
                         requires_grad=True)
    q, k, v = packed.unbind(dim=2)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    contiguous = [t.detach().contiguous() for t in (q, k, v)]
    assert torch.equal(out, flash_attn_func(*contiguous, causal=True))
    check_forward(out, lse, q, k, v, True, (-1, -1))
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, base = oracle_grads(q, k, v, dout, True, (-1, -1))
    grads = packed.grad.unbind(dim=2)
    check_grads(grads, ref, base, torch.float16)


def test_qkvpacked_and_kvpacked_forms():
    """FlashAttention's packed forms on the GPU: the strided views they unbind run the kernels
    without a copy, out / lse against the oracle, the packed tensor's gradient against the
    oracle's per part."""
    import flashcuda

    qkv = torch.randn(2, 150, 3, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, lse = flashcuda.flash_attn_qkvpacked_func(qkv, causal=True, return_lse=True)
    q, k, v = qkv.unbind(dim=2)
    check_forward(out, lse, q, k, v, True, (-1, -1))
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, base = oracle_grads(q, k, v, dout, True, (-1, -1))
    check_grads(qkv.grad.unbind(dim=2), ref, base, torch.bfloat16)
    q = torch.randn(2, 100, 8, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    kv = torch.randn(2, 180, 2, 2, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    out, lse = flashcuda.flash_attn_kvpacked_func(q, kv, window_size=(40, 8), return_lse=True)
    k, v = kv.unbind(dim=2)
    check_forward(out, lse, q, k, v, False, (40, 8))
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, base = oracle_grads(q, k, v, dout, False, (40, 8))
    check_grads((q.grad, *kv.grad.unbind(dim=2)), ref, base, torch.float16)


@pytest.mark.parametrize("ragged", [False, True], ids=["one-call", "per-entry"])
def test_kvcache_prefill_then_decode(ragged):
    """flash_attn_with_kvcache on the GPU: a prefill of 300 tokens, then 3 decoding steps, new
    keys appended in place (GQA 8:2, bf16); each step's out / lse against the oracle on the keys
    it sees (FlashAttention's rule). ragged: the entries' caches at different lengths (one call
    per entry) and cache rows permuted by cache_batch_idx; else one call for the batch."""
    import flashcuda

    g = torch.Generator(device="cuda").manual_seed(7)
    B, H, Hk, D, cap = 3, 8, 2, 128, 512
    k_cache = torch.zeros(4, cap, Hk, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    rows = torch.tensor([2, 0, 3] if ragged else [0, 1, 2], device="cuda", dtype=torch.int32)
    start = torch.tensor([0, 40, 7] if ragged else [0, 0, 0], device="cuda", dtype=torch.int32)
    for new in (300, 1, 1, 1):
        q = torch.randn(B, new, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, new, Hk, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, new, Hk, D, device="cuda", dtype=torch.bfloat16, generator=g)
        out, lse = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                     cache_seqlens=start, cache_batch_idx=rows,
                                                     causal=True, return_softmax_lse=True)
        for b in range(B):
            n, r = int(start[b]) + new, int(rows[b])
            check_forward(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[r:r + 1, :n],
                          v_cache[r:r + 1, :n], True, (-1, -1))
            assert torch.equal(k_cache[r, n - new:n], k[b]) and torch.equal(v_cache[r, n - new:n], v[b])
        start = start + new


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_kvcache_paged_left_padded_rotary(interleaved):
    """flash_attn_with_kvcache on the GPU with a block table over permuted 16-position pages,
    left padding, rotary embeddings on half of d128 and GQA 8:2 (bf16, causal): the appended
    keys in their pages against the float64 rotation (within bf16's rounding of a float32
    result), each entry's out / lse against the oracle on its logical keys, with q rotated by
    the oracle and rounded to bf16."""
    import flashcuda
    from flashcuda.reference import rotary_ref

    g = torch.Generator(device="cuda").manual_seed(8)
    B, Sq, new, H, Hk, D, page, cap = 3, 5, 5, 8, 2, 128, 16, 160
    bf = dict(device="cuda", dtype=torch.bfloat16)
    blocks = cap // page
    table = torch.randperm(B * blocks + 5, device="cuda", generator=g)[:B * blocks]
    table = table.view(B, blocks).to(torch.int32)
    k_cache = torch.randn(B * blocks + 5, page, Hk, D, generator=g, **bf)
    v_cache = torch.randn(B * blocks + 5, page, Hk, D, generator=g, **bf)
    q = torch.randn(B, Sq, H, D, generator=g, **bf)
    k, v = (torch.randn(B, new, Hk, D, generator=g, **bf) for _ in range(2))
    theta = torch.rand(cap, D // 4, device="cuda", generator=g) * 6.2832
    cos, sin = theta.cos().bfloat16(), theta.sin().bfloat16()
    lengths, pads = [100, 100, 37], [5, 5, 0]
    out, lse = flashcuda.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=torch.tensor(lengths, device="cuda", dtype=torch.int32),
        cache_leftpad=torch.tensor(pads, device="cuda", dtype=torch.int32), block_table=table,
        causal=True, rotary_interleaved=interleaved, return_softmax_lse=True)
    for b, (n, p) in enumerate(zip(lengths, pads, strict=True)):
        logical = [(int(table[b, i // page]), i % page) for i in range(p, n + new)]
        keys = torch.stack([k_cache[s] for s in logical])[None]
        values = torch.stack([v_cache[s] for s in logical])[None]
        pos = torch.arange(n, n + new, device="cuda")[None]
        k_rot = rotary_ref(k[b:b + 1], cos, sin, pos, interleaved)
        got = keys[:, n - p:].double()
        assert ((got - k_rot).abs() <= 2.0 ** -8 * k_rot.abs() + 1e-6).all()
        assert torch.equal(values[0, n - p:], v[b])
        q_rot = rotary_ref(q[b:b + 1], cos, sin, torch.arange(n, n + Sq, device="cuda")[None],
                           interleaved).bfloat16()
        check_forward(out[b:b + 1], lse[b:b + 1], q_rot, keys, values, True, (-1, -1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decoding_packed_by_kv_head(dtype):
    """flash_attn_func and the SDPA shim with one query per entry (no autograd, GQA 16:4, 777
    keys): ops.decode's call (the decode kernels for fp16 / bf16, the packed view for fp32) and
    the plain one (decode_off) each against the oracle (their tiles may differ, so their bits
    may); the shim's call is the same call, bit for bit."""
    from flashcuda.bench.extras import decode_off

    g = torch.Generator(device="cuda").manual_seed(10)
    q = torch.randn(4, 1, 16, 64, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(4, 777, 4, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_forward(out, lse, q, k, v, True, (-1, -1))
    with decode_off():
        plain, plain_lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_forward(plain, plain_lse, q, k, v, True, (-1, -1))
    sdpa = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                        enable_gqa=True)
    assert torch.equal(sdpa.transpose(1, 2), out)


@pytest.mark.parametrize("entry", ["kvcache", "func"])
@pytest.mark.parametrize("heads", [(32, 8), (16, 16)], ids=["gqa", "mha"])
def test_long_single_sequence_decode(heads, entry):
    """One sequence's decode step over 20000 cached keys (bf16, d128), through
    flash_attn_with_kvcache (appending one key) or flash_attn_func on the cache's view: the
    decode kernels' split (fp32 partials) against the oracle, with the bound of ops.decode's
    fallback pieces (FlashAttention's rule plus one more rounding of each piece's out to bf16,
    2^-9 max|v|) that the same call runs where the kernels do not take it."""
    import flashcuda
    from flashcuda.ops import decode

    H, Hk = heads
    D, n = 128, 20000
    g = torch.Generator(device="cuda").manual_seed(9)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(1, n + 64, Hk, D, generator=g, **bf)
    v_cache = torch.randn(1, n + 64, Hk, D, generator=g, **bf)
    q = torch.randn(1, 1, H, D, generator=g, **bf)
    k, v = (torch.randn(1, 1, Hk, D, generator=g, **bf) for _ in range(2))
    assert decode.split_chunk(n + 1, Hk, decode._sms(q.device)) > 0  # the split runs
    if entry == "kvcache":
        out, lse = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=n,
                                                     causal=True, return_softmax_lse=True)
    else:
        k_cache[:, n:n + 1], v_cache[:, n:n + 1] = k, v
        out, lse = flashcuda.flash_attn_func(q, k_cache[:, :n + 1], v_cache[:, :n + 1],
                                             causal=True, return_lse=True)
    keys, values = k_cache[:, :n + 1], v_cache[:, :n + 1]
    ref, ref_lse = attention_ref(q, keys, values, causal=True)
    base, base_lse = attention_ref(q, keys, values, causal=True, upcast=False)
    err, berr = max_error(out, ref), max_error(base, ref)
    bound = 2 * berr + rounding_floor(ref, q.dtype) + 2.0 ** -9 * float(values.abs().max())
    assert err <= bound, f"out: {err:.3e} > {bound:.3e} (torch {berr:.3e})"
    err, berr = max_error(lse, ref_lse), max_error(base_lse, ref_lse)
    assert err <= 2 * berr + 1e-5, f"lse: {err:.3e} vs torch {berr:.3e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sq,sk", [(128, 128), (100, 180), (180, 100)])
def test_sdpa_shim(sq, sk, dtype):
    g = torch.Generator(device="cuda").manual_seed(sq + sk)
    query = torch.randn(2, 8, sq, 64, device="cuda", generator=g).to(dtype)
    key = torch.randn(2, 2, sk, 64, device="cuda", generator=g).to(dtype)
    value = torch.randn(2, 2, sk, 64, device="cuda", generator=g).to(dtype)
    out = scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    assert out.shape == query.shape and out.dtype == dtype
    ref = F.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                         is_causal=True, enable_gqa=True)
    torch_out = F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                               enable_gqa=True)
    assert max_error(out, ref) <= 2 * max_error(torch_out, ref) + rounding_floor(ref, dtype)


def test_backward_from_another_thread():
    q, k, v = make(CASES[0], torch.bfloat16, requires_grad=True)
    errors = []

    def work():
        try:
            flash_attn_func(q, k, v, causal=True).float().square().sum().backward()
            torch.cuda.synchronize()
        except Exception as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_edge_cases_on_gpu():
    # Fully masked rows (causal, Sq > Sk): out 0, lse -inf, zero dq, never NaN.
    q, k, v = make((1, 80, 20, 4, 2, 64), torch.float16, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert (out[:, :60] == 0).all() and (lse[:, :, :60] == NEG_INF).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 60:]).all()
    out.sum().backward()
    assert (q.grad[:, :60] == 0).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # Empty shapes: no launch, right shapes.
    for b, sq, sk in [(0, 8, 8), (2, 0, 8), (2, 8, 0)]:
        q, k, v = make((b, sq, sk, 4, 2, 64), torch.float16)
        out, lse = flash_attn_func(q, k, v, return_lse=True)
        assert out.shape == q.shape and (out == 0).all() and (lse == NEG_INF).all()
    # NaN past seqlen_k in the underlying buffer never reaches the output.
    q, k, v = make((1, 64, 100, 4, 4, 64), torch.float16)
    pad = torch.full((1, 28, 4, 64), float("nan"), device="cuda", dtype=torch.float16)
    kb, vb = torch.cat([k, pad], dim=1)[:, :100], torch.cat([v, pad], dim=1)[:, :100]
    assert torch.equal(flash_attn_func(q, kb, vb), flash_attn_func(q, k, v))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()

    def fn(q, k, v):
        return flash_attn_func(q, k, v, causal=True).float().square().mean()

    compiled = torch.compile(fn, fullgraph=True)
    q, k, v = make(CASES[1], torch.bfloat16, requires_grad=True)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = fn(q, k, v)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_bench_graph_latency_times_replays():
    """The bench's CUDA-graph serving column (flashcuda.bench.timing.graph_latency) captures a
    flashcuda forward and times its replays."""
    from flashcuda.bench.timing import graph_latency

    q, k, v = make(CASES[1], torch.float16)
    r = graph_latency(lambda: flash_attn_func(q, k, v, causal=True), n=20)
    assert r["graph_n"] == 20 and 0 < r["graph_p50_ms"] <= r["graph_p99_ms"] < 1000


def test_cuda_graph_capture_and_replay():
    q, k, v = make(CASES[1], torch.float16)
    static = [t.clone() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compile and load outside the capture
        for _ in range(2):
            flash_attn_func(*static, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flash_attn_func(*static, causal=True)
    for seed in (1, 2):
        fresh = make(CASES[1], torch.float16, seed=seed)
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, flash_attn_func(*fresh, causal=True))

"""The sm90a backward (flashcuda.ops.bwd_sm90) on the H200 (its gate was lifted after this file
passed in full, lane 8b5e075: docs/EVIDENCE.md).

Every check runs `bwd_sm90.run(BwdCall(...))` on NaN-prefilled dq / dk / dv, with out / lse
from the float64 oracle (so no forward kernel is involved), and compares with the float64
autograd gradients of flashcuda.reference.attention_ref under FlashAttention's rule:

    max |ours - ref64| <= 3 * max |torch_same_dtype - ref64| + rounding_floor(ref64, dtype) + 1e-5

(the 1e-5, as in test_bwd_sm80.py: where every row sees one key, dS = P (dP - delta) is exactly 0
in the oracle and in torch, and rounding noise of a few 1e-7 in ours.)

Debug order on a fresh GPU (each step seconds; run with -x; scripts/sm90_bwd_probe.py prints
error maps per GEMM, one case per process, if a smoke test fails):
    pytest -m gpu tests/gpu/test_bwd_sm90.py -x -q -k smoke
    pytest -m gpu tests/gpu/test_bwd_sm90.py -x -q -k "pipeline or rag"
    pytest -m gpu tests/gpu/test_bwd_sm90.py -q
`test_smoke_*` isolate the GEMMs of one CTA, one head, one query block: dV = P^T dO alone (Q = 0:
uniform P), dP^T / dS^T through dK alone, dQ = dS K alone; then the whole tile.
Every test runs with the defaults, with each dQ staging (FLASHCUDA_SM90_BWD_DQ=tma, frag; the
defaults are tma at d64, frag at d128) and with the schedule switches (the fixture below). After a
kernel change add FLASHCUDA_SM90_BWD_WATCHDOG=1: a barrier wait that gives up after 2 s poisons
dK / dV with NaN (a failing test) instead of hanging the GPU (scripts/sm90_bwd_bringup.sh).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from flashcuda.ops import bwd_sm80, bwd_sm90, dispatch
from flashcuda.ops.call import BwdCall
from flashcuda.reference import attention_ref, rounding_floor

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
FULL = (None, None)
CAUSAL = (None, 0)


@pytest.fixture(autouse=True,
                params=["default", "wsplit", "wsplit5", "lptl", "tma", "frag"],
                ids=["default", "wsplit", "wsplit5", "lptl", "dq-tma", "dq-frag"])
def _enable_sm90_bwd(monkeypatch, request):
    """Every test with each dQ staging (FLASHCUDA_SM90_BWD_DQ: tma, frag; at each head dim one
    of them is the default, the other an A/B), and first with none of the switches set: the
    kernels dispatch runs by default (at d128 the register-order staging, 80 query rows per step
    without a mask from SWAP_MIN_SEQLEN_Q; P^T split at both head dims; at d64 the last-wave
    split without a mask from 2k and the causal tail's own grid at 2k-8k;
    FLASHCUDA_SM90_BWD_DEFINES, if the lane sets it, passes through); "wsplit": the last wave
    split into pieces
    (FLASHCUDA_SM90_BWD_WAVE_SPLIT=1; FC_WAVE_SPLIT: at these sizes every work item is in the
    last wave, so the pieces kernel runs them all); "wsplit5": the same planned for 5 SMs
    (FLASHCUDA_SM90_BWD_WAVE_SMS=5: MAIN's CTAs, then the pieces as its dependents); "lptl":
    causal calls' first pairs as their own grid after MAIN (FLASHCUDA_SM90_BWD_LPT_LAUNCH=1;
    FC_WAVE_SPLIT=3)."""
    monkeypatch.setenv(bwd_sm90.ENABLE_ENV, "1")
    switches = {"wsplit": bwd_sm90.WAVE_SPLIT_ENV, "wsplit5": bwd_sm90.WAVE_SPLIT_ENV,
                "lptl": bwd_sm90.LPT_LAUNCH_ENV}  # (the defaults with one 0 / 1 switch on)
    if request.param == "default" or request.param in switches:
        for env in (bwd_sm90.DQ_ENV, bwd_sm90.SWAP_ENV, bwd_sm90.WATCHDOG_ENV,
                    bwd_sm90.FENCE_ENV, bwd_sm90.WAVE_SMS_ENV, *switches.values()):
            monkeypatch.delenv(env, raising=False)
        if request.param in switches:
            monkeypatch.setenv(switches[request.param], "1")
        if request.param == "wsplit5":
            monkeypatch.setenv(bwd_sm90.WAVE_SMS_ENV, "5")
    else:  # the dQ staging named (the other switches as the lane left them)
        monkeypatch.setenv(bwd_sm90.DQ_ENV, request.param)
    dispatch._reset()
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        pytest.skip(f"sm90a kernel: needs compute capability 9.0, got {major}.{minor}")
    yield
    dispatch._reset()


def make(B, Sq, Sk, H, Hkv, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v, dout


def run(module, q, k, v, out, dout, lse, scale, window):
    dq = torch.full(q.shape, float("nan"), device=q.device, dtype=q.dtype)
    dk = torch.full(k.shape, float("nan"), device=q.device, dtype=q.dtype)
    dv = torch.full(v.shape, float("nan"), device=q.device, dtype=q.dtype)
    call = BwdCall(q, k, v, out, dout, lse, dq, dk, dv, scale, window[0], window[1], False)
    why = module.can_implement(call)
    assert why is None, why
    module.run(call)
    torch.cuda.synchronize()
    return dq, dk, dv


def oracle(q, k, v, dout, scale, window):
    """(out in q's dtype, lse fp32) of the float64 forward, the float64 gradients, and the
    gradients PyTorch gets in q's dtype (the error baseline)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_ref(q64, k64, v64, scale, window=window)
    out64.backward(dout.double())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outl, _ = attention_ref(ql, kl, vl, scale, window=window, upcast=False)
    outl.backward(dout)
    return ((out64.detach().to(q.dtype), lse64.detach().float()),
            (q64.grad, k64.grad, v64.grad), (ql.grad, kl.grad, vl.grad))


def check(q, k, v, dout, window=FULL, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    (out, lse), refs, lows = oracle(q, k, v, dout, scale, window)
    ours = run(bwd_sm90, q, k, v, out, dout, lse, scale, window)
    for name, got, ref, low in zip(("dq", "dk", "dv"), ours, refs, lows, strict=True):
        assert not got.isnan().any(), f"{name}: NaN (unwritten or poisoned)"
        err = (got.double() - ref).abs().max().item()
        torch_err = (low.double() - ref).abs().max().item()
        tol = 3 * torch_err + rounding_floor(ref, q.dtype) + 1e-5
        assert err <= tol, f"{name}: max error {err:.3e} > {tol:.3e} (torch {torch_err:.3e})"
    return ours, refs


# ---- smoke: one CTA, one head, one query block; each GEMM isolated -------------------------------

@pytest.mark.parametrize("head_dim", [64, 128])
def test_smoke_dv_only(head_dim):
    """dV = P^T dO (RS wgmma, A = P^T from the S^T accumulators, dO read MN-major) with Q = 0:
    P is uniform (1 / Sk), so every dV row is the column mean of dO, and a wrong dO descriptor
    or a wrong P^T fragment shows as rows that differ or a wrong mean."""
    bm = bwd_sm90.BLOCK_M[head_dim]
    _, k, v, dout = make(1, bm, 128, 1, 1, head_dim, BF16, seed=1)
    q = torch.zeros(1, bm, 1, head_dim, device="cuda", dtype=BF16)
    (_, _, dv), _ = check(q, k, v, dout)
    mean = dout[0, :, 0].double().sum(0) / 128
    assert (dv[0, :, 0].double() - mean).abs().max().item() < 2e-2


@pytest.mark.parametrize("head_dim", [64, 128])
def test_smoke_scores_and_dk(head_dim):
    """S^T = K Q^T, dP^T = V dO^T (SS wgmma, K-major) and dK = dS^T Q (RS, Q read MN-major):
    dK is the first gradient that needs every one of them; dV needs only S^T."""
    bm = bwd_sm90.BLOCK_M[head_dim]
    q, k, v, dout = make(1, bm, 128, 1, 1, head_dim, BF16, seed=2)
    check(q, k, v, dout)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_smoke_dq_only(head_dim):
    """dQ = dS K (dS through shared memory, the layout FLASHCUDA_SM90_BWD_DS picks, K read
    MN-major) with K = identity rows on the first head_dim keys: dQ[:, j] = scale * dS[:, j]."""
    bm = bwd_sm90.BLOCK_M[head_dim]
    q, _, v, dout = make(1, bm, head_dim, 1, 1, head_dim, BF16, seed=3)
    k = torch.eye(head_dim, device="cuda", dtype=BF16)[None, :, None, :].contiguous()
    check(q, k, v, dout)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_smoke_one_tile(head_dim, dtype):
    q, k, v, dout = make(1, bwd_sm90.BLOCK_M[head_dim], 128, 1, 1, head_dim, dtype, seed=4)
    check(q, k, v, dout)
    check(q, k, v, dout, CAUSAL)


# ---- the pipeline: many query blocks (stage reuse, mbarrier phases, dS double buffer) ----------

@pytest.mark.parametrize("head_dim", [64, 128])
def test_pipeline_many_query_blocks(head_dim):
    q, k, v, dout = make(1, 128 * 7, 128, 1, 1, head_dim, BF16, seed=5)
    check(q, k, v, dout)
    check(q, k, v, dout, CAUSAL)


def test_ragged_smallest():
    check(*make(1, 1, 1, 1, 1, 128, BF16, seed=6))
    check(*make(1, 17, 143, 1, 1, 64, BF16, seed=7), CAUSAL)


# ---- the grid: sequence lengths, Sq != Sk, masks, GQA, batch -----------------------------------

SEQLENS = [1, 17, 128, 143, 1023, 2048]
PAIRS = [(a, b) for a in SEQLENS for b in SEQLENS if a == b or (a, b) in
         {(1, 17), (17, 1), (128, 1023), (1023, 128), (143, 2048), (2048, 143), (17, 2048)}]


@pytest.mark.parametrize("window", [FULL, CAUSAL, (100, 20)], ids=["full", "causal", "window"])
@pytest.mark.parametrize("seqlens", PAIRS, ids=[f"q{a}-k{b}" for a, b in PAIRS])
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 128), (FP16, 64), (BF16, 64), (FP16, 128)],
                         ids=["bf16-d128", "fp16-d64", "bf16-d64", "fp16-d128"])
def test_seqlens(dtype, head_dim, seqlens, window):
    sq, sk = seqlens
    check(*make(1, sq, sk, 2, 2, head_dim, dtype, seed=sq * 7919 + sk), window)


@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("nheads_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_batch(batch, nheads_kv, head_dim):
    q, k, v, dout = make(batch, 257, 300, 4, nheads_kv, head_dim, BF16, seed=batch * 10 + nheads_kv)
    check(q, k, v, dout, CAUSAL)
    check(q, k, v, dout, FULL)


def test_causal_longest_first_tail_over_part_of_the_grid():
    """Causal d128 calls run the CTAs of the grid's last LPT_TAIL[128] (KV head, batch) pairs
    longest-first (FC_LPT_TAIL): with 3 x 5 pairs (GQA, 2 query heads each) the tail remaps 8 of
    the 15 and leaves the first 7 in blockIdx order; every CTA's dK / dV still lands in place.
    Without a mask the plan keeps blockIdx order."""
    q, k, v, dout = make(3, 700, 700, 10, 5, 128, BF16, seed=21)
    check(q, k, v, dout, CAUSAL)
    check(q, k, v, dout, FULL)
    lse = torch.zeros(3, 10, 700, device="cuda", dtype=torch.float32)
    for window, tail in ((CAUSAL, bwd_sm90.LPT_TAIL[128]), (FULL, 0)):
        call = BwdCall(q, k, v, torch.empty_like(q), dout, lse, torch.empty_like(q),
                       torch.empty_like(k), torch.empty_like(v), 0.088, *window, False)
        plan = bwd_sm90._plan(call)  # (the "lptl" parameter: the tail as its own grid instead)
        assert plan.cfg.lpt_tail == (0 if plan.tail is not None else tail)
        assert 3 * 5 > tail


WAVE_CASES = [  # (B, Sq, Sk, H, Hkv, D, window, SMs)
    (2, 700, 700, 4, 2, 64, FULL, 10),        # 24 items: 20 in MAIN, 4 x 2 pieces of 6 steps
    (3, 300, 1000, 6, 2, 64, CAUSAL, 22),     # GQA 3:1, 48 items: 44 + 4 x up to 5 pieces
    (1, 2048, 2048, 2, 1, 64, FULL, 11),      # 16 items: 11 + 5 x 2 pieces of 16 steps
    (2, 1000, 333, 3, 3, 128, (100, 20), 4),  # sliding window, ragged: 18 items, 16 + 2 x 2
    (1, 143, 2048, 1, 1, 64, CAUSAL, 200),    # 16 items < 200 SMs: all pieces, no MAIN
]


@pytest.mark.parametrize("case", WAVE_CASES, ids=[f"case{i}" for i in range(len(WAVE_CASES))])
def test_wave_split_main_and_pieces(monkeypatch, case):
    """The last-wave split planned for a few SMs (FLASHCUDA_SM90_BWD_WAVE_SMS), so that MAIN runs
    the first items and the pieces kernel (its programmatic dependent) the rest, cut unevenly
    where the steps do not divide: every dK / dV row lands once, summed over its pieces; dQ from
    both kernels. Runs under the "wsplit" parameter only."""
    if os.environ.get(bwd_sm90.WAVE_SPLIT_ENV) != "1" or os.environ.get(bwd_sm90.WAVE_SMS_ENV):
        pytest.skip("runs under the wsplit fixture parameter")
    b, sq, sk, h, hkv, d, window, sms = case
    monkeypatch.setenv(bwd_sm90.WAVE_SMS_ENV, str(sms))
    monkeypatch.setenv(bwd_sm90.LPT_LAUNCH_ENV, "0")  # (case 4's causal 2k: the split, not the tail grid)
    q, k, v, dout = make(b, sq, sk, h, hkv, d, BF16, seed=sq + sk + sms)
    check(q, k, v, dout, window)
    lse = torch.zeros(b, h, sq, device="cuda", dtype=torch.float32)
    call = BwdCall(q, k, v, torch.empty_like(q), dout, lse, torch.empty_like(q),
                   torch.empty_like(k), torch.empty_like(v), 0.1, *window, False)
    plan = bwd_sm90._plan(call)
    items = -(-sk // 128) * hkv * b
    expect = bwd_sm90.wave_plan(call, dataclasses.replace(plan.cfg, wave_split=0), sms)
    assert expect is not None and plan.wave == expect and plan.cfg.wave_split == 1
    assert plan.wave.main_ctas == (items // sms) * sms and plan.wave.total == items
    assert plan.table.tolist() == [list(p) for p in plan.wave.pieces]


@pytest.mark.parametrize("shape", [(3, 700, 700, 12, 6, 64), (2, 300, 1000, 6, 2, 128),
                                   (1, 1023, 1023, 3, 1, 64)], ids=["18pairs", "4pairs", "1pair"])
def test_causal_tail_as_its_own_grid(shape):
    """Causal calls' first LPT_LAUNCH_PAIRS (KV head, batch) pairs as a grid of (pairs, key
    blocks) after MAIN (FC_WAVE_SPLIT=3; MAIN skips their CTAs): 18 pairs (8 in the tail, GQA
    2:1, ragged last key block), 4 and 1 pairs (the tail grid alone, no MAIN launch). Runs under
    the "lptl" parameter only."""
    if os.environ.get(bwd_sm90.LPT_LAUNCH_ENV) != "1":
        pytest.skip("runs under the lptl fixture parameter")
    b, s, h, hkv, d = shape[0], shape[1], shape[3], shape[4], shape[5]
    q, k, v, dout = make(b, s, shape[2], h, hkv, d, BF16, seed=s + h)
    check(q, k, v, dout, CAUSAL)
    lse = torch.zeros(b, h, s, device="cuda", dtype=torch.float32)
    call = BwdCall(q, k, v, torch.empty_like(q), dout, lse, torch.empty_like(q),
                   torch.empty_like(k), torch.empty_like(v), 0.1, *CAUSAL, False)
    plan = bwd_sm90._plan(call)
    pairs = b * hkv
    assert plan.tail is not None and plan.cfg.wave_split == 1 and not plan.cfg.lpt_tail
    assert plan.tail_main == (pairs > bwd_sm90.LPT_LAUNCH_PAIRS)
    assert plan.tail.grid == (min(pairs, bwd_sm90.LPT_LAUNCH_PAIRS), -(-shape[2] // 128), 1)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_convert_readers_agree(monkeypatch, dtype):
    """d128's CONVERT reads the register-order dq_accum in whole 64-byte spans and writes dq
    through shared memory (FC_DQ_SPANS, the default since session 15); the float2 reader it
    replaced (FLASHCUDA_SM90_BWD_CONVERT_SPANS=0, A/B) must give the same bits: both compute
    dq_accum * scale once per element. 333 queries end inside a 64-row CTA, 3 batches x 3 heads
    (GQA 3:1) put the (batch, head) slices at odd offsets. Runs once (the default reductions)."""
    if os.environ.get(bwd_sm90.DQ_ENV) != "tma":
        pytest.skip("runs under one fixture parameter (dq-tma)")
    monkeypatch.delenv(bwd_sm90.DQ_ENV)
    dispatch._reset()
    q, k, v, dout = make(3, 333, 200, 3, 1, 128, dtype, seed=41)
    scale = 128 ** -0.5
    (out, lse), _, _ = oracle(q, k, v, dout, scale, FULL)
    (spans, _, _), _ = check(q, k, v, dout, FULL)
    monkeypatch.setenv(bwd_sm90.CONVERT_SPANS_ENV, "0")
    dispatch._reset()
    lanes, _, _ = run(bwd_sm90, q, k, v, out, dout, lse, scale, FULL)
    assert torch.equal(spans, lanes)


def test_windows_and_fully_masked_rows():
    q, k, v, dout = make(2, 1023, 1023, 2, 1, 64, BF16, seed=8)
    check(q, k, v, dout, (64, 0))
    check(q, k, v, dout, (32, 16))
    q, k, v, dout = make(2, 300, 100, 2, 2, 128, BF16, seed=9)  # rows < 200 see no key
    (dq, _, _), _ = check(q, k, v, dout, CAUSAL)
    assert (dq[:, :200] == 0).all()


def test_keys_no_row_sees_get_zero_grads():
    # window (2, 0): row i sees keys i + 198 .. i + 200, so keys < 198 are unseen (a window of
    # one key would make dS = P (dP - delta) cancel to rounding noise against an exact-0 oracle)
    q, k, v, dout = make(1, 100, 300, 2, 2, 128, FP16, seed=10)
    (_, dk, dv), _ = check(q, k, v, dout, (2, 0))
    assert (dk[:, :198] == 0).all() and (dv[:, :198] == 0).all()


def test_packed_qkv_views():
    g = torch.Generator(device="cuda").manual_seed(11)
    qkv = torch.randn(2, 513, 3, 4, 128, device="cuda", dtype=FP16, generator=g)
    q, k, v = qkv.unbind(2)
    dout = torch.randn(2, 513, 4, 128, device="cuda", dtype=FP16, generator=g)
    check(q, k, v, dout, CAUSAL)


# ---- agreement with the sm80 kernel, and dispatch ----------------------------------------------

@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_agrees_with_sm80(head_dim, window):
    q, k, v, dout = make(2, 1023, 2048, 4, 2, head_dim, BF16, seed=12)
    scale = head_dim ** -0.5
    (out, lse), refs, lows = oracle(q, k, v, dout, scale, window)
    ours = run(bwd_sm90, q, k, v, out, dout, lse, scale, window)
    theirs = run(bwd_sm80, q, k, v, out, dout, lse, scale, window)
    for name, a, b, ref, low in zip(("dq", "dk", "dv"), ours, theirs, refs, lows, strict=True):
        tol = 3 * (low.double() - ref).abs().max().item() + rounding_floor(ref, q.dtype) + 1e-5
        assert (a.double() - b.double()).abs().max().item() <= 2 * tol, name


def test_dispatch_prefers_sm90_bwd_when_enabled():
    q, k, v, dout = make(1, 256, 256, 2, 2, 128, BF16, seed=13)
    out = torch.empty_like(q)
    lse = torch.zeros(1, 2, 256, device="cuda", dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    call = BwdCall(q, k, v, out, dout, lse, dq, dk, dv, 0.088, None, 0, False)
    assert dispatch.backward(call) == "bwd_sm90"

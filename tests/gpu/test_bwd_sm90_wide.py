"""The sm90a backward for head dims 192 and 256 (flashcuda.ops.bwd_sm90_wide) on the H200.

As tests/gpu/test_bwd_sm90.py: `bwd_sm90_wide.run(BwdCall(...))` on NaN-prefilled dq / dk / dv,
out / lse from the float64 oracle (no forward kernel involved), compared with the float64
autograd gradients of flashcuda.reference.attention_ref under FlashAttention's rule

    max |ours - ref64| <= 3 * max |torch_same_dtype - ref64| + rounding_floor(ref64, dtype) + 1e-5

Debug order on a fresh GPU: `-k smoke` (one CTA, one query block: dV alone with Q = 0, so P is
uniform; dK; dQ alone), then `-k "pipeline or seqlens"`, then the file.
"""

from __future__ import annotations

import pytest
import torch

from flashcuda.ops import bwd_sm80, bwd_sm90_wide, dispatch
from flashcuda.ops.call import BwdCall
from flashcuda.reference import rounding_floor
from tests.gpu.test_bwd_sm90 import make, oracle, run

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
FULL = (None, None)
CAUSAL = (None, 0)


VARIANTS = {  # id: (FLASHCUDA_SM90_BWD_WIDE_DEFINES, _SPLIT)
    "default": ("", ""),
    "dims": ("", "dims"),  # (d192 only: at d256 it is the default)
    # the default kernels with the grid's last 8 (KV head, batch) pairs longest-first
    # (FC_LPT_TAIL=8, session 32's A/B; with fewer pairs the whole grid is remapped)
    "lpt8": ("FC_LPT_TAIL=8", ""),
}
KEYS_ONLY = ("dims",)  # variants of the d192 kernels


@pytest.fixture(params=[256, 192], ids=["d256", "d192"])
def D(request, _sm90):
    if _sm90 in KEYS_ONLY and request.param not in bwd_sm90_wide.KEYS_HEAD_DIMS:
        pytest.skip("d256 has only the head-dim split: the default kernel")
    return request.param


@pytest.fixture(autouse=True, params=list(VARIANTS))
def _sm90(monkeypatch, request):
    """Every test with the default kernels (d192: dK / dV split by keys, flash_bwd_sm90_keys.cu;
    d256: split by head-dim rows, flash_bwd_sm90_wide.cu; dQ by staged bulk reduce-adds in
    both), then the head-dim split at d192 ("dims") and the default kernels with the causal
    tail longest-first (FC_LPT_TAIL=8, "lpt8"). Yields the variant's id. (The A/B variants
    of the dQ reduction and of the key split's layout were removed in session 39.)"""
    defines, split = VARIANTS[request.param]
    monkeypatch.setenv(bwd_sm90_wide.DEFINES_ENV, defines)
    monkeypatch.setenv(bwd_sm90_wide.SPLIT_ENV, split)
    dispatch._reset()
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        pytest.skip(f"sm90a kernel: needs compute capability 9.0, got {major}.{minor}")
    yield request.param
    dispatch._reset()


def test_the_variant_runs_its_kernel(D, _sm90):
    """The call's MAIN kernel is the variant's: the key split exactly at d192 by default."""
    q, k, v, dout = make(1, 64, 64, 1, 1, D, BF16, seed=1)
    call = BwdCall(q, k, v, dout, dout, torch.zeros(1, 1, 64, device="cuda"), q, k, v, 0.1,
                   None, None, False)
    keys = _sm90 in ("default", "lpt8") and D == 192
    cfg = bwd_sm90_wide.config_for(call)
    assert cfg.keys_split == keys
    assert (("FC_LPT_TAIL", 8) in cfg.defines) == (_sm90 == "lpt8")


def tolerance(ref, low, dtype):
    return 3 * (low.double() - ref).abs().max().item() + rounding_floor(ref, dtype) + 1e-5


def check(q, k, v, dout, window=FULL, scale=None, only=("dq", "dk", "dv")):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    (out, lse), refs, lows = oracle(q, k, v, dout, scale, window)
    ours = run(bwd_sm90_wide, q, k, v, out, dout, lse, scale, window)
    for name, got, ref, low in zip(("dq", "dk", "dv"), ours, refs, lows, strict=True):
        if name not in only:
            continue
        assert not got.isnan().any(), f"{name}: NaN (unwritten)"
        err = (got.double() - ref).abs().max().item()
        tol = tolerance(ref, low, q.dtype)
        assert err <= tol, f"{name}: max error {err:.3e} > {tol:.3e}"
    return ours, refs


# ---- smoke: one CTA, one head, one query block -------------------------------------------------

def test_smoke_dv_only(D):
    # Q = 0: S = 0, P uniform (1 / 64 per key): dV^T = dO^T P alone is exercised
    q, k, v, dout = make(1, 64, 64, 1, 1, D, BF16, seed=1)
    check(torch.zeros_like(q), k, v, dout, only=("dv",))


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_smoke_one_tile(dtype, D):
    q, k, v, dout = make(1, 64, 64, 1, 1, D, dtype, seed=2)
    check(q, k, v, dout)


def test_smoke_dk_dq_causal(D):
    q, k, v, dout = make(1, 64, 64, 1, 1, D, BF16, seed=3)
    check(q, k, v, dout, CAUSAL)


# ---- pipeline, shapes, masks ---------------------------------------------------------------------

def test_pipeline_many_query_blocks(D):
    q, k, v, dout = make(1, 1024, 128, 2, 2, D, BF16, seed=4)
    check(q, k, v, dout)


SEQLENS = [1, 17, 64, 143, 1023]
PAIRS = [(a, b) for a in SEQLENS for b in SEQLENS if a == b or (a, b) in
         ((1, 143), (143, 1), (17, 1023), (1023, 17), (64, 143), (143, 64))]


@pytest.mark.parametrize("window", [FULL, CAUSAL, (100, 20)], ids=["full", "causal", "window"])
@pytest.mark.parametrize("seqlens", PAIRS, ids=[f"q{a}-k{b}" for a, b in PAIRS])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_seqlens(dtype, seqlens, window, D):
    q, k, v, dout = make(2, seqlens[0], seqlens[1], 2, 1, D, dtype, seed=5)
    check(q, k, v, dout, window)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("nheads_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_gqa_batch(batch, nheads_kv, D):
    q, k, v, dout = make(batch, 300, 257, 4, nheads_kv, D, BF16, seed=6)
    check(q, k, v, dout, CAUSAL)


def test_windows_and_fully_masked_rows(D):
    q, k, v, dout = make(1, 300, 100, 2, 2, D, BF16, seed=9)  # rows < 200 see no key
    (dq, _, _), _ = check(q, k, v, dout, CAUSAL)
    assert (dq[:, :200] == 0).all()


def test_keys_no_row_sees_get_zero_grads(D):
    # window (2, 0): row i sees keys i + 198 .. i + 200, so keys < 198 are unseen
    q, k, v, dout = make(1, 100, 300, 2, 2, D, FP16, seed=10)
    (_, dk, dv), _ = check(q, k, v, dout, (2, 0))
    assert (dk[:, :198] == 0).all() and (dv[:, :198] == 0).all()


def test_nonfinite_v_outside_the_band_does_not_leak(D):
    # causal: keys past a row's diagonal are masked; poison V and K there for the first rows'
    # blocks — dS is forced to 0 where P is masked, whatever dP holds
    q, k, v, dout = make(1, 256, 256, 2, 2, D, BF16, seed=14)
    (out, lse), refs, lows = oracle(q, k, v, dout, D ** -0.5, CAUSAL)
    v2 = v.clone()
    v2[:, 200:] = float("nan")  # rows < 200 never see keys >= 200 (nor K: untouched)
    ours = run(bwd_sm90_wide, q, k, v2, out, dout, lse, D ** -0.5, CAUSAL)
    dq = ours[0]
    assert not dq[:, :200].isnan().any()
    tol = tolerance(refs[0][:, :200], lows[0][:, :200], BF16)
    assert (dq[:, :200].double() - refs[0][:, :200]).abs().max().item() <= tol


def test_packed_qkv_views(D):
    g = torch.Generator(device="cuda").manual_seed(11)
    qkv = torch.randn(2, 513, 3, 2, D, device="cuda", dtype=FP16, generator=g)
    q, k, v = qkv.unbind(2)
    dout = torch.randn(2, 513, 2, D, device="cuda", dtype=FP16, generator=g)
    check(q, k, v, dout, CAUSAL)


# ---- agreement with the SIMT kernel, and dispatch -----------------------------------------------

@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
def test_agrees_with_simt(window, D):
    from flashcuda.ops import bwd_simt

    q, k, v, dout = make(1, 383, 520, 2, 1, D, BF16, seed=12)
    scale = D ** -0.5
    (out, lse), refs, lows = oracle(q, k, v, dout, scale, window)
    ours = run(bwd_sm90_wide, q, k, v, out, dout, lse, scale, window)
    theirs = run(bwd_simt, q, k, v, out, dout, lse, scale, window)
    for name, a, b, ref, low in zip(("dq", "dk", "dv"), ours, theirs, refs, lows, strict=True):
        assert (a.double() - b.double()).abs().max().item() <= 2 * tolerance(ref, low, BF16), name


def test_dispatch_prefers_sm90_wide(D):
    q, k, v, dout = make(1, 256, 256, 2, 2, D, BF16, seed=13)
    out = torch.empty_like(q)
    lse = torch.zeros(1, 2, 256, device="cuda", dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    call = BwdCall(q, k, v, out, dout, lse, dq, dk, dv, 0.0625, None, 0, False)
    assert dispatch.backward(call) == "bwd_sm90_wide"
    assert bwd_sm80.can_implement(call) is not None  # (what ran here before: bwd_simt)

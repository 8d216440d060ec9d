"""The sm80 tensor-core forward kernel (flashcuda.ops.fwd_sm80), called directly, on the GPU.

Every check runs `fwd_sm80.run(FwdCall(...))` on NaN-prefilled out / lse and compares with an
oracle written here: softmax(Q K^T * scale) V under the visibility rule of mask.cuh, in float64
on the GPU. Tolerance (FlashAttention's rule, DESIGN.md §7):

    max |ours - ref64| <= 2 * max |torch_same_dtype - ref64| + 1e-5

where torch_same_dtype is the same math done by torch in the input dtype. lse (float32, natural
log) gets the same rule against the same-dtype logsumexp, plus 1e-4 (our l sums the fp16/bf16
P that multiplies V, see flash_fwd_sm80.cu; that moves lse by at most 2^-9 for bf16, far below
torch's own bf16 error, but the floor keeps single-key rows exact-vs-exact comparisons sane).
Rows that see no key must give out == 0 and lse == -inf exactly.

Run: pytest -m gpu tests/gpu/test_fwd_sm80.py -q   (about 10 kernel compiles on a cold cache)
"""

from __future__ import annotations

import math

import pytest
import torch

from flashcuda.ops import fwd_sm80
from flashcuda.ops.call import FwdCall
from tests.gpu import masked_v

pytestmark = pytest.mark.gpu
DEVICE = "cuda"  # (tests/cpu/test_fwd_sm80_emulated.py runs these bodies on the host emulator)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()

BF16, FP16 = torch.bfloat16, torch.float16
FULL = (None, None)
CAUSAL = (None, 0)


# ---- oracle --------------------------------------------------------------------------------------

def visible(seqlen_q: int, seqlen_k: int, window: tuple[int | None, int | None],
            device) -> torch.Tensor:
    """(Sq, Sk) bool: query i sees key j iff i + shift - wl <= j <= i + shift + wr."""
    wl, wr = window
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    d = j - i - (seqlen_k - seqlen_q)
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if wr is not None:
        vis &= d <= wr
    if wl is not None:
        vis &= d >= -wl
    return vis


def attention(q, k, v, scale, window, dtype):
    """(out (B, Sq, H, D), lse (B, H, Sq) float32/64) computed by torch in `dtype`."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    vis = visible(q.shape[1], k.shape[1], window, q.device)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key: NaN -> 0
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def run_ours(q, k, v, scale, window):
    B, Sq, H, D = q.shape
    out = torch.full((B, Sq, H, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, Sq), float("nan"), dtype=torch.float32, device=q.device)
    call = FwdCall(q, k, v, out, lse, scale, window[0], window[1])
    why = fwd_sm80.can_implement(call)
    assert why is None, why
    fwd_sm80.run(call)
    sync()
    return out, lse


def check(q, k, v, window=FULL, scale=None, clean=None):
    """Run ours on (q, k, v); compare with the oracle on `clean` (default: the same tensors)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = run_ours(q, k, v, scale, window)
    qr, kr, vr = clean if clean is not None else (q, k, v)
    ref_out, ref_lse = attention(qr, kr, vr, scale, window, torch.float64)
    tch_out, tch_lse = attention(qr, kr, vr, scale, window, q.dtype)

    assert not out.isnan().any(), "unwritten or NaN output"
    assert not lse.isnan().any(), "unwritten or NaN lse"
    err = (out.double() - ref_out).abs().max().item()
    tol = 2 * (tch_out.double() - ref_out).abs().max().item() + 1e-5
    assert err <= tol, f"out error {err:.3e} > {tol:.3e}"

    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead), "lse -inf pattern differs"
    if dead.any():  # rows that see no key: exactly 0 and -inf
        dead_rows = dead.permute(0, 2, 1)  # (B, Sq, H)
        assert (out[dead_rows] == 0).all(), "a row that sees no key is not 0"
    live = ~dead
    if live.any():
        err = (lse.double() - ref_lse)[live].abs().max().item()
        tol = 2 * (tch_lse.double() - ref_lse)[live].abs().max().item() + 1e-4
        assert err <= tol, f"lse error {err:.3e} > {tol:.3e}"
    return out, lse


def make(B, Sq, Sk, H, Hkv, D, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype, generator=g)
    k = torch.randn(B, Sk, Hkv, D, device=DEVICE, dtype=dtype, generator=g)
    v = torch.randn(B, Sk, Hkv, D, device=DEVICE, dtype=dtype, generator=g)
    return q, k, v


# ---- head dims (every kernel head dim, and padded ones) ------------------------------------------

HEAD_DIMS = [(BF16, 32), (BF16, 64), (BF16, 96), (BF16, 128), (BF16, 192), (BF16, 256),
             (FP16, 64), (FP16, 128), (BF16, 72), (FP16, 40), (BF16, 8)]


@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,head_dim", HEAD_DIMS,
                         ids=[f"{'bf16' if d == BF16 else 'fp16'}-d{h}" for d, h in HEAD_DIMS])
def test_head_dims(dtype, head_dim, window):
    q, k, v = make(2, 143, 143, 3, 3, head_dim, dtype)
    check(q, k, v, window)


# ---- sequence lengths, ragged, Sq != Sk ----------------------------------------------------------

SEQLENS = [(1, 1), (1, 17), (17, 1), (17, 17), (128, 128), (143, 143), (1023, 1023),
           (2048, 2048), (128, 1023), (1023, 128), (143, 2048), (2048, 143)]


@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"q{a}-k{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 128), (FP16, 64)], ids=["bf16-d128", "fp16-d64"])
def test_seqlens(dtype, head_dim, seqlens, window):
    sq, sk = seqlens
    q, k, v = make(1, sq, sk, 2, 2, head_dim, dtype, seed=sq * 7919 + sk)
    check(q, k, v, window)


# ---- windows -------------------------------------------------------------------------------------

WINDOWS = [(64, 0), (32, 16), (0, 0), (200, 200), (None, 37), (5, None)]


@pytest.mark.parametrize("window", WINDOWS, ids=[f"wl{a}-wr{b}" for a, b in WINDOWS])
def test_sliding_window(window):
    q, k, v = make(2, 1023, 1023, 2, 1, 64, BF16, seed=3)
    check(q, k, v, window)


def test_top_left_causal_negative_window():
    # SDPA's causal for Sq < Sk: row i sees keys j <= i, i.e. window_right = Sq - Sk < 0.
    sq, sk = 300, 700
    q, k, v = make(1, sq, sk, 2, 2, 128, BF16, seed=4)
    check(q, k, v, (None, sq - sk))


# ---- heads, batch, layouts, scale ----------------------------------------------------------------

@pytest.mark.parametrize("nheads_kv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_mqa(nheads_kv, head_dim):
    q, k, v = make(3, 257, 300, 8, nheads_kv, head_dim, BF16, seed=5)
    check(q, k, v, CAUSAL)
    check(q, k, v, FULL)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_packed_qkv_views(head_dim):
    qkv = torch.randn(2, 513, 3, 4, head_dim, device=DEVICE, dtype=FP16)
    q, k, v = qkv.unbind(2)  # strides (S*3*H*D, 3*H*D, D, 1): no copy
    assert not q.is_contiguous()
    check(q, k, v, CAUSAL)


def test_batch_and_scale():
    q, k, v = make(3, 200, 333, 4, 2, 96, FP16, seed=6)
    check(q, k, v, FULL, scale=0.3)
    check(q, k, v, CAUSAL, scale=1.7)


# ---- edges: rows that see nothing, NaN where nobody looks, empty K -------------------------------

def test_fully_masked_rows():
    # Bottom-right causal with Sq > Sk: rows i < Sq - Sk see no key -> out 0, lse -inf.
    q, k, v = make(2, 300, 100, 2, 2, 64, BF16, seed=7)
    out, lse = check(q, k, v, CAUSAL)
    assert torch.isneginf(lse[:, :, :200]).all() and torch.isfinite(lse[:, :, 200:]).all()
    assert (out[:, :200] == 0).all()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_nan_beyond_seqlen_k(head_dim):
    # k, v are the first Sk rows of a longer allocation whose tail is NaN: it must never be read
    # into a result (the ragged last tile zero-fills rows >= seqlen_k).
    B, Sq, Sk, H = 2, 200, 143, 2
    q, k_big, v_big = make(B, Sq, Sk + 77, H, H, head_dim, BF16, seed=8)
    k_big[:, Sk:] = float("nan")
    v_big[:, Sk:] = float("nan")
    k, v = k_big[:, :Sk], v_big[:, :Sk]
    check(q, k, v, FULL)
    check(q, k, v, CAUSAL)


def test_nan_in_keys_no_row_sees():
    # Top-left causal with Sq < Sk: keys >= Sq are visible to no row; NaN there must not leak,
    # even where they share a loaded tile with visible keys (they are zero-filled on load).
    B, Sq, Sk, H, D = 1, 100, 333, 2, 128
    q, k, v = make(B, Sq, Sk, H, H, D, BF16, seed=9)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, Sq:] = float("nan")
    v_nan[:, Sq:] = float("nan")
    check(q, k_nan, v_nan, (None, Sq - Sk), clean=(q, k, v))
    # and a sliding window: keys before the first row's window and after the last row's
    wl, wr = 16, 8
    lo, hi = (Sk - Sq) - wl, (Sq - 1) + (Sk - Sq) + wr + 1  # visible keys of all rows: [lo, hi)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :lo] = float("nan")
    v_nan[:, :lo] = float("nan")
    k_nan[:, hi:] = float("nan")
    v_nan[:, hi:] = float("nan")
    check(q, k_nan, v_nan, (wl, wr), clean=(q, k, v))


def test_nan_in_k_masked_positions():
    # A masked (row, key) pair gets -inf whatever Q K^T gave, so NaN in K at a key beyond the
    # causal limit of some rows (but visible to later rows of the same tile) cannot leak into the
    # rows that do not see it. Those rows are checked against an oracle run on clean data; the
    # rows that do see the NaN key are not checked (their output is NaN by definition).
    B, S, H, D = 1, 128, 1, 64
    q, k, v = make(B, S, S, H, H, D, FP16, seed=10)
    key = 77
    k_nan = k.clone()
    k_nan[:, key] = float("nan")
    out, _ = run_ours(q, k_nan, v, D ** -0.5, CAUSAL)
    ref, _ = attention(q, k, v, D ** -0.5, CAUSAL, torch.float64)
    tch, _ = attention(q, k, v, D ** -0.5, CAUSAL, FP16)
    rows = slice(0, key)  # causal: rows < key never see key
    err = (out[:, rows].double() - ref[:, rows]).abs().max().item()
    tol = 2 * (tch[:, rows].double() - ref[:, rows]).abs().max().item() + 1e-5
    assert err <= tol, f"out error {err:.3e} > {tol:.3e}"


def test_empty_keys():
    q, k, v = make(2, 65, 0, 2, 2, 64, BF16)
    out, lse = run_ours(q, k, v, 0.125, FULL)
    assert (out == 0).all() and torch.isneginf(lse).all()


# ---- determinism ---------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
def test_bitwise_deterministic(window):
    q, k, v = make(2, 1023, 1023, 4, 2, 128, BF16, seed=11)
    scale = 128 ** -0.5
    out1, lse1 = run_ours(q, k, v, scale, window)
    out2, lse2 = run_ours(q, k, v, scale, window)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


# ---- row sums: exact (default) and the tensor cores' (FLASHCUDA_SM80_FWD_ROWSUM=mma, A/B) ---------

@pytest.mark.parametrize("mode", ["exact", "mma"])
@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 64), (FP16, 128), (BF16, 96), (FP16, 256)],
                         ids=["bf16-d64", "fp16-d128", "bf16-d96", "fp16-d256"])
def test_rowsum_modes_match_the_oracle(dtype, head_dim, window, mode, monkeypatch):
    monkeypatch.setenv(fwd_sm80.ROWSUM_ENV, mode)
    q, k, v = make(2, 333, 517, 4, 2, head_dim, dtype, seed=17)
    check(q, k, v, window)


def test_default_rowsum_keeps_lse_exact_over_65537_keys(monkeypatch):
    """The tensor cores' row sum (one accumulator over every k16 step of the row,
    FLASHCUDA_SM80_FWD_ROWSUM=mma) came out low by ~2.4e-4 at 65537 keys (docs/GUARANTEES.md §4).
    The default, exact row sums: the truncating accumulation spans one tile (8 steps) and tiles
    are carried with round-to-nearest adds: the prediction is an lse error below 2e-5 (tiles:
    8 x 2^-24 each; 513 carries: ~sqrt(513) x 2^-24; the fp16 P that the mma sums: ~2^-11 /
    sqrt(65537)); out within the usual rule."""
    monkeypatch.delenv(fwd_sm80.ROWSUM_ENV, raising=False)
    q, k, v = make(1, 1, 65537, 1, 1, 128, FP16, seed=18)
    _, lse = check(q, k, v)
    _, ref_lse = attention(q, k, v, 128 ** -0.5, FULL, torch.float64)
    err = (lse.double() - ref_lse).abs().max().item()
    assert err < 2e-5, f"lse error {err:.3e} over 65537 keys with the default (exact) row sums"


# ---- non-finite V in partly seen tiles (masked-V: the default; =0 the A/B variant) ---------------

@pytest.mark.parametrize("window", [FULL, CAUSAL, (37, 5)], ids=["full", "causal", "wl37-wr5"])
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 64), (FP16, 128), (BF16, 96)],
                         ids=["bf16-d64", "fp16-d128", "bf16-d96"])
def test_masked_v_fast_path_is_the_kernel_without_it_bitwise(dtype, head_dim, window,
                                                             monkeypatch):
    """With finite inputs the masked-V kernel (the default) only adds a scan and a vote: out and
    lse equal those of the variant without it (FLASHCUDA_SM80_FWD_MASKED_V=0) bit for bit."""
    q, k, v = make(2, 300, 517, 4, 2, head_dim, dtype, seed=19)
    scale = head_dim ** -0.5
    monkeypatch.setenv(fwd_sm80.MASKED_V_ENV, "0")
    want = run_ours(q, k, v, scale, window)
    monkeypatch.delenv(fwd_sm80.MASKED_V_ENV)
    got = check(q, k, v, window)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("value", masked_v.VALUES)
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 64), (FP16, 128)], ids=["bf16-d64", "fp16-d128"])
def test_masked_v_nonfinite_reaches_only_rows_that_see_it(dtype, head_dim, value, monkeypatch):
    """Causal, 256 x 256: V of key 200 (head 1) holds `value` in columns 3 and 9 ("inf,-inf": +Inf
    in key 200 and -Inf in key 201, same columns). Rows 0..199 of head 1 (they do not see key
    200, yet share its tile) and all of head 0 equal a clean run's bit for bit; rows that see the
    key get exactly what IEEE gives (NaN; +Inf / -Inf in those columns and finite elsewhere; NaN
    where +Inf and -Inf meet, from row 201). The default kernel, no switch set."""
    monkeypatch.delenv(fwd_sm80.MASKED_V_ENV, raising=False)
    q, k, v = make(1, 256, 256, 2, 2, head_dim, dtype, seed=20)
    scale = head_dim ** -0.5
    clean, clean_lse = run_ours(q, k, v, scale, CAUSAL)
    cols = [3, 9]
    out, lse = run_ours(q, k, masked_v.poison(v, value, cols), scale, CAUSAL)
    masked_v.assert_reaches_only_its_rows(out, lse, clean, clean_lse, value, cols)


# ---- what dispatch sees ----------------------------------------------------------------------------

def test_config_on_this_gpu():
    q, k, v = make(1, 8, 8, 1, 1, 128, BF16)
    out = torch.empty_like(q)
    lse = torch.empty(1, 1, 8, device=DEVICE)
    call = FwdCall(q, k, v, out, lse, 0.1, None, None)
    cfg = fwd_sm80.config_for(call)
    assert cfg.spec().name in {spec.name for spec, _ in fwd_sm80.variants()}
    _, smem_per_block, _ = fwd_sm80._device_info(torch.cuda.current_device())
    assert cfg.smem_bytes <= smem_per_block
    assert math.ceil(8 / cfg.block_m) == cfg.grid(call)[0]

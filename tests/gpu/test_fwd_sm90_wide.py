"""The sm90a forward at head dims 192 and 256 (fwd_sm90.WIDE: 128 x 64 tiles, two consumer
warpgroups) on the H200, against the float64 oracle under FlashAttention's rule (DESIGN.md §7;
`check` / `assert_oracle` of tests/gpu/test_fwd_sm90.py, which holds the d64 / d128 grid).

The same parts as at d64 / d128, at the head dims whose O takes 96 / 128 registers per thread and
whose tiles are four (d256) or three (d192) 64-column swizzled chunks: the GEMMs alone and
together, ragged lengths, causal / windowed masks, GQA, the persistent schedule, empty work
tiles, the masked-V guarantee in its two passes (d256's masked-V kernel has one K / V stage and
puts a NaN / Inf back into O in two halves: put_back_nonfinite's parts), and agreement with the
sm80 kernel (the fallback these head dims had before).
"""

from __future__ import annotations

import pytest
import torch

from flashcuda.ops import dispatch, fwd_sm90
from flashcuda.ops.call import FwdCall
from tests.gpu import masked_v
from tests.gpu.test_fwd_sm90 import (
    CAUSAL,
    FULL,
    PAIRS,
    assert_oracle,
    check,
    check_agrees_with_sm80,
    check_empty_work_tiles,
    check_pv_only,
    check_scores_only,
    make,
    run,
)

pytestmark = [pytest.mark.gpu]

BF16, FP16 = torch.bfloat16, torch.float16
WIDE = [192, 256]


@pytest.fixture(autouse=True, params=["default", "plain", "d192=bm128_bn64,d256=bm128_bn64",
                                      "d192=bm128_bn112"],
                ids=["tiles-dispatch", "plain", "bn64", "bn112"])
def _enable_sm90(monkeypatch, request):
    """Every test with dispatch's kernels (below seqlen_q 2k, where most of these cases lie, 128
    x 80 tiles without a mask, 128 x 64 with one), with neither ping-pong nor snake order, with
    128 x 64 tiles for every call (the A/B FLASHCUDA_SM90_TILES=d192=bm128_bn64,d256=bm128_bn64),
    and with d192's 128 x 112 tiles for every call (dispatch's from 2k, session 32;
    FLASHCUDA_SM90_TILES=d192=bm128_bn112 — its d256 cases would repeat dispatch's)."""
    callspec = getattr(request.node, "callspec", None)
    if (request.param == "d192=bm128_bn112" and callspec is not None
            and callspec.params.get("head_dim") == 256):
        pytest.skip("bn112 is a d192 A/B; d256 runs dispatch's tiles")
    monkeypatch.setenv(fwd_sm90.ENABLE_ENV, "1")
    for env in (fwd_sm90.TILES_ENV, fwd_sm90.PINGPONG_ENV, fwd_sm90.SNAKE_ENV):
        monkeypatch.delenv(env, raising=False)
    if request.param == "plain":
        monkeypatch.setenv(fwd_sm90.PINGPONG_ENV, "0")
        monkeypatch.setenv(fwd_sm90.SNAKE_ENV, "0")
    elif request.param != "default":
        monkeypatch.setenv(fwd_sm90.TILES_ENV, request.param)
    dispatch._reset()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90a kernel: needs compute capability 9.0")
    yield
    dispatch._reset()


def only_dispatch_tiles(head_dim=None):
    """Tests of what dispatch builds (masked V, the two passes: head_dim None) run under its own
    parameter only; the others under every parameter."""
    forced = fwd_sm90.select_config(BF16, 256).block_n != fwd_sm90.tiles_for(256, False, 1)[1]
    pp_off = not fwd_sm90.select_config(BF16, 256).pingpong
    if head_dim is None and (forced or pp_off):
        pytest.skip("runs under the tiles-dispatch parameter")


# ---- the GEMMs, one tile, many tiles ----------------------------------------------------------

@pytest.mark.parametrize("head_dim", WIDE)
def test_smoke_scores_only(head_dim):
    """Q K^T alone: V row j = e_j on the first head_dim keys, so out[i, j] = P[i, j]."""
    only_dispatch_tiles(head_dim)
    check_scores_only(head_dim)


@pytest.mark.parametrize("head_dim", WIDE)
def test_smoke_pv_only(head_dim):
    """P V alone: Q = 0 gives uniform P, so every output row is the mean of the V rows (a wrong
    chunk offset of the MN-major V descriptor shows in one 64-column quarter)."""
    only_dispatch_tiles(head_dim)
    check_pv_only(head_dim)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", WIDE)
def test_one_tile_and_many(head_dim, dtype):
    only_dispatch_tiles(head_dim)
    check(*make(1, 128, 128, 1, 1, head_dim, dtype, seed=3))
    check(*make(1, 128, 64 * 7 + 5, 1, 1, head_dim, dtype, seed=4))
    check(*make(1, 200, 200, 1, 1, head_dim, dtype, seed=5), CAUSAL)


@pytest.mark.parametrize("pingpong", ["1", "0"], ids=["pp", "no-pp"])
@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", WIDE)
def test_rescale_early_same_bits(head_dim, window, pingpong, monkeypatch):
    """FC_RESCALE_EARLY (FA4's rescale of O before the P V GEMM; session 32, d256's default since
    session 33) gives O the same multiplications in the same order: its output and lse equal the
    old order's bit for bit, with and without ping-pong, and pass the oracle."""
    only_dispatch_tiles(head_dim)
    q, k, v = make(2, 700, 700, 3, 1, head_dim, BF16, seed=11)  # 6-9 key tiles, two work tiles
    scale = head_dim ** -0.5
    monkeypatch.setenv(fwd_sm90.PINGPONG_ENV, pingpong)
    monkeypatch.setenv(fwd_sm90.DEFINES_ENV, "FC_RESCALE_EARLY=0")
    dispatch._reset()
    want_out, want_lse = run(fwd_sm90, q, k, v, scale, window)
    monkeypatch.setenv(fwd_sm90.DEFINES_ENV, "FC_RESCALE_EARLY=1")
    dispatch._reset()
    out, lse = run(fwd_sm90, q, k, v, scale, window)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert_oracle(out, lse, q, k, v, window, scale)


# ---- the grid: lengths, causal, GQA, batch, windows -------------------------------------------

@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", PAIRS, ids=[f"q{a}-k{b}" for a, b in PAIRS])
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 256), (FP16, 192), (FP16, 256), (BF16, 192)],
                         ids=["bf16-d256", "fp16-d192", "fp16-d256", "bf16-d192"])
def test_seqlens(dtype, head_dim, seqlens, window):
    only_dispatch_tiles(head_dim)
    sq, sk = seqlens
    check(*make(1, sq, sk, 2, 2, head_dim, dtype, seed=sq * 7919 + sk), window)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("nheads_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("head_dim", WIDE)
def test_gqa_batch(batch, nheads_kv, head_dim):
    only_dispatch_tiles(head_dim)
    q, k, v = make(batch, 257, 300, 4, nheads_kv, head_dim, BF16, seed=batch * 10 + nheads_kv)
    check(q, k, v, CAUSAL)
    check(q, k, v, FULL)


@pytest.mark.parametrize("head_dim", WIDE)
def test_windows_and_fully_masked_rows(head_dim):
    only_dispatch_tiles(head_dim)
    q, k, v = make(2, 1023, 1023, 2, 1, head_dim, BF16, seed=7)
    check(q, k, v, (64, 0))
    check(q, k, v, (32, 16))
    q, k, v = make(2, 300, 100, 2, 2, head_dim, FP16, seed=8)  # rows < 200 see no key
    out, lse = check(q, k, v, CAUSAL)
    assert torch.isneginf(lse[:, :, :200]).all() and (out[:, :200] == 0).all()


@pytest.mark.parametrize("window", [FULL, CAUSAL, (200, 0)], ids=["full", "causal", "window"])
@pytest.mark.parametrize("head_dim", WIDE)
def test_persistent_many_work_tiles(head_dim, window):
    """384 work tiles over at most 132 CTAs (the ring runs on across work tiles)."""
    only_dispatch_tiles(head_dim)
    check(*make(3, 1000, 1500, 16, 4, head_dim, BF16, seed=11), window)


@pytest.mark.parametrize("head_dim", WIDE)
def test_empty_work_tiles(head_dim):
    only_dispatch_tiles(head_dim)
    check_empty_work_tiles(head_dim, 40, 8, seed=12)


# ---- non-finite V: the masked-V guarantee, in two passes -------------------------------------

@pytest.mark.parametrize("window", [FULL, CAUSAL, (200, 0)], ids=["full", "causal", "window"])
@pytest.mark.parametrize("head_dim", WIDE)
def test_nan_in_v_reaches_only_rows_that_see_it(head_dim, window):
    """A NaN in V of key 200 (2 x 1024 x 1024, 16 heads) in a column of the first and of the last
    64-column chunk: lse and the other columns equal a clean run's bit for bit, and those
    columns are NaN exactly in the rows that see the key."""
    only_dispatch_tiles()
    q, k, v = make(2, 1024, 1024, 16, 16, head_dim, BF16, seed=13)
    scale = head_dim ** -0.5
    clean, clean_lse = run(fwd_sm90, q, k, v, scale, window)
    cols = [3, head_dim - 7]
    bad = v.clone()
    bad[:, 200, :, cols] = float("nan")
    out, lse = run(fwd_sm90, q, k, bad, scale, window)
    assert torch.equal(lse, clean_lse)
    first, end = (0, 1024) if window == FULL else (200, 1024 if window == CAUSAL else 401)
    assert out[:, first:end, :, cols].isnan().all()
    assert torch.equal(out[:, :first], clean[:, :first])
    assert torch.equal(out[:, end:], clean[:, end:])
    others = [c for c in range(head_dim) if c not in cols]
    assert torch.equal(out[:, first:end, :, others], clean[:, first:end, :, others])


@pytest.mark.parametrize("passes", ["", "0"], ids=["two-passes", "masked-v-alone"])
@pytest.mark.parametrize("value", masked_v.VALUES)
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 256), (FP16, 192)], ids=["bf16-d256", "fp16-d192"])
def test_masked_v_nonfinite(dtype, head_dim, value, passes, monkeypatch):
    """Causal 256 x 256 (tests/gpu/masked_v.py): V of key 200 of head 1 holds `value` in one
    column of every 64-column chunk; rows 0..199 of head 1 and all of head 0 equal a clean run's
    bits, rows that see the key get IEEE's answer. Two passes by default, or the masked-V kernel
    alone (FLASHCUDA_SM90_FWD_NAN_FIXUP=0)."""
    only_dispatch_tiles()
    if passes:
        monkeypatch.setenv(fwd_sm90.NAN_FIXUP_ENV, passes)
    monkeypatch.setenv(fwd_sm90.MASKED_V_ENV, "1")
    dispatch._reset()
    q, k, v = make(1, 256, 256, 2, 2, head_dim, dtype, seed=20)
    scale = head_dim ** -0.5
    assert fwd_sm90.select_config(dtype, head_dim, True, 256).masked_v
    clean, clean_lse = run(fwd_sm90, q, k, v, scale, CAUSAL)
    cols = list(range(3, head_dim, 67))  # 3, 70, 137 (, 204 at d256): each chunk
    out, lse = run(fwd_sm90, q, k, masked_v.poison(v, value, cols), scale, CAUSAL)
    masked_v.assert_reaches_only_its_rows(out, lse, clean, clean_lse, value, cols)


def test_d256_two_passes_plan():
    """A causal d256 call runs in two passes: the first with two K / V stages, the second (the
    masked-V kernel, its two clean V tiles beside one stage) with one, on the same grid."""
    only_dispatch_tiles()
    q, k, v = make(1, 1000, 1000, 4, 4, 256, BF16, seed=21)
    out, lse = torch.empty_like(q), torch.empty(1, 4, 1000, device="cuda")
    plan = fwd_sm90._plan(FwdCall(q, k, v, out, lse, 0.0625, *CAUSAL))
    assert plan.cfg.nan_flags and plan.cfg.stages == 2
    assert plan.fixup_cfg.nan_fixup and plan.fixup_cfg.stages == 1
    assert plan.fixup_cfg.smem_bytes <= fwd_sm90.SMEM_OPTIN
    check(q, k, v, CAUSAL)


# ---- agreement with the sm80 kernel, and dispatch -----------------------------------------------

@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", WIDE)
def test_agrees_with_sm80(head_dim, window):
    only_dispatch_tiles(head_dim)
    check_agrees_with_sm80(head_dim, window)


@pytest.mark.parametrize("head_dim", WIDE)
def test_dispatch_prefers_sm90(head_dim):
    only_dispatch_tiles(head_dim)
    q, k, v = make(1, 256, 256, 2, 2, head_dim, BF16, seed=10)
    out = torch.empty_like(q)
    lse = torch.empty(1, 2, 256, device="cuda", dtype=torch.float32)
    assert dispatch.forward(FwdCall(q, k, v, out, lse, head_dim ** -0.5, None, 0)) == "fwd_sm90"

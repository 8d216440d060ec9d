"""The sm90a forward kernel (flashcuda.ops.fwd_sm90) on the H200: the test that lifts its gate.

Every check runs `fwd_sm90.run(FwdCall(...))` (FLASHCUDA_ENABLE_SM90=1 via monkeypatch) on
NaN-prefilled out / lse and compares with the float64 oracle flashcuda.reference.attention_ref
under FlashAttention's rule (DESIGN.md §7):

    max |ours - ref64| <= 2 * max |torch_same_dtype - ref64| + 1e-5      (lse: + 1e-4)

Debug order on a fresh GPU (each step a few seconds; run with -x):
    pytest -m gpu tests/gpu/test_fwd_sm90.py -x -q -k smoke     # one tile, one head: layouts
    pytest -m gpu tests/gpu/test_fwd_sm90.py -x -q -k "pipeline or ragged"
    pytest -m gpu tests/gpu/test_fwd_sm90.py -q
`test_smoke_*` isolate the pieces: S = Q K^T alone (V = identity rows, so out = softmax(S) picks
columns), then P V (Q = 0: uniform P, out = mean of V rows), then the full tile.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashcuda.ops import dispatch, fwd_sm80, fwd_sm90
from flashcuda.ops.call import FwdCall
from flashcuda.reference import attention_ref
from tests.gpu import masked_v

pytestmark = [pytest.mark.gpu]

BF16, FP16 = torch.bfloat16, torch.float16
FULL = (None, None)
CAUSAL = (None, 0)


@pytest.fixture(autouse=True, params=["default", "bm128_bn128", "d64=bm192_bn128,d128=bm128_bn176",
                                      "plain", "snake"],
                ids=["tiles-dispatch", "tiles-128x128", "tiles-fa3", "plain", "snake"])
def _enable_sm90(monkeypatch, request):
    """Every test runs with the tiles dispatch picks for its shape, with 128 x 128 everywhere,
    with FA3's tiles everywhere (so each specialisation sees every shape), and with the ping-pong
    with neither ping-pong nor snake order (FLASHCUDA_SM90_PINGPONG=0 SNAKE=0, the kernel as first
    proven), and with the snake order everywhere (FLASHCUDA_SM90_SNAKE=1; dispatch uses it only
    with a causal or window mask)."""
    monkeypatch.setenv(fwd_sm90.ENABLE_ENV, "1")
    monkeypatch.delenv(fwd_sm90.TILES_ENV, raising=False)
    monkeypatch.delenv(fwd_sm90.PINGPONG_ENV, raising=False)
    monkeypatch.delenv(fwd_sm90.SNAKE_ENV, raising=False)
    if request.param == "plain":
        monkeypatch.setenv(fwd_sm90.PINGPONG_ENV, "0")
        monkeypatch.setenv(fwd_sm90.SNAKE_ENV, "0")
    elif request.param == "snake":
        monkeypatch.setenv(fwd_sm90.SNAKE_ENV, "1")
    elif request.param != "default":
        monkeypatch.setenv(fwd_sm90.TILES_ENV, request.param)
    dispatch._reset()  # the plan cache does not key on the gate
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
    return q, k, v


def run(module, q, k, v, scale, window):
    B, Sq, H, D = q.shape
    out = torch.full((B, Sq, H, D), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, Sq), float("nan"), dtype=torch.float32, device=q.device)
    call = FwdCall(q, k, v, out, lse, scale, window[0], window[1])
    why = module.can_implement(call)
    assert why is None, why
    module.run(call)
    torch.cuda.synchronize()
    return out, lse


def check(q, k, v, window=FULL, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = run(fwd_sm90, q, k, v, scale, window)
    return assert_oracle(out, lse, q, k, v, window, scale)


def assert_oracle(out, lse, q, k, v, window, scale):
    """out / lse of the call (q, k, v, window, scale) against the float64 oracle (the rule above);
    returns them."""
    ref_out, ref_lse = attention_ref(q, k, v, scale, window=window)
    tch_out, tch_lse = attention_ref(q, k, v, scale, window=window, upcast=False)

    assert not out.isnan().any(), "unwritten or NaN output"
    assert not lse.isnan().any(), "unwritten or NaN lse"
    err = (out.double() - ref_out).abs().max().item()
    tol = 2 * (tch_out.double() - ref_out).abs().max().item() + 1e-5
    assert err <= tol, f"out error {err:.3e} > {tol:.3e}"
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead), "lse -inf pattern differs"
    if dead.any():
        assert (out[dead.permute(0, 2, 1)] == 0).all(), "a row that sees no key is not 0"
    live = ~dead
    if live.any():
        err = (lse.double() - ref_lse)[live].abs().max().item()
        tol = 2 * (tch_lse.double() - ref_lse.double())[live].abs().max().item() + 1e-4
        assert err <= tol, f"lse error {err:.3e} > {tol:.3e}"
    return out, lse


# ---- smoke: one CTA, one head, one key tile; each GEMM isolated ---------------------------------

@pytest.mark.parametrize("head_dim", [64, 128])
def test_smoke_scores_only(head_dim):
    """Q K^T (SS wgmma, K-major 128B swizzle) alone: V row j = e_j (identity on the first
    head_dim keys), so out[i, j] = P[i, j]; a wrong Q/K descriptor garbles P."""
    check_scores_only(head_dim)


def check_scores_only(head_dim):
    """test_smoke_scores_only's check (also run at d192 / d256: test_fwd_sm90_wide.py)."""
    q, k, _ = make(1, 128, head_dim, 1, 1, head_dim, BF16, seed=1)
    v = torch.eye(head_dim, device="cuda", dtype=BF16)[None, :, None, :].contiguous()
    out, _ = check(q, k, v)
    p = torch.softmax((q[0, :, 0].double() @ k[0, :, 0].double().T) * head_dim ** -0.5, dim=-1)
    assert (out[0, :, 0].double() - p).abs().max().item() < 1e-2


@pytest.mark.parametrize("head_dim", [64, 128])
def test_smoke_pv_only(head_dim):
    """P V (RS wgmma, V read MN-major, imm-trans-b) alone: Q = 0 gives uniform P, so every
    output row is the mean of the V rows; a wrong V descriptor (the classic transposition bug)
    shows as rows that differ or a wrong mean."""
    check_pv_only(head_dim)


def check_pv_only(head_dim):
    """test_smoke_pv_only's check (also run at d192 / d256: test_fwd_sm90_wide.py)."""
    _, k, v = make(1, 1, 128, 1, 1, head_dim, BF16, seed=2)
    q = torch.zeros(1, 128, 1, head_dim, device="cuda", dtype=BF16)
    out, _ = check(q, k, v)
    mean = v[0, :, 0].double().mean(dim=0)
    assert (out[0, :, 0].double() - mean).abs().max().item() < 1e-2


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_smoke_one_tile(head_dim, dtype):
    q, k, v = make(1, 128, 128, 1, 1, head_dim, dtype, seed=3)
    check(q, k, v)
    check(q, k, v, CAUSAL)


# ---- the pipeline: many key tiles (stage reuse, mbarrier phases) -------------------------------

@pytest.mark.parametrize("head_dim", [64, 128])
def test_pipeline_many_tiles(head_dim):
    q, k, v = make(1, 128, 128 * 7, 1, 1, head_dim, BF16, seed=4)
    check(q, k, v)
    check(q, k, v, CAUSAL)


def test_ragged_smallest():
    q, k, v = make(1, 1, 1, 1, 1, 128, BF16, seed=5)
    check(q, k, v)
    q, k, v = make(1, 17, 143, 1, 1, 64, BF16, seed=6)
    check(q, k, v, CAUSAL)


# ---- the grid: sequence lengths, Sq != Sk, causal, GQA, batch ----------------------------------

SEQLENS = [1, 17, 128, 143, 1023, 2048]
PAIRS = [(a, b) for a in SEQLENS for b in SEQLENS if a == b or (a, b) in
         {(1, 17), (17, 1), (128, 1023), (1023, 128), (143, 2048), (2048, 143), (17, 2048)}]


@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", PAIRS, ids=[f"q{a}-k{b}" for a, b in PAIRS])
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 128), (FP16, 64), (BF16, 64), (FP16, 128)],
                         ids=["bf16-d128", "fp16-d64", "bf16-d64", "fp16-d128"])
def test_seqlens(dtype, head_dim, seqlens, window):
    sq, sk = seqlens
    q, k, v = make(1, sq, sk, 2, 2, head_dim, dtype, seed=sq * 7919 + sk)
    check(q, k, v, window)


@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("nheads_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_batch(batch, nheads_kv, head_dim):
    q, k, v = make(batch, 257, 300, 4, nheads_kv, head_dim, BF16, seed=batch * 10 + nheads_kv)
    check(q, k, v, CAUSAL)
    check(q, k, v, FULL)


def test_windows_and_fully_masked_rows():
    q, k, v = make(2, 1023, 1023, 2, 1, 64, BF16, seed=7)
    check(q, k, v, (64, 0))
    check(q, k, v, (32, 16))
    q, k, v = make(2, 300, 100, 2, 2, 128, BF16, seed=8)  # rows < 200 see no key
    out, lse = check(q, k, v, CAUSAL)
    assert torch.isneginf(lse[:, :, :200]).all() and (out[:, :200] == 0).all()


def test_packed_qkv_views():
    qkv = torch.randn(2, 513, 3, 4, 128, device="cuda", dtype=FP16)
    q, k, v = qkv.unbind(2)
    check(q, k, v, CAUSAL)


# ---- the persistent schedule: more work tiles than SMs, so each CTA runs several -------------

@pytest.mark.parametrize("window", [FULL, CAUSAL, (200, 0)], ids=["full", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_persistent_many_work_tiles(head_dim, window):
    """384 work tiles over at most 132 CTAs: the K/V ring and the Q barrier run on across work
    tiles of different heads, batches and lengths."""
    q, k, v = make(3, 1000, 1500, 16, 4, head_dim, BF16, seed=11)
    check(q, k, v, window)


@pytest.mark.parametrize("heads_per_section,nheads_kv,sections",
                         [(4, 4, 12), (1, 16, 48), (7, 16, 7)],
                         ids=["one-group-gqa", "one-head", "seven-heads-ragged"])
@pytest.mark.parametrize("window", [CAUSAL, (200, 0)], ids=["causal", "window"])
def test_l2_sections_many_alternating(monkeypatch, heads_per_section, nheads_kv, sections, window):
    """The causal / window order in L2 sections (Schedule in the .cu) with sections forced small
    (FLASHCUDA_SM90_FWD_L2_SHARE sized from this GPU's L2): at the bench's shapes sections hold
    many heads, here one GQA group (4 query heads), one head, or seven heads with a last section
    of six — even and odd section counts, so both directions of the alternation and a ragged
    last section run, over batches (sections span two batches' heads)."""
    B, Sq, Sk, H, D = 3, 777, 900, 16, 128
    q, k, v = make(B, Sq, Sk, H, nheads_kv, D, BF16, seed=17)
    l2 = torch.cuda.get_device_properties(q.device).L2_cache_size
    kv_head = 2 * Sk * D * 2
    groups = heads_per_section // (H // nheads_kv)
    monkeypatch.setenv(fwd_sm90.L2_SHARE_ENV, f"{(groups + 0.5) * kv_head / l2:.9f}")
    fwd_sm90._plans.clear()
    lse = torch.empty(B, H, Sq, device="cuda")
    per = fwd_sm90.l2_section(FwdCall(q, k, v, q, lse, 0.1, *window), l2)
    assert (per, -(-B * H // per)) == (heads_per_section, sections)
    check(q, k, v, window)


def test_repeat_layout_reuses_the_plan_with_new_data():
    """The second call of a layout skips can_implement and re-encodes only the tensor maps: it
    must read the new tensors, not the first call's."""
    fwd_sm90._plans.clear()
    for seed in (13, 14, 15):
        q, k, v = make(2, 300, 260, 4, 2, 128, BF16, seed=seed)
        check(q, k, v, CAUSAL)
    assert len(fwd_sm90._plans) == 1


def check_empty_work_tiles(head_dim, nheads, nheads_kv, seed):
    """Causal with seqlen_q > seqlen_k: the first 400 rows of every head see no key (their work
    tiles have zero key tiles and no Q load) between blocks that do: out 0, lse -inf there."""
    out, lse = check(*make(2, 700, 300, nheads, nheads_kv, head_dim, FP16, seed=seed), CAUSAL)
    assert torch.isneginf(lse[:, :, :400]).all() and (out[:, :400] == 0).all()


def check_nan_in_v_column(head_dim, window, key, seed):
    """A NaN in V of `key` (every batch and head, column 3), 2 x 1024 x 1024 x 16 heads: lse and
    the other columns equal a clean run's bit for bit, and column 3 is NaN exactly in the rows
    that see the key (all without a mask, from `key` on causal, `key` .. `key` + 200 with the
    window (200, 0))."""
    q, k, v = make(2, 1024, 1024, 16, 16, head_dim, BF16, seed=seed)
    scale = head_dim ** -0.5
    clean, clean_lse = run(fwd_sm90, q, k, v, scale, window)
    bad = v.clone()
    bad[:, key, :, 3] = float("nan")
    out, lse = run(fwd_sm90, q, k, bad, scale, window)
    assert torch.equal(lse, clean_lse)
    first, end = (0, 1024) if window == FULL else (key, 1024 if window == CAUSAL else key + 201)
    assert out[:, first:end, :, 3].isnan().all()
    assert torch.equal(out[:, :first], clean[:, :first])
    assert torch.equal(out[:, end:], clean[:, end:])
    others = [c for c in range(head_dim) if c != 3]
    assert torch.equal(out[:, first:end, :, others], clean[:, first:end, :, others])


def skip_unless_dispatch_tiles():
    """A/B-variant tests run once, under the fixture parameter with dispatch's tiles (the
    variants configs() precompiles for them)."""
    if any(os.environ.get(e) for e in (fwd_sm90.TILES_ENV, fwd_sm90.PINGPONG_ENV,
                                       fwd_sm90.SNAKE_ENV)):
        pytest.skip("runs under one fixture parameter (tiles-dispatch)")


def test_persistent_with_empty_work_tiles():
    """480 work tiles, the first blocks of every head without keys (check_empty_work_tiles)."""
    check_empty_work_tiles(128, 40, 8, seed=12)


def boundary_part(monkeypatch, env, value):
    """`env` set to `value` ("" leaves the default: the part on) and the plans reset; the tests
    of the work-tile boundary's parts run them on (dispatch's kernels) and off (their A/B
    variants), once, with dispatch's tiles."""
    skip_unless_dispatch_tiles()
    if value:
        monkeypatch.setenv(env, value)
    dispatch._reset()


def planned(head_dim, window, seqlen_q=1000, nheads=16):
    """The config dispatch plans for a bf16 call of this head dim, window and length."""
    q = torch.empty(1, seqlen_q, nheads, head_dim, device="cuda", dtype=BF16)
    lse = torch.empty(1, nheads, seqlen_q, device="cuda")
    return fwd_sm90.plan_config(FwdCall(q, q, q, q, lse, head_dim ** -0.5, *window), 132)


@pytest.mark.parametrize("q_stages", ["", "1"], ids=["two", "one"])
@pytest.mark.parametrize("window", [FULL, CAUSAL, (200, 0)], ids=["full", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_two_q_buffers(monkeypatch, head_dim, window, q_stages):
    """Two Q buffers (FC_Q_STAGES, by default where the second fits; FLASHCUDA_SM90_FWD_Q_STAGES=1
    the A/B variant with one): the Q rounds alternate between the buffers over 384 work tiles
    per call, and with seqlen_q > seqlen_k under a causal mask work tiles without keys skip their
    Q round on both sides. d128's masked-V kernels keep one buffer (the same checks)."""
    boundary_part(monkeypatch, fwd_sm90.Q_STAGES_ENV, q_stages)
    fits = not (head_dim == 128 and window != FULL)
    assert planned(head_dim, window).q_stages == (2 if fits and not q_stages else 1)
    check(*make(3, 1000, 1500, 16, 4, head_dim, BF16, seed=13), window)
    check_empty_work_tiles(head_dim, 40, 8, seed=14)


@pytest.mark.parametrize("o_tma", ["", "0"], ids=["tma", "stores"])
@pytest.mark.parametrize("window", [FULL, CAUSAL, (200, 0)], ids=["full", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_o_through_a_tma_store(monkeypatch, head_dim, window, o_tma):
    """O through each consumer's staging tile and a TMA store (FC_O_TMA, the default;
    FLASHCUDA_SM90_FWD_O_TMA=0 the A/B variant with the consumers' own stores). 1000 queries end
    inside a 64-row consumer tile (the store must clip the rows past seqlen_q, which belong to no
    one: they hold the next head's rows in memory), ~3 work tiles per CTA reuse each staging
    tile (the store must have read it first), and work tiles without keys store zeros."""
    boundary_part(monkeypatch, fwd_sm90.O_TMA_ENV, o_tma)
    assert planned(head_dim, window).o_tma == (not o_tma)
    check(*make(3, 1000, 1500, 16, 4, head_dim, BF16, seed=15), window)
    check(*make(2, 77, 300, 4, 4, head_dim, FP16, seed=16), window)
    check_empty_work_tiles(head_dim, 40, 8, seed=17)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_o_tma_staging_in_the_clean_v_tiles(monkeypatch, head_dim):
    """With masked V, FC_O_TMA stages O in the consumer's clean V tile, which the non-finite
    path rewrites: a NaN in V of key 200 (every batch and head, column 3), causal 1024 x 1024,
    16 heads x 2 batches = ~2 work tiles per CTA, so the diagonal tile that copies V clean follows
    another work tile's store from the same tile. Rows before 200 (they do not see the key) and
    the other columns equal the clean run bit for bit; rows from 200 are NaN in column 3."""
    boundary_part(monkeypatch, fwd_sm90.O_TMA_ENV, "")
    cfg = planned(head_dim, CAUSAL, 1024)
    assert cfg.o_tma and cfg.masked_v
    check_nan_in_v_column(head_dim, CAUSAL, 200, seed=18)


@pytest.mark.parametrize("window", [FULL, CAUSAL, (200, 0)], ids=["full", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_next_work_tile_decoded_ahead(monkeypatch, head_dim, window):
    """Each consumer decodes its next work tile under its last P V, or right away after a work
    tile without key tiles (the decode ahead, every kernel's since session 39); the masked calls
    here walk their tiles in snake order (few rounds), the others in plain order."""
    boundary_part(monkeypatch, fwd_sm90.Q_STAGES_ENV, "")
    check(*make(3, 1000, 1500, 16, 4, head_dim, BF16, seed=19), window)
    check_empty_work_tiles(head_dim, 40, 8, seed=20)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_v_scanned_in_the_producer_warpgroup(monkeypatch, head_dim):
    """Masked V's scans in the producer warpgroup (the masked-V kernels' only form since session
    39): warps 1 .. 3 of the producer warpgroup scan the masked tiles' V and the consumers read
    its verdict. Causal and window calls over ~3 work tiles per CTA (the scanner follows the ring
    across work tiles; work tiles without keys add no ring entries), a NaN in V of key 200 that
    only rows from 200 see (rows before it equal the clean run bit for bit), and the finite
    calls bit-equal to the kernel without masked V (FLASHCUDA_SM90_FWD_MASKED_V=0: the
    scanners' clean verdicts leave the masked-V kernel's arithmetic the same)."""
    skip_unless_dispatch_tiles()
    monkeypatch.setenv(fwd_sm90.MASKED_V_ENV, "0")
    monkeypatch.setenv(fwd_sm90.NAN_FIXUP_ENV, "0")  # (the masked-V kernel alone below)
    dispatch._reset()
    q, k, v = make(3, 1000, 1500, 16, 4, head_dim, BF16, seed=21)
    scale = head_dim ** -0.5
    want = [run(fwd_sm90, q, k, v, scale, w) for w in (CAUSAL, (200, 0))]
    assert not planned(head_dim, CAUSAL).masked_v
    monkeypatch.delenv(fwd_sm90.MASKED_V_ENV)
    dispatch._reset()
    assert planned(head_dim, CAUSAL).masked_v
    for w, (out, lse) in zip((CAUSAL, (200, 0)), want, strict=True):
        got = check(q, k, v, w)
        assert torch.equal(got[0], out) and torch.equal(got[1], lse)
    check_empty_work_tiles(head_dim, 40, 8, seed=22)
    check_nan_in_v_column(head_dim, CAUSAL, 200, seed=23)


@pytest.mark.parametrize("window", [FULL, CAUSAL, (200, 0)], ids=["full", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_schedule_by_magic_numbers(monkeypatch, head_dim, window):
    """The work tiles decoded with the host's magic numbers (Magic, every kernel's since session
    39). 3 x 10 query heads over 5 K / V
    heads (groups of 2), 1000 queries, in snake order and in L2 sections (an l2_share picked so
    that the 30 pairs leave a shorter last section: its own magic number); then work tiles
    without keys."""
    boundary_part(monkeypatch, fwd_sm90.Q_STAGES_ENV, "")
    monkeypatch.setenv(fwd_sm90.SNAKE_ENV, "1")
    q, k, v = make(3, 1000, 1500, 10, 5, head_dim, BF16, seed=24)
    call = FwdCall(q, k, v, torch.empty_like(q), torch.empty(3, 10, 1000, device="cuda"),
                   head_dim ** -0.5, *CAUSAL)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for share in ("0.01", "0.02", "0.036", "0.05", "0.08", "0.12"):
        monkeypatch.setenv(fwd_sm90.L2_SHARE_ENV, share)
        if 30 % fwd_sm90.l2_section(call, l2):
            break
    assert 30 % fwd_sm90.l2_section(call, l2), "no share gives a shorter last section"
    dispatch._reset()
    check(q, k, v, window)
    check(*make(1, 333, 333, 6, 6, head_dim, FP16, seed=25), window)
    check_empty_work_tiles(head_dim, 40, 8, seed=26)


# ---- agreement with the sm80 kernel, and dispatch ----------------------------------------------

@pytest.mark.parametrize("window", [FULL, CAUSAL], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_agrees_with_sm80(head_dim, window):
    check_agrees_with_sm80(head_dim, window)


def check_agrees_with_sm80(head_dim, window):
    """fwd_sm90 and fwd_sm80 on one call (2 x 1023 x 2048, GQA): out within twice the oracle
    rule's tolerance of each other, lse within 1e-2."""
    q, k, v = make(2, 1023, 2048, 4, 2, head_dim, BF16, seed=9)
    scale = head_dim ** -0.5
    ours, ours_lse = run(fwd_sm90, q, k, v, scale, window)
    theirs, theirs_lse = run(fwd_sm80, q, k, v, scale, window)
    ref, _ = attention_ref(q, k, v, scale, window=window)
    tch, _ = attention_ref(q, k, v, scale, window=window, upcast=False)
    tol = 2 * (tch.double() - ref).abs().max().item() + 1e-5
    assert (ours.double() - theirs.double()).abs().max().item() <= 2 * tol
    assert (ours_lse - theirs_lse).abs().max().item() <= 1e-2


def test_dispatch_prefers_sm90_when_enabled():
    q, k, v = make(1, 256, 256, 2, 2, 128, BF16, seed=10)
    out = torch.empty_like(q)
    lse = torch.empty(1, 2, 256, device="cuda", dtype=torch.float32)
    assert dispatch.forward(FwdCall(q, k, v, out, lse, 0.088, None, 0)) == "fwd_sm90"


# ---- non-finite V in partly seen tiles (the masked-V variant: windowed calls' default) -------------

def _masked_v_or_skip(monkeypatch, q, k, window):
    """The masked-V variant (explicitly on, as by default); skip under forced tiles it is not
    built for (d128 x 176)."""
    monkeypatch.setenv(fwd_sm90.MASKED_V_ENV, "1")
    dispatch._reset()
    windowed = window != FULL
    cfg = fwd_sm90.select_config(q.dtype, q.shape[-1], windowed, q.shape[1])
    if windowed and not cfg.masked_v:
        pytest.skip(f"the masked-V variant is not built for {cfg.name}'s tiles")
    return cfg


@pytest.mark.parametrize("window", [FULL, CAUSAL, (37, 5)], ids=["full", "causal", "wl37-wr5"])
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 64), (FP16, 128)], ids=["bf16-d64", "fp16-d128"])
def test_masked_v_fast_path_is_the_default_kernel_bitwise(dtype, head_dim, window, monkeypatch):
    """With finite inputs the masked-V variant only adds a scan and a vote per masked tile: out
    and lse equal the default kernel's bit for bit (and the oracle's rule)."""
    q, k, v = make(2, 300, 517, 4, 2, head_dim, dtype, seed=19)
    scale = head_dim ** -0.5
    monkeypatch.setenv(fwd_sm90.MASKED_V_ENV, "0")
    want = run(fwd_sm90, q, k, v, scale, window)
    _masked_v_or_skip(monkeypatch, q, k, window)
    got = check(q, k, v, window)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("passes", ["", "0", "fused"], ids=["two-passes", "masked-v-alone", "fused"])
@pytest.mark.parametrize("value", masked_v.VALUES)
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 64), (FP16, 128)], ids=["bf16-d64", "fp16-d128"])
def test_masked_v_nonfinite_reaches_only_rows_that_see_it(dtype, head_dim, value, passes,
                                                          monkeypatch):
    """Causal, 256 x 256: V of key 200 (head 1) holds `value` in columns 3 and 70 % head_dim
    ("inf,-inf": +Inf in key 200 and -Inf in key 201, same columns). Rows 0..199 of head 1 (they
    do not see key 200, yet share its tile) and all of head 0 equal a clean run's bit for bit;
    rows that see the key get what IEEE gives (NaN; +Inf / -Inf in those columns and the clean
    values elsewhere; NaN where +Inf and -Inf meet, from row 201). By default in two passes (the
    kernel without masked V, then the masked-V kernel for the CTA that reported a non-finite O);
    FLASHCUDA_SM90_FWD_NAN_FIXUP=0: the masked-V kernel alone; FLASHCUDA_SM90_FWD_FUSED=1: both
    passes in one kernel."""
    q, k, v = make(1, 256, 256, 2, 2, head_dim, dtype, seed=20)
    scale = head_dim ** -0.5
    monkeypatch.setenv(fwd_sm90.FUSED_ENV, "1" if passes == "fused" else "0")
    if passes == "0":
        monkeypatch.setenv(fwd_sm90.NAN_FIXUP_ENV, passes)
    cfg = _masked_v_or_skip(monkeypatch, q, k, CAUSAL)
    assert cfg.masked_v
    clean, clean_lse = run(fwd_sm90, q, k, v, scale, CAUSAL)
    cols = [3, 70 % head_dim]  # one column in each 64-wide swizzled chunk at d128
    out, lse = run(fwd_sm90, q, k, masked_v.poison(v, value, cols), scale, CAUSAL)
    masked_v.assert_reaches_only_its_rows(out, lse, clean, clean_lse, value, cols)


# ---- the two passes of a windowed call (fwd_sm90.two_passes: FC_NAN_FLAGS, FC_NAN_FIXUP) ----------

@pytest.mark.parametrize("dtype,head_dim", [(BF16, 64), (FP16, 128)], ids=["bf16-d64", "fp16-d128"])
def test_two_passes_report_and_redo(dtype, head_dim, monkeypatch):
    """A causal call's two passes launched one by one from its plan (1 x 256 x 256, 2 heads:
    four work tiles, four CTAs). The first pass writes every flag byte of every CTA (the buffer
    prefilled 0xff): all 0 with finite V, and its output meets the oracle; with a NaN in V of key
    200 of head 1 exactly one CTA reports (the work tile of rows 128..255 of head 1: rows 128..199
    share key 200's tile without seeing it). The second pass writes nothing where every flag is
    0 (out and lse keep a sentinel), and with every flag set writes the masked-V kernel's answer:
    the oracle's, bit for bit the first pass's on finite V."""
    skip_unless_dispatch_tiles()
    monkeypatch.setenv(fwd_sm90.FUSED_ENV, "0")  # (the two launches, one by one)
    dispatch._reset()
    q, k, v = make(1, 256, 256, 2, 2, head_dim, dtype, seed=42)
    scale = head_dim ** -0.5
    B, Sq, H, D = q.shape

    def buffers(fill):
        return (torch.full((B, Sq, H, D), fill, dtype=dtype, device="cuda"),
                torch.full((B, H, Sq), fill, dtype=torch.float32, device="cuda"))

    def launch(which, vv, out, lse, flags):
        call = FwdCall(q, k, vv, out, lse, scale, *CAUSAL)
        plan = fwd_sm90._plan(call)
        cfg, prepared = (plan.cfg, plan.launch) if which == 1 else (plan.fixup_cfg, plan.fixup)
        prepared(*(m.raw for m in fwd_sm90._maps(call, cfg)), out.data_ptr(), lse.data_ptr(),
                 flags.data_ptr())
        torch.cuda.synchronize()

    out1, lse1 = buffers(float("nan"))
    probe = FwdCall(q, k, v, out1, lse1, scale, *CAUSAL)
    assert fwd_sm90.can_implement(probe) is None
    plan = fwd_sm90._plan(probe)
    assert plan.fixup is not None and plan.cfg.nan_flags and plan.fixup_cfg.nan_fixup
    assert plan.grid[0] == 4
    warps = 4 * plan.cfg.consumers
    flags = torch.full((plan.grid[0] * fwd_sm90.NAN_FLAG_BYTES,), 0xff, dtype=torch.uint8,
                       device="cuda")
    launch(1, v, out1, lse1, flags)
    reports = flags.view(plan.grid[0], fwd_sm90.NAN_FLAG_BYTES)[:, :warps]
    assert (reports == 0).all(), reports
    assert_oracle(out1, lse1, q, k, v, CAUSAL, scale)

    bad = v.clone()
    bad[0, 200, 1, 3] = float("nan")
    out_bad, lse_bad = buffers(float("nan"))
    flags.fill_(0xff)
    launch(1, bad, out_bad, lse_bad, flags)
    reports = flags.view(plan.grid[0], fwd_sm90.NAN_FLAG_BYTES)[:, :warps]
    assert ((reports == 0) | (reports == 1)).all(), reports
    assert int((reports.sum(dim=1) > 0).sum()) == 1, reports
    assert out_bad[0, 128:200, 1, 3].isnan().all(), "the first pass lets 0 x NaN through"

    out2, lse2 = buffers(7.0)
    launch(2, v, out2, lse2, torch.zeros_like(flags))
    assert (out2 == 7.0).all() and (lse2 == 7.0).all(), "the second pass wrote without a report"
    out3, lse3 = buffers(float("nan"))
    launch(2, v, out3, lse3, torch.ones_like(flags))
    assert_oracle(out3, lse3, q, k, v, CAUSAL, scale)
    assert torch.equal(out3, out1) and torch.equal(lse3, lse1)


@pytest.mark.parametrize("pdl", ["", "1"], ids=["plain-launch", "pdl"])
@pytest.mark.parametrize("window", [CAUSAL, (200, 0)], ids=["causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_two_passes_equal_the_masked_v_kernel_alone(monkeypatch, head_dim, window, pdl):
    """Many CTAs and work tiles (2 x 1024, 16 heads), a NaN in V of key 200 (check_nan_in_v_column):
    the default two passes (the second launched after the first, or with FLASHCUDA_SM90_FWD_PDL=1
    as its programmatic dependent) and FLASHCUDA_SM90_FWD_NAN_FIXUP=0 give the same bits, NaN
    for NaN."""
    skip_unless_dispatch_tiles()
    monkeypatch.setenv(fwd_sm90.FUSED_ENV, "0")  # (two launches: test_fused_equals_two_passes)
    if pdl:
        monkeypatch.setenv(fwd_sm90.PDL_ENV, pdl)
    dispatch._reset()
    q, k, v = make(2, 1024, 1024, 16, 16, head_dim, BF16, seed=43)
    v[:, 200, :, 3] = float("nan")
    scale = head_dim ** -0.5
    got, got_lse = run(fwd_sm90, q, k, v, scale, window)
    monkeypatch.setenv(fwd_sm90.NAN_FIXUP_ENV, "0")
    dispatch._reset()
    want, want_lse = run(fwd_sm90, q, k, v, scale, window)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got_lse, want_lse)


# ---- both passes in one kernel (FLASHCUDA_SM90_FWD_FUSED=1: flash_fwd_sm90_fused.cu) ----------------

@pytest.mark.parametrize("poison", ["clean", "nan"])
@pytest.mark.parametrize("window", [CAUSAL, (200, 0), (37, 5)], ids=["causal", "wl200", "wl37-wr5"])
@pytest.mark.parametrize("head_dim,seqlen", [(64, 1000), (64, 4100), (128, 1000), (192, 777),
                                             (256, 600)])
def test_fused_equals_two_passes(monkeypatch, head_dim, seqlen, window, poison):
    """The fused kernel against the default two launches, many CTAs (2 x seqlen, 8 heads; 4100
    takes d64's 192-row tiles): on clean inputs the first pass's bits, which meet the oracle; with
    a NaN in V of key 200 (every head), the same bits, NaN for NaN: the CTAs that reported redo
    their work tiles as the masked-V kernel, as the second launch does."""
    skip_unless_dispatch_tiles()
    q, k, v = make(2, seqlen, seqlen, 8, 8, head_dim, BF16, seed=44 + head_dim)
    if poison == "nan":
        v[:, 200, :, 3] = float("nan")
    scale = head_dim ** -0.5
    monkeypatch.setenv(fwd_sm90.FUSED_ENV, "0")
    dispatch._reset()
    want, want_lse = run(fwd_sm90, q, k, v, scale, window)
    monkeypatch.setenv(fwd_sm90.FUSED_ENV, "1")
    dispatch._reset()
    out, lse = torch.empty_like(q), torch.empty(2, 8, seqlen, device="cuda")
    plan = fwd_sm90._plan(FwdCall(q, k, v, out, lse, scale, *window))
    assert isinstance(plan.cfg, fwd_sm90.Sm90FwdFused) and plan.fixup is None
    got, got_lse = run(fwd_sm90, q, k, v, scale, window)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got_lse.isnan(), want_lse.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got_lse.nan_to_num(), want_lse.nan_to_num())
    if poison == "nan":
        assert got.isnan().any(), "the poisoned key reaches the rows that see it"
    elif seqlen < 2000:  # (the float64 oracle of the 4100 case: 4 GB)
        assert_oracle(got, got_lse, q, k, v, window, scale)

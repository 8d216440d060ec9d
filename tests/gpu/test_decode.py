"""The decode kernels (flashcuda/ops/fwd_decode.py: split-KV, fp32 partials, a combine) against
the float64 oracle, FlashAttention's rule (DESIGN.md §7): max error <= 2x PyTorch's same-dtype
error plus FA3's rounding floor. Head dims across the three buckets (and 8 / 72 inside one),
query groups of 1 to 16 heads, 1 to 20000 keys, one or many splits, per-entry key counts on the
device (0, 1, the capacity), strided caches, NaN in one entry's keys, and the public entry
points that route decoding to them. The bodies that need no CUDA graph also run on the CPU in
tests/cpu/test_decode_emulated.py (the kernels' source on the host emulator, tests/cpu/simt_emu).
"""

from __future__ import annotations

import pytest
import torch

import flashcuda
from flashcuda import kvcache
from flashcuda.bench.timing import capture
from flashcuda.ops import decode, fwd_decode
from flashcuda.reference import attention_ref, max_error, rounding_floor

pytestmark = pytest.mark.gpu
DEVICE = "cuda"  # (tests/cpu/test_decode_emulated.py runs these bodies on the host emulator)


def rand(g, *shape, dtype):
    return torch.randn(*shape, device=DEVICE, generator=g).to(dtype)


def check_entries(out, lse, q, k, v, counts, scale=None):
    """Each entry b against the oracle over its first counts[b] keys (0 keys: out 0, lse -inf)."""
    check_spans(out, lse, q, [k[b:b + 1, :n] for b, n in enumerate(counts)],
                [v[b:b + 1, :n] for b, n in enumerate(counts)], scale)


def check_spans(out, lse, q, ks, vs, scale=None):
    """Entry b against the oracle over the keys ks[b], values vs[b] ((1, n, Hkv, D) each; n = 0:
    out 0, lse -inf)."""
    for b, (kb, vb) in enumerate(zip(ks, vs, strict=True)):
        n = kb.shape[1]
        if n == 0:
            assert torch.all(out[b] == 0) and torch.all(lse[b] == float("-inf")), b
            continue
        qb = q[b:b + 1]
        ref, ref_lse = attention_ref(qb, kb, vb, softmax_scale=scale)
        base, base_lse = attention_ref(qb, kb, vb, softmax_scale=scale, upcast=False)
        err, berr = max_error(out[b:b + 1], ref), max_error(base, ref)
        assert err <= 2 * berr + rounding_floor(ref, q.dtype), \
            f"entry {b} ({n} keys) out: {err:.3e} vs torch {berr:.3e}"
        err, berr = max_error(lse[b:b + 1], ref_lse), max_error(base_lse, ref_lse)
        assert err <= 2 * berr + 1e-5, f"entry {b} lse: {err:.3e} vs torch {berr:.3e}"


def splits_of(q, k):
    group = q.shape[2] // k.shape[2]
    cfg = fwd_decode.config_on(q.device, q.dtype, q.shape[3], group)
    kernel = fwd_decode.get_kernel(cfg.spec(), q.device)
    slots = fwd_decode.slots(kernel, cfg, fwd_decode._device_ok(q.device)[1])
    return fwd_decode.plan_splits(q.shape[0], k.shape[2], -(-group // cfg.rows), k.shape[1],
                                  slots, cfg.step)[0]


@pytest.fixture(params=["regs", "pipe3", "mma"])
def stages(request, monkeypatch):
    """The three ways a step runs: the CUDA-core lanes with K / V straight to registers or
    through a 3-stage cp.async pipeline (the .cu's FC_STAGES; FLASHCUDA_DECODE_MMA=0), and the
    default — the tensor cores up to d128 at MMA_STAGES, the 256 bucket's lanes at STAGES.
    Returns the lanes' stages (the default's where mma)."""
    stages = {"regs": 0, "pipe3": 3, "mma": fwd_decode.STAGES}[request.param]
    monkeypatch.setattr(fwd_decode, "MMA", int(request.param == "mma"))
    monkeypatch.setattr(fwd_decode, "STAGES", stages)
    return stages


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (12, 2), (32, 2)],
                         ids=["mha", "gqa4", "gqa6", "gqa16"])
@pytest.mark.parametrize("batch,keys", [(1, 1), (3, 77), (2, 1000), (1, 20000)])
def test_decode_kernel_matches_the_oracle(dtype, head_dim, heads, batch, keys, stages):
    g = torch.Generator(device=DEVICE).manual_seed(keys + head_dim + heads[0])
    h, hk = heads
    q = rand(g, batch, 1, h, head_dim, dtype=dtype)
    k, v = (rand(g, batch, keys, hk, head_dim, dtype=dtype) for _ in range(2))
    assert fwd_decode.can_take(q, k, v) is None
    out, lse = fwd_decode.attention(q, k, v, head_dim ** -0.5)
    assert out.shape == q.shape and lse.shape == (batch, h, 1)
    check_entries(out, lse, q, k, v, [keys] * batch)


@pytest.mark.parametrize("unroll,pipe", [(2, 2), (4, 2), (2, 4), (4, 4)])
@pytest.mark.parametrize("head_dim,heads", [(64, (8, 1)), (128, (32, 8)), (256, (16, 2))])
def test_pipeline_depths_match_the_oracle(unroll, pipe, head_dim, heads, monkeypatch):
    """The other pipeline shapes the tune tries (decode_probe.py --tune): 2 or 4 keys per slot,
    2 or 4 stages, across the buckets; 1 key, a part step, and many splits."""
    monkeypatch.setattr(fwd_decode, "UNROLL", unroll)
    monkeypatch.setattr(fwd_decode, "STAGES", pipe)
    monkeypatch.setattr(fwd_decode, "MMA", 0)
    g = torch.Generator(device=DEVICE).manual_seed(head_dim + unroll + pipe)
    h, hk = heads
    for batch, keys in ((2, 1), (1, 45), (3, 3001)):
        q = rand(g, batch, 1, h, head_dim, dtype=torch.bfloat16)
        k, v = (rand(g, batch, keys, hk, head_dim, dtype=q.dtype) for _ in range(2))
        out, lse = fwd_decode.attention(q, k, v, head_dim ** -0.5)
        check_entries(out, lse, q, k, v, [keys] * batch)


@pytest.mark.parametrize("head_dim,heads", [(64, (8, 1)), (128, (32, 8)), (128, (12, 2)),
                                            (256, (16, 2))])
def test_combine_after_and_dependent(head_dim, heads, stages, monkeypatch):
    """FLASHCUDA_DECODE_COMBINE 0 (the combine kernel launched after the split) and 1 (as its
    programmatic dependent, sm_90): both within the oracle's rule over entries of 0 / 1 / part /
    all keys (several pieces each), bitwise one another where they cut the keys alike (their
    split kernels' occupancy, so their pieces, may differ); three calls in a row; a group of 6
    in an 8-row block (rows < FC_ROWS)."""
    g = torch.Generator(device=DEVICE).manual_seed(head_dim + heads[0])
    h, hk = heads
    counts = [0, 1, 3001, 5000]
    q = rand(g, 4, 1, h, head_dim, dtype=torch.bfloat16)
    k, v = (rand(g, 4, 5000, hk, head_dim, dtype=q.dtype) for _ in range(2))
    used = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    got = {}
    for combine in (0, 1):
        monkeypatch.setattr(fwd_decode, "COMBINE", combine)
        splits = splits_of(q, k)
        assert splits > 1
        out, lse = fwd_decode.attention(q, k, v, 0.2, used)
        check_entries(out, lse, q, k, v, counts, 0.2)
        for _ in range(2):
            again, again_lse = fwd_decode.attention(q, k, v, 0.2, used)
            assert torch.equal(again, out) and torch.equal(again_lse, lse)
        got[combine] = (splits, out, lse)
    if got[0][0] == got[1][0]:
        assert torch.equal(got[0][1], got[1][1]) and torch.equal(got[0][2], got[1][2])


@pytest.mark.parametrize("quads", [1, 0])
@pytest.mark.parametrize("head_dim,heads", [(8, (8, 1)), (64, (8, 1)), (72, (12, 2)),
                                            (128, (24, 3)), (256, (16, 2))])
def test_combine_by_quads(head_dim, heads, quads, monkeypatch):
    """FLASHCUDA_DECODE_COMBINE_QUADS: the combine's threads as column quads x groups of pieces
    (1, the default; d8: 2 quads x 64 groups, d72: 18 x 7 with two threads idle, d256: 64 x 2)
    or one per column over every piece (0), within the oracle's rule over entries of 0 / 1 /
    part / all keys; more pieces than 8 (up to MAX_SPLITS at one KV head); three calls bitwise
    alike."""
    monkeypatch.setattr(fwd_decode, "COMBINE_QUADS", quads)
    monkeypatch.setattr(fwd_decode, "MIN_SPLIT_KEYS", 64)  # (many pieces on any device)
    fwd_decode._plans.clear()  # (MIN_SPLIT_KEYS is not in the plans' key)
    g = torch.Generator(device=DEVICE).manual_seed(head_dim + heads[0] + 7)
    h, hk = heads
    counts = [0, 1, 3001, 5000]
    q = rand(g, 4, 1, h, head_dim, dtype=torch.bfloat16)
    k, v = (rand(g, 4, 5000, hk, head_dim, dtype=q.dtype) for _ in range(2))
    used = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    assert splits_of(q, k) > 8
    out, lse = fwd_decode.attention(q, k, v, 0.2, used)
    check_entries(out, lse, q, k, v, counts, 0.2)
    for _ in range(2):
        again, again_lse = fwd_decode.attention(q, k, v, 0.2, used)
        assert torch.equal(again, out) and torch.equal(again_lse, lse)


@pytest.mark.parametrize("per_sm", [1, 2])
def test_split_counting_ctas_per_sm(per_sm, monkeypatch):
    """FLASHCUDA_DECODE_CTAS_PER_SM (1, the default since session 49): the split sized for at
    most per_sm CTAs per SM cuts no more pieces than one counting every CTA an SM holds (0; at
    one CTA per SM fewer, where more fit), and the result stays within the oracle's rule over
    entries of 20000 and 777 keys."""
    monkeypatch.setattr(fwd_decode, "MIN_SPLIT_KEYS", 64)  # (the slots decide, not the keys)
    fwd_decode._plans.clear()  # (MIN_SPLIT_KEYS is not in the plans' key)
    g = torch.Generator(device=DEVICE).manual_seed(41 + per_sm)
    counts = [20000, 777]
    q = rand(g, 2, 1, 8, 64, dtype=torch.bfloat16)
    k, v = (rand(g, 2, 20000, 1, 64, dtype=q.dtype) for _ in range(2))
    used = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(fwd_decode, "CTAS_PER_SM", 0)
    every = splits_of(q, k)
    monkeypatch.setattr(fwd_decode, "CTAS_PER_SM", per_sm)
    got = splits_of(q, k)
    cfg = fwd_decode.config_on(q.device, q.dtype, 64, 8)
    per_sm_held = fwd_decode.get_kernel(cfg.spec(), q.device).resident_blocks(
        fwd_decode.THREADS, cfg.smem_bytes)
    assert got <= every
    if per_sm == 1 and per_sm_held > 1:  # (66 CTAs for 2 entries: under MAX_SPLITS' 128 each)
        assert got < every
    out, lse = fwd_decode.attention(q, k, v, 0.125, used)
    check_entries(out, lse, q, k, v, counts, 0.125)


@pytest.fixture
def mma(monkeypatch):
    """FLASHCUDA_DECODE_MMA=1 at its shallowest pipeline, 2 stages (the default, MMA_STAGES: the
    `stages` fixture's mma)."""
    monkeypatch.setattr(fwd_decode, "MMA", 1)
    monkeypatch.setattr(fwd_decode, "MMA_STAGES", 2)
    assert fwd_decode.config_for(torch.bfloat16, 128, 4).mma


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (12, 2), (32, 2)],
                         ids=["mha", "gqa4", "gqa6", "gqa16"])
@pytest.mark.parametrize("batch,keys", [(1, 1), (3, 77), (2, 1000), (1, 20000)])
def test_mma_step_matches_the_oracle(dtype, head_dim, heads, batch, keys, mma):
    """The tensor-core step over the oracle grid (head dims up to the 128 bucket; 256 keeps the
    lanes' step): one key, a part step, many splits, groups of 1 to 16 (two row blocks)."""
    test_decode_kernel_matches_the_oracle(dtype, head_dim, heads, batch, keys, 2)


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_mma_step_spans_pages_rows(page_size, mma):
    """The tensor-core step with per-entry counts (0, 1, part, all; NaN past them), paged caches
    with left padding, cache rows, several causal / full query rows, strided views, NaN in one
    entry's keys, bitwise determinism."""
    test_paged_cache_with_left_padding(page_size, 2)
    if page_size == 1:
        test_per_entry_counts_on_the_device(torch.bfloat16, 2)
        test_cache_rows_and_left_padding(2)
        for seqlen_q, causal in ((5, True), (3, False)):
            test_several_query_rows_per_sequence(seqlen_q, causal, 2)
        test_strided_cache_views(2)
        test_nan_stays_in_its_entry_and_kv_head(2)
        test_bitwise_deterministic_across_calls(2)


def test_the_split_covers_one_and_many_pieces():
    """The cases above include one piece (1 key) and many (20000 keys, one entry)."""
    q = torch.empty(1, 1, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    assert splits_of(q, torch.empty(1, 1, 8, 128, device=DEVICE, dtype=q.dtype)) == 1
    assert splits_of(q, torch.empty(1, 20000, 8, 128, device=DEVICE, dtype=q.dtype)) > 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_per_entry_counts_on_the_device(dtype, stages):
    """seqused: entries of 0, 1, 300, 4095 and the capacity (4096) keys in one call, a 1000-key
    scale; keys past an entry's count (NaN here) never read into its result."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    counts = [0, 1, 300, 4095, 4096]
    q = rand(g, 5, 1, 16, 128, dtype=dtype)
    k, v = (rand(g, 5, 4096, 4, 128, dtype=dtype) for _ in range(2))
    for b, n in enumerate(counts):
        k[b, n:], v[b, n:] = float("nan"), float("nan")
    seqused = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    out, lse = fwd_decode.attention(q, k, v, 0.1, seqused)
    check_entries(out, lse, q, k, v, counts, scale=0.1)


@pytest.mark.parametrize("page_size", [1, 16, 7, 256])
def test_paged_cache_with_left_padding(page_size, stages):
    """block_table over shuffled pages of a pool (page sizes 1, 7, 16, 256), ragged ends and
    left padding on the device (an entry with none, one with a single key, one empty), GQA 4:
    each entry against the oracle over its positions [start, end) gathered from its pages;
    the pool's other pages hold NaN (a wrong page read would show)."""
    g = torch.Generator(device=DEVICE).manual_seed(20 + page_size)
    blocks = -(-2500 // page_size)  # positions per entry: blocks x page_size >= 2500
    B, H, Hk, D = 4, 16, 4, 128
    pool = B * blocks + 5
    k_pool, v_pool = (rand(g, pool, page_size, Hk, D, dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(pool, device=DEVICE, generator=g)[:B * blocks].view(B, blocks)
    used = torch.ones(pool, dtype=torch.bool, device=DEVICE)
    used[table.flatten()] = False
    k_pool[used], v_pool[used] = float("nan"), float("nan")
    ends, starts = [2500, 1, 0, 1700], [0, 0, 0, 333]
    q = rand(g, B, 1, H, D, dtype=torch.bfloat16)
    i32 = torch.int32
    out, lse = fwd_decode.attention(q, k_pool, v_pool, 0.09,
                                    torch.tensor(ends, dtype=i32, device=DEVICE),
                                    torch.tensor(starts, dtype=i32, device=DEVICE), None,
                                    table.to(i32))
    flat_k, flat_v = (x[table].flatten(1, 2) for x in (k_pool, v_pool))  # (B, positions, ...)
    spans = list(enumerate(zip(starts, ends, strict=True)))
    check_spans(out, lse, q, [flat_k[b:b + 1, s:e] for b, (s, e) in spans],
                [flat_v[b:b + 1, s:e] for b, (s, e) in spans], 0.09)


def test_cache_rows_and_left_padding(stages):
    """cache_rows (FlashAttention's cache_batch_idx) picks each entry's cache row out of order
    (the unpicked rows hold NaN), with left padding and ragged ends."""
    g = torch.Generator(device=DEVICE).manual_seed(21)
    k_cache, v_cache = (rand(g, 6, 3000, 2, 64, dtype=torch.float16) for _ in range(2))
    rows, ends, starts = [4, 0, 2], [3000, 900, 5], [100, 0, 4]
    for r in (1, 3, 5):
        k_cache[r], v_cache[r] = float("nan"), float("nan")
    q = rand(g, 3, 1, 8, 64, dtype=torch.float16)
    i32 = torch.int32
    out, lse = fwd_decode.attention(q, k_cache, v_cache, 0.125,
                                    torch.tensor(ends, dtype=i32, device=DEVICE),
                                    torch.tensor(starts, dtype=i32, device=DEVICE),
                                    torch.tensor(rows, dtype=i32, device=DEVICE))
    spans = list(zip(rows, starts, ends, strict=True))
    check_spans(out, lse, q, [k_cache[r:r + 1, s:e] for r, s, e in spans],
                [v_cache[r:r + 1, s:e] for r, s, e in spans], 0.125)


@pytest.mark.parametrize("seqlen_q,causal", [(2, True), (5, True), (16, True), (3, False)])
def test_several_query_rows_per_sequence(seqlen_q, causal, stages):
    """Sq query rows per sequence (speculative decoding's drafts), each an entry of its own:
    causal row i over positions [start, end - (Sq - 1 - i)), else [start, end); ragged ends,
    left padding (a row that sees no key: out 0, lse -inf), GQA 4, a strided q; every row
    against the oracle over its span."""
    g = torch.Generator(device=DEVICE).manual_seed(30 + seqlen_q + causal)
    B, H, Hk, D = 3, 16, 4, 128
    k, v = (rand(g, B, 3000, Hk, D, dtype=torch.bfloat16) for _ in range(2))
    q = rand(g, B, seqlen_q + 1, H, D, dtype=torch.bfloat16)[:, 1:]
    ends, starts = [3000, 17, 900], [0, 16, 850]
    i32 = torch.int32
    out, lse = fwd_decode.attention(q, k, v, 0.08, torch.tensor(ends, dtype=i32, device=DEVICE),
                                    torch.tensor(starts, dtype=i32, device=DEVICE), None, None,
                                    causal)
    assert out.shape == q.shape and lse.shape == (B, H, seqlen_q) and lse.is_contiguous()
    ks, vs = [], []
    for b in range(B):
        for i in range(seqlen_q):
            end = ends[b] - (seqlen_q - 1 - i) if causal else ends[b]
            s = min(starts[b], max(end, 0))
            ks.append(k[b:b + 1, s:max(end, s)])
            vs.append(v[b:b + 1, s:max(end, s)])
    rows = B * seqlen_q
    check_spans(out.reshape(rows, 1, H, D), lse.transpose(1, 2).reshape(rows, H, 1),
                q.reshape(rows, 1, H, D), ks, vs, 0.08)


def test_strided_cache_views(stages):
    """k / v as views of a larger cache (rows and heads beyond the call's) and a transposed q."""
    g = torch.Generator(device=DEVICE).manual_seed(4)
    cache_k, cache_v = (rand(g, 3, 600, 6, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = cache_k[:, :513, 1:5], cache_v[:, :513, 1:5]
    q = rand(g, 3, 8, 1, 64, dtype=torch.bfloat16).transpose(1, 2)
    assert fwd_decode.can_take(q, k, v) is None
    out, lse = fwd_decode.attention(q, k, v, 0.125)
    check_entries(out, lse, q, k, v, [513] * 3, scale=0.125)


def test_nan_stays_in_its_entry_and_kv_head(stages):
    """A NaN key of entry 1, KV head 0 makes exactly that entry's group of query heads NaN."""
    g = torch.Generator(device=DEVICE).manual_seed(5)
    q = rand(g, 3, 1, 8, 128, dtype=torch.bfloat16)
    k, v = (rand(g, 3, 5000, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    k[1, 1234, 0, 7] = float("nan")
    out, _ = fwd_decode.attention(q, k, v, 0.1)
    bad = out.isnan().any(-1)[:, 0]  # (batch, heads)
    expect = torch.zeros_like(bad)
    expect[1, :4] = True
    assert torch.equal(bad, expect)


@pytest.mark.parametrize("ragged", [False, True])
def test_kvcache_decode_one_call(ragged, monkeypatch, stages):
    """flash_attn_with_kvcache's decode step (one new key per entry, GQA 32:8, d128) runs the
    decode kernels once, ragged lengths included (counts as a device tensor), against the
    oracle over each entry's keys."""
    calls = []
    real = fwd_decode.attention
    monkeypatch.setattr(fwd_decode, "attention", lambda *a: calls.append(a[4]) or real(*a))
    g = torch.Generator(device=DEVICE).manual_seed(6)
    lengths = [700, 31, 2048, 0] if ragged else [512] * 4
    k_cache, v_cache = (rand(g, 4, 2100, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    q = rand(g, 4, 1, 32, 128, dtype=torch.bfloat16)
    k, v = (rand(g, 4, 1, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, lse = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                 causal=True, return_softmax_lse=True)
    assert len(calls) == 1
    check_entries(out, lse, q, k_cache, v_cache, [n + 1 for n in lengths])


@pytest.mark.parametrize("new", [1, 4])
@pytest.mark.parametrize("layout", ["paged_leftpad", "rows_leftpad"])
def test_kvcache_spans_on_device_one_call(layout, new, monkeypatch, stages):
    """kvcache.SPANS_ON_DEVICE: flash_attn_with_kvcache's decode step over a paged cache (pages
    of 64, shuffled) or cache rows out of order, left-padded, 1 or 4 new keys and queries per
    entry (causal): one call of the decode kernels (block table / rows / spans on the device),
    each query row against the oracle over its span after the append."""
    monkeypatch.setattr(kvcache, "SPANS_ON_DEVICE", True)
    calls = []
    real = fwd_decode.attention
    monkeypatch.setattr(fwd_decode, "attention", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator(device=DEVICE).manual_seed(12)
    B, H, Hk, D, page, blocks = 4, 32, 8, 128, 64, 40
    bf = torch.bfloat16
    lengths, pads = [700, 31, 2048, 0], [0, 30, 1000, 0]
    q = rand(g, B, new, H, D, dtype=bf)
    k, v = (rand(g, B, new, Hk, D, dtype=bf) for _ in range(2))
    i32 = torch.int32
    kw = dict(cache_seqlens=torch.tensor(lengths, dtype=i32, device=DEVICE),
              cache_leftpad=torch.tensor(pads, dtype=i32, device=DEVICE), causal=True,
              return_softmax_lse=True)
    if layout == "paged_leftpad":
        k_cache, v_cache = (rand(g, B * blocks + 7, page, Hk, D, dtype=bf) for _ in range(2))
        table = torch.randperm(B * blocks + 7, device=DEVICE, generator=g)[:B * blocks]
        kw["block_table"] = table.view(B, blocks).to(i32)
    else:
        k_cache, v_cache = (rand(g, B + 3, blocks * page, Hk, D, dtype=bf) for _ in range(2))
        kw["cache_batch_idx"] = torch.tensor([6, 2, 0, 4], dtype=i32, device=DEVICE)
    out, lse = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    assert len(calls) == 1
    if layout == "paged_leftpad":
        flat_k, flat_v = (t[kw["block_table"].long()].flatten(1, 2) for t in (k_cache, v_cache))
    else:
        flat_k, flat_v = (t[kw["cache_batch_idx"].long()] for t in (k_cache, v_cache))
    rows = [(b, p, n + i + 1) for b, (p, n) in enumerate(zip(pads, lengths, strict=True))
            for i in range(new)]  # (causal: query row i of entry b ends at its own key)
    check_spans(out.reshape(B * new, 1, H, D), lse.transpose(1, 2).reshape(B * new, H, 1),
                q.reshape(B * new, 1, H, D), [flat_k[b:b + 1, s:e] for b, s, e in rows],
                [flat_v[b:b + 1, s:e] for b, s, e in rows])


def test_func_decode_runs_the_kernel(monkeypatch):
    """flash_attn_func with one query per entry and no autograd reaches the decode kernels (and
    with a window that hides keys, does not)."""
    calls = []
    real = fwd_decode.attention
    monkeypatch.setattr(fwd_decode, "attention", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator(device=DEVICE).manual_seed(7)
    q = rand(g, 2, 1, 8, 128, dtype=torch.float16)
    k, v = (rand(g, 2, 3000, 8, 128, dtype=torch.float16) for _ in range(2))
    out, lse = flashcuda.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert calls == [1]
    check_entries(out, lse, q, k, v, [3000, 3000])
    flashcuda.flash_attn_func(q, k, v, window_size=(100, 0))
    assert calls == [1]
    monkeypatch.setattr(decode, "KERNEL", False)
    flashcuda.flash_attn_func(q, k, v)
    assert calls == [1]


def test_bitwise_deterministic_across_calls(stages):
    """The same call twice (many splits, GQA, other work in between): the same bits."""
    g = torch.Generator(device=DEVICE).manual_seed(8)
    q = rand(g, 2, 1, 32, 128, dtype=torch.bfloat16)
    k, v = (rand(g, 2, 9000, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    out, lse = fwd_decode.attention(q, k, v, 0.09)
    torch.randn(4096, 4096, device=DEVICE).sum()
    again, again_lse = fwd_decode.attention(q, k, v, 0.09)
    assert splits_of(q, k) > 1
    assert torch.equal(out, again) and torch.equal(lse, again_lse)


def test_kvcache_decode_step_in_a_cuda_graph():
    """flash_attn_with_kvcache's decode step captured in a CUDA graph (rotary embeddings, GQA,
    ragged cache_seqlens incl. 0) and replayed with new q / k / v and new lengths written into
    the captured tensors: each replay's caches equal, bit for bit, the same step run eagerly
    (the checked path, counts read on the host), and its out / lse match the oracle over each
    entry's keys (the replay's split plan is the capacity's, the eager one's the longest
    entry's, so their bits may differ)."""
    g = torch.Generator(device=DEVICE).manual_seed(11)
    B, cap, H, Hk, D = 4, 3000, 32, 8, 128
    bf = torch.bfloat16
    k_cache, v_cache = (rand(g, B, cap, Hk, D, dtype=bf) for _ in range(2))
    q = rand(g, B, 1, H, D, dtype=bf)
    k, v = (rand(g, B, 1, Hk, D, dtype=bf) for _ in range(2))
    theta = torch.rand(cap + 1, 32, device=DEVICE, generator=g) * 6.3
    cos, sin = theta.cos().to(bf), theta.sin().to(bf)
    seqlens = torch.tensor([5, 100, 2000, 0], dtype=torch.int32, device=DEVICE)

    def step(kc, vc):
        return flashcuda.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin,
                                                 cache_seqlens=seqlens, causal=True,
                                                 return_softmax_lse=True)

    kc, vc = k_cache.clone(), v_cache.clone()
    graph, (out, lse) = capture(lambda: step(kc, vc), warmup=1)
    for lengths in ([5, 100, 2000, 0], [6, 2998, 0, 1234], [2999, 1, 77, 640]):
        q.copy_(rand(g, B, 1, H, D, dtype=bf))
        k.copy_(rand(g, B, 1, Hk, D, dtype=bf))
        v.copy_(rand(g, B, 1, Hk, D, dtype=bf))
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        ref_kc, ref_vc = kc.clone(), vc.clone()
        step(ref_kc, ref_vc)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc), lengths
        q_rot = kvcache.rotary(q, cos, sin, seqlens.long().unsqueeze(1), True)
        check_entries(out, lse, q_rot, kc, vc, [n + 1 for n in lengths])


@pytest.mark.parametrize("new", [1, 3])
def test_kvcache_paged_left_padded_step_in_a_cuda_graph(new, monkeypatch):
    """kvcache.SPANS_ON_DEVICE: a paged, left-padded decode step of 1 or 3 queries per entry
    (causal; pages of 16, shuffled; GQA 4, d64, fp16) captured once and replayed with new
    queries / keys, new lengths, new padding and a new block table written into the captured
    tensors: each replay's pool equals, bit for bit, the same step run eagerly, and each query
    row's out / lse match the oracle over its span gathered from its pages."""
    monkeypatch.setattr(kvcache, "SPANS_ON_DEVICE", True)
    g = torch.Generator(device=DEVICE).manual_seed(13 + new)
    B, H, Hk, D, page, blocks = 3, 8, 2, 64, 16, 50
    f16, i32 = torch.float16, torch.int32
    pool_k, pool_v = (rand(g, B * blocks + 4, page, Hk, D, dtype=f16) for _ in range(2))
    q = rand(g, B, new, H, D, dtype=f16)
    k, v = (rand(g, B, new, Hk, D, dtype=f16) for _ in range(2))
    seqlens = torch.tensor([5, 300, 0], dtype=i32, device=DEVICE)
    pads = torch.tensor([0, 100, 0], dtype=i32, device=DEVICE)
    table = torch.randperm(B * blocks + 4, device=DEVICE, generator=g)[:B * blocks]
    table = table.view(B, blocks).to(i32)

    def step(kc, vc):
        return flashcuda.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                                 cache_leftpad=pads, block_table=table,
                                                 causal=True, return_softmax_lse=True)

    kc, vc = pool_k.clone(), pool_v.clone()
    graph, (out, lse) = capture(lambda: step(kc, vc), warmup=1)
    for lengths, padding in (([5, 300, 0], [0, 100, 0]), ([800 - new, 1, 64], [700, 0, 64]),
                             ([17, 400, 222], [3, 399, 0])):
        q.copy_(rand(g, B, new, H, D, dtype=f16))
        k.copy_(rand(g, B, new, Hk, D, dtype=f16))
        v.copy_(rand(g, B, new, Hk, D, dtype=f16))
        seqlens.copy_(torch.tensor(lengths, dtype=i32))
        pads.copy_(torch.tensor(padding, dtype=i32))
        table.copy_(torch.randperm(B * blocks + 4, device=DEVICE, generator=g)[:B * blocks]
                    .view(B, blocks))
        ref_kc, ref_vc = kc.clone(), vc.clone()
        step(ref_kc, ref_vc)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc), lengths
        flat_k, flat_v = (t[table.long()].flatten(1, 2) for t in (kc, vc))
        rows = [(b, p, n + i + 1) for b, (p, n) in enumerate(zip(padding, lengths, strict=True))
                for i in range(new)]  # (causal: query row i ends at its own key)
        check_spans(out.reshape(B * new, 1, H, D), lse.transpose(1, 2).reshape(B * new, H, 1),
                    q.reshape(B * new, 1, H, D), [flat_k[b:b + 1, s:e] for b, s, e in rows],
                    [flat_v[b:b + 1, s:e] for b, s, e in rows])

"""The sm90 backward's 80-query steps with dQ^T = K^T dS^T (FC_DQ_SWAP) on the CPU: which calls
get it (FLASHCUDA_SM90_BWD_SWAP, the default from SWAP_MIN_SEQLEN_Q query rows at d128 without a
mask), its config (tiles, staging, shared memory, its CONVERT), the padded query length against
PRE's 64-row blocks, and the register-order dQ^T tiles from the consumers' registers through
CONVERT's FC_DQ_FRAG_T reader (the .cu's arithmetic, written out here). The shared-memory reads
of its GEMMs are tests/cpu/test_bwd_sm90_layouts.py's (test_swap_reads); its build and SASS are
test_bwd_sm90_compile.py's (every config of bwd_sm90.configs()).
"""

from __future__ import annotations

import pytest
import torch

from flashcuda.ops import bwd_sm90
from flashcuda.ops.bwd_sm90 import SWAP_ENV, Sm90BwdConfig
from flashcuda.ops.call import BwdCall

AB_SWITCHES = (bwd_sm90.DQ_ENV,)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for env in (*AB_SWITCHES, SWAP_ENV, bwd_sm90.WATCHDOG_ENV, bwd_sm90.DEFINES_ENV,
                bwd_sm90.FENCE_ENV):
        monkeypatch.delenv(env, raising=False)


def _call(sq=2048, sk=2048, d=128, window=(None, None), dtype=torch.bfloat16):
    q = torch.empty(1, sq, 2, d, dtype=dtype)
    k = torch.empty(1, sk, 2, d, dtype=dtype)
    lse = torch.empty(1, 2, sq, dtype=torch.float32)
    return BwdCall(q, k, k, q, q, lse, q, k, k, d ** -0.5, window[0], window[1], False)


def test_default_calls_that_swap():
    assert bwd_sm90.config_for(_call()).dq_swap
    assert bwd_sm90.config_for(_call(sq=bwd_sm90.SWAP_MIN_SEQLEN_Q, sk=100)).dq_swap
    for call in (_call(sq=bwd_sm90.SWAP_MIN_SEQLEN_Q - 1), _call(d=64), _call(window=(None, 0)),
                 _call(window=(100, 20)), _call(window=(None, 5000))):
        cfg = bwd_sm90.config_for(call)
        assert not cfg.dq_swap and cfg.block_m == bwd_sm90.BLOCK_M[call.head_dim], cfg.name
    # causal keeps its longest-first tail and 64-query steps
    assert bwd_sm90.config_for(_call(window=(None, 0))).lpt_tail == bwd_sm90.LPT_TAIL[128]


def test_swap_switch(monkeypatch):
    monkeypatch.setenv(SWAP_ENV, "0")
    assert not bwd_sm90.config_for(_call()).dq_swap
    monkeypatch.setenv(SWAP_ENV, "1")
    assert bwd_sm90.config_for(_call(sq=33)).dq_swap  # any length when asked for
    assert not bwd_sm90.config_for(_call(window=(None, 0))).dq_swap  # never under a mask
    assert not bwd_sm90.config_for(_call(d=64)).dq_swap  # nor where the kernel has no build
    monkeypatch.setenv(bwd_sm90.DQ_ENV, "tma")
    assert bwd_sm90.config_for(_call()).dq_swap  # =1 wins over the 64-query A/B switches
    monkeypatch.delenv(SWAP_ENV)
    for env, value in zip(AB_SWITCHES, ("tma",), strict=True):
        for other in AB_SWITCHES:
            monkeypatch.delenv(other, raising=False)
        monkeypatch.setenv(env, value)
        assert not bwd_sm90.config_for(_call()).dq_swap, env  # an A/B of the 64-query kernel
    for other in AB_SWITCHES:
        monkeypatch.delenv(other, raising=False)
    # the default's own settings, named, are the default kernel (bwd_sm90.is_default_kernel)
    for env, value in zip(AB_SWITCHES, ("frag",), strict=True):
        monkeypatch.setenv(env, value)
    assert bwd_sm90.config_for(_call()).dq_swap
    monkeypatch.setenv(SWAP_ENV, "yes")
    with pytest.raises(ValueError, match=SWAP_ENV):
        bwd_sm90.config_for(_call())


def test_swapped_config():
    for dtype in (torch.bfloat16, torch.float16):
        for watchdog in (False, True):
            cfg = bwd_sm90.swapped(Sm90BwdConfig(dtype, 128, watchdog=watchdog))
            assert cfg in bwd_sm90.configs()  # built and checked by the CPU lane
            assert (cfg.block_m, cfg.ds_k_major, cfg.dq_frag) == (80, True, True)
            assert not cfg.ds_stmatrix and not cfg.dq_tma and cfg.watchdog == watchdog
            assert cfg.name.endswith("_early_swap") and dict(cfg.spec().defines)["FC_DQ_SWAP"] == "1"
            assert (cfg.producer_regs, cfg.consumer_regs) == (24, 240)
            # K, V 64 KB; 2 x (Q, dO 20 KB each + lse2, delta 320 B each); dS 2 x 20 KB; the
            # staging 2 x 20 KB; 9 barriers; 1 KB alignment slack: within the 227 KB per block
            assert cfg.smem_bytes == 1024 + 65536 + 2 * (40960 + 640) + 40960 + 40960 + 9 * 8
            assert cfg.smem_bytes <= 227 * 1024
            conv = bwd_sm90.convert_spec(cfg)
            assert conv.name.endswith("_t80") and dict(conv.defines)["FC_DQ_FRAG_T"] == "1"
            assert dict(conv.defines)["FC_BLOCK_M"] == "80" and bwd_sm90.convert_rows(cfg) == 80
    names = {spec.name for spec, _ in bwd_sm90.variants()}
    assert {bwd_sm90.convert_spec(c).name for c in bwd_sm90.configs() if c.dq_swap} <= names
    for bad in (dict(head_dim=64, block_m=80), dict(head_dim=128, block_m=64),
                dict(head_dim=128, block_m=80, dq_frag=False, dq_tma=True)):
        kwargs = dict(dq_swap=True, dq_frag=True)
        with pytest.raises(ValueError, match="dq_swap"):
            Sm90BwdConfig(torch.bfloat16, **{**kwargs, **bad})


def test_swap_seqlen_pad_and_pre_grid():
    """Sq_pad: whole 80-row steps, not padded to PRE's 64-row blocks (which would make it a
    multiple of 320); PRE's grid rounds up and its last block stops at Sq_pad (the .cu's bounds)."""
    cfg = bwd_sm90.swapped(Sm90BwdConfig(torch.bfloat16, 128))
    aux = cfg.aux().aux_rows
    for sq in (1, 79, 80, 81, 512, 1000, 1024, 2048, 4096, 16384):
        pad = cfg.seqlen_pad(sq)
        assert pad % 80 == 0 and sq <= pad < sq + 80
        blocks = -(-pad // aux)
        rows = [min(aux, pad - aux * i) for i in range(blocks)]
        assert all(r > 0 for r in rows) and sum(rows) == pad  # every padded row once, none past


def test_swap_dq_tiles_round_trip():
    """MAIN: consumer c's dQ^T register i = 4 j + 2 h + e of thread W = 32 w + 4 g + t (element
    d = 64 c + 16 w + g + 8 h, query 8 j + 2 t + e of the step's 80 rows) goes to float
    512 j + 4 W + 2 h + e of block c (stage_dq_frag, 10 float4), block c of tile m at
    (m * 2 + c) * 5120 floats (write_dq). CONVERT (FC_DQ_FRAG_T): float4 i of tile m is block
    i // 1280, j = (i % 1280) // 128, w = (i % 128) // 32, g = (i % 32) // 4, t = i % 4, its
    four floats (query q, d), (q + 1, d), (q, d + 8), (q + 1, d + 8) with q = 8 j + 2 t,
    d = 64 c + 16 w + g; put_t's swizzled unit must be the one the row writer reads back."""
    rows, d_model, consumers = 80, 128, 2
    block = 64 * rows
    staged = {}
    for m in range(3):
        for c in range(consumers):
            for big_w in range(128):
                w, g, t = big_w // 32, (big_w % 32) // 4, big_w % 4
                for i in range(rows // 2):
                    j, h, e = i // 4, (i % 4) // 2, i % 2
                    at = (m * consumers + c) * block + 512 * j + 4 * big_w + 2 * h + e
                    staged[at] = (m * rows + 8 * j + 2 * t + e, 64 * c + 16 * w + g + 8 * h)
    assert len(staged) == 3 * rows * d_model and len(set(staged.values())) == len(staged)
    for m in range(3):
        tile = {}
        for i in range(rows * d_model // 4):
            c, j, w = i // (16 * rows), (i % (16 * rows)) // 128, (i % 128) // 32
            g, t = (i % 32) // 4, i % 4
            q, d = 8 * j + 2 * t, 64 * c + 16 * w + g
            for k, (qq, dd) in enumerate(((q, d), (q + 1, d), (q, d + 8), (q + 1, d + 8))):
                assert staged[m * rows * d_model + 4 * i + k] == (m * rows + qq, dd)
                u = dd // 8
                su = (u & ~7) | ((u ^ qq) & 7)  # put_t
                tile[(qq, 8 * su + dd % 8)] = (qq, dd)
        for r in range(rows):  # the row writer: chunk k of row r from unit (k & ~7) | ((k ^ r) & 7)
            for k in range(d_model // 8):
                su = (k & ~7) | ((k ^ r) & 7)
                assert [tile[(r, 8 * su + x)] for x in range(8)] == [(r, 8 * k + x)
                                                                     for x in range(8)]

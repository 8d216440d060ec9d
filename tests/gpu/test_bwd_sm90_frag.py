"""The sm90a backward with its dQ staged in the consumers' register order
(FLASHCUDA_SM90_BWD_DQ=frag, FC_DQ_FRAG; d128's default, an A/B at d64 since session 23) on the
H200: the float64 oracle rule of test_bwd_sm90.py over the shapes that exercise what the mode
changes — the per-consumer dq_full / dq_empty handshakes (many query blocks per CTA, GQA head
loops), the register-order dq_accum tiles and the CONVERT that reads them back (ragged Sq inside the
padded tiles, both dtypes, masks). Written in session 11 with the watchdog build
(FLASHCUDA_SM90_BWD_WATCHDOG=1: a barrier wait that never completes gives up after 2 s and poisons
dK / dV with NaN, failing the test instead of hanging the GPU lane); first run in session 12 (6
passed), since then d128's default, which the rest of the GPU lane runs without the watchdog — these
keep the watchdog build of the mode covered.
"""

from __future__ import annotations

import pytest
import torch

from flashcuda.ops import bwd_sm90, dispatch

from .test_bwd_sm90 import BF16, CAUSAL, FP16, FULL, check, make

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _frag(monkeypatch):
    for env in (bwd_sm90.DEFINES_ENV,):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv(bwd_sm90.ENABLE_ENV, "1")
    monkeypatch.setenv(bwd_sm90.DQ_ENV, "frag")
    monkeypatch.setenv(bwd_sm90.WATCHDOG_ENV, "1")  # (see the module docstring)
    dispatch._reset()
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        pytest.skip(f"sm90a kernel: needs compute capability 9.0, got {major}.{minor}")
    for d in (64, 128):
        cfg = bwd_sm90.select_config(torch.bfloat16, d)
        assert cfg.dq_frag and cfg.watchdog, cfg.name
    yield
    dispatch._reset()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_frag_one_tile_each_dtype(head_dim):
    for dtype in (BF16, FP16):
        q, k, v, dout = make(1, 64, 128, 1, 1, head_dim, dtype, seed=41)
        check(q, k, v, dout)
        check(q, k, v, dout, CAUSAL)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_frag_dq_only(head_dim):
    """dQ alone (K = identity rows): every element of each consumer's register-order tile must
    come back at its (row, column) through CONVERT."""
    q, _, v, dout = make(1, 128, head_dim, 1, 1, head_dim, BF16, seed=42)
    k = torch.eye(head_dim, device="cuda", dtype=BF16)[None, :, None, :].contiguous()
    check(q, k, v, dout)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_frag_many_query_blocks_and_ragged(head_dim):
    check(*make(1, 64 * 9, 128, 1, 1, head_dim, BF16, seed=43), CAUSAL)
    check(*make(1, 1023, 1023, 2, 2, head_dim, BF16, seed=44))
    check(*make(1, 17, 143, 1, 1, head_dim, FP16, seed=45), CAUSAL)
    check(*make(2, 1, 1, 1, 1, head_dim, BF16, seed=46))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("nheads_kv", [4, 1], ids=["mha", "mqa"])
def test_frag_gqa_batch(nheads_kv, head_dim):
    q, k, v, dout = make(2, 257, 300, 4, nheads_kv, head_dim, BF16, seed=47 + nheads_kv)
    check(q, k, v, dout, CAUSAL)
    check(q, k, v, dout, FULL)
    check(q, k, v, dout, (100, 20))

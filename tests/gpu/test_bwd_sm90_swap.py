"""The sm90a backward at 80-query steps with dQ^T = K^T dS^T (FLASHCUDA_SM90_BWD_SWAP=1, FC_DQ_SWAP;
d128 calls without a mask) on the H200: the float64 oracle rule of test_bwd_sm90.py over the shapes
that exercise what the variant changes — the m64n80 GEMMs, dS stored [query][key] by stmatrix.trans
and read K-major as dQ^T's B, dQ^T staged in each consumer's register order with one hand-off and
one bulk reduce-add per consumer (read back by CONVERT's FC_DQ_FRAG_T), query blocks of 80 rows
(ragged Sq inside them, the padded Sq_pad no longer a multiple of PRE's 64-row blocks), GQA head
loops, both dtypes; with and without the watchdog build (a barrier wait that never completes gives
up after 2 s and poisons dK / dV with NaN, failing the test instead of hanging the GPU lane).
"""

from __future__ import annotations

import pytest
import torch

from flashcuda.ops import bwd_sm90, dispatch
from flashcuda.ops.call import BwdCall

from .test_bwd_sm90 import BF16, CAUSAL, FP16, FULL, check, make

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=["plain", "watchdog"])
def _swap(monkeypatch, request):
    for env in (bwd_sm90.DQ_ENV, bwd_sm90.DEFINES_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv(bwd_sm90.ENABLE_ENV, "1")
    monkeypatch.setenv(bwd_sm90.SWAP_ENV, "1")
    monkeypatch.setenv(bwd_sm90.WATCHDOG_ENV, "1" if request.param == "watchdog" else "0")
    dispatch._reset()
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        pytest.skip(f"sm90a kernel: needs compute capability 9.0, got {major}.{minor}")
    yield
    dispatch._reset()


def _cfg(q, k, window):
    """The MAIN config a call on these inputs gets (out / lse / grads stand in: shapes only)."""
    call = BwdCall(q, k, k, q, q, q.new_empty(q.shape[0], q.shape[2], q.shape[1],
                                              dtype=torch.float32),
                   q, k, k, 1.0, window[0], window[1], False)
    return bwd_sm90.config_for(call)


def test_swap_one_tile_each_dtype():
    for dtype in (BF16, FP16):
        q, k, v, dout = make(1, 80, 128, 1, 1, 128, dtype, seed=61)
        cfg = _cfg(q, k, FULL)
        assert cfg.dq_swap and cfg.block_m == 80, cfg.name
        check(q, k, v, dout)


def test_swap_dq_only():
    """dQ alone (K = identity rows, so dQ = dS): every element of each consumer's dQ^T must come
    back at its (query, d) through the register-order staging, the bulk reduce-add and CONVERT."""
    q, _, v, dout = make(1, 80, 128, 1, 1, 128, BF16, seed=62)
    k = torch.eye(128, device="cuda", dtype=BF16)[None, :, None, :].contiguous()
    check(q, k, v, dout)


def test_swap_many_query_blocks_and_ragged():
    check(*make(1, 80 * 9, 128, 1, 1, 128, BF16, seed=63))
    check(*make(1, 1023, 1023, 2, 2, 128, BF16, seed=64))
    check(*make(1, 17, 143, 1, 1, 128, FP16, seed=65))
    check(*make(2, 1, 1, 1, 1, 128, BF16, seed=66))
    check(*make(1, 81, 200, 2, 1, 128, FP16, seed=67))
    check(*make(3, 161, 77, 2, 2, 128, BF16, seed=68))
    check(*make(1, 513, 512, 1, 1, 128, BF16, seed=69))


@pytest.mark.parametrize("nheads_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_swap_gqa_batch(nheads_kv):
    check(*make(2, 257, 300, 4, nheads_kv, 128, BF16, seed=70 + nheads_kv))


def test_masked_calls_keep_64_query_steps():
    q, k, v, dout = make(1, 200, 200, 1, 1, 128, BF16, seed=75)
    for window in (CAUSAL, (100, 20)):
        cfg = _cfg(q, k, window)
        assert not cfg.dq_swap and cfg.block_m == 64, cfg.name
        check(q, k, v, dout, window)

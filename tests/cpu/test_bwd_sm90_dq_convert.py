"""CONVERT inside the sm90 backward's MAIN (FC_DQ_CONVERT, FLASHCUDA_SM90_BWD_DQ_CONVERT=1) on the
CPU lane: the expected counts per query block against the mask itself, the switch and its
fallback, the kernel's parameter table against the plan's launch layout, and its SASS (the
count, the landing tile's bulk copy, the wgmmas in order). The GPU proves the rest
(tests/gpu/test_bwd_sm90.py's "cvt" parameters: the oracle, the counts left at 0)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from flashcuda.jit import compile_spec
from flashcuda.jit.runtime import pack_args
from flashcuda.jit.tensor_map import TensorMap
from flashcuda.ops import bwd_sm90
from flashcuda.ops.call import BwdCall, kernel_windows

from .sm90_compile import ARCH, assert_compiled_clean, clean_sass, param_table
from .test_bwd_sm90_compile import _gemm_region


def _call(b, sq, sk, h, hkv, d, window):
    q = torch.empty(b, sq, h, d, dtype=torch.bfloat16)
    k = torch.empty(b, sk, hkv, d, dtype=torch.bfloat16)
    lse = torch.empty(b, h, sq)
    return BwdCall(q, k, k.clone(), q.clone(), q.clone(), lse, q.clone(), k.clone(), k.clone(),
                   d ** -0.5, *window, False)


def _visits(sq, sk, window, block_m, block_n, sq_pad):
    """Per query block, the key blocks holding a key one of its rows (below sq) sees: the mask's
    visibility, element by element (mask.cuh's band, bottom-right aligned)."""
    wl, wr = (int(w) for w in kernel_windows(sq, sk, *window))
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    d = j - i - (sk - sq)
    seen = (d <= wr) & (d >= -wl)
    out = []
    for m0 in range(0, sq_pad, block_m):
        rows = seen[m0:m0 + block_m]
        out.append(sum(bool(rows[:, n0:n0 + block_n].any()) for n0 in range(0, sk, block_n)))
    return out


SHAPES = [(512, 512, (None, 0)), (512, 512, (None, None)), (300, 1000, (None, 0)),
          (1000, 300, (None, 0)), (1000, 1000, (10, 10)), (777, 777, (0, 0)),
          (129, 4096, (None, 0)), (2048, 2048, (None, -300)), (1000, 2000, (64, 0))]


@pytest.mark.parametrize("sq,sk,window", SHAPES)
def test_expected_counts_are_the_key_blocks_each_query_block_sees(sq, sk, window):
    call = _call(1, sq, sk, 2, 2, 64, window)
    bm, bn = bwd_sm90.BLOCK_M[64], 128
    sq_pad = bwd_sm90.Sm90BwdConfig(torch.bfloat16, 64).seqlen_pad(sq)
    got = bwd_sm90.dq_expected(call, bm, bn, sq_pad)
    assert got.dtype == np.int32 and got.tolist() == _visits(sq, sk, window, bm, bn, sq_pad)


def test_switch_and_fallback(monkeypatch):
    """Off unless FLASHCUDA_SM90_BWD_DQ_CONVERT=1; then on at d64's tma staging (40 producer
    registers, the schedule defaults kept: the causal tail's grid at 2k), not at d128 (frag) nor
    with FLASHCUDA_SM90_BWD_DQ=frag, and off where a query block has no step (rows that see no
    key: CONVERT writes their zeros)."""
    monkeypatch.delenv(bwd_sm90.DQ_ENV, raising=False)
    causal = _call(2, 2048, 2048, 4, 4, 64, (None, 0))
    monkeypatch.delenv(bwd_sm90.DQ_CONVERT_ENV, raising=False)
    assert not bwd_sm90.config_for(causal).dq_convert
    monkeypatch.setenv(bwd_sm90.DQ_CONVERT_ENV, "1")
    cfg = bwd_sm90.config_for(causal)
    assert cfg.dq_convert and cfg.producer_regs == bwd_sm90.DQ_CONVERT_REGS
    assert cfg.name.endswith("_cvt") and dict(cfg.spec().defines)["FC_DQ_CONVERT"] == "1"
    assert bwd_sm90.is_default_kernel(cfg) and bwd_sm90.lpt_launch_for(causal, cfg) > 0
    assert cfg.smem_bytes == bwd_sm90.Sm90BwdConfig(torch.bfloat16, 64).smem_bytes + 16384 + 8
    assert not bwd_sm90.config_for(_call(2, 512, 512, 4, 4, 128, (None, 0))).dq_convert
    assert not bwd_sm90.config_for(_call(1, 1000, 300, 2, 2, 64, (None, 0))).dq_convert
    monkeypatch.setenv(bwd_sm90.DQ_ENV, "frag")
    assert not bwd_sm90.config_for(causal).dq_convert
    with pytest.raises(ValueError, match="dq_convert"):
        bwd_sm90.Sm90BwdConfig(torch.bfloat16, 128, dq_convert=True)
    key_on = bwd_sm90._plan_key(causal)
    monkeypatch.setenv(bwd_sm90.DQ_CONVERT_ENV, "0")
    assert bwd_sm90._plan_key(causal) != key_on


@pytest.mark.parametrize("split", [0, 1, 3])
def test_parameter_offsets_match_the_plans_layout(tmp_path, split):
    """The three pointers after dv (counts, expected, dq) and dq's three strides before dk's, in
    MAIN, the causal tail's MAIN (first_main) and grid, as _build_plan lays them out."""
    cfg = next(c for c in bwd_sm90.configs() if c.dq_convert and c.wave_split == split)
    table = param_table(compile_spec(cfg.spec(), ARCH).cubin, tmp_path)
    m = TensorMap(b"\0" * 128)
    i32, i64 = np.int32(0), np.int64(0)
    pointers = 5 + 3
    args = ((m,) * 5 + (None,) * pointers + (i64,) * 9 + (i32,) * 5
            + (np.float32(0), np.float32(0), i32, i32) + ((i32,) if split == 1 else ()))
    _, offsets = pack_args("k", args)
    assert len(table) == len(args)
    assert [table[i][0] - table[0][0] for i in range(len(args))] == list(offsets)


def test_sass_counts_and_converts(tmp_path):
    """The converting kernel compiles clean (at 40 producer registers; 32 spill), counts with
    an atomic at each of the writer's two count sites, lands dq_accum rows with bulk copies,
    stores dq with 16-byte stores; its consumers' loop issues the default's wgmmas in the
    default's order (the cost ptxas adds around them, R2UR, is the .cu header's: measured, not
    pinned here)."""
    base = bwd_sm90.select_config(torch.bfloat16, 64)
    cvt = bwd_sm90.converting(base)
    sass, plain = clean_sass(cvt, tmp_path), clean_sass(base, tmp_path)
    assert len(re.findall(r"ATOMG\.E\.ADD", sass)) == 2 and "ATOMG" not in plain
    assert sass.count("UBLKCP") > plain.count("UBLKCP")
    assert re.search(r"STG\.E\.128", sass)
    hgmma = [op for op in _gemm_region(sass) if op.startswith("HGMMA")]
    assert hgmma == [op for op in _gemm_region(plain) if op.startswith("HGMMA")]
    spilled = compile_spec(dataclasses.replace(cvt, producer_regs=32).spec(), ARCH)
    with pytest.raises(AssertionError):
        assert_compiled_clean(spilled, cvt.name)

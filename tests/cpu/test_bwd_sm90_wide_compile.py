"""The sm90a backward for head dims 192 and 256 (bwd_sm90_wide) on the CPU lane: its kernels compile for
sm_90a with no spills, ptxas warnings or performance notes; the SASS (when cuobjdump is at hand)
has the loop's HGMMA mix — S and dP as m64n32 (both operands K-major), dV^T and dK^T as
m64n{block_n} with both operands transposed, dQ as m64n{head_dim / consumers} with B transposed —
TMA / bulk loads, the dQ reductions (bulk reduce-adds; the head-dim split's dO half issued before
the wait for dK^T), the key split's P / dS by stmatrix and no local memory; the parameter table
matches pack_args; the config, the gate and the plan key.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from flashcuda.jit import all_variants, compile_spec
from flashcuda.jit.runtime import pack_args
from flashcuda.jit.tensor_map import TensorMap
from flashcuda.ops import bwd_sm90_wide, dispatch
from flashcuda.ops.bwd_sm90_wide import ENABLE_ENV, GATED, Sm90BwdWideConfig
from flashcuda.ops.call import BwdCall

from .sm90_compile import (
    ARCH,
    assert_compiled_clean,
    assert_plan_key_follows_operands,
    build_all,
    dump,
    param_table,
)


@pytest.fixture(scope="module")
def builds():
    return build_all(bwd_sm90_wide.configs())


@pytest.mark.parametrize("cfg", bwd_sm90_wide.configs(), ids=lambda c: c.name)
def test_compiles_without_spills(builds, cfg):
    result = builds[cfg.name]
    assert_compiled_clean(result, cfg.name)
    assert not re.search(r"C75\d\d", result.log), result.log


@pytest.mark.parametrize("cfg", bwd_sm90_wide.configs(), ids=lambda c: c.name)
def test_sass_uses_wgmma(builds, cfg, tmp_path):
    sass = dump(builds[cfg.name].cubin, tmp_path, "-sass")
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory"
    hgmma = [line for line in sass.splitlines() if "HGMMA" in line]
    d, bm, bn, c = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.consumers

    bf16 = cfg.dtype == torch.bfloat16
    assert all(".F32" in line and ("BF16" in line) == bf16 for line in hgmma)
    assert not [line for line in hgmma if re.search(r"HGMMA\S+ R\d+, R\d+, gdesc", line)], \
        "every operand from shared memory"
    scores = [line for line in hgmma if f"64x{bn // c}x16" in line and ".tnsp" not in line]
    # the key split: one step loop per consumer (each GEMM twice in the SASS)
    roles = cfg.keys_split
    assert len(scores) == 2 * (d // 16) * (2 if roles else 1)
    if roles:  # dV^T in consumer 0, dK^T in consumer 1: all head-dim tiles, all keys
        key_grads = [line for line in hgmma if f"64x{bn}x16" in line and ".tnspA" in line]
        assert len(key_grads) == 2 * (d // 64) * (bm // 16)
    else:  # over this consumer's head-dim tiles, all keys
        key_grads = [line for line in hgmma if f"64x{bn}x16" in line]
        assert len(key_grads) == 2 * (d // c // 64) * (bm // 16)
    assert all(".tnspA" in line and ".tnspB" in line for line in key_grads)
    dq = [line for line in hgmma if f"64x{d // c}x16" in line and ".tnspA" not in line]
    assert len(dq) == bn // 16 * (2 if roles else 1) and all(".tnspB" in line for line in dq)
    assert len(hgmma) == len(scores) + len(key_grads) + len(dq)
    assert "UTMALDG" in sass and "UBLKCP" in sass and "USETMAXREG" in sass
    # dQ by bulk reduce-adds only, no per-thread reductions: the head-dim split's two halves of
    # a warpgroup's tile per step; the key split's one per step in each of its two loops
    lines = sass.splitlines()
    reds = [i for i, line in enumerate(lines) if re.search(r"UBLKRED\.G\.S\.ADD\.F32", line)]
    assert len(reds) == 2
    assert "REDG" not in sass
    if not cfg.keys_split:
        # the dO half's reduce-add issued while dK^T runs: before the step's wait for all
        # wgmma groups (dQ + dV^T, then dK^T), which comes before the Q half's
        waits = [i for i, line in enumerate(lines) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line]
        assert any(reds[0] < i < reds[1] for i in waits)
    else:  # P and dS by stmatrix.x4: 3 per tile and warp x (P masked / not, dS) x two loops
        assert len(re.findall(r"\bSTSM\b", sass)) == 18
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory"


@pytest.mark.parametrize("split", ["dims", "keys"])
def test_parameter_offsets_match_pack_args(builds, tmp_path, split):
    """Both MAIN kernels (the head-dim split's and the key split's) take the same parameters."""
    cfg = next(c for c in bwd_sm90_wide.configs() if c.split == split)
    table = param_table(builds[cfg.name].cubin, tmp_path)
    m = TensorMap(b"\0" * 128)
    i32, i64 = np.int32(0), np.int64(0)
    args = (m, m, m, m, None, None, None, None, None, i64, i64, i64, i64, i64, i64, i32, i32,
            i32, i32, i32, np.float32(0), np.float32(0), i32, i32)
    _, offsets = pack_args("k", args)
    assert len(table) == len(args)
    base = table[0][0]
    assert [table[i][0] - base for i in range(len(args))] == list(offsets)


def test_pre_and_convert_compile_at_d256():
    cfg = bwd_sm90_wide.configs()[0]
    for spec in (cfg.aux().pre_spec(), bwd_sm90_wide.convert_spec(cfg)):
        result = compile_spec(spec, ARCH)
        res = result.resources()[spec.name]
        assert res.spill_stores == 0 and res.spill_loads == 0, (spec.name, res)


def test_variants_registered():
    specs = {spec.name: archs for spec, archs in all_variants()}
    for cfg in bwd_sm90_wide.configs():
        assert specs[cfg.name] == (ARCH,)
        assert cfg.aux().pre_spec().name in specs


def test_config():
    cfg = Sm90BwdWideConfig(torch.bfloat16, 256)
    assert cfg.name == "flash_bwd_sm90w_bf16_d256_bm64_bn64_c2_s2_dqs"  # (dQ staged)
    assert (cfg.block_m, cfg.block_n, cfg.consumers, cfg.threads) == (64, 64, 2, 384)
    kv, q, p, stats = 64 * 256 * 2, 64 * 256 * 2, 64 * 64 * 2, 2 * 64 * 4
    assert cfg.smem_bytes == 1024 + 2 * kv + 2 * (2 * q + stats) + 4 * p + 8 * 5
    assert cfg.smem_bytes <= 232448  # the opt-in limit per block (227 KB)
    assert dict(cfg.spec().defines) == {
        "FC_DTYPE": "2", "FC_HEAD_DIM": "256", "FC_BLOCK_M": "64", "FC_BLOCK_N": "64",
        "FC_STAGES": "2", "FC_CONSUMERS": "2", "FC_P_BUFFERS": "2", "FC_PRODUCER_REGS": "24",
        "FC_CONSUMER_REGS": "240", "FC_SMEM_BYTES": str(cfg.smem_bytes)}
    assert cfg.aux().head_dim == 256 and cfg.seqlen_pad(65) == 128
    # per dtype (2): the causal default per head dim (LPT_TAIL: d192 key split, d256), the
    # head-dim split per head dim (d256's default, d192's with SPLIT_ENV=dims) and the key split
    # (d192): 2 x (2 + 2 + 1) = 10
    assert len(bwd_sm90_wide.configs()) == 2 * (
        len(bwd_sm90_wide.LPT_TAIL) + len(bwd_sm90_wide.HEAD_DIMS)
        + len(bwd_sm90_wide.KEYS_HEAD_DIMS)) == 10
    keys = Sm90BwdWideConfig(torch.bfloat16, 192, split="keys")
    assert keys.name == "flash_bwd_sm90w_bf16_d192_bm64_bn96_c2_s2_dqs_keys"
    assert (keys.consumers, keys.threads, keys.consumer_regs, keys.k_swizzle) == (2, 384, 240, 64)
    # K, V; two Q stages with lse2 / delta; one dO; P, dS unpadded; two fp32 dQ staging tiles
    assert keys.smem_bytes == (1024 + 2 * 96 * 192 * 2 + 2 * (64 * 192 * 2 + stats)
                               + 64 * 192 * 2 + 2 * 64 * 96 * 2 + 2 * 64 * 96 * 4 + 8 * 7)
    assert dict(keys.spec().defines) == {
        "FC_DTYPE": "2", "FC_PRODUCER_REGS": "24", "FC_CONSUMER_REGS": "240",
        "FC_SMEM_BYTES": str(keys.smem_bytes)}
    assert keys.spec().source != cfg.spec().source
    assert "FC_DQ_FRAG_M" in dict(bwd_sm90_wide.convert_spec(keys).defines)
    with pytest.raises(ValueError, match="head_dim"):
        Sm90BwdWideConfig(torch.bfloat16, 256, split="keys")
    with pytest.raises(ValueError, match="split"):
        Sm90BwdWideConfig(torch.bfloat16, 192, split="rows")
    d192 = Sm90BwdWideConfig(torch.float16, 192)
    assert d192.name == "flash_bwd_sm90w_fp16_d192_bm64_bn96_c3_s2_dqs"
    assert (d192.block_n, d192.consumers, d192.threads, d192.consumer_regs) == (96, 3, 512, 160)
    # one P / dS tile each, of two 64-key chunks (the second half used)
    kv192, q192, p192 = 96 * 192 * 2, 64 * 192 * 2, 64 * 128 * 2
    assert d192.smem_bytes == 1024 + 2 * kv192 + 2 * (2 * q192 + stats) + 2 * p192 + 8 * 5
    assert dict(d192.spec().defines)["FC_P_BUFFERS"] == "1"
    assert 24 * 128 + 160 * 384 <= 65536
    # dQ staged in register order (the stage's own Q / dO chunks: no shared memory of its own):
    # CONVERT reads 64-row blocks of that order for both splits
    for c in (cfg, d192, keys):
        assert dict(bwd_sm90_wide.convert_spec(c).defines)["FC_DQ_FRAG_M"] == "64", c.name
    with pytest.raises(ValueError, match="head_dim"):
        Sm90BwdWideConfig(torch.bfloat16, 128)
    with pytest.raises(ValueError, match="block_m x block_n"):
        Sm90BwdWideConfig(torch.bfloat16, 256, block_n=128)
    with pytest.raises(ValueError, match="shared memory"):
        Sm90BwdWideConfig(torch.bfloat16, 256, stages=3)
    with pytest.raises(ValueError, match="pool"):
        Sm90BwdWideConfig(torch.bfloat16, 192, consumer_regs=168)
    with pytest.raises(ValueError, match="pool"):
        Sm90BwdWideConfig(torch.bfloat16, 256, producer_regs=40)


def _call(dtype=torch.bfloat16, B=2, Sq=33, Sk=47, H=4, Hkv=2, D=256, deterministic=False,
          window=(None, 0)):
    q = torch.randn(B, Sq, H, D, dtype=dtype)
    k = torch.randn(B, Sk, Hkv, D, dtype=dtype)
    v = torch.randn(B, Sk, Hkv, D, dtype=dtype)
    lse = torch.zeros(B, H, Sq, dtype=torch.float32)
    return BwdCall(q, k, v, torch.randn(q.shape, dtype=dtype), torch.randn(q.shape, dtype=dtype),
                   lse, torch.empty(q.shape, dtype=dtype), torch.empty_like(k),
                   torch.empty_like(v), 0.0625, *window, deterministic)


def test_split_follows_its_env(monkeypatch):
    """FLASHCUDA_SM90_BWD_WIDE_SPLIT picks the d192 kernel (d256 has only the head-dim split); a
    bad name is a ValueError naming the variable."""
    env = bwd_sm90_wide.SPLIT_ENV
    monkeypatch.setenv(env, "keys")
    assert bwd_sm90_wide.config_for(_call(D=192)).keys_split
    assert not bwd_sm90_wide.config_for(_call(D=256)).keys_split
    monkeypatch.setenv(env, "dims")
    assert not bwd_sm90_wide.config_for(_call(D=192)).keys_split
    monkeypatch.setenv(env, "rows")
    with pytest.raises(ValueError, match=env):
        bwd_sm90_wide.config_for(_call(D=192))
    monkeypatch.delenv(env)
    cfg = bwd_sm90_wide.config_for(_call(D=192))
    assert cfg.split == bwd_sm90_wide.SPLIT_DEFAULT[192]


def test_causal_tail_longest_first(monkeypatch):
    """Causal calls (a right edge, no left one) run the kernels with the grid's last LPT_TAIL
    pairs longest-first, compiled with FC_LPT_TAIL and named for it; a sliding window or no mask
    keeps blockIdx order; every such kernel is one configs() builds."""
    monkeypatch.delenv(bwd_sm90_wide.DEFINES_ENV, raising=False)
    names = {c.name for c in bwd_sm90_wide.configs()}
    for d in (192, 256):
        cfg = bwd_sm90_wide.config_for(_call(D=d))
        assert cfg.lpt_tail == bwd_sm90_wide.LPT_TAIL[d] == 8
        assert ("FC_LPT_TAIL", "8") in cfg.spec().defines and cfg.name.endswith("_lpt8")
        assert cfg.name in names
        assert bwd_sm90_wide.config_for(_call(D=d, window=(None, None))).lpt_tail == 0
        assert bwd_sm90_wide.config_for(_call(D=d, window=(30, 0))).lpt_tail == 0
        assert bwd_sm90_wide.config_for(_call(D=d, window=(None, 5))).lpt_tail == 8


def test_can_implement_reasons(monkeypatch):
    ci = bwd_sm90_wide.can_implement
    for off in ("0", "off", "false"):  # (the other families' FLASHCUDA_ENABLE_* spellings)
        monkeypatch.setenv(ENABLE_ENV, off)
        assert ci(_call()) == GATED
    monkeypatch.delenv(ENABLE_ENV)
    assert "head_dim 128" in ci(_call(D=128))
    assert "not on the CUDA device" in ci(_call(D=192))
    assert "deterministic" in ci(_call(deterministic=True))
    assert "fp16/bf16" in ci(_call(dtype=torch.float32))
    assert "not on the CUDA device" in ci(_call())  # CPU tensors pass every layout check first
    assert "bwd_sm90_wide" in dispatch.BWD_FAMILIES


def test_plan_key_holds_what_can_implement_reads(monkeypatch):
    base = _call()
    key = assert_plan_key_follows_operands(
        bwd_sm90_wide._plan_key, base, ("q", "k", "v", "out", "dout", "dq", "dk", "dv"))
    assert bwd_sm90_wide._plan_key(_call()) == key
    for change in ({"window_left": 5}, {"window_right": None}, {"softmax_scale": 0.5},
                   {"deterministic": True}):
        assert bwd_sm90_wide._plan_key(dataclasses.replace(base, **change)) != key, change
    monkeypatch.setenv(ENABLE_ENV, "0")
    assert bwd_sm90_wide._plan_key(base) != key

"""The sm90a forward family on the CPU lane: every variant compiles for sm_90a with no spills and
no ptxas performance warnings; when cuobjdump (+ nvdisasm) is at hand, the SASS has HGMMA (the
wgmma path, not a fallback), the register-A P V form with a transposed B, TMA loads, and the
kernel's parameter offsets equal what runtime.pack_args produces. Plus the config and the
can_implement gate.

cuobjdump / nvdisasm: as tests/cpu/sm90_compile.py finds them; without them those checks skip,
saying so.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from flashcuda.jit import all_variants
from flashcuda.jit.compiler import compile_spec
from flashcuda.jit.runtime import pack_args
from flashcuda.jit.tensor_map import TensorMap
from flashcuda.ops import dispatch, fwd_sm90
from flashcuda.ops.call import FwdCall, register_pool
from flashcuda.ops.fwd_sm90 import ENABLE_ENV, GATED, Sm90FwdConfig

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
    return build_all(fwd_sm90.configs())


# d256's masked-V kernels (the second of a windowed call's two passes, run only for the CTAs whose
# first pass saw a NaN / Inf; or alone under FLASHCUDA_SM90_FWD_NAN_FIXUP=0) spill: 128 O
# registers per thread plus the masked-V state exceed 240 (NVRTC 13.5: 8-52 bytes; the producer's
# share and FC_SOFTMAX_IN_ARMS / FC_EXP_SPLIT / FC_MASK_BITS off did not remove them); with the
# 80-key tiles that causal / windowed d256 calls take since session 29, 152 bytes (NVRTC 13.0:
# the A/B variant without ping-pong). Held to these budgets, by keys per tile; every other kernel
# spills nothing.
D256_MASKED_V_SPILL_BUDGET = {64: 64, 80: 160}


def spills_allowed(cfg) -> bool:
    return cfg.head_dim == 256 and cfg.masked_v


@pytest.mark.parametrize("cfg", fwd_sm90.configs(), ids=lambda c: c.name)
def test_sm90_compiles_without_spills(builds, cfg):
    if spills_allowed(cfg):
        res = builds[cfg.name].resources()[cfg.name]
        budget = D256_MASKED_V_SPILL_BUDGET[cfg.block_n]
        assert res.spill_stores <= budget, res
        assert res.stack_bytes <= budget, res
        assert "warning" not in builds[cfg.name].log.lower(), builds[cfg.name].log
        assert not builds[cfg.name].performance_notes(), builds[cfg.name].log
        return
    assert_compiled_clean(builds[cfg.name], cfg.name)


@pytest.mark.parametrize("cfg", fwd_sm90.configs(), ids=lambda c: c.name)
def test_sm90_sass_uses_wgmma_and_tma(builds, cfg, tmp_path):
    sass = dump(builds[cfg.name].cubin, tmp_path, "-sass")
    hgmma = [line for line in sass.splitlines() if "HGMMA" in line]
    # The first tile (Q K^T only), the loop body (Q K^T, P V) and the last P V: 2 x head_dim / 16
    # Q K^T and 2 x block_n / 16 P V wgmmas. The masked-V variant has three copies of the loop
    # body (masked, unmasked, masked runs of tiles): two more of each.
    bodies = 3 if cfg.masked_v else 1
    assert len(hgmma) == (1 + bodies) * (cfg.head_dim // 16 + cfg.block_n // 16), len(hgmma)
    # nvdisasm spells bf16 inputs .F32.BF16 and fp16 inputs plain .F32
    bf16 = cfg.dtype == torch.bfloat16
    assert all(".F32" in line and ("BF16" in line) == bf16 for line in hgmma)
    pv = [line for line in hgmma if ".tnspB" in line]
    assert len(pv) == (1 + bodies) * (cfg.block_n // 16)
    assert all(f"64x{cfg.head_dim}x16" in line for line in pv)
    assert all(re.search(r"HGMMA\S+ R\d+, R\d+, gdesc", line) for line in pv), "A from registers"
    assert "UTMALDG" in sass
    assert "USETMAXREG" in sass
    assert ("BAR.ARV" in sass) == cfg.pingpong, "named-barrier hand-offs exactly in ping-pong"
    if not spills_allowed(cfg):
        assert not re.search(r"\b(LDL|STL)\b", sass), "local memory"


@pytest.mark.parametrize("o_tma", [True, False], ids=["tma", "stores"])
def test_sm90_parameter_offsets_match_pack_args(builds, tmp_path, o_tma):
    """The cubin's own parameter table (EIATTR_KPARAM_INFO) against pack_args' layout, for a
    kernel with O's tensor map after Q / K / V's and one without it; both end in the schedule's
    eight magic numbers and two counts (fast_div_args)."""
    cfg = next(c for c in fwd_sm90.configs() if c.o_tma == o_tma)
    table = param_table(builds[cfg.name].cubin, tmp_path)
    m = TensorMap(b"\0" * 128)
    maps = (m,) * (3 + cfg.o_tma)
    args = (*maps, None, None, np.int64(0), np.int64(0), np.int64(0), np.int32(0), np.int32(0),
            np.int32(0), np.int32(0), np.float32(0), np.int32(0), np.int32(0), np.int32(0),
            np.int32(0))
    args += (np.uint64(0),) * 8 + (np.int32(0),) * 2
    _, offsets = pack_args("k", args)
    assert len(table) == len(args)
    base = table[0][0]
    assert [table[i][0] - base for i in range(len(args))] == list(offsets)
    assert [table[i][1] for i in range(len(maps))] == [128] * len(maps)


def test_tensor_map_enum_values_match_cuda_bindings():
    """tensor_map calls libcuda through ctypes with cuda.h's enum values written out."""
    from cuda.bindings import driver

    from flashcuda.jit import tensor_map as tm

    assert tm._DTYPE_CODES == {
        "torch.float16": int(driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
        "torch.bfloat16": int(driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
        "torch.float32": int(driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32)}
    assert tm._INTERLEAVE_NONE == int(driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE)
    assert tm._SWIZZLE_CODES == {
        n: int(getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{n}B"))
        for n in (32, 64, 128)}
    assert tm._L2_PROMOTION_256B == int(
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
    assert tm._OOB_FILL_NONE == int(
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


def test_variants_registered():
    specs = {spec.name: archs for spec, archs in all_variants()}
    for cfg in fwd_sm90.configs():
        assert specs[cfg.name] == (ARCH,)
    # the tiles x ping-pong x snake x masked V (per dtype: 16 at d64, 12 at d128, 24 at d192, 16
    # at d256), the bf16 timeline variants (8), the two passes of the windowed kernels (36 + 36)
    # and the A/B variants without one of the boundary's parts that need room (52); 392 before
    # session 39, which removed the variants without the decode ahead, the magic-number divisions
    # or the V scanner, without every boundary part, and with FC_CROSS_TILE (124)
    assert len(fwd_sm90.configs()) == 2 * 68 + 8 + 36 + 36 + 52 == 268
    assert len(fwd_sm90.fused_configs()) == 26  # (unchanged by session 39)


# ---- config ---------------------------------------------------------------------------------------

def test_config_is_the_single_source_of_truth():
    cfg = Sm90FwdConfig(torch.bfloat16, 128)
    # (_fd_da: the magic-number divisions and the decode ahead, parts of every kernel)
    assert cfg.name == "flash_fwd_sm90_bf16_d128_bm128_bn128_s2_fd_da"
    assert cfg.threads == 384 and cfg.consumers == 2
    assert cfg.smem_bytes == 1024 + 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + 8 * 10
    assert dict(cfg.spec().defines) == {
        "FC_DTYPE": "2", "FC_HEAD_DIM": "128", "FC_BLOCK_M": "128", "FC_BLOCK_N": "128",
        "FC_STAGES": "2", "FC_PRODUCER_REGS": "24", "FC_CONSUMER_REGS": "240",
        "FC_SMEM_BYTES": str(cfg.smem_bytes), "FC_PINGPONG": "0", "FC_SNAKE": "0",
        "FC_SOFTMAX_IN_ARMS": "1",  # d128 only (fwd_sm90.SOFTMAX_IN_ARMS)
        "FC_EXP_SPLIT": "6",  # d128 only (fwd_sm90.EXP_SPLIT)
        "FC_O_QUAD": "1"}  # d128, and d64's 192-row tiles (fwd_sm90.O_QUAD)
    assert dict(Sm90FwdConfig(torch.bfloat16, 64).spec().defines)["FC_SOFTMAX_IN_ARMS"] == "0"
    assert "FC_EXP_SPLIT" not in dict(Sm90FwdConfig(torch.bfloat16, 64).spec().defines)
    assert "FC_O_QUAD" not in dict(Sm90FwdConfig(torch.bfloat16, 64).spec().defines)
    assert dict(Sm90FwdConfig(torch.bfloat16, 64, block_m=192,
                              consumer_regs=160).spec().defines)["FC_O_QUAD"] == "1"
    knob = dataclasses.replace(cfg, defines=(("FC_SOFTMAX_IN_ARMS", 0),))  # an A/B override wins
    assert dict(knob.spec().defines)["FC_SOFTMAX_IN_ARMS"] == "0" and knob.name != cfg.name
    pp = Sm90FwdConfig(torch.bfloat16, 128, pingpong=True)
    assert pp.name == "flash_fwd_sm90_bf16_d128_bm128_bn128_s2_pp_fd_da"
    assert dict(pp.spec().defines)["FC_PINGPONG"] == "1"
    assert cfg.smem_bytes <= 232448  # H100/H200 opt-in limit per block
    assert Sm90FwdConfig(torch.float16, 64).smem_bytes == 1024 + 16384 + 4 * 16384 + 80


@pytest.mark.parametrize("kwargs", [
    dict(dtype=torch.float32, head_dim=128),
    dict(dtype=torch.float16, head_dim=96),
    dict(dtype=torch.float16, head_dim=128, block_m=64),
    dict(dtype=torch.float16, head_dim=128, block_n=96),
    dict(dtype=torch.float16, head_dim=128, stages=0),
    dict(dtype=torch.float16, head_dim=128, consumer_regs=256),
])
def test_config_rejects_bad_shapes(kwargs):
    with pytest.raises(ValueError):
        Sm90FwdConfig(**kwargs)


# ---- can_implement: the gate, then every check before the device ones ---------------------------

def _call(dtype=torch.bfloat16, B=2, Sq=33, Sk=47, H=4, Hkv=2, D=128, scale=0.125, q=None):
    q = torch.randn(B, Sq, H, D, dtype=dtype) if q is None else q
    k = torch.randn(B, Sk, Hkv, q.shape[-1], dtype=dtype)
    v = torch.randn(B, Sk, Hkv, q.shape[-1], dtype=dtype)
    out = torch.empty(q.shape, dtype=dtype)
    lse = torch.empty(B, H, Sq, dtype=torch.float32)
    return FwdCall(q, k, v, out, lse, scale, None, 0)


def test_sm90_can_be_turned_off(monkeypatch):
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    assert fwd_sm90.enabled()
    assert fwd_sm90.can_implement(_call()) != GATED  # CPU tensors: refused for another reason
    monkeypatch.setenv(ENABLE_ENV, "0")
    assert fwd_sm90.can_implement(_call()) == GATED
    reasons = dict(dispatch.explain(_call()))
    assert reasons["fwd_sm90"] == GATED
    with pytest.raises(NotImplementedError, match="turned off"):
        fwd_sm90.run(_call())


def test_sm90_can_implement_reasons(monkeypatch):
    monkeypatch.setenv(ENABLE_ENV, "1")
    ci = fwd_sm90.can_implement
    assert "dtype" in ci(_call(dtype=torch.float32))
    assert "head_dim" in ci(_call(D=96))
    assert "head_dim" in ci(_call(D=80))
    assert "CUDA" in ci(_call(D=256)) and "CUDA" in ci(_call(D=192))  # (session 26)
    assert "nheads_kv" in ci(_call(H=3, Hkv=2))
    assert "softmax_scale" in ci(_call(scale=-1.0))
    assert "seqlen_k is 0" in ci(_call(Sk=0))
    big = torch.randn(2, 33, 4, 136, dtype=torch.bfloat16)
    assert "16-byte" in ci(_call(q=big[..., 1:129]))
    odd = torch.randn(2, 33, 4, 132, dtype=torch.bfloat16)[..., :128]
    assert "multiple of 8" in ci(_call(q=odd))
    bad_lse = dataclasses.replace(_call(), lse=torch.empty(2, 4, 34))
    assert "lse" in ci(bad_lse)
    # Well-formed calls fail only on the device check here.
    assert "CUDA" in ci(_call())
    assert "CUDA" in ci(_call(dtype=torch.float16, D=64, Sq=1, Sk=1, H=2, Hkv=1))


def test_tiles_follow_the_table_and_the_ab_override(monkeypatch):
    monkeypatch.delenv(fwd_sm90.TILES_ENV, raising=False)
    monkeypatch.delenv(fwd_sm90.PINGPONG_ENV, raising=False)
    monkeypatch.delenv(fwd_sm90.SNAKE_ENV, raising=False)
    pick = fwd_sm90.select_config
    assert pick(torch.bfloat16, 64).pingpong and not pick(torch.bfloat16, 64).snake
    assert pick(torch.bfloat16, 64, windowed=True).snake  # snake order where tiles differ
    assert pick(torch.bfloat16, 128, True, 4096).snake  # ... from seqlen_q 4k
    assert not pick(torch.bfloat16, 128, True, 2048).snake
    monkeypatch.setenv(fwd_sm90.SNAKE_ENV, "1")
    assert pick(torch.bfloat16, 128, True, 1024).snake  # the A/B override wins
    monkeypatch.delenv(fwd_sm90.SNAKE_ENV)
    assert (pick(torch.bfloat16, 64).block_m, pick(torch.bfloat16, 64).block_n) == (192, 128)
    assert pick(torch.bfloat16, 64).consumer_regs == 160 and pick(torch.bfloat16, 64).threads == 512
    assert pick(torch.float16, 128).block_n == 128  # FA4's d128 tiles at every length (session 13)
    assert pick(torch.float16, 128, False, 16384).block_n == 128
    assert pick(torch.float16, 128, windowed=True).block_n == 128
    assert pick(torch.float16, 128, False, 1024).block_n == 128  # short: 128 x 128
    assert pick(torch.float16, 64, True, 1024).block_m == 128  # causal below 2k
    assert pick(torch.float16, 64, True, 2047).block_m == 128
    assert pick(torch.float16, 64, True, 2048).block_m == 192
    assert pick(torch.float16, 64, True, 8192).block_m == 192
    # d64's windowed 128-row tiles run without ping-pong (session 28), its other tiles with it
    assert not pick(torch.float16, 64, True, 1024).pingpong
    assert pick(torch.float16, 64, True, 2048).pingpong and pick(torch.float16, 64, False, 1024).pingpong
    assert pick(torch.float16, 128, True, 1024).pingpong
    monkeypatch.setenv(fwd_sm90.PINGPONG_ENV, "1")
    assert pick(torch.float16, 64, True, 1024).pingpong  # the A/B override wins
    monkeypatch.delenv(fwd_sm90.PINGPONG_ENV)
    names = {c.name for c in fwd_sm90.configs()}
    assert {pick(dt, d, w, s).name for dt in fwd_sm90.DTYPES for d in (64, 128, 192, 256)
            for w in (False, True) for s in (1024, fwd_sm90.LONG)} <= names
    # d192 / d256: below 2k 128 x 80 without a window, 128 x 64 with one; from 2k d256 128 x 80
    # (session 29) and d192 128 x 112 (session 32) with a window or not, the windowed second
    # pass with one K / V stage
    for d, long_n in ((192, 112), (256, 80)):
        assert (pick(torch.bfloat16, d).block_m, pick(torch.bfloat16, d).block_n) == (128, long_n)
        assert pick(torch.bfloat16, d, False, 512).block_n == 80
        assert pick(torch.bfloat16, d, False, 2047).block_n == 80
        assert pick(torch.bfloat16, d, False, 2048).block_n == long_n
        assert pick(torch.bfloat16, d, True, 2047).block_n == 64
        assert pick(torch.bfloat16, d, True, 2048).block_n == long_n
        assert pick(torch.bfloat16, d, True, 16384).block_n == long_n
        assert fwd_sm90.two_passes(pick(torch.bfloat16, d, True, 4096))[1].stages == 1
    for dt in fwd_sm90.DTYPES:  # the two passes of the windowed kernels dispatch picks
        for d, s in ((64, 1024), (64, 4096), (128, 1024), (192, 1024), (256, 1024), (192, 4096),
                     (256, 4096), (192, 16384), (256, 16384)):
            passes = fwd_sm90.two_passes(pick(dt, d, True, s))
            assert passes and {p.name for p in passes} <= names, (d, s)
    monkeypatch.setenv(fwd_sm90.TILES_ENV, "bm128_bn128")
    assert pick(torch.bfloat16, 64).name == "flash_fwd_sm90_bf16_d64_bm128_bn128_s2_pp_q2_ot_fd_da"
    assert pick(torch.bfloat16, 64).name in names
    monkeypatch.setenv(fwd_sm90.TILES_ENV, "d64=bm192_bn128,d128=bm128_bn176")
    assert pick(torch.bfloat16, 64, True, 1).block_m == 192
    assert pick(torch.bfloat16, 128, True, 1).block_n == 176
    monkeypatch.setenv(fwd_sm90.TILES_ENV, "d64=bm128_bn128")
    assert pick(torch.bfloat16, 128, False, 4096).block_n == 128  # d128: the rule
    monkeypatch.setenv(fwd_sm90.PINGPONG_ENV, "0")
    monkeypatch.setenv(fwd_sm90.SNAKE_ENV, "1")
    assert pick(torch.bfloat16, 64).name.endswith("_s2_sn_q2_ot_fd_da") and pick(torch.bfloat16, 64).name in names
    monkeypatch.setenv(fwd_sm90.SNAKE_ENV, "yes")
    with pytest.raises(ValueError, match="FLASHCUDA_SM90_SNAKE"):
        pick(torch.bfloat16, 64)
    monkeypatch.delenv(fwd_sm90.SNAKE_ENV)
    monkeypatch.setenv(fwd_sm90.TILES_ENV, "128x128")
    with pytest.raises(ValueError, match="FLASHCUDA_SM90_TILES"):
        pick(torch.bfloat16, 64)
    for cfg in fwd_sm90.configs():
        assert cfg.smem_bytes <= 232448 - 1024, cfg.name  # H100/H200 opt-in limit per block
        assert (cfg.producer_regs * 128 + cfg.consumer_regs * 128 * cfg.consumers
                <= register_pool(cfg.threads))


def test_snake_order_for_few_rounds(monkeypatch):
    """Below seqlen_q 4k a masked call walks its tiles in snake order when its work tiles make
    at most SNAKE_ROUNDS rounds over the SMs (the serving shape: 512 tiles on 132 SMs); more
    rounds, or no mask, keep the plain order; the A/B switch overrides either way."""
    monkeypatch.delenv(fwd_sm90.TILES_ENV, raising=False)
    monkeypatch.delenv(fwd_sm90.SNAKE_ENV, raising=False)

    def call(b, s, h, causal=True):
        q = torch.zeros(b, s, h, 128, dtype=torch.bfloat16)
        return FwdCall(q, q, q, q, torch.zeros(b, h, s), 0.1, None, 0 if causal else None)

    sms = 132
    serving = call(1, 2048, 32)  # 16 query blocks x 32 heads = 512 work tiles, 3.9 rounds
    assert fwd_sm90.plan_config(serving, sms).snake
    assert fwd_sm90.plan_config(call(3, 2048, 32), sms).snake  # 1536 tiles, 11.6 rounds
    assert not fwd_sm90.plan_config(call(4, 2048, 32), sms).snake  # 2048 tiles, 15.5 rounds
    assert not fwd_sm90.plan_config(call(1, 2048, 32, causal=False), sms).snake
    assert fwd_sm90.plan_config(call(4, 2048, 32), 200).snake  # a larger GPU: fewer rounds
    # d192 keeps the snake order only from seqlen_q 4k (session 28); d256 takes it for few rounds
    wide = [torch.zeros(32, 512, 10, d, dtype=torch.bfloat16) for d in (192, 256)]
    calls = [FwdCall(q, q, q, q, torch.zeros(32, 10, 512), 0.1, None, 0) for q in wide]
    assert not fwd_sm90.plan_config(calls[0], sms).snake and fwd_sm90.plan_config(calls[1], sms).snake
    q = torch.zeros(2, 4096, 10, 192, dtype=torch.bfloat16)
    assert fwd_sm90.plan_config(FwdCall(q, q, q, q, torch.zeros(2, 10, 4096), 0.1, None, 0), sms).snake
    monkeypatch.setenv(fwd_sm90.SNAKE_ENV, "0")
    assert not fwd_sm90.plan_config(serving, sms).snake
    plain = fwd_sm90.plan_config(serving, sms)
    monkeypatch.delenv(fwd_sm90.SNAKE_ENV)
    snake = fwd_sm90.plan_config(serving, sms)
    assert (plain.block_m, plain.block_n) == (snake.block_m, snake.block_n) == (128, 128)


def _kernel_order(total: int, grid: int, snake: bool) -> list[list[int]]:
    """flash_fwd_sm90.cu's next_work, transcribed: the work tiles each CTA visits."""
    order = []
    for c in range(grid):
        seq, t = [], c
        while t < total:
            seq.append(t)
            r = t // grid + 1
            t = r * grid + ((grid - 1 - c) if (snake and r % 2) else c) if snake else t + grid
        order.append(seq)
    return order


@pytest.mark.parametrize("snake", [False, True])
def test_work_order_visits_every_tile_once(snake):
    for total, grid in [(1, 1), (5, 132), (132, 132), (512, 132), (2048, 132), (4097, 132),
                        (300, 7)]:
        seen = sorted(t for seq in _kernel_order(total, grid, snake) for t in seq)
        assert seen == list(range(total)), (total, grid)


def test_snake_order_balances_causal_work():
    """1 x 32 heads x 2048 causal at 128-row blocks: 16 query blocks per head, block m costs m + 1
    key tiles, heaviest first (by_block). Round robin leaves the last CTA 21% behind the mean;
    the snake order is within 4% (the model behind FLASHCUDA_SM90_SNAKE's prediction)."""
    num_m, heads, grid = 16, 32, 132

    def cost(t):
        return num_m - t // heads

    for snake, worst in ((False, 1.20), (True, 1.04)):
        loads = [sum(cost(t) for t in seq) for seq in _kernel_order(num_m * heads, grid, snake)]
        ratio = max(loads) / (sum(loads) / grid)
        assert (ratio > worst) if not snake else (ratio < worst), ratio


def _pingpong_program(c: int, consumers: int, turns: int) -> list[tuple[str, int]]:
    """flash_fwd_sm90.cu's named-barrier operations of consumer warpgroup c, in order
    (turn_open, per issued GEMM batch turn_begin / turn_end, turn_close)."""
    ops = [("arrive", 1)] if c == consumers - 1 else []
    for _ in range(turns):
        ops += [("sync", 1 + c), ("arrive", 1 + (c + 1) % consumers)]
    if c == 0:
        ops.append(("sync", 1))
    return ops


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("turns", [0, 1, 5])
def test_pingpong_protocol_completes_and_leaves_no_arrival(consumers, turns):
    """Model check of the hand-off: bar.sync / bar.arrive of 128 threads each on barriers of 256
    (two warpgroups per phase). Every interleaving the scheduler could pick is explored; none may
    deadlock, complete a phase without a waiting warpgroup, or leave an arrival behind."""
    programs = [_pingpong_program(c, consumers, turns) for c in range(consumers)]

    def explore(pcs, pending, waiting, seen):
        key = (pcs, pending, waiting)
        if key in seen:
            return
        seen.add(key)
        if all(pc == len(p) for pc, p in zip(pcs, programs, strict=True)):
            assert not any(pending) and not any(waiting), "an arrival left unmatched at exit"
            return
        moved = False
        for c, (pc, prog) in enumerate(zip(pcs, programs, strict=True)):
            if pc == len(prog) or waiting[c]:
                continue
            op, bar = prog[pc]
            pend, wait = list(pending), list(waiting)
            pend[bar] += 1
            if op == "sync":
                wait[c] = bar
            if pend[bar] == 2:  # the phase completes: 256 threads
                assert any(w == bar for w in wait), f"barrier {bar}: two arrivals, no waiter"
                pend[bar] = 0
                wait = [0 if w == bar else w for w in wait]
            nxt = list(pcs)
            nxt[c] += 1
            moved = True
            explore(tuple(nxt), tuple(pend), tuple(wait), seen)
        assert moved, f"deadlock at {pcs} (pending {pending}, waiting {waiting})"

    explore(tuple([0] * consumers), tuple([0] * (consumers + 2)), tuple([0] * consumers), set())


def test_plan_key_holds_what_can_implement_reads(monkeypatch):
    """A plan hit skips can_implement: the key must change with every tensor's layout,
    alignment, dtype and device, the switches, the mask and the scale — and stay the same for a
    call that differs only in where equally aligned data lives."""
    import dataclasses

    base = _call()
    key = assert_plan_key_follows_operands(fwd_sm90._plan_key, base, ("q", "k", "v", "out"))
    assert fwd_sm90._plan_key(_call()) == key  # fresh tensors, same layout
    for change in ({"window_left": 5}, {"window_right": None}, {"softmax_scale": 0.5}):
        assert fwd_sm90._plan_key(dataclasses.replace(base, **change)) != key, change
    for env in (ENABLE_ENV, fwd_sm90.PERSISTENT_ENV, fwd_sm90.TILES_ENV, fwd_sm90.PINGPONG_ENV,
                fwd_sm90.SNAKE_ENV):
        monkeypatch.setenv(env, "x")
        assert fwd_sm90._plan_key(base) != key, env
        monkeypatch.delenv(env)


def test_masked_v_switch(monkeypatch):
    """Windowed calls get the masked-V variant by default on the tiles it is built for (name,
    define, a clean V tile per consumer in shared memory that still fits the H200's 227 KB);
    FLASHCUDA_SM90_FWD_MASKED_V=0 gives the kernel without it (A/B); calls without a window keep
    the plain kernel; bad values are refused."""
    for env in (fwd_sm90.TILES_ENV, fwd_sm90.PINGPONG_ENV, fwd_sm90.SNAKE_ENV,
                fwd_sm90.MASKED_V_ENV):
        monkeypatch.delenv(env, raising=False)
    pick = fwd_sm90.select_config
    names = {c.name for c in fwd_sm90.configs()}
    for d, sq in ((128, 2048), (64, 2048), (64, 8192)):
        mv = pick(torch.bfloat16, d, True, sq)
        assert mv.masked_v and "_mv_" in mv.name and mv.name in names
        assert dict(mv.spec().defines)["FC_MASKED_V"] == "1"
        plain = pick(torch.bfloat16, d, False, sq)
        assert not plain.masked_v  # no window: every key below seqlen_k is seen by every row
        bare = dataclasses.replace(mv, o_tma=False)  # (O's staging tiles: their own bytes)
        # + the clean V tiles and the V scanner's 4 barrier slots per stage
        assert bare.smem_bytes == (dataclasses.replace(bare, masked_v=False).smem_bytes
                                   + mv.consumers * mv.kv_bytes + 4 * 8 * mv.stages)
        assert mv.smem_bytes <= 227 * 1024
    monkeypatch.setenv(fwd_sm90.MASKED_V_ENV, "0")
    off = pick(torch.bfloat16, 128, True, 2048)
    assert not off.masked_v and "FC_MASKED_V" not in dict(off.spec().defines)
    monkeypatch.setenv(fwd_sm90.MASKED_V_ENV, "1")
    monkeypatch.setenv(fwd_sm90.TILES_ENV, "bm128_bn176")  # forced wide tiles: not built for them
    assert not pick(torch.bfloat16, 128, True, 2048).masked_v
    monkeypatch.delenv(fwd_sm90.TILES_ENV)
    monkeypatch.setenv(fwd_sm90.MASKED_V_ENV, "yes")
    with pytest.raises(ValueError, match=fwd_sm90.MASKED_V_ENV):
        pick(torch.bfloat16, 128, True, 2048)


def test_two_passes_of_windowed_calls(monkeypatch):
    """A windowed call's masked-V kernel gets a first pass by default (two_passes): the same
    tiles, ping-pong and order (so the same grid and schedule arguments), without masked V,
    reporting (FC_NAN_FLAGS), with the second Q buffer at d128 that the masked-V kernel's clean
    V tiles deny it, and the windowed kernels' mask bits where the masked-V kernel has them; the second pass is the masked-V kernel reading the report (FC_NAN_FIXUP).
    Both are listed in configs(); FLASHCUDA_SM90_FWD_NAN_FIXUP=0 keeps the masked-V kernel alone;
    calls without a window have one kernel."""
    for env in (fwd_sm90.TILES_ENV, fwd_sm90.PINGPONG_ENV, fwd_sm90.SNAKE_ENV,
                fwd_sm90.MASKED_V_ENV, fwd_sm90.NAN_FIXUP_ENV, fwd_sm90.Q_STAGES_ENV):
        monkeypatch.delenv(env, raising=False)
    names = {c.name for c in fwd_sm90.configs()}
    for d, sq in ((128, 512), (128, 8192), (64, 1024), (64, 8192)):
        cfg = fwd_sm90.select_config(torch.bfloat16, d, True, sq)
        first, second = fwd_sm90.two_passes(cfg)
        assert first.name in names and second.name in names
        assert first.nan_flags and not first.masked_v and "_nf" in first.name
        assert second.nan_fixup and second.masked_v and "_fx" in second.name
        for c in (first, second):
            assert ((c.block_m, c.block_n, c.pingpong, c.snake)
                    == (cfg.block_m, cfg.block_n, cfg.pingpong, cfg.snake))
            assert c.smem_bytes <= fwd_sm90.SMEM_OPTIN
        assert first.q_stages == 2 and first.o_tma
        assert dict(first.spec().defines)["FC_NAN_FLAGS"] == "1"
        assert dict(second.spec().defines)["FC_NAN_FIXUP"] == "1"
        assert dict(first.spec().defines)["FC_MASK_BITS"] == dict(cfg.spec().defines)["FC_MASK_BITS"]
        for b, h in ((1, 16), (4, 32)):
            qq = torch.empty(b, sq, h, d, dtype=torch.bfloat16)
            lse = torch.empty(b, h, sq)
            call = FwdCall(qq, qq, qq, qq, lse, d ** -0.5, None, 0)
            grid = first.grid(call, 132)
            assert second.grid(call, 132) == grid
            by_block = fwd_sm90.schedule_arg(call, cfg, 60 << 20, grid[0])
            assert fwd_sm90.schedule_arg(call, first, 60 << 20, grid[0]) == by_block
            assert (fwd_sm90.constants(call, first, by_block, grid[0])
                    == fwd_sm90.constants(call, second, by_block, grid[0]))
    assert fwd_sm90.two_passes(fwd_sm90.select_config(torch.bfloat16, 128, False, 512)) is None
    monkeypatch.setenv(fwd_sm90.NAN_FIXUP_ENV, "0")
    assert fwd_sm90.two_passes(fwd_sm90.select_config(torch.bfloat16, 128, True, 512)) is None
    with pytest.raises(ValueError, match="nan_flags"):
        Sm90FwdConfig(torch.bfloat16, 128, masked_v=True, nan_flags=True)
    with pytest.raises(ValueError, match="nan_fixup"):
        Sm90FwdConfig(torch.bfloat16, 128, nan_fixup=True)


@pytest.mark.parametrize("which", ["first", "second"])
def test_two_passes_parameters_and_sass(builds, tmp_path, which):
    """The two passes' kernels: nan_flags is the parameter after lse (a pointer: 8 bytes, before
    the layout's constants), as kernel_args and the plan pack it; the first pass stores one byte
    per consumer warp (one STG.E.U8) and lets its programmatic dependent launch (PREEXIT); the
    second waits for the first (ACQBULK), then reads its CTA's bytes (LDG.E.U8) before any
    mbarrier is set up."""
    cfg = next(c for c in fwd_sm90.configs()
               if (c.nan_flags if which == "first" else c.nan_fixup)
               and c.dtype == torch.bfloat16 and c.head_dim == 128 and c.pingpong)
    table = param_table(builds[cfg.name].cubin, tmp_path)
    m = TensorMap(b"\0" * 128)
    maps = (m,) * (3 + cfg.o_tma)
    args = (*maps, None, None, None, np.int64(0), np.int64(0), np.int64(0), np.int32(0),
            np.int32(0), np.int32(0), np.int32(0), np.float32(0), np.int32(0), np.int32(0),
            np.int32(0), np.int32(0))
    args += (np.uint64(0),) * 8 + (np.int32(0),) * 2
    _, offsets = pack_args("k", args)
    assert len(table) == len(args)
    base = table[0][0]
    assert [table[i][0] - base for i in range(len(args))] == list(offsets)
    sass = dump(builds[cfg.name].cubin, tmp_path, "-sass")
    lines = sass.splitlines()
    if which == "first":
        assert len(re.findall(r"STG\.E\.U8", sass)) == 1
        assert sum("PREEXIT" in line for line in lines) == 1, "griddepcontrol.launch_dependents"
    else:
        loads = [i for i, line in enumerate(lines) if re.search(r"LDG\.E\.U8", line)]
        syncs = [i for i, line in enumerate(lines) if "SYNCS" in line]
        waits = [i for i, line in enumerate(lines) if "ACQBULK" in line]  # griddepcontrol.wait
        assert loads and syncs and max(loads) < min(syncs), "the report is read first"
        assert len(waits) == 1 and waits[0] < min(loads), "after the first pass is complete"


# ---- both passes in one kernel (fwd_sm90.Sm90FwdFused, flash_fwd_sm90_fused.cu) -----------------

@pytest.fixture(scope="module")
def fused_builds():
    return build_all(fwd_sm90.fused_configs())


# Spill budgets of the fused kernels, by (head dim, keys per tile): d256's are its second pass's
# (the masked-V kernel spills alone, D256_MASKED_V_SPILL_BUDGET); at d192 x 112 the fused kernel
# spills 4 bytes where neither pass spills alone (NVRTC 13.0). Every other fused kernel: none.
FUSED_SPILL_BUDGET = {(256, 64): 64, (256, 80): 160, (192, 112): 8}


@pytest.mark.parametrize("fused", fwd_sm90.fused_configs(), ids=lambda c: c.name)
def test_fused_compiles(fused_builds, fused):
    assert fused.smem_bytes <= fwd_sm90.SMEM_OPTIN
    first = fused.first
    budget = FUSED_SPILL_BUDGET.get((first.head_dim, first.block_n))
    result = fused_builds[fused.name]
    if budget is None:
        assert_compiled_clean(result, fused.name)
        return
    res = result.resources()[fused.name]
    assert res.spill_stores <= budget and res.stack_bytes <= budget, res
    assert "warning" not in result.log.lower(), result.log
    assert not result.performance_notes(), result.log


@pytest.mark.parametrize("fused", fwd_sm90.fused_configs()[:4], ids=lambda c: c.name)
def test_fused_sass_holds_both_passes(fused_builds, builds, fused, tmp_path):
    """The fused kernel's HGMMAs are the first pass's plus the masked-V kernel's (nothing of
    either dropped), its register split moves once more where the passes' differ, one CTA
    barrier, and it never reads a report buffer (no nan_flags argument: 4 tensor maps, out,
    lse and the scalars)."""
    def hgmma(cubin):
        return sum("HGMMA" in line for line in dump(cubin, tmp_path, "-sass").splitlines())

    fused_sass = dump(fused_builds[fused.name].cubin, tmp_path, "-sass")
    assert hgmma(fused_builds[fused.name].cubin) == (
        hgmma(builds[fused.first.name].cubin) + hgmma(builds[fused.second.name].cubin))
    moves = 2 + 2 * (fused.first.producer_regs != fused.second.producer_regs)
    assert fused_sass.count("USETMAXREG") >= moves
    # one CTA barrier, the first pass's setup: the roles vote and hand over on mbarriers (a CTA
    # barrier reached from two places in the code is what synccheck reported in session 35)
    assert len(re.findall(r"BAR\.(?:RED|SYNC)\S* 0x0\b", fused_sass)) == 1
    table = param_table(fused_builds[fused.name].cubin, tmp_path)
    m = TensorMap(b"\0" * 128)
    args = ((m,) * 4 + (None, None) + (np.int64(0),) * 3 + (np.int32(0),) * 4
            + (np.float32(0),) + (np.int32(0),) * 4 + (np.uint64(0),) * 8 + (np.int32(0),) * 2)
    _, offsets = pack_args("k", args)
    assert len(table) == len(args)
    assert [table[i][0] - table[0][0] for i in range(len(args))] == list(offsets)


def test_fused_config(monkeypatch):
    """fused_passes pairs a windowed call's first pass with its masked-V kernel (not the second
    launch's FC_NAN_FIXUP variant); the spec hands the pass-specific macros over prefixed; passes
    that differ elsewhere are refused."""
    cfg = fwd_sm90.select_config(torch.bfloat16, 128, True, 1024)
    fused = fwd_sm90.fused_passes(cfg)
    assert fused.first == fwd_sm90.first_pass(cfg) and fused.second == cfg
    assert fused.smem_bytes == max(fused.first.smem_bytes, cfg.smem_bytes) + 24  # (the vote)
    assert fused.smem_bytes <= fwd_sm90.SMEM_OPTIN
    defines = dict(fused.spec().defines)
    assert defines["FC_P1_NAN_FLAGS"] == "1" and defines["FC_P2_MASKED_V"] == "1"
    assert "FC_NAN_FLAGS" not in defines and not any("MV_SCANNER" in k for k in defines)
    assert (defines["FC_P1_PRODUCER_REGS"], defines["FC_P2_PRODUCER_REGS"]) == ("24", "32")
    assert fused.spec().source == fwd_sm90.FUSED_SOURCE
    assert fwd_sm90.fused_passes(fwd_sm90.select_config(torch.bfloat16, 128, False, 1024)) is None
    with pytest.raises(ValueError, match="differ in block_n"):
        fwd_sm90.Sm90FwdFused(fused.first, dataclasses.replace(cfg, block_n=64))
    with pytest.raises(ValueError, match="nan_fixup"):
        fwd_sm90.Sm90FwdFused(fused.first, fwd_sm90.second_pass(cfg))
    monkeypatch.setenv(fwd_sm90.NAN_FIXUP_ENV, "0")
    assert fwd_sm90.fused_passes(cfg) is None
    names = {spec.name for spec, _ in all_variants()}
    assert {f.name for f in fwd_sm90.fused_configs()} <= names


def test_l2_hints_put_a_cache_policy_on_the_tma_traffic(tmp_path):
    """FC_L2_HINTS (A/B, off): 1 gives every TMA load and the O store an L2 cache policy (SASS:
    a desc[UR] operand, from createpolicy), 2 the K / V loads only (Q's load and O's store plain);
    the default has none. The d128 masked-V kernel builds clean with either."""
    cfg = fwd_sm90.select_config(torch.bfloat16, 128, True, 1024)

    def tma(c):
        result = compile_spec(c.spec(), ARCH)
        assert_compiled_clean(result, c.name)
        sass = dump(result.cubin, tmp_path, "-sass")
        return [line for line in sass.splitlines() if "UTMALDG" in line or "UTMASTG" in line]

    plain = tma(cfg)
    assert plain and not any("desc[" in line for line in plain)
    every = tma(dataclasses.replace(cfg, defines=(("FC_L2_HINTS", 1),)))
    assert every and all("desc[" in line for line in every)
    kv = tma(dataclasses.replace(cfg, defines=(("FC_L2_HINTS", 2),)))
    loads = [line for line in kv if "UTMALDG" in line]
    assert any("desc[" in line for line in loads) and not all("desc[" in line for line in loads)
    assert not any("desc[" in line for line in kv if "UTMASTG" in line)

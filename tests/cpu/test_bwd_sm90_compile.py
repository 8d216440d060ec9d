"""The sm90a backward family on the CPU lane: every variant compiles for sm_90a with no spills and
no ptxas warnings or performance-loss lines; when cuobjdump (+ nvdisasm) is at hand, the SASS has
the expected HGMMA mix (SS for S^T / dP^T, RS with a transposed B for dV / dK, SS with transposed
operands for dQ), TMA and bulk loads, the dQ writer's tensor-map or bulk reductions, and the
kernel's parameter offsets equal what runtime.pack_args produces. Plus the config and the
can_implement gate.

cuobjdump / nvdisasm: as tests/cpu/sm90_compile.py finds them; without them the SASS checks skip,
saying so.
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
from flashcuda.ops import bwd_sm90, dispatch, wave_split
from flashcuda.ops.bwd_sm90 import (
    DQ_ENV,
    ENABLE_ENV,
    GATED,
    WATCHDOG_ENV,
    Sm90BwdConfig,
)
from flashcuda.ops.call import BwdCall

from .sm90_compile import (
    ARCH,
    assert_compiled_clean,
    assert_plan_key_follows_operands,
    build_all,
    clean_sass,
    dump,
    param_table,
)


@pytest.fixture(scope="module")
def builds():
    return build_all(bwd_sm90.configs())


@pytest.mark.parametrize("cfg", bwd_sm90.configs(), ids=lambda c: c.name)
def test_sm90_bwd_compiles_without_spills(builds, cfg):
    result = builds[cfg.name]
    assert_compiled_clean(result, cfg.name)
    assert not re.search(r"C75\d\d", result.log), result.log


@pytest.mark.parametrize("cfg", bwd_sm90.configs(), ids=lambda c: c.name)
def test_sm90_bwd_sass_uses_wgmma(builds, cfg, tmp_path):
    sass = dump(builds[cfg.name].cubin, tmp_path, "-sass")
    hgmma = [line for line in sass.splitlines() if "HGMMA" in line]
    d, bm, bn = cfg.head_dim, cfg.block_m, cfg.block_n
    # One loop body: S^T and dP^T (d / 16 each), dV and dK (bm / 16 each), dQ (bn / 16).
    assert len(hgmma) == 2 * (d // 16) + 2 * (bm // 16) + bn // 16, len(hgmma)
    bf16 = cfg.dtype == torch.bfloat16
    assert all(".F32" in line and ("BF16" in line) == bf16 for line in hgmma)
    rs = [line for line in hgmma if re.search(r"HGMMA\S+ R\d+, R\d+, gdesc", line)]
    assert len(rs) == 2 * (bm // 16), "dV, dK: A from registers"
    assert all(f"64x{d}x16" in line and ".tnspB" in line and ".tnspA" not in line for line in rs)
    ss = [line for line in hgmma if line not in rs]
    scores = [line for line in ss if f"64x{bm}x16" in line and ".tnsp" not in line]
    if bm != 64:  # at d128 S^T and dQ are both m64n64: tell them apart by the transposes alone
        assert len(scores) == 2 * (d // 16)
    if cfg.dq_swap:  # dQ^T = K^T dS^T: m64n{bm}, A (K) transposed, B (dS [query][key]) K-major
        dq = [line for line in ss if ".tnspA" in line]
        assert len(dq) == bn // 16
        assert all(f"64x{bm}x16" in line and ".tnspB" not in line for line in dq)
        # dS by stmatrix.trans, one per k16 step
        assert len(re.findall(r"STSM\.16\.MT88\.4", sass)) == bm // 16
    else:
        dq = [line for line in ss if ".tnspB" in line]
        assert len(dq) == bn // 16 and all("64x64x16" in line for line in dq)
        assert all((".tnspA" in line) != cfg.ds_k_major for line in dq)
    assert "UTMALDG" in sass and "UBLKCP" in sass
    assert "USETMAXREG" in sass
    if cfg.wave_split == 2:  # (the pieces' dK / dV sums: test_wave_split_main_keeps_the_...)
        sass = "\n".join(line for line in sass.splitlines() if "REDG.E.ADD.F32x4" not in line)
    if cfg.dq_tma:  # the writer's tensor-map reductions, one per 32-column box
        assert len(re.findall(r"UTMAREDG\.2D\.ADD", sass)) == d // 32
        assert "REDG.E.ADD" not in sass and "UBLKRED" not in sass
    else:  # dq_frag: the writer's bulk reductions (one per consumer); the consumers issue none
        assert re.search(r"UBLKRED\.G\.S\.ADD\.F32", sass) and "UTMAREDG" not in sass
        assert "REDG.E.ADD" not in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory"
    # the clock is read by the watchdog's waits and the timeline variant only
    assert ("GLOBALTIMER" in sass) == (cfg.watchdog or cfg.timeline)


@pytest.mark.parametrize("dq", ["default", "tma"])
def test_sm90_bwd_parameter_offsets_match_pack_args(builds, tmp_path, dq):
    """The cubin's own parameter table (EIATTR_KPARAM_INFO) against pack_args' layout (the tma
    dQ variant has a fifth tensor map, map_dq)."""
    cfg = next(c for c in bwd_sm90.configs() if c.dq_tma == (dq == "tma"))
    table = param_table(builds[cfg.name].cubin, tmp_path)
    m = TensorMap(b"\0" * 128)
    i32, i64 = np.int32(0), np.int64(0)
    maps = (m,) * (4 + cfg.dq_tma)
    args = (*maps, None, None, None, None, None, i64, i64, i64, i64, i64, i64, i32, i32,
            i32, i32, i32, np.float32(0), np.float32(0), i32, i32)
    _, offsets = pack_args("k", args)
    assert len(table) == len(args)
    base = table[0][0]
    assert [table[i][0] - base for i in range(len(args))] == list(offsets)
    assert [table[i][1] for i in range(len(maps))] == [128] * len(maps)


def test_variants_registered():
    specs = {spec.name: archs for spec, archs in all_variants()}
    for cfg in bwd_sm90.configs():
        assert specs[cfg.name] == (ARCH,)


def test_dispatch_order_and_plan_key(monkeypatch):
    assert dispatch.BWD_FAMILIES == ("bwd_sm90", "bwd_sm90_wide", "bwd_sm80", "bwd_simt")
    call = _call()
    monkeypatch.setenv(ENABLE_ENV, "1")
    on = dispatch._plan_key(call, "bwd")
    monkeypatch.setenv(ENABLE_ENV, "0")
    assert dispatch._plan_key(call, "bwd") != on
    monkeypatch.setenv(DQ_ENV, "frag")
    assert dispatch._plan_key(call, "bwd") != on
    monkeypatch.setenv(WATCHDOG_ENV, "1")
    assert dispatch._plan_key(call, "bwd") != on


# ---- config --------------------------------------------------------------------------------------

def test_config_is_the_single_source_of_truth():
    cfg = Sm90BwdConfig(torch.bfloat16, 128)  # d128's default dQ staging (frag), no P^T split
    # (d128 without the release fence: bwd_sm90.FENCE_DIMS, session 19)
    assert cfg.name == "flash_bwd_sm90_bf16_d128_bm64_bn128_s2_nofence_dqwg_early_stm"
    assert (cfg.block_m, cfg.block_n, cfg.threads, cfg.consumers) == (64, 128, 384, 2)
    kv, q, ds, stats = 128 * 128 * 2, 64 * 128 * 2, 128 * 64 * 2, 2 * 64 * 4
    staging = 64 * 128 * 4  # the step's fp32 dQ tile
    # kv_full, full / empty x 2 stages, dq_full / dq_empty per consumer (frag)
    assert cfg.smem_bytes == 1024 + 2 * kv + 2 * (2 * q + stats) + 2 * ds + staging + 8 * 9
    assert dict(cfg.spec().defines) == {
        "FC_DTYPE": "2", "FC_HEAD_DIM": "128", "FC_BLOCK_M": "64", "FC_BLOCK_N": "128",
        "FC_STAGES": "2", "FC_PRODUCER_REGS": "24", "FC_CONSUMER_REGS": "240",
        "FC_SMEM_BYTES": str(cfg.smem_bytes), "FC_DS_K_MAJOR": "0", "FC_WATCHDOG": "0",
        "FC_RELEASE_FENCE": "0", "FC_DQ_FRAG": "1", "FC_DS_STMATRIX": "1"}
    d64 = Sm90BwdConfig(torch.float16, 64)  # d64's default staging (tma, its stores spread)
    # (d64 without the release fence too since session 21)
    assert d64.block_m == 128
    assert d64.name == "flash_bwd_sm90_fp16_d64_bm128_bn128_s2_nofence_dqwts_early_stm"
    assert Sm90BwdConfig(torch.float16, 64, watchdog=True).name.endswith("_wd_nofence_dqwts_early_stm")
    for c in bwd_sm90.configs():
        # the H100 / H200 opt-in limit per block (cudaDevAttrMaxSharedMemoryPerBlockOptin, 227 KB;
        # smem_bytes holds the 1 KB alignment slack already): the swap kernels' 231752 bytes ran
        # on the H200 (runs/lane-20261202-f32f147)
        assert c.smem_bytes <= 232448, c.name
        assert c.producer_regs * 128 + c.consumer_regs * 128 * c.consumers <= c.register_pool
        assert c.dq_tma != c.dq_frag and c.ds_k_major == c.dq_swap
    # per dtype and d: the default staging with and without the watchdog and with the release
    # fence flipped, and the other staging (4 x 4); + the 80-query dQ^T kernels (dtype x
    # watchdog); + the defaults with FC_PROBS_EARLY (per dtype: d64, d128 and its 80-query form);
    # + the timeline variants of the bf16 defaults (two); + the causal calls' longest-first tail
    # at d128 (per dtype, and its bf16 timeline variant); + the pieces' two timeline variants; +
    # the last-wave split's MAIN, pieces and causal-tail grid (FC_WAVE_SPLIT 1 / 2 / 3) of the
    # three bf16 kernels with FC_PROBS_EARLY in blockIdx order (d64, d128, its 80-query form)
    assert len({c.name for c in bwd_sm90.configs()}) == 16 + 4 + 6 + 2 + 3 + 2 + 9 == 42
    tma = Sm90BwdConfig(torch.bfloat16, 128, dq_tma=True)
    assert tma.name.endswith("_dqwt_early_stm") and dict(tma.spec().defines)["FC_DQ_TMA"] == "1"
    assert "FC_DQ_FRAG" not in dict(tma.spec().defines)
    assert tma.smem_bytes == cfg.smem_bytes - 2 * 8  # one dq_full / dq_empty pair
    # the tensor-map writer fits in 24 registers at d128 (not at d64: ptxas spills there)
    assert (tma.producer_regs, tma.consumer_regs) == (24, 240)
    assert (d64.producer_regs, d64.consumer_regs, d64.register_pool) == (32, 232, 168 * 384)
    frag64 = Sm90BwdConfig(torch.bfloat16, 64, dq_frag=True)
    assert frag64.name.endswith("_dqwg_early_stm") and (frag64.producer_regs, frag64.consumer_regs) == (32, 232)
    with pytest.raises(ValueError, match="dq_tma / dq_frag"):
        Sm90BwdConfig(torch.bfloat16, 64, dq_tma=True, dq_frag=True)
    with pytest.raises(ValueError, match="ds_stmatrix"):
        Sm90BwdConfig(torch.bfloat16, 128, block_m=80, dq_swap=True, dq_frag=True,
                      ds_stmatrix=True)


def test_dq_switch(monkeypatch):
    for env in (DQ_ENV, WATCHDOG_ENV, bwd_sm90.FENCE_ENV):
        monkeypatch.delenv(env, raising=False)
    # the measured defaults, in FA3's GEMM order: d64 the tensor-map split with its staging
    # stores spread (FC_DQ_SPREAD), d128 the per-consumer register-order staging (frag); both
    # store dS^T by stmatrix (FC_DS_STMATRIX; d128 since session 21)
    d64 = bwd_sm90.select_config(torch.bfloat16, 64)
    assert d64.dq_tma and d64.dq_spread and d64.ds_stmatrix
    assert dict(d64.spec().defines)["FC_DQ_SPREAD"] == "1"
    assert dict(d64.spec().defines)["FC_DS_STMATRIX"] == "1"
    # + P^T's first 4 column blocks before the dP^T wait (FC_PROBS_EARLY, session 23; d128 since
    # session 24); + at d64 the descriptors' 64-bit add (FC_DESC_ADVANCE=2, session 24; in the
    # spec, not the name: every d64 kernel has it)
    assert d64.name.endswith("_dqwts_early_stm_pe4_em2") and d64.probs_early == 4
    assert dict(d64.spec().defines)["FC_PROBS_EARLY"] == "4"
    assert dict(d64.spec().defines)["FC_DESC_ADVANCE"] == "2" and d64.desc_add64
    d128 = bwd_sm90.select_config(torch.bfloat16, 128)
    assert d128.dq_frag and not d128.dq_tma
    assert d128.ds_stmatrix and dict(d128.spec().defines)["FC_DS_STMATRIX"] == "1"
    assert d128.name.endswith("_dqwg_early_stm_pe4") and not d128.desc_add64
    assert "FC_DESC_ADVANCE" not in dict(d128.spec().defines)
    flipped = dataclasses.replace(d128, desc_add64=True)
    assert flipped.name.endswith("_stm_da2_pe4") and dict(flipped.spec().defines)["FC_DESC_ADVANCE"] == "2"
    assert dataclasses.replace(d64, desc_add64=False).name.endswith("_stm_da1_pe4_em2")
    assert d64 in bwd_sm90.configs() and d128 in bwd_sm90.configs()
    monkeypatch.setenv(DQ_ENV, "tma")
    for d in (64, 128):
        tma = bwd_sm90.select_config(torch.bfloat16, d)
        assert tma.dq_tma and not tma.dq_frag
        # (=tma is d64's default: its kernel, FC_PROBS_EARLY included; at d128 an A/B)
        assert tma.name.endswith("_dqwts_early_stm_pe4_em2" if d == 64 else "_dqwt_early_stm")
        assert tma in bwd_sm90.configs()
    monkeypatch.setenv(DQ_ENV, "frag")
    for d in (64, 128):
        frag = bwd_sm90.select_config(torch.bfloat16, d)
        assert frag.dq_frag and not frag.dq_tma and frag in bwd_sm90.configs()
        assert frag.name.endswith("_dqwg_early_stm" if d == 64 else "_dqwg_early_stm_pe4")
    with pytest.raises(ValueError, match="dq_spread"):
        Sm90BwdConfig(torch.bfloat16, 64, dq_frag=True, dq_spread=True)
    for gone in ("v2", "v4", "bulk", "warp", "warpflat", "tensor"):  # (removed in session 39)
        monkeypatch.setenv(DQ_ENV, gone)
        with pytest.raises(ValueError, match=DQ_ENV):
            bwd_sm90.select_config(torch.bfloat16, 64)


def test_seqlen_pad_covers_query_blocks_and_pre_blocks():
    for d in (64, 128):
        cfg = Sm90BwdConfig(torch.bfloat16, d)
        for sq in (1, 63, 64, 65, 127, 128, 129, 1023):
            pad = cfg.seqlen_pad(sq)
            assert pad >= sq and pad % cfg.block_m == 0 and pad % cfg.aux().aux_rows == 0
            assert pad < sq + max(cfg.block_m, cfg.aux().aux_rows)


@pytest.mark.parametrize("kwargs", [
    dict(dtype=torch.float32, head_dim=128),
    dict(dtype=torch.float16, head_dim=96),
    dict(dtype=torch.float16, head_dim=128, block_m=128),
    dict(dtype=torch.float16, head_dim=64, block_m=64),
    dict(dtype=torch.float16, head_dim=128, block_n=64),
    dict(dtype=torch.float16, head_dim=128, stages=0),
    dict(dtype=torch.float16, head_dim=128, consumer_regs=256),
    # 128 * 32 + 256 * 240 = 65536 is the register file but not the 64512 a 384-thread CTA holds
    # from launch: the consumers' setmaxnreg.inc would wait forever (the dq-warp hang of session 6)
    dict(dtype=torch.float16, head_dim=128, producer_regs=32, consumer_regs=240),
])
def test_config_rejects_bad_shapes(kwargs):
    with pytest.raises(ValueError):
        Sm90BwdConfig(**kwargs)


def test_watchdog_switch(monkeypatch):
    monkeypatch.delenv(WATCHDOG_ENV, raising=False)
    monkeypatch.delenv(DQ_ENV, raising=False)
    assert not bwd_sm90.select_config(torch.float16, 128).watchdog
    monkeypatch.setenv(WATCHDOG_ENV, "1")
    cfg = bwd_sm90.select_config(torch.float16, 128)
    assert cfg.watchdog and "_wd" in cfg.name and dict(cfg.spec().defines)["FC_WATCHDOG"] == "1"
    assert cfg in bwd_sm90.configs()  # the bring-up variant of the default kernel is precompiled


# ---- can_implement: the gate, then every check before the device ones ---------------------------

def _call(dtype=torch.bfloat16, B=2, Sq=33, Sk=47, H=4, Hkv=2, D=128, q=None,
          deterministic=False):
    q = torch.randn(B, Sq, H, D, dtype=dtype) if q is None else q
    D = q.shape[-1]
    k = torch.randn(B, Sk, Hkv, D, dtype=dtype)
    v = torch.randn(B, Sk, Hkv, D, dtype=dtype)
    out = torch.randn(q.shape, dtype=dtype)
    dout = torch.randn(q.shape, dtype=dtype)
    lse = torch.zeros(B, H, Sq, dtype=torch.float32)
    return BwdCall(q, k, v, out, dout, lse, torch.empty(q.shape, dtype=dtype),
                   torch.empty_like(k), torch.empty_like(v), 0.125, None, 0, deterministic)


def test_sm90_bwd_is_on_by_default_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    assert bwd_sm90.enabled()
    assert bwd_sm90.can_implement(_call()) != GATED  # CPU tensors: refused for another reason
    monkeypatch.setenv(ENABLE_ENV, "0")
    assert bwd_sm90.can_implement(_call()) == GATED
    assert dict(dispatch.explain(_call()))["bwd_sm90"] == GATED
    with pytest.raises(NotImplementedError, match="turned off"):
        bwd_sm90.run(_call())


def test_sm90_bwd_can_implement_reasons(monkeypatch):
    monkeypatch.setenv(ENABLE_ENV, "1")
    ci = bwd_sm90.can_implement
    assert "dtype" in ci(_call(dtype=torch.float32))
    assert "head_dim" in ci(_call(D=96))
    assert "head_dim" in ci(_call(D=256))
    assert "nheads_kv" in ci(_call(H=3, Hkv=2))
    assert "deterministic" in ci(_call(deterministic=True))
    assert "empty" in ci(_call(Sk=0))
    assert "empty" in ci(_call(Sq=0))
    big = torch.randn(2, 33, 4, 136, dtype=torch.bfloat16)
    assert "16-byte" in ci(_call(q=big[..., 1:129]))
    odd = torch.randn(2, 33, 4, 132, dtype=torch.bfloat16)[..., :128]
    assert "multiple of 8" in ci(_call(q=odd))
    assert "lse" in ci(dataclasses.replace(_call(), lse=torch.zeros(2, 4, 34)))
    bad_dk = torch.empty(2, 47, 2, 128, dtype=torch.float16)
    assert "dk" in ci(dataclasses.replace(_call(), dk=bad_dk))
    # Well-formed calls fail only on the device check here.
    assert "CUDA" in ci(_call())
    assert "CUDA" in ci(_call(dtype=torch.float16, D=64, Sq=1, Sk=1, H=2, Hkv=1))


def test_plan_key_holds_what_can_implement_reads(monkeypatch):
    """A plan hit skips can_implement: the key must change with every operand's layout,
    alignment, dtype and device, the switches, the mask and the mode — and stay the same for a
    call that differs only in where equally aligned data lives."""
    import dataclasses

    base = _call()
    key = assert_plan_key_follows_operands(
        bwd_sm90._plan_key, base, ("q", "k", "v", "out", "dout", "dq", "dk", "dv"))
    assert bwd_sm90._plan_key(_call()) == key  # fresh tensors, same layout
    for change in ({"window_left": 5}, {"window_right": None}, {"softmax_scale": 0.5},
                   {"deterministic": True}):
        assert bwd_sm90._plan_key(dataclasses.replace(base, **change)) != key, change
    for env in (ENABLE_ENV, WATCHDOG_ENV, DQ_ENV, bwd_sm90.FENCE_ENV, bwd_sm90.DEFINES_ENV,
                bwd_sm90.SWAP_ENV, bwd_sm90.WAVE_SPLIT_ENV, bwd_sm90.LPT_LAUNCH_ENV):
        monkeypatch.setenv(env, "x")
        assert bwd_sm90._plan_key(base) != key, env
        monkeypatch.delenv(env)
    # the device of every operand (CPU tensors give -1, a CUDA tensor its index)
    assert all(-1 in part for part in key if isinstance(part, tuple) and torch.bfloat16 in part)


def test_bwd_defines_switch(monkeypatch):
    """FLASHCUDA_SM90_BWD_DEFINES adds kernel defines (an A/B knob such as FC_DESC_ADVANCE=1) to
    the selected config, named by a suffix, as part of the plan key; a malformed value is
    refused naming the variable."""
    for env in (DQ_ENV, WATCHDOG_ENV, bwd_sm90.FENCE_ENV, bwd_sm90.DEFINES_ENV):
        monkeypatch.delenv(env, raising=False)
    call = _call()
    off = dispatch._plan_key(call, "bwd")
    base = bwd_sm90.select_config(torch.bfloat16, 128)
    monkeypatch.setenv(bwd_sm90.DEFINES_ENV, "FC_DESC_ADVANCE=1")
    cfg = bwd_sm90.select_config(torch.bfloat16, 128)
    assert cfg.defines == (("FC_DESC_ADVANCE", 1),) and cfg.name == base.name + "_fc_desc_advance1"
    assert dict(cfg.spec().defines)["FC_DESC_ADVANCE"] == "1"
    assert dispatch._plan_key(call, "bwd") != off
    monkeypatch.setenv(bwd_sm90.DEFINES_ENV, "FC_DV_EARLY=1+FC_CONSUMER_REGS=240")  # "+" too
    cfg = bwd_sm90.select_config(torch.bfloat16, 128)
    assert cfg.defines == (("FC_CONSUMER_REGS", 240), ("FC_DV_EARLY", 1))
    assert dict(cfg.spec().defines)["FC_CONSUMER_REGS"] == "240"  # overrides the config's own
    # a negative value names the kernel with "m" (the name is its C identifier)
    monkeypatch.setenv(bwd_sm90.DEFINES_ENV, "FC_X=-3")
    cfg = bwd_sm90.select_config(torch.bfloat16, 128)
    assert cfg.name == base.name + "_fc_xm3" and cfg.name.isidentifier()
    assert dict(cfg.spec().defines)["FC_X"] == "-3"
    monkeypatch.setenv(bwd_sm90.DEFINES_ENV, "DESC_ADVANCE=1")
    with pytest.raises(ValueError, match=bwd_sm90.DEFINES_ENV):
        bwd_sm90.select_config(torch.bfloat16, 128)
    monkeypatch.delenv(bwd_sm90.DEFINES_ENV)
    assert dispatch._plan_key(call, "bwd") == off


def _dq_tma_store_chunks(spread: bool):
    """The 16-byte chunks (box, row, swizzled chunk) each half-warp of a consumer warp writes at
    each of Consumer::stage_dq's 16 float2 stores with FC_DQ_TMA, per flash_bwd_sm90.cu's
    dq_swizzled: (row, col) -> box col / 32, row, chunk ((col % 32) / 4) ^ (row % 8); with
    FC_DQ_SPREAD lanes of odd g store fragment i ^ 2 at store i. Also returns which fragment each
    lane stored where, to check every fragment is stored exactly once."""
    out, placed = [], {}
    for i in range(8):
        for h in range(2):
            for half in range(2):
                chunks = []
                for lane in range(16 * half, 16 * half + 16):
                    g, t = lane >> 2, lane & 3
                    j = i ^ 2 if spread and g & 1 else i
                    row, col = g + 8 * h, 8 * j + 2 * t  # row0 = col0 = 0, warp 0
                    cc = col % 32
                    chunks.append((col // 32, row, ((cc >> 2) ^ (row & 7))))
                    placed.setdefault(lane, []).append((j, h))
                out.append(chunks)
    return out, placed


@pytest.mark.parametrize("spread", (False, True))
def test_dq_tma_staging_store_banks(spread):
    """A half-warp's 16 float2 stores (128 bytes) are one wavefront when they cover 8 distinct
    16-byte chunks of the 128-byte bank window (rows are 128 bytes, so the chunk index is the
    bank group). The default order covers 4 (2-way conflicts: the 2 extra wavefronts per store
    ncu counted in session 11); FC_DQ_SPREAD covers 8. Either way every lane stores each of its
    16 fragments (j, h) exactly once."""
    stores, placed = _dq_tma_store_chunks(spread)
    for chunks in stores:
        groups = {c[2] for c in chunks}
        assert len(groups) == (8 if spread else 4)
        if spread:  # two lanes (t = 2s, 2s + 1) per chunk, 8 bytes each: the 16 bytes, once
            assert all(sum(1 for c in chunks if c[2] == k) == 2 for k in groups)
    for lane, frags in placed.items():
        assert sorted(frags) == [(j, h) for j in range(8) for h in range(2)], lane


def test_dq_spread_compiles_clean(tmp_path):
    """FC_DQ_SPREAD (the d64 default, an A/B knob at d128 through FLASHCUDA_SM90_BWD_DEFINES) builds
    for both head dims without spills or serialized wgmma, either way."""
    for d in (64, 128):
        for on in (0, 1):
            clean_sass(dataclasses.replace(bwd_sm90.select_config(torch.bfloat16, d),
                                           defines=(("FC_DQ_SPREAD", on),)), tmp_path)


def test_mask_never_keeps_the_default_step_code(tmp_path):
    """FC_MASK_NEVER (diagnostic A/B: the masked path built but never taken) leaves the step
    loop as the default builds it: no spills, the same instruction count up to the
    runtime-false test (an FSETP per use, in place of NOPs at d64), the same HGMMA, MUFU.EX2
    and SEL counts. (FC_FORCE_MASKED=0, which drops the masked path, spills at d64: it times
    another loop.)"""
    for d in (64, 128):
        cfg = bwd_sm90.select_config(torch.bfloat16, d)
        default = _opcodes(clean_sass(cfg, tmp_path))
        never = _opcodes(clean_sass(dataclasses.replace(cfg, defines=(("FC_MASK_NEVER", 1),)),
                                    tmp_path))
        assert never != default  # the runtime-false test is there
        assert abs(len(never) - len(default)) <= 4, (d, len(default), len(never))
        for op in ("HGMMA.64x64x16.F32.BF16", "MUFU.EX2", "SEL", "FSEL"):
            assert sum(o.startswith(op) for o in never) == sum(o.startswith(op) for o in default)


@pytest.mark.parametrize("head_dim", (64, 128))
def test_ds_stmatrix_stores_every_element_where_store_ds_does(head_dim):
    """Consumer::store_ds_stmatrix (FC_DS_STMATRIX) against store_ds, in the [key][query] layout:
    per k16 step kk and fragment f, the two 16-bit elements lane (g, t) holds are (key r0 + 8 (f & 1),
    queries q, q + 1) with q = 16 kk + 8 (f >> 1) + 2t (store_ds writes them with one 4-byte store);
    stmatrix.x4 writes them at the row address lane 8f + g gave (row g of matrix f) plus 4t bytes.
    Both addresses must agree for every lane, step and fragment (the .cu's arithmetic, here)."""
    block_m = bwd_sm90.BLOCK_M[head_dim]
    ds_chunk = 128 * 128  # [key][query]: chunks of 64 queries x kBlockN = 128 keys, 128 B rows

    def sts_addr(r, q):  # store_ds: element (r, q)
        return (q // 64) * ds_chunk + r * 128 + ((((q % 64) // 8) ^ (r % 8)) * 16) + (q % 8) * 2

    def row_addr(row0, lane, kk):  # store_ds_stmatrix: the address lane `lane` gives
        f = lane >> 3
        r = row0 + 8 * (f & 1) + (lane & 7)
        q = 16 * kk + 8 * (f >> 1)
        return (q // 64) * ds_chunk + r * 128 + ((((q % 64) // 8) ^ (r % 8)) * 16)

    for warp_row0 in range(0, 128, 16):  # both consumers' four warps
        for kk in range(block_m // 16):
            for f in range(4):
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    r = warp_row0 + g + 8 * (f & 1)
                    q = 16 * kk + 8 * (f >> 1) + 2 * t
                    stm = row_addr(warp_row0, 8 * f + g, kk) + 4 * t
                    assert stm == sts_addr(r, q), (warp_row0, kk, f, lane)


def test_ds_stmatrix_builds_clean_with_stsm(tmp_path):
    """FC_DS_STMATRIX (d64's default since session 12, an A/B knob at d128) builds clean at both
    head dims, its dS^T stores are STSM (kBlockM / 16 per thread) and no STS is left there."""
    for d in (64, 128):
        cfg = dataclasses.replace(bwd_sm90.select_config(torch.bfloat16, d),
                                  defines=(("FC_DS_STMATRIX", 1),))
        sass = clean_sass(cfg, tmp_path)
        assert sass.count("STSM") == bwd_sm90.BLOCK_M[d] // 16
        assert not re.search(r"\bSTS\s", sass)


def test_convert_spans_cover_each_frag_block_once():
    """FC_DQ_SPANS (CONVERT, flash_bwd_sm80.cu): thread s of 256 reads the 16 floats at 16 s of a
    4096-float FC_DQ_FRAG block and takes float 4 u + e as row rr + 8 (e / 2), column
    8 (s / 32) + 2 u + e % 2 of the 64 x 64 tile, rr = 16 ((s % 32) / 8) + s % 8. That must be
    frag_offset's inverse (the .cu's arithmetic, here), and its shared-memory swizzle must put
    each phase of 8 threads' 16-byte stores in 8 different 16-byte columns."""
    def frag_offset(rr, cc):  # within one 64 x 64 tile's block
        w = 32 * (rr // 16) + 4 * (rr % 8) + (cc % 8) // 2
        i = 4 * (cc // 8) + 2 * ((rr % 16) // 8) + cc % 2
        return 512 * (i // 4) + 4 * w + i % 4
    seen = set()
    for s in range(256):
        rr, chunk = 16 * ((s % 32) // 8) + s % 8, s // 32
        for u in range(4):
            for e in range(4):
                row, col = rr + 8 * (e // 2), 8 * chunk + 2 * u + e % 2
                assert frag_offset(row, col) == 16 * s + 4 * u + e, (s, u, e)
                seen.add((row, col))
        if s % 8 == 0:  # a phase: threads s .. s + 7 write rows rr .. rr + 7, chunk ^ (rr % 8)
            assert len({chunk ^ ((16 * ((t % 32) // 8) + t % 8) % 8) for t in range(s, s + 8)}) == 8
    assert len(seen) == 64 * 64


def test_dq_frag_config(monkeypatch):
    """FLASHCUDA_SM90_BWD_DQ=frag (FC_DQ_FRAG; d128's default since session 12): at d128 the
    24 / 240 split, two dq_full / dq_empty pairs, its CONVERT reading the register-order
    layout; at d64 an A/B with 32 / 232."""
    for env in (DQ_ENV, WATCHDOG_ENV, bwd_sm90.FENCE_ENV, bwd_sm90.DEFINES_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv(DQ_ENV, "tma")
    base = bwd_sm90.select_config(torch.bfloat16, 128)
    assert base.dq_tma  # the previous default
    monkeypatch.setenv(DQ_ENV, "frag")
    cfg = bwd_sm90.select_config(torch.bfloat16, 128)
    monkeypatch.delenv(DQ_ENV)
    assert cfg == bwd_sm90.select_config(torch.bfloat16, 128)  # the default at d128
    monkeypatch.setenv(DQ_ENV, "frag")
    assert cfg.dq_frag and not cfg.dq_tma and not cfg.dq_spread
    assert cfg.name.endswith("_dqwg_early_stm_pe4") and cfg in bwd_sm90.configs()
    assert dict(cfg.spec().defines)["FC_DQ_FRAG"] == "1"
    assert (cfg.producer_regs, cfg.consumer_regs) == (24, 240)
    assert cfg.smem_bytes == base.smem_bytes + 2 * 8  # the same 32 KB staging, 2 more barriers
    conv = cfg.aux().convert_spec(cfg.block_m)  # the span reader (FC_DQ_SPANS) by default
    assert conv.name.endswith("_frag64s") and dict(conv.defines)["FC_DQ_FRAG_M"] == "64"
    assert dict(conv.defines)["FC_DQ_SPANS"] == "1"
    pairs = cfg.aux().convert_spec(cfg.block_m, spans=False)
    assert pairs.name.endswith("_frag64") and "FC_DQ_SPANS" not in dict(pairs.defines)
    assert not {"FC_DQ_FRAG_M", "FC_DQ_SPANS"} & set(dict(cfg.aux().convert_spec().defines))
    names = {spec.name for spec, _ in bwd_sm90.variants()}
    assert conv.name in names and pairs.name in names
    d64 = bwd_sm90.select_config(torch.bfloat16, 64)  # an A/B at d64 (session 23)
    assert d64.dq_frag and d64 in bwd_sm90.configs()
    assert (d64.producer_regs, d64.consumer_regs) == (32, 232)
    conv64 = d64.aux().convert_spec(d64.block_m)
    assert conv64.name.endswith("_frag128s") and conv64.name in names


@pytest.mark.parametrize("block_m,head_dim", [(64, 128), (128, 64)])
def test_dq_frag_layout_round_trip(block_m, head_dim):
    """The register-order dq_accum, both ends (the .cu's arithmetic, here): the MAIN's consumer c
    (query tile c % (block_m / 64), d tile c / (block_m / 64)) stages register i of thread w
    (warp w / 32, lane (g, t)) — element (16 warp + g + 8 ((i % 4) / 2), 8 (i / 4) + 2t + i % 2)
    of its 64 x 64 tile — at float 512 (i / 4) + 4 w + i % 4 of block c of the query block's
    tile (stage_dq_frag + write_dq); CONVERT's frag_offset must find every (row, col) of the
    padded slice exactly there."""
    from .test_bwd_sm90_emulated import frag_offset  # flash_bwd_sm80.cu's, transcribed

    tiles_m = block_m // 64
    per_tile = block_m * head_dim // 4096  # consumers (4096-float blocks) per query block

    seen = {}
    for tile in range(3):  # three query blocks of a (batch, head) slice
        for c in range(per_tile):
            tm, td = c % tiles_m, c // tiles_m
            for w in range(128):
                warp, lane = w // 32, w % 32
                g, t = lane >> 2, lane & 3
                for i in range(32):
                    row = tile * block_m + 64 * tm + 16 * warp + g + 8 * ((i % 4) // 2)
                    col = 64 * td + 8 * (i // 4) + 2 * t + i % 2
                    at = (tile * per_tile + c) * 4096 + 512 * (i // 4) + 4 * w + i % 4
                    assert frag_offset(row, col, block_m, head_dim) == at, (row, col)
                    seen[(row, col)] = at
    assert len(seen) == 3 * block_m * head_dim and len(set(seen.values())) == len(seen)


def test_dkv_quad_transpose_gives_each_lane_one_whole_chunk():
    # on entry lane q holds word q of chunks 0..3; on exit it must hold words 0..3 of chunk q
    from .test_bwd_sm90_emulated import quad_transpose  # the emulation's transcription

    got = quad_transpose([[(chunk, q) for chunk in range(4)] for q in range(4)])
    assert got == [[(q, word) for word in range(4)] for q in range(4)]


def test_dkv_epilogue_builds_clean_with_16_byte_stores(tmp_path):
    """The dK / dV epilogue (quad_transpose): every global store of the default kernels is a
    16-byte one, 2 rows x 2 tensors x kHeadDim / 32 per lane, with no spills at either head
    dim (the 4-byte stores it replaced were 2 x 2 x kHeadDim / 8)."""
    for d in (64, 128):
        sass = clean_sass(bwd_sm90.select_config(torch.bfloat16, d), tmp_path)
        assert len(re.findall(r"STG\.E\.128 ", sass)) == 2 * 2 * d // 32
        assert len(re.findall(r"\bSTG\.E(\.[A-Z0-9.]+)? ", sass)) == 2 * 2 * d // 32


def _no_epilogue_switches(monkeypatch):
    """config_for's switches unset."""
    for env in (DQ_ENV, WATCHDOG_ENV, bwd_sm90.FENCE_ENV, bwd_sm90.DEFINES_ENV,
                bwd_sm90.SWAP_ENV):
        monkeypatch.delenv(env, raising=False)


def _block_coord(bx: int, by: int, bz: int, gx: int, gy: int, gz: int, k: int):
    """block_coord (flash_bwd_sm90.cu, with FC_LPT_TAIL = k) in Python."""
    pairs = gy * gz
    tail = min(k, pairs)
    first = pairs - tail
    pair = by + gy * bz
    if pair < first:
        return bx, by, bz
    j = bx + gx * (pair - first)
    p = first + j % tail
    return j // tail, p % gy, p // gy


@pytest.mark.parametrize("grid,k", [((32, 16, 4), 8), ((8, 3, 5), 4), ((5, 2, 1), 8), ((1, 1, 1), 8)])
def test_lpt_tail_is_a_bijection_running_the_tail_longest_first(grid, k):
    gx, gy, gz = grid
    order = [(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)]  # blockIdx order
    got = [_block_coord(*b, gx, gy, gz, k) for b in order]
    assert sorted(got) == sorted(order)  # every CTA's work exactly once
    tail = min(k, gy * gz) * gx
    assert got[:len(order) - tail] == order[:len(order) - tail]  # outside the tail: unchanged
    # in the tail, key blocks in nondecreasing order (key block 0, the heaviest under a causal
    # mask, of every tail pair first)
    blocks = [x for x, _, _ in got[len(order) - tail:]]
    assert blocks == sorted(blocks)


def test_lpt_tail_builds_clean(tmp_path):
    """FC_LPT_TAIL builds for both head dims without spills or serialized wgmma (d128's causal
    default, LPT_TAIL; d64 through FLASHCUDA_SM90_BWD_DEFINES, A/B)."""
    for d in (64, 128):
        clean_sass(dataclasses.replace(bwd_sm90.select_config(torch.bfloat16, d),
                                       defines=(("FC_LPT_TAIL", 8),)), tmp_path)


def test_lpt_tail_is_dispatched_for_causal_calls_at_its_head_dims():
    """lpt_tail_for: LPT_TAIL[head_dim] for a right edge without a left one (causal, either
    alignment), 0 without a mask, with a sliding window, or at the other head dims; the
    variant it picks is one configs() builds (precompiled, compile-tested)."""
    from types import SimpleNamespace

    def call(d, wl, wr):
        return SimpleNamespace(head_dim=d, window_left=wl, window_right=wr)

    k = bwd_sm90.LPT_TAIL[128]
    assert k > 0 and 64 not in bwd_sm90.LPT_TAIL
    assert bwd_sm90.lpt_tail_for(call(128, None, 0)) == k
    assert bwd_sm90.lpt_tail_for(call(128, None, -512)) == k  # SDPA's top-left causal
    assert bwd_sm90.lpt_tail_for(call(128, None, None)) == 0
    assert bwd_sm90.lpt_tail_for(call(128, 256, 0)) == 0
    assert bwd_sm90.lpt_tail_for(call(64, None, 0)) == 0
    names = {c.name for c in bwd_sm90.configs()}
    for dtype in bwd_sm90.DTYPES:
        cfg = dataclasses.replace(bwd_sm90.select_config(dtype, 128), lpt_tail=k)
        assert cfg.name in names and dict(cfg.spec().defines)["FC_LPT_TAIL"] == str(k)


def _opcodes(sass: str) -> list[str]:
    """The SASS's instructions as opcodes (predicates and operands dropped), in order."""
    ops = []
    for line in sass.splitlines():
        if not re.search(r"/\*[0-9a-f]{4}\*/", line):
            continue
        words = re.sub(r"/\*[0-9a-f]+\*/", "", line).split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if words:
            ops.append(words[0].rstrip(";"))
    return ops


def _gemm_region(sass: str) -> list[str]:
    """The opcodes from the kernel's first wgmma to its last: the consumers' loop."""
    ops = _opcodes(sass)
    at = [i for i, op in enumerate(ops) if op.startswith("HGMMA")]
    return ops[at[0]:at[-1] + 1]


# ---- FC_WAVE_SPLIT (session 38) --------------------------------------------------------------------

def test_wave_split_main_keeps_the_consumers_loop(builds, tmp_path):
    """The split's MAIN (FC_WAVE_SPLIT=1) is the default kernel with an early exit for the CTAs
    the pieces take and the dependents' trigger at its start: its consumers' loop is the
    default's, R2UR for R2UR. The pieces kernel (=2) sums dK / dV with 16-byte fp32 reductions,
    counts steps with one atomic, waits for MAIN (griddepcontrol.wait: ACQBULK) and builds
    clean (both in configs(), the pieces also with the timeline). Both refuse FC_LPT_TAIL's
    reordered grid."""
    names = {c.name for c in bwd_sm90.configs()}
    for d in (64, 128):
        base = bwd_sm90.select_config(torch.bfloat16, d)
        main, pieces = (dataclasses.replace(base, wave_split=w) for w in (1, 2))
        assert main.name == base.name + "_ws1" and pieces.name == base.name + "_ws2"
        assert {main.name, pieces.name} <= names
        main_sass, plain = clean_sass(main, tmp_path), clean_sass(base, tmp_path)
        loop, plain_loop = _gemm_region(main_sass), _gemm_region(plain)
        assert len(plain_loop) <= len(loop) <= len(plain_loop) + 4
        assert loop.count("R2UR") == plain_loop.count("R2UR")
        assert "PREEXIT" in main_sass and "PREEXIT" not in plain
        sass = clean_sass(pieces, tmp_path)
        assert sass.count("REDG.E.ADD.F32x4") == d // 4  # dK and dV: d / 8 float4 each
        assert sass.count("ATOMG.E.ADD") == 1 and "ACQBULK" in sass
        # the causal tail's grid (=3): key block a blockIdx component, the loop the default's
        tail = dataclasses.replace(base, wave_split=3)
        assert tail.name == base.name + "_ws3" and tail.name in names
        sass = clean_sass(tail, tmp_path)
        loop = _gemm_region(sass)
        assert len(plain_loop) <= len(loop) <= len(plain_loop) + 8
        assert loop.count("R2UR") == plain_loop.count("R2UR") and "ACQBULK" in sass
        assert "REDG.E.ADD.F32x4" not in sass and "PREEXIT" not in sass
        with pytest.raises(ValueError, match="wave_split"):
            dataclasses.replace(base, wave_split=1, lpt_tail=8)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_wave_split_parameter_offsets_match_pack_args(builds, tmp_path, split):
    """MAIN's extra trailing int32 (first_main), the pieces kernel's three pointers after dv
    (table, part, part_steps) and the tail grid's arguments (MAIN's without first_main), as
    _build_plan lays out its launches."""
    cfg = next(c for c in bwd_sm90.configs() if c.wave_split == split and not c.timeline)
    table = param_table(builds[cfg.name].cubin, tmp_path)
    m = TensorMap(b"\0" * 128)
    i32, i64 = np.int32(0), np.int64(0)
    maps = (m,) * (4 + cfg.dq_tma)
    args = (*maps, *(None,) * (8 if split == 2 else 5), i64, i64, i64, i64, i64, i64, i32, i32,
            i32, i32, i32, np.float32(0), np.float32(0), i32, i32, *((i32,) if split == 1 else ()))
    _, offsets = pack_args("k", args)
    assert len(table) == len(args)
    assert [table[i][0] - table[0][0] for i in range(len(args))] == list(offsets)


def test_wave_split_switch(monkeypatch):
    """FLASHCUDA_SM90_BWD_WAVE_SPLIT=1 lets a call's plan split its last wave (the plan key holds
    it and FLASHCUDA_SM90_BWD_WAVE_SMS); 0 does not; unset, calls without a mask at
    WAVE_SPLIT_DIMS whose items have WAVE_MIN_STEPS steps; never with the
    causal tail or an A/B build. wave_plan cuts a call's grid as
    wave_split.plan does, each item's steps its key block's query blocks times the group."""
    _no_epilogue_switches(monkeypatch)
    for env in (bwd_sm90.WAVE_SPLIT_ENV, bwd_sm90.WAVE_SMS_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(bwd_sm90, "WAVE_SPLIT_DIMS", ())
    call = _call(B=2, Sq=300, Sk=700, H=4, Hkv=2, D=64)  # causal; 6 key blocks, 24 items
    full = dataclasses.replace(call, window_right=None)
    cfg = bwd_sm90.config_for(full)
    key = bwd_sm90._plan_key(full)
    assert not bwd_sm90.wave_split_for(full, cfg)
    monkeypatch.setenv(bwd_sm90.WAVE_SPLIT_ENV, "1")
    assert bwd_sm90.wave_split_for(full, cfg) and bwd_sm90._plan_key(full) != key
    for other in ({"lpt_tail": 8}, *_NOT_SCHEDULABLE):
        assert not bwd_sm90.wave_split_for(full, dataclasses.replace(cfg, **other)), other
    # (another dQ mode: not the default kernel, which the split was tested on)
    assert not bwd_sm90.wave_split_for(full, Sm90BwdConfig(torch.bfloat16, 64, dq_frag=True))
    monkeypatch.setenv(bwd_sm90.WAVE_SMS_ENV, "10")
    assert bwd_sm90.wave_sms(full) == 10
    plan = bwd_sm90.wave_plan(full, cfg, 10)  # 24 items: 4 besides 2 waves, 2 pieces each
    assert plan.first_main == 4 and plan.main_ctas == 20 and len(plan.pieces) == 8
    assert all(b - a == 3 for _, a, b, _ in plan.pieces)  # 6 steps: 3 query blocks x 2 heads
    causal = bwd_sm90.wave_plan(call, bwd_sm90.config_for(call), 10)  # items 0..3: blocks 0..3
    steps = {s: max(b for _, _, b, t in causal.pieces if t == s) for s in range(4)}
    wl, wr = (int(w) for w in bwd_sm90.kernel_windows(300, 700, None, 0))
    assert steps == {s: 2 * wave_split.query_blocks(300, 700, wl, wr, 128, 128, s)
                     for s in range(4)}
    monkeypatch.setenv(bwd_sm90.WAVE_SMS_ENV, "-2")
    with pytest.raises(ValueError, match=bwd_sm90.WAVE_SMS_ENV):
        bwd_sm90.wave_sms(full)
    assert bwd_sm90.wave_split_for(full, cfg) == bwd_sm90.wave_split_for(call, cfg) == 2
    monkeypatch.setenv(bwd_sm90.WAVE_SPLIT_ENV, "0")
    monkeypatch.setattr(bwd_sm90, "WAVE_SPLIT_DIMS", (64,))
    assert not bwd_sm90.wave_split_for(full, cfg)
    monkeypatch.delenv(bwd_sm90.WAVE_SPLIT_ENV)
    # unset at WAVE_SPLIT_DIMS: calls without a mask, items of WAVE_MIN_STEPS steps at least
    assert bwd_sm90.wave_split_for(full, cfg) == bwd_sm90.WAVE_MIN_STEPS
    assert not bwd_sm90.wave_split_for(call, cfg)  # causal
    assert bwd_sm90.wave_plan(full, cfg, 10, bwd_sm90.WAVE_MIN_STEPS) is None  # 6 steps
    monkeypatch.setenv(bwd_sm90.WAVE_SPLIT_ENV, "yes")
    with pytest.raises(ValueError, match=bwd_sm90.WAVE_SPLIT_ENV):
        bwd_sm90.wave_split_for(full, cfg)


# the A/B builds the split and the tail grid leave alone (bwd_sm90._schedulable)
_NOT_SCHEDULABLE = ({"watchdog": True}, {"defines": (("FC_PROBS_EMU", 1),)},
                    {"release_fence": True})


def test_lpt_launch_switch(monkeypatch):
    """FLASHCUDA_SM90_BWD_LPT_LAUNCH=1 runs a causal call's first LPT_LAUNCH_PAIRS pairs (all
    when fewer) as their own grid after MAIN (FC_WAVE_SPLIT=3); not without a mask or with a
    left edge, not with an A/B build; 0 or unset (LPT_LAUNCH_DIMS) off; the plan key holds it."""
    _no_epilogue_switches(monkeypatch)
    monkeypatch.delenv(bwd_sm90.LPT_LAUNCH_ENV, raising=False)
    monkeypatch.setattr(bwd_sm90, "LPT_LAUNCH_DIMS", ())
    call = _call(B=3, Sq=300, Sk=700, H=6, Hkv=3, D=64)  # causal; 9 pairs
    cfg = bwd_sm90.config_for(call)
    key = bwd_sm90._plan_key(call)
    assert bwd_sm90.lpt_launch_for(call, cfg) == 0
    monkeypatch.setenv(bwd_sm90.LPT_LAUNCH_ENV, "1")
    assert bwd_sm90.lpt_launch_for(call, cfg) == bwd_sm90.LPT_LAUNCH_PAIRS == 8
    assert bwd_sm90._plan_key(call) != key
    small = _call(B=2, Sq=300, Sk=700, H=4, Hkv=2, D=128)  # 4 pairs, d128 (its FC_LPT_TAIL)
    assert bwd_sm90.config_for(small).lpt_tail
    assert bwd_sm90.lpt_launch_for(small, bwd_sm90.config_for(small)) == 4
    assert bwd_sm90.lpt_launch_for(dataclasses.replace(call, window_right=None), cfg) == 0
    assert bwd_sm90.lpt_launch_for(dataclasses.replace(call, window_left=64), cfg) == 0
    for other in _NOT_SCHEDULABLE:
        assert bwd_sm90.lpt_launch_for(call, dataclasses.replace(cfg, **other)) == 0, other
    monkeypatch.setenv(bwd_sm90.LPT_LAUNCH_ENV, "0")
    monkeypatch.setattr(bwd_sm90, "LPT_LAUNCH_DIMS", (64,))
    assert bwd_sm90.lpt_launch_for(call, cfg) == 0
    monkeypatch.delenv(bwd_sm90.LPT_LAUNCH_ENV)
    assert bwd_sm90.lpt_launch_for(call, cfg) == 0  # 6 key blocks: outside LPT_LAUNCH_BLOCKS
    for sk, on in ((1920, False), (1921, True), (8192, True), (8193, False)):  # 16..64 blocks
        long = _call(B=3, Sq=64, Sk=sk, H=6, Hkv=3, D=64)
        assert bool(bwd_sm90.lpt_launch_for(long, cfg)) == on, sk


# ---- FC_PROBS_EARLY (session 23) -------------------------------------------------------------------

def test_probs_early_only_in_the_default_kernel(monkeypatch):
    """PROBS_EARLY's split goes to the default kernel of its head dims (the kernel measured and
    GPU-tested with it), however its settings were reached; every A/B of the 64-query kernel, the
    watchdog build and the other head dims keep P^T whole before the dP^T wait."""
    for env in (DQ_ENV, WATCHDOG_ENV, bwd_sm90.FENCE_ENV, bwd_sm90.DEFINES_ENV):
        monkeypatch.delenv(env, raising=False)
    assert bwd_sm90.PROBS_EARLY == {64: 4, 128: 4}
    assert bwd_sm90.select_config(torch.bfloat16, 64).probs_early == 4
    assert bwd_sm90.select_config(torch.bfloat16, 128).probs_early == 4
    monkeypatch.setenv(DQ_ENV, "tma")  # d64's default, named
    assert bwd_sm90.select_config(torch.float16, 64).probs_early == 4
    for env, value in ((DQ_ENV, "frag"), (WATCHDOG_ENV, "1"), (bwd_sm90.FENCE_ENV, "1")):
        monkeypatch.setenv(env, value)
        cfg = bwd_sm90.select_config(torch.bfloat16, 64)
        assert cfg.probs_early == 128 // 8 and "FC_PROBS_EARLY" not in dict(cfg.spec().defines)
        monkeypatch.delenv(env)
    with pytest.raises(ValueError, match="probs_early"):
        Sm90BwdConfig(torch.bfloat16, 64, probs_early=17)
    split = Sm90BwdConfig(torch.bfloat16, 128, probs_early=0)
    assert split.name.endswith("_pe0") and dict(split.spec().defines)["FC_PROBS_EARLY"] == "0"
    names = {c.name for c in bwd_sm90.configs()}
    # the defaults' split kernels (and d128's 80-query form) are built by the CPU lane;
    # swapped() carries a split and leaves a whole P^T whole
    for d in bwd_sm90.PROBS_EARLY:
        cfg = bwd_sm90.select_config(torch.bfloat16, d)
        assert cfg.name in names
        if d in bwd_sm90.SWAP_HEAD_DIMS:
            assert bwd_sm90.swapped(cfg).name in names
            assert bwd_sm90.swapped(cfg).probs_early == bwd_sm90.PROBS_EARLY[d]
    whole = Sm90BwdConfig(torch.bfloat16, 128)
    assert bwd_sm90.swapped(whole).probs_early == bwd_sm90.SWAP_BLOCK_M // 8


def test_probs_early_puts_work_between_the_exp2s(tmp_path):
    """The point of the split, in SASS: fewer MUFU.EX2 directly after another MUFU (among the
    float instructions of the kernel) than the same kernel with P^T whole before the wait
    (d64: 96 -> 67 at k = 8, 54 at k = 4, in session 23's build)."""
    def back_to_back(cfg):
        sass = dump(compile_spec(cfg.spec(), ARCH).cubin, tmp_path, "-sass")
        ops = re.findall(r"\b(MUFU|FADD|FMUL|FFMA|F2FP)\b", sass)
        return ops.count("MUFU"), sum(a == b == "MUFU" for a, b in zip(ops, ops[1:], strict=False))
    # (without the default's exp2s on the FMA pipe, FC_PROBS_EMU: the same exp2s either way)
    cfg = dataclasses.replace(bwd_sm90.select_config(torch.bfloat16, 64), probs_emu=0)
    whole = dataclasses.replace(cfg, probs_early=16)
    (n_split, b2b_split), (n_whole, b2b_whole) = back_to_back(cfg), back_to_back(whole)
    assert n_split == n_whole  # the same exp2s
    assert b2b_split < 0.7 * b2b_whole, (b2b_split, b2b_whole)

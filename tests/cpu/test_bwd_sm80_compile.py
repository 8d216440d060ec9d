"""CPU lane: every sm80 backward variant compiles for sm_80 and sm_90a without register spills, and
the config (the single source of truth for tiles and shared memory) is self-consistent."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flashcuda.jit import all_variants, compile_spec
from flashcuda.ops import bwd_sm80
from flashcuda.ops.bwd_sm80 import BwdSm80Config, config_for
from flashcuda.ops.call import BwdCall

VARIANTS = bwd_sm80.variants()
H100_SMEM_OPTIN = 227 * 1024
A100_SMEM_OPTIN = 163 * 1024
ARCHS = ("sm_80", "sm_90a")


@pytest.fixture(scope="module")
def reports():
    """ptxas' report of every variant on both archs, compiled in parallel once."""
    import cuda.core  # noqa: F401  (import once here: importing it from several threads races)

    jobs = [(spec, arch) for spec, archs in VARIANTS for arch in archs]

    def build(job):
        spec, arch = job
        result = compile_spec(spec, arch)
        resources = result.resources()
        assert spec.entry_name in resources, f"no ptxas report for {spec.entry_name}:\n{result.log}"
        return (spec.name, arch), resources[spec.entry_name]

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(pool.map(build, jobs))


@pytest.mark.parametrize(
    "spec,arch",
    [(spec, arch) for spec, archs in VARIANTS for arch in archs],
    ids=lambda x: getattr(x, "name", x),
)
def test_variant_compiles_without_spills(reports, spec, arch):
    res = reports[(spec.name, arch)]
    assert not res.spills, f"{spec.name} on {arch}: {res}"
    assert res.registers <= 255


@pytest.mark.parametrize("cfg", bwd_sm80.configs(), ids=lambda c: c.spec().name)
def test_occupancy_on_hopper_and_ampere(reports, cfg):
    """One 8-warp CTA per SM (255 registers x 256 threads), or two 4-warp CTAs per SM on H100 /
    H200 (255 x 128 threads each, <= 113 KB of shared memory each); A100's 164 KB fits two
    4-warp CTAs only below 81 KB (d64 bm64)."""
    for arch in ARCHS:
        regs = reports[(cfg.spec().name, arch)].registers
        h100 = cfg.ctas_per_sm(regs, bwd_sm80.H100_SMEM_PER_SM)
        a100 = cfg.ctas_per_sm(regs, bwd_sm80.A100_SMEM_PER_SM)
        assert cfg.warps * h100 == 8, (arch, regs, h100)  # 8 warps per SM on Hopper, every config
        assert h100 == cfg.min_blocks  # what the launch bounds ask for is what fits
        if cfg.warps == 4:
            assert a100 == (2 if cfg.main_smem_bytes(True) + 1024 <= 167936 // 2 else 1)


def test_variants_are_registered_and_unique():
    names = [spec.name for spec, _ in VARIANTS]
    assert len(names) == len(set(names))
    registered = {spec.name for spec, _ in all_variants()}
    assert set(names) <= registered
    for _, archs in VARIANTS:
        assert archs == ("sm_80", "sm_90a")


def test_spec_names_spell_the_specialisation():
    cfg = config_for(torch.bfloat16, 128)
    assert cfg.spec().name == "flash_bwd_sm80_bf16_d128_bm64_bn128_w8"
    assert cfg.main_spec(False).name.endswith("_nodq")
    assert cfg.dq_spec().name == "flash_bwd_dq_sm80_bf16_d128_bm64_bn64_w4"
    defines = dict(cfg.spec().defines)
    assert defines["FC_HEAD_DIM"] == "128" and defines["FC_DTYPE"] == "2"
    assert defines["FC_SMEM_BYTES"] == str(cfg.main_smem_bytes(True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 16, 32, 40, 64, 72, 96, 120, 128])
def test_config_for_pads_head_dim(dtype, head_dim):
    cfg = config_for(dtype, head_dim)
    assert cfg is not None
    assert cfg.head_dim >= head_dim and cfg.head_dim in bwd_sm80.HEAD_DIMS
    smaller = [d for d in bwd_sm80.HEAD_DIMS if d < cfg.head_dim]
    assert all(d < head_dim for d in smaller)  # the smallest compile-time dim that fits


@pytest.mark.parametrize(
    "dtype,head_dim",
    [
        (torch.float32, 64),
        (torch.bfloat16, 12),
        (torch.bfloat16, 0),
        (torch.float16, 136),
        (torch.float16, 256),
    ],
)
def test_config_for_rejects(dtype, head_dim):
    assert config_for(dtype, head_dim) is None


@pytest.mark.parametrize("head_dim", bwd_sm80.HEAD_DIMS)
def test_shared_memory_fits_ampere_and_hopper(head_dim):
    cfg = config_for(torch.bfloat16, head_dim)
    for deterministic in (False, True):
        assert cfg.smem_bytes(deterministic) <= A100_SMEM_OPTIN <= H100_SMEM_OPTIN
    # d128: K, V (128 x 136) + 2 stages of Q, dO (64 x 136) + dS^T (128 x 72) + lse/delta
    if head_dim == 128:
        assert cfg.main_smem_bytes(True) == 2 * 34816 + 4 * 17408 + 18432 + 1024


def test_seqlen_pad_covers_every_block():
    cfg = config_for(torch.bfloat16, 64)
    for sq in (0, 1, 63, 64, 65, 1023, 4097):
        pad = cfg.seqlen_pad(sq)
        assert pad >= sq and pad - sq < max(cfg.block_m, cfg.dq_block_m, cfg.aux_rows)
        for block in (cfg.block_m, cfg.dq_block_m, cfg.aux_rows):
            assert pad % block == 0


def test_dq_warp_grid_minimises_shared_reads():
    cfg = BwdSm80Config(torch.float16, 128, 64, 128, 8)
    assert cfg.dq_warps_m == 2  # 32 x 32 warp tiles
    cfg = BwdSm80Config(torch.float16, 96, 64, 128, 8)
    assert cfg.dq_warps_m == 4  # 16 x 48: 96 / 4 = 24 is no multiple of 16


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_n": 64},  # block_n must be 16 * warps
        {"block_m": 40},  # not a multiple of 16
        {"dq_warps_m": 3},  # does not divide the warps
        {"dq_passes": 3},  # 16-column passes do not tile the warp's columns
        {"dp_group": 3},  # dP^T groups: even, dividing block_m / 8
        {"dtype": torch.float32},
    ],
)
def test_config_rejects_bad_tiles(kwargs):
    base = {"dtype": torch.bfloat16, "head_dim": 128, "block_m": 64, "block_n": 128, "warps": 8}
    with pytest.raises(ValueError):
        BwdSm80Config(**{**base, **kwargs})


def test_config_is_frozen_and_hashable():
    cfg = config_for(torch.float16, 64)
    with pytest.raises(AttributeError):
        cfg.block_m = 32  # type: ignore[misc]
    assert {cfg: 1}[config_for(torch.float16, 64)] == 1


def test_dq_grid_auto_bounds_the_accumulators():
    # 4 warps, d128: 64 x 128 dQ block, 2 x 2 warps of 32 x 64 in 2 passes (32 fp32 per thread)
    cfg = BwdSm80Config(torch.float16, 128, 64, 64, 4)
    assert (cfg.dq_warps_m, cfg.dq_passes) == (2, 2)
    # d64 affords 64 accumulators: one pass
    cfg = BwdSm80Config(torch.float16, 64, 128, 64, 4)
    assert cfg.dq_passes == 1
    for cfg in bwd_sm80.configs():
        rows = cfg.block_m // cfg.dq_warps_m
        cols = cfg.head_dim // (cfg.warps // cfg.dq_warps_m)
        assert rows * cols // cfg.dq_passes // 32 <= bwd_sm80.max_dq_acc(cfg.head_dim)


def test_table_keeps_the_measured_defaults():
    """The tiles measured at 10dcd36 (sweep-20261130-002723) stay the defaults until the A/B."""
    expect = {
        32: ("bm128_bn128_w8", 16, 4, 1),
        64: ("bm128_bn128_w8", 8, 4, 1),
        96: ("bm64_bn128_w8", 4, 4, 1),
        128: ("bm64_bn128_w8", 4, 2, 1),
    }
    for d, (tag, dp, wm, passes) in expect.items():
        for dtype in (torch.float16, torch.bfloat16):
            for windowed in (False, True):
                cfg = config_for(dtype, d, windowed)
                assert cfg.tag == tag
                assert (cfg.dp_group, cfg.dq_warps_m, cfg.dq_passes, cfg.min_blocks, cfg.dq_red) == (
                    dp, wm, passes, 1, 2)


@pytest.mark.parametrize("cfg", bwd_sm80.configs(), ids=lambda c: c.spec().name)
def test_tags_round_trip(cfg):
    assert BwdSm80Config.from_tag(cfg.dtype, cfg.head_dim, cfg.tag) == cfg
    assert cfg.spec().name == f"flash_bwd_sm80_{cfg.dtype_name}_d{cfg.head_dim}_{cfg.tag}"


def test_tags_spell_only_the_knobs_off_auto():
    cfg = BwdSm80Config(torch.bfloat16, 128, 64, 64, 4, dp_group=8, min_blocks=1, dq_red=4)
    assert cfg.tag == "bm64_bn64_w4_dp8_mb1_red4"
    cfg = BwdSm80Config(torch.bfloat16, 128, 64, 64, 4, dq_warps_m=1, dq_passes=2)
    assert cfg.tag == "bm64_bn64_w4_dqm1_dqp2"
    assert BwdSm80Config.from_tag(torch.bfloat16, 128, cfg.tag) == cfg
    assert BwdSm80Config.from_tag(torch.bfloat16, 128, "bm64_bn64_w4_dp4").tag == "bm64_bn64_w4"
    # the _nodq kernel of a _red4 tag is the _red2 one (no reductions without dQ)
    red4 = BwdSm80Config.from_tag(torch.bfloat16, 128, "bm64_bn128_w8_red4")
    assert red4.main_spec(False) == config_for(torch.bfloat16, 128).main_spec(False)
    assert dict(red4.spec().defines)["FC_DQ_RED_V4"] == "1"
    assert dict(red4.main_spec(False).defines)["FC_DQ_RED_V4"] == "0"


@pytest.mark.parametrize(
    "tag",
    ["", "bm64", "bm64_bn64_w3", "bm64_bn64_w4_dp3", "bm64_bn64_w4_red8", "bm64_bn64_w4_dp4_dp4",
     "bm64_bn64_w4_foo2", "bm40_bn64_w4", "bm64_bn64_w4_dqp3"],
)
def test_bad_tags_are_rejected(tag):
    with pytest.raises(ValueError):
        BwdSm80Config.from_tag(torch.bfloat16, 128, tag)


def test_config_env_override(monkeypatch):
    env = bwd_sm80.CONFIG_ENV
    monkeypatch.setenv(env, "bm64_bn64_w4")
    for d in (64, 128):
        cfg = config_for(torch.bfloat16, d)
        assert (cfg.tag, cfg.head_dim, cfg.warps) == ("bm64_bn64_w4", d, 4)
    assert config_for(torch.bfloat16, 72).head_dim == 96  # runtime 72 -> compile-time 96
    monkeypatch.setenv(env, "d64=bm128_bn64_w4, d128=bm64_bn128_w8_red4")
    assert config_for(torch.float16, 64).tag == "bm128_bn64_w4"
    assert config_for(torch.float16, 128, True).tag == "bm64_bn128_w8_red4"
    assert config_for(torch.float16, 96).tag == "bm64_bn128_w8"  # not overridden: the table
    for raw in ("default", " ", ""):
        monkeypatch.setenv(env, raw)
        assert config_for(torch.float16, 128).tag == "bm64_bn128_w8"
    for raw in ("bm64_bn64_w3", "d48=bm64_bn64_w4", "d128=bm64_bn64_w4_dp3"):
        monkeypatch.setenv(env, raw)
        with pytest.raises(ValueError, match=env):
            config_for(torch.float16, 128)
    monkeypatch.setenv(env, "bm64_bn64_w4")
    assert config_for(torch.float32, 128) is None and config_for(torch.float16, 12) is None


def test_config_env_reaches_can_implement(monkeypatch):
    """An override that cannot run is an error, never a silent fallback to another family."""
    monkeypatch.setenv(bwd_sm80.CONFIG_ENV, "bm64_bn64_w5")
    with pytest.raises(ValueError, match="block_n"):
        bwd_sm80.can_implement(_call())


def test_candidates_are_registered_for_both_dtypes():
    names = {spec.name for spec, _ in VARIANTS}
    for d, tags in bwd_sm80.CANDIDATES.items():
        for tag in tags:
            for dtype in ("fp16", "bf16"):
                assert f"flash_bwd_sm80_{dtype}_d{d}_{tag}" in names


def _call(b=1, sq=16, sk=24, h=4, hkv=2, d=64, dtype=torch.bfloat16, **over):
    q = torch.zeros(b, sq, h, d, dtype=dtype)
    k = torch.zeros(b, sk, hkv, d, dtype=dtype)
    t = {
        "q": q,
        "k": k,
        "v": k.clone(),
        "out": q.clone(),
        "dout": q.clone(),
        "lse": torch.zeros(b, h, sq),
        "dq": q.clone(),
        "dk": k.clone(),
        "dv": k.clone(),
    }
    t.update(over)
    return BwdCall(
        t["q"],
        t["k"],
        t["v"],
        t["out"],
        t["dout"],
        t["lse"],
        t["dq"],
        t["dk"],
        t["dv"],
        0.125,
        None,
        0,
        False,
    )


@pytest.mark.parametrize(
    "over,reason",
    [
        ({"dtype": torch.float32}, "float16 / bfloat16 only"),
        ({"d": 136}, "head_dim 136 is not supported"),
        ({"d": 60}, "head_dim 60 is not supported"),
        ({"h": 3, "hkv": 2}, "multiple of nheads_kv"),
        ({"lse": torch.zeros(1, 4, 16, dtype=torch.float16)}, "lse must be float32"),
        ({"lse": torch.zeros(1, 4, 15)}, "lse has shape"),
        ({"dout": torch.zeros(1, 16, 4, 64)}, "dout has dtype"),
        ({"q": torch.zeros(1, 16, 4, 68, dtype=torch.bfloat16)[..., :64]}, "multiple of 8 elements"),
        ({"k": torch.zeros(1, 24, 2, 72, dtype=torch.bfloat16)[..., 1:65]}, "16-byte aligned"),
        ({}, "expected a CUDA device"),  # everything else fine: CPU tensors are the last reason
    ],
)
def test_can_implement_reasons(over, reason):
    shape_keys = {"b", "sq", "sk", "h", "hkv", "d", "dtype"}
    call = _call(
        **{k: v for k, v in over.items() if k in shape_keys},
        **{k: v for k, v in over.items() if k not in shape_keys},
    )
    why = bwd_sm80.can_implement(call)
    assert why is not None and reason in why, why

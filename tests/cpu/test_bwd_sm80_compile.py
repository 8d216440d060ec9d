"""CPU lane: every sm80 backward variant compiles for sm_80 and sm_90a without register spills, and
the config (the single source of truth for tiles and shared memory) is self-consistent."""

from __future__ import annotations

import pytest
import torch

from flashcuda.jit import all_variants, compile_spec
from flashcuda.ops import bwd_sm80
from flashcuda.ops.bwd_sm80 import BwdSm80Config, config_for
from flashcuda.ops.call import BwdCall

VARIANTS = bwd_sm80.variants()
H100_SMEM_OPTIN = 227 * 1024
A100_SMEM_OPTIN = 163 * 1024


@pytest.mark.parametrize(
    "spec,arch",
    [(spec, arch) for spec, archs in VARIANTS for arch in archs],
    ids=lambda x: getattr(x, "name", x),
)
def test_variant_compiles_without_spills(spec, arch):
    result = compile_spec(spec, arch)
    resources = result.resources()
    assert spec.entry_name in resources, f"no ptxas report for {spec.entry_name}:\n{result.log}"
    res = resources[spec.entry_name]
    assert not res.spills, f"{spec.name} on {arch}: {res}"
    assert res.registers <= 255


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

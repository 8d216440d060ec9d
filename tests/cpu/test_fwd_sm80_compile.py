"""The sm80 forward family on the CPU lane: every variant compiles for sm_80 and sm_90a within its
register budget, and the config / can_implement logic answers without a GPU.

Register budget. A thread of the FA2 shapes holds O and S in registers: d128 at 128 x 64 with
4 warps is 128 + 64 fp32 accumulators under a hard cap of 255 registers. FlashAttention 2's own
kernel at that shape spills (ptxas: 172 bytes spill stores, 112 bytes stack frame, sm_80, FA2
issue #1630). Ours, with NVRTC 13.0: d128 spills 20 bytes (sm_80) / 12 bytes (sm_90a) -- the key
loop counter and one loop invariant, reloaded from L1 once per key tile -- and d96 16 bytes on
sm_90a; every other variant spills nothing. The register-tight shapes are held to SPILL_BUDGET
bytes, every other shape to zero; growing past that fails this test.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flashcuda.jit import all_variants, compile_spec
from flashcuda.ops import fwd_sm80
from flashcuda.ops.call import FwdCall
from flashcuda.ops.fwd_sm80 import Sm80FwdConfig, kernel_head_dim, select_config

ARCHS = ("sm_80", "sm_90a")
SPILL_BUDGET = 32  # bytes of spill stores, and of stack frame
# Masked-V kernels (the default since session 8): up to 88 bytes (sm_90a d192; d128 56) since the
# vote moved into the loop's barrier, in the put-back path; the same-run A/B measured d64 / d128 at
# 0-4% of the variant without it. The budget catches blow-ups (the first version spilled 1.1-1.7 KB)
MASKED_V_SPILL_BUDGET = 96
# (head_dim, block_m, block_n, warps) shapes that live at the 255-register cap (FA2's choices).
TIGHT = {(96, 128, 64, 4), (128, 128, 64, 4)}

A100 = (166912, 167936)  # (max dynamic smem per block, smem per SM)
H100 = (232448, 233472)
SM86 = (101376, 102400)


# ---- compile every variant ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reports():
    import cuda.core  # noqa: F401  (import once here: importing it from several threads races)

    jobs = [(cfg, arch) for cfg in fwd_sm80.configs() for arch in ARCHS]

    def build(job):
        cfg, arch = job
        result = compile_spec(cfg.spec(), arch)
        return (cfg.name, arch), result.resources()[cfg.name]

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(pool.map(build, jobs))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", fwd_sm80.configs(), ids=lambda c: c.name)
def test_compiles_within_register_budget(reports, cfg, arch):
    res = reports[(cfg.name, arch)]
    assert res.registers <= 255
    assert res.shared_bytes == 0, "all shared memory is dynamic (Sm80FwdConfig.smem_bytes)"
    tight = (cfg.head_dim, cfg.block_m, cfg.block_n, cfg.warps) in TIGHT
    # The exact row sums (the default since session 7) cost one register at the cap: d64
    # spills 16 bytes on sm_90a with them; the same-run A/B put the whole cost at 0-2%.
    budget = SPILL_BUDGET if tight or (cfg.exact_rowsum and cfg.head_dim == 64) else 0
    if cfg.masked_v:  # the masked-V scan and put-back cost up to 88 bytes
        budget = MASKED_V_SPILL_BUDGET
    assert res.spill_stores <= budget and res.stack_bytes <= budget, (
        f"{cfg.name} on {arch}: {res.spill_stores} bytes spill stores, {res.spill_loads} bytes "
        f"spill loads, {res.stack_bytes} bytes stack (budget {budget})")


def _call_on_h100(monkeypatch, head_dim, dtype, window_right):
    """A small CPU call that config_for plans as on an H100-class device, switches unset."""
    q = torch.zeros(1, 4, 2, head_dim, dtype=dtype)
    monkeypatch.setattr(fwd_sm80, "_device_info", lambda index: ((9, 0), *H100))
    monkeypatch.setattr(fwd_sm80, "_device_index", lambda device: 0)
    for env in (fwd_sm80.MASKED_V_ENV, fwd_sm80.ROWSUM_ENV):
        monkeypatch.delenv(env, raising=False)
    return FwdCall(q, q, q, q.clone(), torch.zeros(1, 2, 4), 0.125, None, window_right)


def test_rowsum_switch(monkeypatch):
    """Unset or FLASHCUDA_SM80_FWD_ROWSUM=exact picks the default, exact-row-sum kernel; mma the
    A/B variant of the same tiles (name, define); other values are refused, naming the variable."""
    call = _call_on_h100(monkeypatch, 64, torch.float16, None)
    base = fwd_sm80.config_for(call)
    assert base.exact_rowsum and "FC_EXACT_ROWSUM" not in dict(base.spec().defines)
    monkeypatch.setenv(fwd_sm80.ROWSUM_ENV, "exact")
    assert fwd_sm80.config_for(call) == base
    monkeypatch.setenv(fwd_sm80.ROWSUM_ENV, "mma")
    mma = fwd_sm80.config_for(call)
    assert not mma.exact_rowsum and mma.name == base.name + "_mrs"
    assert (mma.block_m, mma.block_n, mma.warps) == (base.block_m, base.block_n, base.warps)
    assert dict(mma.spec().defines)["FC_EXACT_ROWSUM"] == "0"
    assert mma in fwd_sm80.configs()  # compiled by the CPU lane
    monkeypatch.setenv(fwd_sm80.ROWSUM_ENV, "fast")
    with pytest.raises(ValueError, match=fwd_sm80.ROWSUM_ENV):
        fwd_sm80.config_for(call)


def test_masked_v_switch(monkeypatch):
    """Unset or FLASHCUDA_SM80_FWD_MASKED_V=1 picks the masked-V kernel (the default since session
    8: the .cu's own default, the bit table in shared memory); 0 the A/B variant of the same
    tiles without it (name, define); other values are refused."""
    call = _call_on_h100(monkeypatch, 128, torch.bfloat16, 0)
    base = fwd_sm80.config_for(call)
    assert base.masked_v and "FC_MASKED_V" not in dict(base.spec().defines)
    monkeypatch.setenv(fwd_sm80.MASKED_V_ENV, "1")
    assert fwd_sm80.config_for(call) == base
    monkeypatch.setenv(fwd_sm80.MASKED_V_ENV, "0")
    off = fwd_sm80.config_for(call)
    assert not off.masked_v and off.name == base.name + "_nomv"
    assert (off.block_m, off.block_n, off.warps) == (base.block_m, base.block_n, base.warps)
    assert dict(off.spec().defines)["FC_MASKED_V"] == "0"
    assert base.smem_bytes == off.smem_bytes + 3 * 128 * (base.block_n // 32) * 4
    assert off in fwd_sm80.configs()
    monkeypatch.setenv(fwd_sm80.MASKED_V_ENV, "yes")
    with pytest.raises(ValueError, match=fwd_sm80.MASKED_V_ENV):
        fwd_sm80.config_for(call)


def test_masked_v_where_its_table_fits():
    """The tiles are FA2's whatever the masked-V table needs; the table rides along where it fits
    next to them: every head dim on A100 / H100-class parts, all but d192 / d256 on 99 KB ones."""
    for device in (A100, H100, SM86):
        for d in (32, 64, 96, 128, 192, 256):
            with_table = select_config(torch.bfloat16, d, *device)
            without = select_config(torch.bfloat16, d, *device, masked_v=False)
            assert (with_table.block_m, with_table.block_n, with_table.warps) == \
                (without.block_m, without.block_n, without.warps)
            assert not without.masked_v
            assert with_table.masked_v == (device != SM86 or d <= 128), (device, d)
            assert with_table.smem_bytes <= device[0]


def test_variants_registered():
    specs = {spec.name: archs for spec, archs in all_variants()}
    for cfg in fwd_sm80.configs():
        assert specs[cfg.name] == ARCHS
    names = [spec.name for spec, _ in fwd_sm80.variants()]
    assert len(names) == len(set(names))


# ---- config: tile choice, shared memory, names ----------------------------------------------------

def test_kernel_head_dim_padding():
    assert [kernel_head_dim(d) for d in (8, 32, 40, 64, 72, 96, 100, 128, 136, 192, 200, 256)] == \
        [32, 32, 64, 64, 96, 96, 128, 128, 192, 192, 256, 256]
    assert kernel_head_dim(264) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tile_choice(dtype):
    shape = lambda cfg: (cfg.head_dim, cfg.block_m, cfg.block_n, cfg.warps)  # noqa: E731
    for device in (A100, H100, SM86):
        assert shape(select_config(dtype, 40, *device)) == (64, 128, 128, 4)
        assert shape(select_config(dtype, 32, *device)) == (32, 128, 128, 4)
        assert shape(select_config(dtype, 72, *device)) == (96, 128, 64, 4)
        assert shape(select_config(dtype, 128, *device)) == (128, 128, 64, 4)
        assert shape(select_config(dtype, 192, *device)) == (192, 128, 64, 8)
    # d256: 128 KB tiles only where one block may take them but two 96 KB CTAs do not fit an SM.
    assert shape(select_config(dtype, 256, *A100)) == (256, 128, 64, 8)
    assert shape(select_config(dtype, 256, *H100)) == (256, 64, 64, 4)
    assert shape(select_config(dtype, 256, *SM86)) == (256, 64, 64, 4)
    for device in (A100, H100, SM86):
        for d in (8, 64, 96, 128, 160, 192, 256):
            assert select_config(dtype, d, *device).smem_bytes <= device[0]


def test_config_is_the_single_source_of_truth():
    cfg = Sm80FwdConfig(torch.bfloat16, 128, 128, 64, 4)
    assert cfg.name == "flash_fwd_sm80_bf16_d128_bm128_bn64_w4"
    assert cfg.threads == 128
    assert cfg.smem_bytes == (128 + 2 * 64) * 128 * 2 + 3 * 128 * (64 // 32) * 4
    defines = dict(cfg.spec().defines)
    assert defines == {"FC_DTYPE": "2", "FC_HEAD_DIM": "128", "FC_BLOCK_M": "128",
                       "FC_BLOCK_N": "64", "FC_WARPS": "4", "FC_SMEM_BYTES": str(cfg.smem_bytes)}
    assert cfg.spec().entry_name == cfg.name


@pytest.mark.parametrize("args", [
    (torch.float32, 128, 128, 64, 4),   # dtype
    (torch.float16, 100, 128, 64, 4),   # head dim not a multiple of 32
    (torch.float16, 288, 128, 64, 4),   # head dim too large
    (torch.float16, 128, 96, 64, 4),    # block_m not a multiple of 16 * warps
    (torch.float16, 128, 128, 40, 4),   # block_n not a multiple of 16
])
def test_config_rejects_bad_shapes(args):
    with pytest.raises(ValueError):
        Sm80FwdConfig(*args)


# ---- can_implement on CPU tensors (every check before the device ones) -------------------------

def _call(dtype=torch.bfloat16, B=2, Sq=33, Sk=47, H=4, Hkv=2, D=64, scale=0.125, q=None):
    q = torch.randn(B, Sq, H, D, dtype=dtype) if q is None else q
    k = torch.randn(B, Sk, Hkv, q.shape[-1], dtype=dtype)
    v = torch.randn(B, Sk, Hkv, q.shape[-1], dtype=dtype)
    out = torch.empty(q.shape, dtype=dtype)
    lse = torch.empty(B, H, Sq, dtype=torch.float32)
    return FwdCall(q, k, v, out, lse, scale, None, 0)


def test_can_implement_reasons():
    assert "dtype" in fwd_sm80.can_implement(_call(dtype=torch.float32))
    assert "head_dim" in fwd_sm80.can_implement(_call(D=12))
    assert "head_dim" in fwd_sm80.can_implement(_call(D=264))
    assert "nheads_kv" in fwd_sm80.can_implement(_call(H=3, Hkv=2))
    assert "softmax_scale" in fwd_sm80.can_implement(_call(scale=-1.0))
    assert "softmax_scale" in fwd_sm80.can_implement(_call(scale=float("inf")))
    # A 16-byte-misaligned view (offset of one element) and a stride that is not a multiple of 8.
    big = torch.randn(2, 33, 4, 72, dtype=torch.bfloat16)
    assert "16-byte" in fwd_sm80.can_implement(_call(q=big[..., 1:65]))
    odd = torch.randn(2, 33, 4, 68, dtype=torch.bfloat16)[..., :64]
    assert "multiple of 8" in fwd_sm80.can_implement(_call(q=odd))
    bad_lse = dataclasses.replace(_call(), lse=torch.empty(2, 4, 34))
    assert "lse" in fwd_sm80.can_implement(bad_lse)
    # A well-formed call fails only on the device check here.
    assert "CUDA" in fwd_sm80.can_implement(_call())
    assert "CUDA" in fwd_sm80.can_implement(_call(dtype=torch.float16, D=40))


def test_run_refuses_what_it_cannot_implement():
    with pytest.raises(NotImplementedError, match="flash_fwd_sm80"):
        fwd_sm80.run(_call(dtype=torch.float32))


def test_plan_key_holds_what_can_implement_reads(monkeypatch):
    """A plan hit skips can_implement and packs only the data pointers: the key must change with
    every tensor's layout, alignment and dtype, the switches, the mask and the scale, and stay
    the same for a call that differs only in where equally aligned data lives."""
    from .sm90_compile import assert_plan_key_follows_operands

    base = _call()
    key = assert_plan_key_follows_operands(fwd_sm80._plan_key, base, ("q", "k", "v", "out"))
    assert fwd_sm80._plan_key(_call()) == key  # fresh tensors, same layout
    for change in ({"window_left": 5}, {"window_right": None}, {"softmax_scale": 0.5}):
        assert fwd_sm80._plan_key(dataclasses.replace(base, **change)) != key, change
    for env in (fwd_sm80.ROWSUM_ENV, fwd_sm80.MASKED_V_ENV):
        monkeypatch.setenv(env, "x")
        assert fwd_sm80._plan_key(base) != key, env
        monkeypatch.delenv(env)


def test_plan_cache_builds_once_stores_no_failure_and_stays_bounded():
    """PlanCache (the families' plans): one build per key; a build that raises stores nothing,
    so the same key raises again; past its size it starts over."""
    from flashcuda.ops.call import PlanCache

    built = []

    def build(call):
        built.append(call)
        if call == "bad":
            raise NotImplementedError("no")
        return f"plan of {call}"

    plans = PlanCache(build, size=3)
    assert plans.plan(("a",), "a") == plans.plan(("a",), "a") == "plan of a"
    assert built == ["a"]
    for _ in range(2):
        with pytest.raises(NotImplementedError):
            plans.plan(("bad",), "bad")
    assert built == ["a", "bad", "bad"] and ("bad",) not in plans
    for key in "bcd":
        plans.plan((key,), key)
    assert len(plans) == 4
    plans.plan(("e",), "e")
    assert list(plans) == [("e",)]

"""SIMT flash kernels (and the test kernels of the shared device code: online softmax, mask) on the
CPU lane: every variant compiles for sm_80 and sm_90a without spills, and the configs /
can_implement answer correctly without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashcuda.jit import compile_spec
from flashcuda.ops import bwd_simt, fwd_simt, mask_check, softmax_state
from flashcuda.ops.call import BwdCall, FwdCall


def _all_variants():
    return [(spec, arch)
            for module in (fwd_simt, bwd_simt, softmax_state, mask_check)
            for spec, archs in module.variants() for arch in archs]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "arch"), _all_variants(),
                         ids=[f"{s.name}-{a}" for s, a in _all_variants()])
def test_simt_variant_compiles_without_spills(spec, arch):
    result = compile_spec(spec, arch)
    resources = result.resources()
    if spec.entry_name not in resources:
        pytest.fail(f"no ptxas report for {spec.entry_name}:\n{result.log}")
    r = resources[spec.entry_name]
    if r.spills:
        pytest.fail(f"{spec.name} on {arch} spills: {r}")
    if r.registers > 255:
        pytest.fail(f"{spec.name} on {arch} uses {r.registers} registers")


def test_simt_representative_variants_compile():
    """The fast subset of the above: one of each kernel, both targets."""
    specs = [fwd_simt.config_for(torch.float16, 40).spec(),
             bwd_simt.config_for(torch.bfloat16, 128).dkdv_spec(),
             bwd_simt.config_for(torch.float32, 256).dq_spec(),
             bwd_simt.config_for(torch.float32, 8).dot_do_o_spec(),
             softmax_state.spec(), mask_check.spec()]
    for spec in specs:
        for arch in ("sm_80", "sm_90a"):
            r = compile_spec(spec, arch).resources()[spec.entry_name]
            assert not r.spills, (spec.name, arch, r)


def test_simt_variant_counts_and_names():
    fwd = [s.name for s, _ in fwd_simt.variants()]
    bwd = [s.name for s, _ in bwd_simt.variants()]
    assert len(fwd) == len(set(fwd)) == 12
    assert len(bwd) == len(set(bwd)) == 3 + 2 * 12
    assert "flash_fwd_simt_fp32_d128_bm32_bn32" in fwd
    assert "flash_fwd_simt_bf16_d256_bm16_bn32" in fwd
    assert "flash_bwd_dkdv_simt_fp16_d64_bm32_bn32" in bwd
    assert "flash_bwd_dq_simt_bf16_d256_bm16_bn16" in bwd
    assert "flash_bwd_dot_do_o_simt_fp32" in bwd
    for module in (fwd_simt, bwd_simt, softmax_state, mask_check):
        for _, archs in module.variants():
            assert archs == ("sm_80", "sm_90a")


@pytest.mark.parametrize(("head_dim", "bucket"),
                         [(1, 32), (8, 32), (32, 32), (33, 64), (40, 64), (64, 64), (65, 128),
                          (128, 128), (129, 256), (256, 256)])
def test_simt_head_dim_buckets(head_dim, bucket):
    assert fwd_simt.config_for(torch.float32, head_dim).head_dim == bucket
    assert bwd_simt.config_for(torch.float16, head_dim).head_dim == bucket


def test_simt_head_dim_too_large():
    with pytest.raises(ValueError, match="head_dim"):
        fwd_simt.head_dim_bucket(257)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_simt_configs_are_consistent(dtype, head_dim):
    f = fwd_simt.config_for(dtype, head_dim)
    b = bwd_simt.config_for(dtype, head_dim)
    for cfg in (f, b):
        assert cfg.threads == 128
        assert cfg.head_dim % cfg.lanes == 0 and 32 % cfg.lanes == 0
    assert f.block_n % f.lanes == 0 and b.block % b.lanes == 0
    # Every variant fits sm70's 96 KB of opt-in shared memory.
    assert f.smem_bytes <= 96 * 1024 and b.smem_bytes <= 96 * 1024
    # The budget matches the kernel's carve: Q, K, V, P tiles with row stride cols + 1.
    d1 = head_dim + 1
    assert f.smem_bytes == 4 * (f.block_m * d1 + 2 * f.block_n * d1 + f.block_m * (f.block_n + 1))
    assert b.dkdv_smem_bytes == 4 * (4 * b.block * d1 + 2 * b.block * (b.block + 1) + 2 * b.block)
    defines = dict(f.spec().defines)
    assert defines["FC_THREADS"] == str(f.block_m * f.lanes)
    assert defines["FC_DTYPE"] == str({torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype])
    assert f.spec().name == f.name


def _fwd_call(dtype=torch.float16, head_dim=64, nheads=4, nheads_kv=2, q=None) -> FwdCall:
    q = torch.randn(2, 5, nheads, head_dim).to(dtype) if q is None else q
    k = torch.randn(2, 7, nheads_kv, head_dim).to(dtype)
    v = torch.randn(2, 7, nheads_kv, head_dim).to(dtype)
    out = torch.empty_like(q)
    lse = torch.empty(2, nheads, 5)
    return FwdCall(q, k, v, out, lse, 0.125, None, 0)


def test_simt_can_implement_reasons_on_cpu():
    # A well-formed call is refused only because the tensors are not on a CUDA device.
    assert "CUDA" in fwd_simt.can_implement(_fwd_call())
    assert "float64" in fwd_simt.can_implement(_fwd_call(dtype=torch.float64))
    assert "head_dim" in fwd_simt.can_implement(_fwd_call(head_dim=320))
    assert "multiple" in fwd_simt.can_implement(_fwd_call(nheads=3, nheads_kv=2))
    strided = torch.randn(2, 5, 4, 128, dtype=torch.float16)[..., ::2]
    assert "unit last stride" in fwd_simt.can_implement(_fwd_call(q=strided))


def test_simt_bwd_can_implement_reasons_on_cpu():
    f = _fwd_call(dtype=torch.bfloat16)
    grads = [torch.empty_like(t) for t in (f.q, f.k, f.v)]
    call = BwdCall(f.q, f.k, f.v, f.out, torch.randn_like(f.out), f.lse, *grads,
                   softmax_scale=0.125, window_left=None, window_right=0, deterministic=True)
    assert "CUDA" in bwd_simt.can_implement(call)
    assert "lse" in bwd_simt.can_implement(dataclasses.replace(call, lse=torch.empty(2, 4, 6)))
    wrong_dk = torch.empty(2, 7, 2, 64, dtype=torch.float16)
    assert "dk" in bwd_simt.can_implement(dataclasses.replace(call, dk=wrong_dk))


def test_online_softmax_rows_validates_before_launch():
    s = torch.randn(4, 8)
    with pytest.raises(ValueError, match="CUDA"):
        softmax_state.online_softmax_rows(s, s, 4)
    with pytest.raises(TypeError, match="float32"):
        softmax_state.online_softmax_rows(s.double(), s, 4)
    with pytest.raises(ValueError, match="2-D"):
        softmax_state.online_softmax_rows(s[0], s[0], 4)
    with pytest.raises(ValueError, match="tile"):
        softmax_state.online_softmax_rows(s, s, 0)

"""GPU lane: every A/B candidate of the sm80 backward (bwd_sm80.CANDIDATES: 4-warp two-CTA-per-SM
tiles, red.v4 dQ reductions), forced through FLASHCUDA_BWD_SM80_CONFIG, against the float64 oracle
(flashcuda.reference.attention_ref with autograd).

Run: FLASHCUDA_TEST_SHARED_CACHE=1 pytest -m gpu tests/gpu/test_bwd_sm80_configs.py

Tolerance as in test_bwd_sm80.py (FlashAttention's rule for gradients): our max error against
float64 <= 3x the max error of PyTorch's same-dtype attention (attention_ref(upcast=False)), plus a
small floor. dq / dk / dv start as NaN, so an element a kernel never writes fails.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flashcuda.ops import bwd_sm80
from flashcuda.ops.call import BwdCall
from flashcuda.reference import attention_ref

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
CONFIGS = [(d, tag) for d, tags in sorted(bwd_sm80.CANDIDATES.items()) for tag in tags]
CONFIG_IDS = [f"d{d}-{tag}" for d, tag in CONFIGS]
# Ragged on both sides, Sq != Sk: 1 row / key, just under and over one 64-row block, 1023.
SEQ_PAIRS = [(1, 17), (17, 1), (63, 65), (65, 63), (127, 129), (129, 127), (1, 1023), (1023, 129),
             (129, 1023)]


@pytest.fixture(scope="module", autouse=True)
def _compile_ahead():
    """With the shared cache, compile every variant these tests launch in parallel up front."""
    if os.environ.get("FLASHCUDA_TEST_SHARED_CACHE") != "1" or not torch.cuda.is_available():
        return
    import cuda.core  # noqa: F401  (import once on this thread: its lazy import is not thread-safe)

    from flashcuda.jit import build_cubin, device_arch

    arch = device_arch(torch.cuda.current_device())
    specs = {
        spec.name: spec
        for d, tag in CONFIGS
        for dtype in (BF16, FP16)
        for spec in bwd_sm80.BwdSm80Config.from_tag(dtype, d, tag).specs()
    }
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        list(pool.map(lambda spec: build_cubin(spec, arch), specs.values()))


@pytest.fixture
def forced(monkeypatch):
    """force(d, tag): run head dim d's backward with `tag` (FLASHCUDA_BWD_SM80_CONFIG)."""

    def force(d: int, tag: str) -> None:
        monkeypatch.setenv(bwd_sm80.CONFIG_ENV, f"d{d}={tag}")

    return force


def make_qkv(b, sq, sk, h, hkv, d, dtype):
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    return q, k, v


def run_ours(tag, q, k, v, out, dout, lse, scale, wl, wr, deterministic=False):
    dq = torch.full(q.shape, float("nan"), device=q.device, dtype=q.dtype)
    dk = torch.full(k.shape, float("nan"), device=q.device, dtype=q.dtype)
    dv = torch.full(v.shape, float("nan"), device=q.device, dtype=q.dtype)
    call = BwdCall(q, k, v, out, dout, lse, dq, dk, dv, scale, wl, wr, deterministic)
    assert bwd_sm80.call_config(call).tag == tag  # the override took effect
    why = bwd_sm80.can_implement(call)
    assert why is None, why
    bwd_sm80.run(call)
    torch.cuda.synchronize()
    return dq, dk, dv


def check_grads(tag, q, k, v, wl=None, wr=None, deterministic=False):
    """Our grads vs the float64 oracle, within 3x PyTorch's same-dtype error."""
    scale = q.shape[-1] ** -0.5
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_ref(q64, k64, v64, scale, window=(wl, wr))
    dout = torch.randn(q.shape, device=q.device, dtype=q.dtype)
    out64.backward(dout.double())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outl, _ = attention_ref(ql, kl, vl, scale, window=(wl, wr), upcast=False)
    outl.backward(dout)

    out = out64.detach().to(q.dtype)
    lse = lse64.detach().float()
    ours = run_ours(tag, q, k, v, out, dout, lse, scale, wl, wr, deterministic)
    for name, got, ref, low in zip(
        ("dq", "dk", "dv"),
        ours,
        (q64.grad, k64.grad, v64.grad),
        (ql.grad, kl.grad, vl.grad),
        strict=True,
    ):
        assert not got.isnan().any(), f"{name} has NaN (unwritten or poisoned)"
        err = (got.double() - ref).abs().max().item() if got.numel() else 0.0
        torch_err = (low.double() - ref).abs().max().item() if got.numel() else 0.0
        floor = 1e-5 + 1e-3 * (ref.abs().max().item() if got.numel() else 0.0)
        assert err <= 3 * torch_err + floor, (
            f"{tag} {name}: max error {err:.3g} > 3 x torch {q.dtype} error {torch_err:.3g} "
            f"+ {floor:.2g}"
        )
    return ours, (out, dout, lse, scale)


@pytest.mark.parametrize("d,tag", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("sq,sk", SEQ_PAIRS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ragged(forced, d, tag, dtype, sq, sk, causal):
    forced(d, tag)
    torch.manual_seed(sq * 7 + sk + d)
    q, k, v = make_qkv(2, sq, sk, 2, 2, d, dtype)
    check_grads(tag, q, k, v, wr=0 if causal else None)


@pytest.mark.parametrize("d,tag", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("wl,wr", [(32, 8), (None, -4), (200, 3)])
def test_window(forced, d, tag, wl, wr):
    forced(d, tag)
    torch.manual_seed(d)
    q, k, v = make_qkv(2, 300, 257, 2, 2, d, BF16)
    check_grads(tag, q, k, v, wl=wl, wr=wr)


@pytest.mark.parametrize("d,tag", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("h,hkv,sq,sk", [(8, 2, 127, 1023), (3, 1, 65, 129)], ids=["gqa4", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(forced, d, tag, h, hkv, sq, sk, causal):
    forced(d, tag)
    torch.manual_seed(h + d)
    q, k, v = make_qkv(2, sq, sk, h, hkv, d, FP16)
    check_grads(tag, q, k, v, wr=0 if causal else None)


@pytest.mark.parametrize("d,tag", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("h,hkv,causal", [(2, 2, True), (4, 1, False)])
def test_deterministic_is_correct_and_bitwise_repeatable(forced, d, tag, h, hkv, causal):
    forced(d, tag)
    torch.manual_seed(d + h)
    q, k, v = make_qkv(2, 1023, 777, h, hkv, d, BF16)
    wr = 0 if causal else None
    first, (out, dout, lse, scale) = check_grads(tag, q, k, v, wr=wr, deterministic=True)
    for _ in range(3):
        again = run_ours(tag, q, k, v, out, dout, lse, scale, None, wr, deterministic=True)
        for x, y in zip(first, again, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("d,tag", CONFIGS, ids=CONFIG_IDS)
def test_occupancy_is_what_the_config_plans(d, tag):
    """The driver's occupancy for the main kernel equals BwdSm80Config.ctas_per_sm for the
    kernel's register count and this device's shared memory: on H100 / H200, min_blocks CTAs."""
    from cuda.bindings import driver

    from flashcuda.jit import get_kernel

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    smem_per_sm = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0)
    if not smem_per_sm:
        pytest.skip("torch does not report shared memory per SM")
    cfg = bwd_sm80.BwdSm80Config.from_tag(BF16, d, tag)
    for with_dq in (True, False):
        kernel = get_kernel(cfg.main_spec(with_dq), dev)
        smem = cfg.main_smem_bytes(with_dq)
        if smem > kernel.smem_limit:
            kernel._raise_smem_limit(smem)
        err, blocks = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            kernel.function, cfg.threads, smem
        )
        assert int(err) == 0, err
        regs = kernel.attribute("NUM_REGS")
        assert blocks == cfg.ctas_per_sm(regs, smem_per_sm, with_dq), (with_dq, regs, smem_per_sm)
        if (props.major, props.minor) == (9, 0):
            assert blocks == cfg.min_blocks, (with_dq, regs, blocks)

"""GPU lane: the sm80 tensor-core backward against a float64 autograd oracle.

Run: FLASHCUDA_TEST_SHARED_CACHE=1 pytest -m gpu tests/gpu/test_bwd_sm80.py

The forward's out / lse come from the float64 reference (out cast to the dtype, lse to fp32), so
these tests do not depend on any forward kernel. dq / dk / dv are pre-filled with NaN, so an
unwritten element fails. Tolerance (FlashAttention's rule for gradients): our max error against
float64 <= 3x the max error of the same computation done by PyTorch in the input dtype, plus a
tiny floor.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flashcuda.ops import bwd_sm80
from flashcuda.ops.call import BwdCall

pytestmark = pytest.mark.gpu
DEVICE = "cuda"  # (tests/cpu/test_bwd_sm80_emulated.py runs these bodies on the host emulator)

BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture(scope="module", autouse=True)
def _compile_ahead():
    """With the shared cache, compile every variant these tests launch in parallel up front."""
    if os.environ.get("FLASHCUDA_TEST_SHARED_CACHE") != "1" or not torch.cuda.is_available():
        return
    import cuda.core  # noqa: F401  (import once on this thread: its lazy import is not thread-safe)

    from flashcuda.jit import build_cubin, device_arch

    arch = device_arch(torch.cuda.current_device())
    configs = [bwd_sm80.config_for(BF16, d) for d in bwd_sm80.HEAD_DIMS]
    configs += [bwd_sm80.config_for(FP16, d) for d in (64, 128)]
    specs = [(spec, arch) for cfg in configs for spec in cfg.specs()]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        list(pool.map(lambda sa: build_cubin(*sa), specs))


def visible_mask(sq: int, sk: int, wl: int | None, wr: int | None, device) -> torch.Tensor:
    """(Sq, Sk) bool: row i sees key j iff i + shift - wl <= j <= i + shift + wr (mask.cuh)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    d = j - i - (sk - sq)
    vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if wr is not None:
        vis &= d <= wr
    if wl is not None:
        vis &= d >= -wl
    return vis


def attention(q, k, v, scale, wl, wr):
    """out (B, Sq, H, D) and lse (B, H, Sq) in q's dtype; differentiable; rows with no visible key
    give out 0, lse -inf and zero gradients."""
    h, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=2)
    v = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    vis = visible_mask(q.shape[1], k.shape[1], wl, wr, q.device)
    row_ok = vis.any(-1)[:, None]
    s = s.masked_fill(~vis, float("-inf")).masked_fill(~row_ok, 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(~row_ok[:, 0], float("-inf"))
    p = torch.softmax(s, -1) * row_ok
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def make_qkv(b, sq, sk, h, hkv, d, dtype, packed=False):
    dev = DEVICE
    if packed:  # views of one (B, S, 3, H, D) tensor: strided rows, no copy
        qkv = torch.randn(b, sq, 3, h, d, device=dev, dtype=dtype)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device=dev, dtype=dtype)
    return q, k, v


def run_ours(q, k, v, out, dout, lse, scale, wl, wr, deterministic=False):
    dq = torch.full(q.shape, float("nan"), device=q.device, dtype=q.dtype)
    dk = torch.full(k.shape, float("nan"), device=q.device, dtype=q.dtype)
    dv = torch.full(v.shape, float("nan"), device=q.device, dtype=q.dtype)
    call = BwdCall(q, k, v, out, dout, lse, dq, dk, dv, scale, wl, wr, deterministic)
    why = bwd_sm80.can_implement(call)
    assert why is None, why
    bwd_sm80.run(call)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return dq, dk, dv


def check_grads(q, k, v, wl=None, wr=None, deterministic=False, scale=None):
    """Our grads vs the float64 oracle, within 3x PyTorch's same-dtype error."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention(q64, k64, v64, scale, wl, wr)
    dout = torch.randn(q.shape, device=q.device, dtype=q.dtype)
    out64.backward(dout.double())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outl, _ = attention(ql, kl, vl, scale, wl, wr)
    outl.backward(dout)

    out = out64.detach().to(q.dtype)
    lse = lse64.detach().float()
    ours = run_ours(q, k, v, out, dout, lse, scale, wl, wr, deterministic)
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
            f"{name}: max error {err:.3g} > 3 x torch {q.dtype} error {torch_err:.3g} + {floor:.2g}"
        )
    return ours


SEQLENS = [(1, 17), (17, 1), (128, 128), (143, 1023), (1023, 143)]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grads_core(dtype, d, sq, sk, causal):
    torch.manual_seed(sq * 7 + sk + d)
    q, k, v = make_qkv(2, sq, sk, 2, 2, d, dtype)
    check_grads(q, k, v, wr=0 if causal else None)


@pytest.mark.parametrize("d", [32, 96, 40, 72, 120, 8])
@pytest.mark.parametrize("sq,sk,causal", [(143, 143, True), (17, 128, False)])
def test_grads_other_head_dims(d, sq, sk, causal):
    """Every compile-time head dim, and padded ones (runtime < compile-time, zero-filled)."""
    torch.manual_seed(d + sq)
    q, k, v = make_qkv(1, sq, sk, 3, 3, d, BF16)
    check_grads(q, k, v, wr=0 if causal else None)


@pytest.mark.parametrize("wl,wr", [(32, 8), (64, None), (None, -4), (0, 0), (200, 3)])
@pytest.mark.parametrize("d", [64, 128])
def test_grads_window(wl, wr, d):
    torch.manual_seed(d)
    q, k, v = make_qkv(2, 300, 257, 2, 2, d, BF16)
    check_grads(q, k, v, wl=wl, wr=wr)


@pytest.mark.parametrize("h,hkv", [(8, 2), (3, 1)], ids=["gqa4", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_grads_gqa(h, hkv, causal, d):
    torch.manual_seed(h + d)
    q, k, v = make_qkv(3, 143, 200, h, hkv, d, BF16)
    check_grads(q, k, v, wr=0 if causal else None)


@pytest.mark.parametrize("d", [64, 128])
def test_grads_packed_qkv_views(d):
    torch.manual_seed(d)
    q, k, v = make_qkv(2, 143, 143, 4, 4, d, FP16, packed=True)
    assert not q.is_contiguous()
    check_grads(q, k, v, wr=0)


def test_fully_masked_rows_have_zero_grads():
    torch.manual_seed(0)
    # Causal with Sq > Sk: rows i < Sq - Sk see no key (lse = -inf) -> dq rows exactly 0.
    q, k, v = make_qkv(2, 143, 17, 2, 2, 64, BF16)
    dq, _, _ = check_grads(q, k, v, wr=0)
    assert (dq[:, : 143 - 17] == 0).all()
    # An empty band (every row masked): every gradient is 0.
    q, k, v = make_qkv(1, 130, 130, 2, 2, 128, BF16)
    dq, dk, dv = check_grads(q, k, v, wl=2, wr=-5)
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_empty_sequences():
    torch.manual_seed(0)
    for sq, sk in ((0, 64), (64, 0)):
        q, k, v = make_qkv(2, sq, sk, 2, 2, 64, BF16)
        out = torch.zeros_like(q)
        lse = torch.full((2, 2, sq), float("-inf"), device=DEVICE)
        for det in (False, True):
            dq, dk, dv = run_ours(q, k, v, out, torch.randn_like(q), lse, 0.125, None, None, det)
            assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,hkv,causal", [(2, 2, True), (4, 1, False)])
def test_deterministic(d, h, hkv, causal):
    """deterministic=True: correct, and bitwise equal over repeats."""
    torch.manual_seed(d + h)
    q, k, v = make_qkv(2, 1023, 777, h, hkv, d, BF16)
    wr = 0 if causal else None
    check_grads(q, k, v, wr=wr, deterministic=True)
    scale = d**-0.5
    out64, lse64 = attention(q.double(), k.double(), v.double(), scale, None, wr)
    out, lse = out64.to(q.dtype), lse64.float()
    torch.manual_seed(1)
    dout = torch.randn_like(q)
    a = run_ours(q, k, v, out, dout, lse, scale, None, wr, deterministic=True)
    for _ in range(3):
        b = run_ours(q, k, v, out, dout, lse, scale, None, wr, deterministic=True)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def test_softmax_scale_and_large_values():
    """A non-default scale and large logits (lse far from 0) stay exact."""
    torch.manual_seed(3)
    q, k, v = make_qkv(1, 200, 300, 2, 2, 64, FP16)
    check_grads(q * 4, k, v, scale=0.3, wr=0)

"""Boundary shapes for compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

scripts/gpu_lane.sh runs this file under each tool with torch's caching allocator off, so each
tensor is its own allocation and any out-of-bounds access is reported. Every case also checks its
result against the float64 oracle (loosely: the full tolerance rule lives in the other GPU tests),
so a kernel that stays in bounds but computes garbage still fails here. Shapes are small (the
sanitizers slow kernels 10-100x) and sit on tile edges: 1, tile-1, tile+1, primes.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from flashcuda.jit import KernelSpec, get_kernel
from flashcuda.ops.call import BwdCall, FwdCall
from flashcuda.reference import attention_ref

pytestmark = pytest.mark.gpu

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, window_left, window_right)
SHAPES = [
    (1, 1, 1, 1, 1, 64, None, None),
    (2, 17, 129, 4, 2, 64, None, 0),  # GQA, causal, Sq < Sk
    (1, 129, 63, 2, 1, 128, None, 0),  # MQA, causal, Sq > Sk: rows that see nothing
    (1, 65, 65, 2, 2, 40, 16, 0),  # padded head dim, sliding window
    (1, 127, 131, 2, 2, 128, None, None),
]


@pytest.mark.parametrize("n", [1, 255, 257, 4097])
def test_smoke_kernel_bounds(n):
    x = torch.randn(n, device="cuda")
    y = torch.full_like(x, float("nan"))
    spec = KernelSpec.make("smoke_axpb", "common/smoke.cu")
    get_kernel(spec, x.device).launch(((n + 255) // 256,), (256,), x, y, np.float32(2),
                                      np.float32(1), np.int64(n))
    torch.testing.assert_close(y, 2 * x + 1)


def _inputs(shape, dtype, seed=0):
    b, sq, sk, h, hkv, d = shape[:6]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(dtype)
    return q, k, v


def _window(shape):
    wl, wr = shape[6], shape[7]
    return (-1 if wl is None else wl, -1 if wr is None else wr)


def _family(name):
    return importlib.import_module(f"flashcuda.ops.{name}")


@pytest.mark.parametrize("family,dtype", [("fwd_sm80", torch.bfloat16), ("fwd_simt", torch.float32),
                                          ("fwd_simt", torch.float16)])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_family_bounds(family, dtype, shape):
    mod = _family(family)
    q, k, v = _inputs(shape, dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda")
    call = FwdCall(q, k, v, out, lse, q.shape[-1] ** -0.5, shape[6], shape[7])
    reason = mod.can_implement(call)
    if reason:
        pytest.skip(reason)
    mod.run(call)
    ref, ref_lse = attention_ref(q, k, v, window=(shape[6], shape[7]))
    # Loose bounds (bf16 keeps 8 bits; the sm80 kernel's row sums add the bf16-rounded P that
    # multiplies V, which moves lse by up to 2^-8): an indexing bug is off by O(1).
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max().item() < tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 10 * tol


@pytest.mark.parametrize("family,dtype", [("bwd_sm80", torch.bfloat16), ("bwd_simt", torch.float32)])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_family_bounds(family, dtype, deterministic, shape):
    mod = _family(family)
    q, k, v = _inputs(shape, dtype)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_ref(q64, k64, v64, window=(shape[6], shape[7]))
    dout = torch.randn_like(q)
    ref.backward(dout.double())
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    call = BwdCall(q, k, v, ref.detach().to(dtype), dout, ref_lse.float(), *grads,
                   q.shape[-1] ** -0.5, shape[6], shape[7], deterministic)
    reason = mod.can_implement(call)
    if reason:
        pytest.skip(reason)
    mod.run(call)
    tol = 1e-3 if dtype == torch.float32 else 1e-1
    for got, want in zip(grads, (q64.grad, k64.grad, v64.grad), strict=True):
        assert not got.isnan().any()
        assert (got.double() - want).abs().max().item() < tol * (1 + want.abs().max().item())


@pytest.mark.parametrize("n", [1, 31, 33, 1025])
def test_ladder_bounds(n):
    import flashcuda.ladder as L

    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    torch.testing.assert_close(L.vector_add(x, y), x + y)
    torch.testing.assert_close(L.exp(x), x.exp(), rtol=2e-6, atol=1e-6)
    m = torch.randn(n % 37 + 1, n, device="cuda")
    torch.testing.assert_close(L.row_sum(m), m.double().sum(1).float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(L.transpose(m), m.t().contiguous())
    torch.testing.assert_close(L.softmax(m), m.softmax(-1), rtol=1e-5, atol=1e-6)
    a = torch.randn(n % 67 + 1, n % 45 + 1, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n % 45 + 1, n % 29 + 1, device="cuda", dtype=torch.bfloat16)
    ref = a.double() @ b.double()
    assert (L.matmul(a, b).double() - ref).abs().max().item() < 0.1 + 0.02 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 8), (136, 72), (8, 1032)])
def test_ladder_vector_paths_bounds(dtype, shape):
    # the 16-byte transpose tiles (rows, cols multiples of 8: ragged tiles, a thin matrix) and the
    # softmax kernels: in registers with a warp (8, 72 cols) or a block (1032) per row, and online
    # (out one element past x's offset within 16 bytes)
    import flashcuda.ladder as L

    rows, cols = shape
    x = torch.randn(rows, cols, device="cuda").to(dtype)
    assert torch.equal(L.transpose(x), x.t())
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    want = x.float().softmax(-1)
    torch.testing.assert_close(L.softmax(x).float(), want, **tol)
    shifted = torch.empty(rows * cols + 1, device="cuda", dtype=dtype)[1:].view(rows, cols)
    torch.testing.assert_close(L.softmax(x, out=shifted).float(), want, **tol)

"""The JIT layer on a GPU: a package-compiled kernel runs on torch tensors from the main thread,
from autograd's backward thread, and on a side stream; >48 KiB dynamic shared memory works."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from flashcuda.jit import KernelSpec, get_kernel

pytestmark = pytest.mark.gpu

SMOKE = KernelSpec.make("smoke_axpb", "common/smoke.cu")


def _axpb(x: torch.Tensor, a: float, b: float, stream=None) -> torch.Tensor:
    y = torch.full_like(x, float("nan"))
    n = x.numel()
    get_kernel(SMOKE, x.device).launch(((n + 255) // 256,), (256,), x, y, np.float32(a),
                                       np.float32(b), np.int64(n), stream=stream)
    return y


def test_main_thread_launch_matches_torch():
    x = torch.randn(100_003, device="cuda")
    torch.testing.assert_close(_axpb(x, 2.5, -1.0), 2.5 * x - 1.0, rtol=1e-6, atol=1e-6)


def test_launch_from_another_thread_and_side_stream():
    x = torch.randn(4097, device="cuda")
    result = {}

    def work():
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            result["y"] = _axpb(x, 3.0, 0.5)
        s.synchronize()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    torch.testing.assert_close(result["y"], 3.0 * x + 0.5, rtol=1e-6, atol=1e-6)


class _Scale(torch.autograd.Function):
    """y = a*x + b; the backward runs our kernel on autograd's backward thread."""

    @staticmethod
    def forward(ctx, x):
        return _axpb(x, 2.0, 1.0)

    @staticmethod
    def backward(ctx, gy):
        _Scale.backward_thread = threading.get_ident()
        return _axpb(gy.contiguous(), 2.0, 0.0)


def test_launch_from_autograd_backward_thread():
    x = torch.randn(1000, device="cuda", requires_grad=True)
    y = _Scale.apply(x)
    g = torch.randn_like(y)
    y.backward(g)
    assert _Scale.backward_thread != threading.get_ident()  # really another thread
    torch.testing.assert_close(x.grad, 2.0 * g, rtol=1e-6, atol=1e-6)


def test_python_ints_are_refused_before_launch():
    x = torch.randn(8, device="cuda")
    with pytest.raises(TypeError, match="fixed-width numpy"):
        get_kernel(SMOKE, x.device).launch((1,), (32,), x, x, 1.0, 0.0, 8)


def test_large_dynamic_shared_memory(tmp_path):
    src = tmp_path / "smem.cu"
    src.write_text(
        'extern "C" __global__ void smem_roundtrip(float* y, int n) {\n'
        "  extern __shared__ float buf[];\n"
        "  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = float(i);\n"
        "  __syncthreads();\n"
        "  for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = buf[n - 1 - i];\n}\n")
    spec = KernelSpec.make("smem_roundtrip_test", str(src), entry="smem_roundtrip")
    n = 100 * 1024 // 4  # 100 KiB, above the 48 KiB default
    y = torch.full((n,), float("nan"), device="cuda")
    get_kernel(spec, y.device).launch((1,), (256,), y, np.int32(n), shared_mem=n * 4)
    torch.cuda.synchronize()
    expected = torch.arange(n - 1, -1, -1, device="cuda", dtype=torch.float32)
    assert torch.equal(y, expected)

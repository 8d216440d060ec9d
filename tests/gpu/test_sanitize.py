"""Boundary shapes for compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

scripts/gpu_lane.sh runs this file under each tool with torch's caching allocator off, so each
tensor is its own allocation and any out-of-bounds access is reported. Each case also checks its
result, so a kernel that stays in bounds but computes garbage still fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashcuda.jit import KernelSpec, get_kernel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [1, 255, 256, 257, 4097])
def test_smoke_kernel_bounds(n):
    x = torch.randn(n, device="cuda")
    y = torch.full_like(x, float("nan"))
    spec = KernelSpec.make("smoke_axpb", "common/smoke.cu")
    get_kernel(spec, x.device).launch(((n + 255) // 256,), (256,), x, y, np.float32(2),
                                      np.float32(1), np.int64(n))
    torch.testing.assert_close(y, 2 * x + 1)

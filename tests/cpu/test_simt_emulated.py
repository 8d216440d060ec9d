"""The SIMT flash kernels (flash_fwd_simt.cu, flash_bwd_simt.cu: the readable forward and backward,
and the path for fp32 and head dims the tensor-core kernels do not take) run on the CPU by the
host emulator (tests/cpu/simt_emu) through fwd_simt.run / bwd_simt.run: the GPU tests' cases
(tests/gpu/test_simt.py: fp32 / fp16 / bf16, odd lengths and head dims, MQA / GQA, causal,
windows, SDPA's top-left causal, packed qkv, NaN at unseen keys, deterministic dQ) against the
float64 oracle on CPU tensors. Kernel logic, not a GPU result.
"""

from __future__ import annotations

import pytest
import torch

from flashcuda.ops import bwd_simt, fwd_simt

from . import simt_emu

# the GPU module's flash tests, collected here too (not the OnlineSoftmax struct's: its kernel
# family checks for CUDA itself)
on_gpu, tests, emulated = simt_emu.gpu_suite("tests.gpu.test_simt", (fwd_simt, bwd_simt),
                                             skip={"test_online_softmax_struct_matches_fp64"})
globals().update(tests)

pytestmark = pytest.mark.skipif(simt_emu.available() is not None,
                                reason=str(simt_emu.available()))


def test_a_cpu_tensor_is_still_refused_without_the_emulator(monkeypatch):
    """The seam: outside the emulator a CPU call is not the SIMT kernels' (named refusal)."""
    monkeypatch.undo()
    c = on_gpu.Case(torch.float16, 1, 16, 16, 2, 2, 64)
    q, k, v = on_gpu.make_inputs(c, torch.device("cpu"))
    call = on_gpu.FwdCall(q, k, v, torch.empty_like(q), torch.empty(1, 2, 16), 0.125, None, None)
    assert "CUDA" in fwd_simt.can_implement(call)

"""The sm80 tensor-core forward (flash_bwd_sm80.cu: cp.async tiles, ldmatrix, mma.sync m16n8k16)
run on the CPU by the host emulator (tests/cpu/simt_emu: ldmatrix and mma.sync as warp-collective
exchanges in the PTX ISA's fragment layouts) through bwd_sm80.run, as on an sm_90 GPU: the GPU
suite's bodies (tests/gpu/test_bwd_sm80.py — every kernel head dim and padded ones, odd lengths,
windows, GQA / MQA, packed qkv, NaN handling, both row-sum modes, the masked-V variant bitwise)
on CPU tensors, against its float64 oracle. Kernel logic, not a GPU result.
"""

from __future__ import annotations

import pytest

from flashcuda.ops import bwd_sm80

from . import simt_emu

# the GPU module's tests, collected here too; the deterministic pass at its smallest case only
# (below: its four cases took 3.5 min here)
on_gpu, tests, emulated = simt_emu.gpu_suite("tests.gpu.test_bwd_sm80", (bwd_sm80,),
                                             skip={"test_deterministic"})
globals().update(tests)

pytestmark = pytest.mark.skipif(simt_emu.available() is not None,
                                reason=str(simt_emu.available()))


def test_deterministic_causal_d64():
    """deterministic=True (dQ by its own pass, no atomics): correct and bitwise equal over repeats,
    the GPU suite's smallest case."""
    on_gpu.test_deterministic(64, 2, 2, True)

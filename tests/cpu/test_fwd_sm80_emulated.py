"""The sm80 tensor-core forward (flash_fwd_sm80.cu: cp.async tiles, ldmatrix, mma.sync m16n8k16)
run on the CPU by the host emulator (tests/cpu/simt_emu: ldmatrix and mma.sync as warp-collective
exchanges in the PTX ISA's fragment layouts) through fwd_sm80.run, as on an sm_90 GPU: the GPU
suite's bodies (tests/gpu/test_fwd_sm80.py — every kernel head dim and padded ones, odd lengths,
windows, GQA / MQA, packed qkv, NaN handling, both row-sum modes, the masked-V variant bitwise)
on CPU tensors, against its float64 oracle. Kernel logic, not a GPU result.
"""

from __future__ import annotations

import pytest

from flashcuda.ops import fwd_sm80

from . import simt_emu

# the GPU module's tests, collected here too; not the one that asks the CUDA runtime for its
# current device
on_gpu, tests, emulated = simt_emu.gpu_suite("tests.gpu.test_fwd_sm80", (fwd_sm80,),
                                             skip={"test_config_on_this_gpu"})
globals().update(tests)

pytestmark = pytest.mark.skipif(simt_emu.available() is not None,
                                reason=str(simt_emu.available()))

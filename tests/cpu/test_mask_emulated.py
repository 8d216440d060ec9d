"""mask.cuh's block_verdicts (the sm90 backward's FC_MASK_BLOCKS) and hidden_query_blocks /
hidden_key_blocks (FC_MASK_SKIP) run on the CPU by the host emulator (tests/cpu/simt_emu) through
mask_test.cu's test kernels: the GPU tests' cases (tests/gpu/test_mask.py) against `visible`
tested pair by pair. Kernel logic, not a GPU result.
"""

from __future__ import annotations

import pytest
import torch

from flashcuda.ops import mask_check
from tests.gpu import test_mask as on_gpu

from . import simt_emu

pytestmark = pytest.mark.skipif(simt_emu.available() is not None,
                                reason=str(simt_emu.available()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_verdicts_match_every_pair(seed):
    kernel = simt_emu.build(mask_check.verdicts_spec())
    cases = on_gpu.verdict_cases(seed, 1500)
    got = mask_check.block_verdicts(torch.tensor(cases, dtype=torch.int32), launch=kernel.launch)
    on_gpu.check_verdicts(cases, got)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hidden_blocks_match_every_pair(seed):
    kernel = simt_emu.build(mask_check.hidden_spec())
    cases = on_gpu.hidden_cases(seed, 600)
    got = mask_check.hidden_blocks(torch.tensor(cases, dtype=torch.int32), launch=kernel.launch)
    on_gpu.check_hidden(cases, got)

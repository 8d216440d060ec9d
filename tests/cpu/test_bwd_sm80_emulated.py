"""The sm80 tensor-core forward (flash_bwd_sm80.cu: cp.async tiles, ldmatrix, mma.sync m16n8k16)
run on the CPU by the host emulator (tests/cpu/simt_emu: ldmatrix and mma.sync as warp-collective
exchanges in the PTX ISA's fragment layouts) through bwd_sm80.run, as on an sm_90 GPU: the GPU
suite's bodies (tests/gpu/test_bwd_sm80.py — every kernel head dim and padded ones, odd lengths,
windows, GQA / MQA, packed qkv, NaN handling, both row-sum modes, the masked-V variant bitwise)
on CPU tensors, against its float64 oracle. Kernel logic, not a GPU result.
"""

from __future__ import annotations

import importlib

import pytest

from flashcuda.ops import bwd_sm80

from . import simt_emu

on_gpu = importlib.import_module("tests.gpu.test_bwd_sm80")

# the GPU module's tests, collected here too (its module mark, gpu, is not theirs); the
# deterministic pass at its smallest case only (below: its four cases took 3.5 min here)
SKIP = {"test_deterministic"}
globals().update({name: test for name, test in vars(on_gpu).items()
                  if name.startswith("test_") and name not in SKIP})

pytestmark = pytest.mark.skipif(simt_emu.available() is not None,
                                reason=str(simt_emu.available()))


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    simt_emu.emulate(monkeypatch, bwd_sm80)
    monkeypatch.setattr(on_gpu, "DEVICE", "cpu")


def test_deterministic_causal_d64():
    """deterministic=True (dQ by its own pass, no atomics): correct and bitwise equal over repeats,
    the GPU suite's smallest case."""
    on_gpu.test_deterministic(64, 2, 2, True)

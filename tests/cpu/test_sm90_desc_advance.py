"""FC_DESC_ADVANCE (sm90.cuh; every sm90 kernel's since session 11; the rebuilt descriptors, =0,
were removed in session 39): a GEMM's k16-step descriptors are its first step's plus the byte
offset >> 4, instead of being rebuilt from each address.

On the CPU lane: the arithmetic claim it rests on, over every 16-byte-aligned shared-memory
address a CTA can have, and the removed form refused at compile time. (The SASS of both forms
was compared here until session 39: the advanced descriptors had the same HGMMA instructions and
fewer than 0.9 x the uniform-datapath instructions; docs/perf-notes.md.)
"""

from __future__ import annotations

import pytest
import torch

from flashcuda.jit import compile_spec
from flashcuda.ops import bwd_sm90

from .sm90_compile import ARCH

SMEM_LIMIT = 232448  # bytes of shared memory a CTA may have on the H100 / H200


def desc_field(addr: int) -> int:
    """The start-address field of sm90.cuh's smem_desc: (addr & 0x3ffff) >> 4."""
    return (addr & 0x3FFFF) >> 4


def test_advanced_field_equals_rebuilt_field_over_all_shared_addresses():
    """desc_advance adds offset >> 4 to the low 32-bit word; that equals the rebuilt descriptor
    iff the 14-bit field never carries into bit 14 (bits 14-15 are reserved, 16-29 hold LBO).
    Checked for every aligned base below the limit and every offset the kernels add (up to the
    last k16 step of the largest tile) that keeps the operand inside shared memory."""
    offsets = range(0, 64 * 1024, 16)
    for base in range(0, SMEM_LIMIT, 1024):  # operand bases are 1024-aligned chunks
        for off in offsets:
            if base + off >= SMEM_LIMIT:
                break
            advanced = desc_field(base) + (off >> 4)
            assert advanced < 1 << 14
            assert advanced == desc_field(base + off)


def test_the_rebuilt_descriptors_are_refused(tmp_path):
    """FC_DESC_ADVANCE=0 (the descriptors rebuilt per k16 step, the A/B baseline before session
    39) no longer builds: sm90.cuh refuses it rather than quietly compiling the default."""
    import dataclasses

    cfg = dataclasses.replace(bwd_sm90.select_config(torch.bfloat16, 64),
                              defines=(("FC_DESC_ADVANCE", 0),))
    with pytest.raises(Exception, match="FC_DESC_ADVANCE"):
        compile_spec(cfg.spec(), ARCH)

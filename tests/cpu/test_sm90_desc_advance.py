"""FC_DESC_ADVANCE (sm90.cuh; the default of both sm90 kernels since session 11, =0 through
FLASHCUDA_SM90_FWD_DEFINES / FLASHCUDA_SM90_BWD_DEFINES restores the rebuilt descriptors): a GEMM's k16-step descriptors are its first step's plus the byte
offset >> 4, instead of being rebuilt from each address.

On the CPU lane: the arithmetic claim it rests on, over every 16-byte-aligned shared-memory
address a CTA can have; the variants compile clean for sm_90a; their SASS has the same HGMMA
instructions as the default kernels with fewer uniform-datapath instructions (what the knob is
for). Whether the kernels are right and faster is for the GPU lane (docs/perf-notes.md).
"""

from __future__ import annotations

import re

import pytest
import torch

from flashcuda.jit import compile_spec
from flashcuda.ops import bwd_sm90, fwd_sm90

from .sm90_compile import ARCH, assert_compiled_clean, dump

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


def _variants():
    out = []
    for d in (64, 128):
        out.append(("bwd", bwd_sm90.select_config(torch.bfloat16, d)))
        out.append(("fwd", fwd_sm90.select_config(torch.bfloat16, d)))
    return out


@pytest.mark.parametrize("kind,cfg", _variants(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_desc_advance_compiles_clean_with_fewer_uniform_ops(kind, cfg, tmp_path):
    import dataclasses

    adv = cfg  # the default
    cfg = dataclasses.replace(cfg, defines=(("FC_DESC_ADVANCE", 0),))  # rebuilt descriptors
    assert cfg.name.endswith("_fc_desc_advance0")
    base_build, adv_build = compile_spec(cfg.spec(), ARCH), compile_spec(adv.spec(), ARCH)
    assert_compiled_clean(adv_build, adv.name)
    assert not re.search(r"C75\d\d", adv_build.log), adv_build.log
    sass = {name: dump(b.cubin, tmp_path, "-sass")
            for name, b in (("base", base_build), ("adv", adv_build))}
    hgmma = {k: sorted(re.sub(r"\s+", " ", m) for m in re.findall(r"HGMMA\.[^;]*", v))
             for k, v in sass.items()}
    # the same wgmma shapes and operand kinds (registers may be renamed)
    shape = {k: sorted(re.match(r"HGMMA\.\S+", x).group(0) for x in v) for k, v in hgmma.items()}
    assert shape["adv"] == shape["base"]

    def uniform_ops(text: str) -> int:
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?(U[A-Z0-9]+)", text)
        return sum(1 for op in ops if not op.startswith(("UTMA", "USETMAXREG", "UBLK")))

    assert uniform_ops(sass["adv"]) < 0.9 * uniform_ops(sass["base"])

"""scripts/sass_loop.py's loop finder on a synthetic cuobjdump listing (no compiler needed)."""

from __future__ import annotations

import pytest

from . import script_module

# addresses step by 0x10; the loop: 0x0040 .. 0x00f0, the mask block 0x00a0 .. 0x00c0
SASS = """
        /*0000*/                   BAR.SYNC.DEFER_BLOCKING R3, 0x100 ;   /* first tile's turn */
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0030*/                   MUFU.EX2 R5, R5 ;
        /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR42+0x22020], R11 ;
        /*0050*/                   @!P0  BRA 0x0200 ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING R3, 0x100 ;
        /*0070*/                   UMOV UR23, 0x40000040 ;
        /*0080*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24 ;
        /*0090*/                   @P0   BRA P1, 0x00d0 ;
        /*00a0*/                   ISETP.GE.AND P2, PT, R8, UR43, PT ;
        /*00b0*/                   FSEL R12, -R6, -RZ, P1 ;
        /*00c0*/                   ISETP.GE.AND P3, PT, R8, UR43, PT ;
        /*00d0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*00e0*/                   FMNMX R13, R24, R25, !PT ;
        /*00f0*/                   @!P0  BRA 0x0040 ;
        /*0100*/                   EXIT ;
        /*0200*/                   BRA 0x0040 ;
"""


def _module():
    return script_module.load("sass_loop")


def test_the_loop_its_skipped_mask_block_and_bookkeeping():
    m = _module()
    loop = m.find_loop(SASS)
    assert (loop.head, loop.back, loop.skipped) == (4, 15, 3)
    assert loop.per_step == 9  # 12 instructions, the mask's 3 skipped
    assert loop.instructions[0].startswith("SYNCS") and loop.instructions[-1].endswith("0x0040")
    # not float work, the mask block left out: the wait, its retry, the turn, UMOV, the branch,
    # the wgmma wait and the back edge
    assert [m.opcode(s) for s in m.bookkeeping(loop)] == [
        "SYNCS", "BRA", "BAR", "UMOV", "BRA", "WARPGROUP", "BRA"]


def test_a_listing_without_the_loop_says_so():
    m = _module()
    one_turn = "\n".join(line for line in SASS.splitlines() if "/*0060*/" not in line)
    with pytest.raises(ValueError, match="two turn barriers"):
        m.find_loop(one_turn)

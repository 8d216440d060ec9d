"""scripts/ncu_source_summary.py on a synthetic Nsight Compute source-page CSV."""

from __future__ import annotations

import csv
import io

from . import script_module


def _module():
    return script_module.load("ncu_source_summary")


CSV = '''==PROF== a line ncu prints first
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_short_sb"
"0x10","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24","10","5","0","1"
"0x20","@P0 REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU [R2.64], R8","60","50","40","0"
"0x30","MUFU.EX2 R5, R5","30","20","0","25"
"0x40","REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU [R4.64], R12","0","0","0","0"
'''


def test_summary_ranks_instructions_opcodes_and_reasons():
    rows = list(csv.reader(io.StringIO(CSV)))
    text = _module().summarize(rows, top=2)
    lines = text.splitlines()
    assert lines[0].startswith("4 instructions, 100 stall samples")
    top = lines[lines.index("top 2 instructions:") + 1:][:2]
    assert "60.0%" in top[0] and "REDG" in top[0]
    assert "30.0%" in top[1] and "MUFU" in top[1]
    by_op = lines[lines.index("by opcode:") + 1:]
    assert by_op[0].split() == ["60.0%", "REDG"]  # the predicate is not taken for the opcode
    assert "40.0%  stall_long_sb" in text and "26.0%  stall_short_sb" in text
    assert "Not-issued" not in text.split("by reason")[1]


def test_unknown_layout_prints_the_header():
    rows = [["Address", "Source", "Instructions Executed"], ["0x10", "NOP", "3"]]
    assert "no warp-stall sampling column" in _module().summarize(rows, top=5)
    assert "no 'Source' column" in _module().summarize([["a", "b"]], top=5)


def test_executed_instructions_by_opcode():
    rows = [["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
             "Thread Instructions Executed"],
            ["0x10", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR26+0x38050], R0", "0", "5,000,000",
             "5,000,000"],
            ["0x20", "@!P0  BRA 0x10", "7", "5,000,000", "5,000,000"],
            ["0x30", "MUFU.EX2 R5, R5", "3", "1,000,000", "32,000,000"]]
    text = _module().summarize(rows, top=3)
    tail = text.split("warp instructions executed: 11.00 M; by opcode (M):")[1].split()
    # (the warp count, not the thread count; a predicated branch under its opcode)
    assert tail == ["5.00", "SYNCS", "5.00", "BRA", "1.00", "MUFU"]


def test_hot_loop_counts_instructions_and_samples_per_opcode():
    rows = [["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"],
            ["0x10", "MUFU.EX2 R5, R5", "30", "2,000,000"],
            ["0x20", "MUFU.EX2 R6, R6", "20", "2,000,000"],
            ["0x30", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "70", "2,000,000"],
            ["0x40", "@!P0  BRA 0x10", "0", "36,000,000"],  # a polling loop: left out
            ["0x50", "EXIT", "9", "30,000"]]  # once per warp: left out
    text = _module().summarize(rows, top=3, hot=1.5e6)
    _, tail = text.split("hot loop (executed 1500000 to 6000000 times): ")
    assert tail.splitlines()[0] == ("3 instructions, 120 stall samples; by opcode "
                                    "(instructions, samples):")
    assert [line.split() for line in tail.splitlines()[1:]] == [
        ["1", "70", "WARPGROUP"], ["2", "50", "MUFU"]]
    assert "hot loop" not in _module().summarize(rows, top=3)

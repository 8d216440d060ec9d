"""scripts/ncu_instruction_mix.py on synthetic Nsight Compute source-page CSVs."""

from __future__ import annotations

import pytest

from . import script_module


def _module():
    return script_module.load("ncu_instruction_mix")


HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]


def _rows(counts: list[tuple[str, str]]) -> list[list[str]]:
    return [["==PROF== a line first"], HEADER] + [
        [f"0x{16 * i:x}", text, "0", n] for i, (text, n) in enumerate(counts)]


def test_regions_split_per_cta_from_per_step_code():
    m = _module()
    ins = m.executed(_rows([("IMAD R1, R2, R3, RZ", "4")] * 9 + [("@P0 MUFU.EX2 R5, R5", "1,000")] * 10
                           + [("BRA 0x0", "4")]))
    assert ins[9] == ("@P0 MUFU.EX2 R5, R5", 1000)
    got = m.regions(ins)
    assert [(first, length, count) for first, length, count, _ in got] == [(0, 9, 4), (9, 10, 1000)]
    assert got[1][3] == [("MUFU", 10)]  # (the predicate is not the opcode)


def test_report_sorts_opcodes_by_difference():
    m = _module()
    a = m.executed(_rows([("SEL R1, R2, R3, P0", "3000000"), ("MUFU.EX2 R5, R5", "1000000")]))
    b = m.executed(_rows([("SHFL.IDX R1, R2, R3, R4", "2000000"), ("MUFU.EX2 R5, R5", "1000000")]))
    text = m.report(a, b, ("ours", "peer"), top=5)
    lines = text.split("executed per opcode (M), ours - peer:")[1].split("\n")[1:]
    assert [ln.split()[0] for ln in lines] == ["SEL", "MUFU", "SHFL"]
    assert lines[0].split()[1:] == ["3.000", "0.000", "+3.000"]
    assert "ours: 2 instructions, 4.00 M executed" in text


def test_a_page_without_executed_counts_is_refused():
    with pytest.raises(ValueError, match="Instructions Executed"):
        _module().executed([["Address", "Source", "Warp Stall Sampling (All Samples)"],
                            ["0x0", "NOP", "1"]])

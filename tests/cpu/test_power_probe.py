"""scripts/power_probe.py on the CPU: the summary of nvidia-smi's samples (the GPU part runs on
the device: gpu_lane.sh power)."""

from __future__ import annotations

import pytest

from . import script_module


@pytest.fixture(scope="module")
def probe():
    return script_module.load("power_probe")


def test_samples_summarised(probe):
    out = ("1980, 350.12, 0x0000000000000000\n"
           "1650, 689.50, 0x0000000000000004\n"
           "1350, 704.00, 0x0000000000000004\n"
           "\n"
           "[N/A], 690.0, 0x0000000000000004\n"   # a field that does not parse: skipped
           "1700, 688.0\n")                       # two fields: skipped
    got = probe.summarize(out)
    assert got == {"samples": 3, "clock_median": 1650.0, "clock_min": 1350.0,
                   "power_median": 689.5, "power_max": 704.0,
                   "reasons": {"0x0000000000000000": 1, "0x0000000000000004": 2}}
    text = probe.describe(got)
    assert "1650 MHz (min 1350)" in text and "690 W (max 704)" in text and "3 samples" in text


def test_no_samples(probe):
    assert probe.summarize("") == {"samples": 0}
    assert probe.describe({"samples": 0}) == "no nvidia-smi samples"

"""scripts/racecheck_probe.py's two probe kernels build for sm_90a without spills or warnings (static shared memory: one CTA, 128 threads),
and a wrong probe or mode is refused with the usage (the runs themselves need the GPU and
compute-sanitizer: docs/GUARANTEES.md)."""

from __future__ import annotations

import sys

import pytest

from flashcuda.jit import KernelSpec, compile_spec

from .script_module import load


@pytest.mark.parametrize("name", ["bulk_copy_probe", "mbarrier_handoff_probe"])
def test_probe_kernels_build_clean(name):
    result = compile_spec(KernelSpec.make(name, f"common/{name}.cu"), "sm_90a")
    res = result.resources()[name]
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res
    assert "warning" not in result.log.lower(), result.log


def test_usage_names_the_modes(monkeypatch):
    probe = load("racecheck_probe")
    assert set(probe.MODES) == {"bulk", "handoff"}
    monkeypatch.setattr(sys, "argv", ["racecheck_probe.py", "handoff", "fenced"])
    with pytest.raises(SystemExit, match="handoff: ordered"):
        probe.main()

"""scripts/wgmma_rate.py's kernel (common/wgmma_rate.cu) builds for sm_90a at every N it measures,
with the 8 wgmma of its loop of that shape and no local memory."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from flashcuda.jit import compile_spec

from .sm90_compile import ARCH, assert_compiled_clean, dump

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "wgmma_rate.py"


def _script():
    mod = importlib.util.spec_from_file_location("wgmma_rate", SCRIPT)
    module = importlib.util.module_from_spec(mod)
    mod.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n", [64, 128, 176])
def test_wgmma_rate_kernel_builds(n, tmp_path):
    script = _script()
    spec = script.spec(n, 2)
    result = compile_spec(spec, ARCH)
    assert_compiled_clean(result, spec.name)
    sass = dump(result.cubin, tmp_path, "-sass")
    assert len(re.findall(rf"HGMMA\.64x{n}x16\.F32\.BF16 ", sass)) == 8
    assert script.smem_bytes(n, 2) <= 232448

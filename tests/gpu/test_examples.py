"""Examples run as tests (GPU lane): a shortened training comparison must still agree with SDPA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_train_compare_short(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_compare.py"), "--steps", "40", "--layers",
         "2", "--dim", "256", "--heads", "4", "--seqlen", "256", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads((tmp_path / "train-compare.json").read_text())
    assert record["ok"] and record["mean_abs_diff_last"] <= 0.05
    assert (tmp_path / "train-compare.png").stat().st_size > 0


@pytest.mark.parametrize("mode", [[], ["--paged"], ["--graph"],
                                  ["--paged", "--runs"],
                                  ["--paged", "--graph"]],
                         ids=["rows", "paged", "graph", "paged-runs", "paged-graph"])
def test_generate_kvcache(mode):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "generate_kvcache.py"),
                          "--device", "cuda", "--tokens", "24", *mode],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr

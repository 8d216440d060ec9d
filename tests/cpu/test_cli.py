"""`flashcuda info` and `python -m flashcuda` on a machine with no GPU."""

from __future__ import annotations

import subprocess
import sys


def test_import_needs_no_cuda():
    code = "import sys, flashcuda; print(sorted(m for m in sys.modules if m.startswith('cuda')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout  # no CUDA module is imported at import time


def test_info_runs_and_says_plainly_when_there_is_no_gpu():
    out = subprocess.run([sys.executable, "-m", "flashcuda", "info"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "flashcuda" in out.stdout and "NVRTC" in out.stdout and "kernel cache" in out.stdout
    import torch

    if not torch.cuda.is_available():
        assert "none usable here" in out.stdout

"""`flashcuda info` and `python -m flashcuda` on a machine with no GPU."""

from __future__ import annotations

import subprocess
import sys


def test_import_needs_no_gpu_and_loads_no_cuda_module_of_ours():
    # torch may import cuda.bindings by itself; flashcuda adds neither cuda.core nor NVRTC, and
    # touches no driver, at import time (this machine has none).
    code = ("import sys, torch; before = set(sys.modules); import flashcuda; "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('cuda')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_info_runs_and_says_plainly_when_there_is_no_gpu():
    out = subprocess.run([sys.executable, "-m", "flashcuda", "info"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "flashcuda" in out.stdout and "NVRTC" in out.stdout and "kernel cache" in out.stdout
    import torch

    if not torch.cuda.is_available():
        assert "none usable here" in out.stdout


def test_demo_without_gpu_runs_the_portable_path_and_compiles_for_sm90a():
    import torch

    if torch.cuda.is_available():
        return
    out = subprocess.run([sys.executable, "-m", "flashcuda", "demo"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert "portable" in text and "-> ok" in text
    assert "for sm_90a" in text and "need an NVIDIA GPU" in text

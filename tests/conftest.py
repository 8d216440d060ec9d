"""Two lanes: the CPU lane (default, CI) and the GPU lane (`pytest -m gpu` on a CUDA machine).

GPU tests are skipped, with the reason, where no CUDA GPU is usable. Every test gets a private
kernel cache directory unless FLASHCUDA_TEST_SHARED_CACHE=1 (the GPU lane sets it to reuse cubins).
"""

from __future__ import annotations

import os

import pytest


def _cuda_usable() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is usable here (torch.cuda.is_available() is False)"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ok, why = _cuda_usable()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"GPU lane: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    if os.environ.get("FLASHCUDA_TEST_SHARED_CACHE") == "1":
        yield
        return
    from flashcuda.jit import reset_disk_cache

    d = tmp_path_factory.mktemp("kcache")
    d.chmod(0o700)
    monkeypatch.setenv("FLASHCUDA_CACHE_DIR", str(d))
    reset_disk_cache()
    yield
    reset_disk_cache()

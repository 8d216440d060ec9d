"""Two lanes: the CPU lane (default, CI) and the GPU lane (`pytest -m gpu` on a CUDA machine).

GPU tests are skipped, with the reason, where no CUDA GPU is usable. Every test gets a private
kernel cache directory unless FLASHCUDA_TEST_SHARED_CACHE=1 (the GPU lane sets it to reuse cubins).
A module that compiles many kernels shares one cache over its tests instead: it overrides
`_private_cache` with a fixture that requests `module_kernel_cache`.
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


@pytest.fixture(scope="module")
def module_kernel_cache(request, tmp_path_factory):
    """One private kernel cache for a whole module (the default is one per test, which would
    compile every kernel once per test), unless the lane's shared cache is in use."""
    if os.environ.get("FLASHCUDA_TEST_SHARED_CACHE") == "1":
        yield
        return
    from flashcuda.jit import reset_disk_cache

    d = tmp_path_factory.mktemp(f"kcache-{request.module.__name__.rpartition('.')[2]}")
    d.chmod(0o700)
    old = os.environ.get("FLASHCUDA_CACHE_DIR")
    os.environ["FLASHCUDA_CACHE_DIR"] = str(d)
    reset_disk_cache()
    yield
    if old is None:
        os.environ.pop("FLASHCUDA_CACHE_DIR", None)
    else:
        os.environ["FLASHCUDA_CACHE_DIR"] = old
    reset_disk_cache()

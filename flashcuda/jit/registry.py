"""Every kernel variant the package can dispatch, so the CPU lane can compile them all.

Modules that own kernels register a provider: a function yielding (KernelSpec, archs) pairs, where
archs are the NVRTC targets the variant is built for (e.g. ('sm_80', 'sm_90a')).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

from .spec import KernelSpec

Provider = Callable[[], Iterable[tuple[KernelSpec, tuple[str, ...]]]]
_PROVIDERS: list[Provider] = []

# Modules that register providers when imported.
_KERNEL_MODULES = (
    "flashcuda.ladder",
    "flashcuda.ops.fwd_simt",
    "flashcuda.ops.bwd_simt",
    "flashcuda.ops.fwd_sm80",
    "flashcuda.ops.fwd_sm90",
    "flashcuda.ops.fwd_decode",
    "flashcuda.ops.bwd_sm80",
    "flashcuda.ops.bwd_sm90",
    "flashcuda.ops.bwd_sm90_wide",
    "flashcuda.ops.softmax_state",
    "flashcuda.ops.mask_check",
)


def register(provider: Provider) -> Provider:
    _PROVIDERS.append(provider)
    return provider


def all_variants() -> list[tuple[KernelSpec, tuple[str, ...]]]:
    for module in _KERNEL_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    seen: dict[str, tuple[KernelSpec, tuple[str, ...]]] = {}
    for provider in _PROVIDERS:
        for spec, archs in provider():
            seen.setdefault(spec.name, (spec, archs))
    return list(seen.values())

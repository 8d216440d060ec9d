"""flashcuda: Flash Attention as hand-written CUDA C++ kernels, compiled at first use with NVRTC.

`import flashcuda` needs no GPU and no CUDA driver; the CUDA modules load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ._log import logger  # noqa: E402,F401

__all__ = ["__version__", "flash_attn_func", "scaled_dot_product_attention"]

# The public functions load on first use (PEP 562), with torch and the flashcuda:: custom ops:
# `import torch` imports cuda.bindings where it is installed, and `import flashcuda` imports no
# CUDA module. `import flashcuda.api` registers the ops eagerly.
_LAZY = {"flash_attn_func": "api", "scaled_dot_product_attention": "api"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

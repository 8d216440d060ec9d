"""flashcuda: Flash Attention as hand-written CUDA C++ kernels, compiled at first use with NVRTC.

`import flashcuda` needs no GPU and no CUDA driver; the CUDA modules load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ._log import logger  # noqa: E402,F401

"""flashcuda: Flash Attention as hand-written CUDA C++ kernels, compiled at first use with NVRTC.

`import flashcuda` needs no GPU and no CUDA driver: kernels compile and load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ._log import logger  # noqa: E402,F401
from .api import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    scaled_dot_product_attention,
)
from .kvcache import flash_attn_with_kvcache  # noqa: E402

__all__ = ["__version__", "flash_attn_func", "flash_attn_kvpacked_func",
           "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_with_kvcache", "scaled_dot_product_attention"]

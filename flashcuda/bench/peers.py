"""The implementations a run times on the same inputs: flashcuda and its peers.

Every implementation takes (batch, seqlen, nheads, headdim) tensors q, k, v that require grad and
returns out in the same layout (a view is fine), so one `dout` and one set of leaf tensors serve
all of them. A peer that cannot be imported is recorded as absent with the import error; a peer
that raises on a configuration is recorded as failed at that point with the message. Nothing is
ever substituted for a missing peer.

    sdpa_*            torch SDPA with one backend forced (torch.nn.attention.sdpa_kernel), on the
                      transposed (batch, nheads, seqlen, headdim) view; causal is top-left aligned,
                      which equals bottom-right for seqlen_q == seqlen_k (the sweep).
    fa2               flash_attn.flash_attn_func (FlashAttention 2).
    fa4               flash_attn.cute.flash_attn_func (FlashAttention 4, CuTe DSL); returns
                      (out, lse) in some versions.
                      fa2 and fa4 are also looked for in the directories of FLASHCUDA_BENCH_SITE
                      (os.pathsep-separated, added with site.addsitedir so their .pth files run:
                      the CuTe DSL needs its own), for wheels installed with `pip --target` on a
                      machine without network (scripts/fa4_carry.sh).
    triton_tutorial   Triton's python/tutorials/06-fused-attention.py, loaded from the file named by
                      FLASHCUDA_TRITON_TUTORIAL (the tutorial ships in no package). fp16 only,
                      contiguous (B, H, S, D); forward only. Its TMA forward ignores the batch index,
                      so only its speed is meaningful for batch > 1; it never counts as "best peer".
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import site
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# The MATH backend materialises (B, H, S, S) scores; skip it above this (PERFORMANCE.md).
MATH_SCORES_LIMIT_BYTES = 8 * 1024**3

SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}

# Display names (tables, plots).
LABELS = {
    "flashcuda": "flashcuda",
    "sdpa_flash": "SDPA flash",
    "sdpa_cudnn": "SDPA cuDNN",
    "sdpa_efficient": "SDPA eff",
    "sdpa_math": "SDPA math",
    "fa2": "FA2",
    "fa4": "FA4",
    "triton_tutorial": "Triton tut",
}
SHORT = {
    "flashcuda": "fc", "sdpa_flash": "flash", "sdpa_cudnn": "cudnn", "sdpa_efficient": "eff",
    "sdpa_math": "math", "fa2": "fa2", "fa4": "fa4", "triton_tutorial": "triton",
}
PEER_NAMES = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "fa2", "fa4",
              "triton_tutorial")
# Reference for the correctness spot-check: the first of these that ran at the point.
REFERENCE_ORDER = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")


@dataclass
class Impl:
    """One implementation. status: 'ok' (importable) or 'absent' (detail says why)."""

    name: str
    status: str
    detail: str = ""
    forward: Callable | None = None  # (*prepared, causal, scale) -> out (B, S, H, D)
    prepare: Callable = field(default=lambda q, k, v: (q, k, v))
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    backward: bool = True  # autograd through `forward` is supported and timed
    in_best: bool = True  # may be the "best peer" of a point
    input_dtype: str | None = None  # runs in this dtype instead of the sweep's (Triton: fp16)
    scores_limit_bytes: int | None = None

    @property
    def label(self) -> str:
        return LABELS.get(self.name, self.name)

    def skip_reason(self, batch: int, nheads: int, seqlen_q: int, seqlen_k: int) -> str | None:
        if self.scores_limit_bytes is not None:
            need = batch * nheads * seqlen_q * seqlen_k * 4
            if need > self.scores_limit_bytes:
                return (f"needs {need / 1024**3:.1f} GiB of fp32 scores "
                        f"> {self.scores_limit_bytes / 1024**3:.0f} GiB")
        return None

    def status_dict(self) -> dict:
        return {"status": self.status, "detail": self.detail, "label": self.label,
                "backward": self.backward, "in_best": self.in_best, "input_dtype": self.input_dtype}


def _absent(name: str, exc: BaseException) -> Impl:
    return Impl(name, "absent", f"{type(exc).__name__}: {exc}".strip())


def _first(out):
    """FA4 (some versions) and flashcuda with return_lse return (out, lse)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _bhsd(q, k, v):
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def load_flashcuda() -> Impl:
    try:
        fn = importlib.import_module("flashcuda").flash_attn_func
    except (ImportError, AttributeError) as exc:
        return _absent("flashcuda", exc)

    def forward(q, k, v, causal, scale):
        return _first(fn(q, k, v, softmax_scale=scale, causal=causal))

    return Impl("flashcuda", "ok", "flashcuda.flash_attn_func", forward, in_best=False)


def load_sdpa(name: str) -> Impl:
    try:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, SDPA_BACKENDS[name])
    except (ImportError, AttributeError) as exc:
        return _absent(name, exc)

    def forward(q, k, v, causal, scale):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(1, 2)

    return Impl(name, "ok", f"torch SDPA, backend {backend.name}", forward, prepare=_bhsd,
                context=lambda: sdpa_kernel(backend),
                scores_limit_bytes=MATH_SCORES_LIMIT_BYTES if name == "sdpa_math" else None)


def load_fa2() -> Impl:
    try:
        mod = importlib.import_module("flash_attn")
        fn = mod.flash_attn_func
    except Exception as exc:  # noqa: BLE001 - a broken CUDA extension raises OSError etc.
        return _absent("fa2", exc)

    def forward(q, k, v, causal, scale):
        return _first(fn(q, k, v, softmax_scale=scale, causal=causal))

    return Impl("fa2", "ok", f"flash_attn {getattr(mod, '__version__', '?')}", forward)


SITE_ENV = "FLASHCUDA_BENCH_SITE"


def add_bench_sites() -> list[str]:
    """site.addsitedir each directory of FLASHCUDA_BENCH_SITE not yet on sys.path; returns them."""
    added = []
    for d in os.environ.get(SITE_ENV, "").split(os.pathsep):
        if d and os.path.isdir(d) and d not in sys.path:
            site.addsitedir(d)
            added.append(d)
    return added


def load_fa4() -> Impl:
    add_bench_sites()
    try:
        fn = importlib.import_module("flash_attn.cute").flash_attn_func
    except Exception as exc:  # noqa: BLE001
        return _absent("fa4", exc)

    def forward(q, k, v, causal, scale):
        return _first(fn(q, k, v, softmax_scale=scale, causal=causal))

    return Impl("fa4", "ok", "flash_attn.cute.flash_attn_func", forward)


def load_triton_tutorial() -> Impl:
    path = os.environ.get("FLASHCUDA_TRITON_TUTORIAL")
    if not path:
        return Impl("triton_tutorial", "absent",
                    "set FLASHCUDA_TRITON_TUTORIAL to Triton's python/tutorials/06-fused-attention.py")
    try:
        import torch

        spec = importlib.util.spec_from_file_location("flashcuda_bench_triton_tutorial", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        attention = mod.attention
    except Exception as exc:  # noqa: BLE001
        return _absent("triton_tutorial", exc)

    def prepare(q, k, v):
        return tuple(t.detach().transpose(1, 2).contiguous().to(torch.float16) for t in (q, k, v))

    def forward(q, k, v, causal, scale):
        return _first(attention(q, k, v, causal, scale)).transpose(1, 2)

    return Impl("triton_tutorial", "ok", f"Triton tutorial from {path}", forward, prepare=prepare,
                backward=False, in_best=False, input_dtype="fp16")


LOADERS: dict[str, Callable[[], Impl]] = {
    "flashcuda": load_flashcuda,
    **{name: (lambda n=name: load_sdpa(n)) for name in SDPA_BACKENDS},
    "fa2": load_fa2,
    "fa4": load_fa4,
    "triton_tutorial": load_triton_tutorial,
}


def discover(names: Sequence[str] | None = None,
             loaders: dict[str, Callable[[], Impl]] | None = None) -> list[Impl]:
    """flashcuda first, then the requested peers (all by default), each 'ok' or 'absent'."""
    loaders = loaders or LOADERS
    wanted = ["flashcuda", *(n for n in (names or PEER_NAMES) if n != "flashcuda")]
    impls = []
    for name in wanted:
        if name not in loaders:
            raise ValueError(f"unknown implementation {name!r}; known: {', '.join(loaders)}")
        try:
            impls.append(loaders[name]())
        except Exception as exc:  # noqa: BLE001 - a loader bug must not stop the run
            impls.append(_absent(name, exc))
    return impls

"""`flashcuda info`: what this machine offers flashcuda. Works, and exits 0, with no GPU."""

from __future__ import annotations

import importlib.metadata as md
import platform


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def collect() -> dict:
    """Everything `info` reports, as plain data (the bench run record reuses it)."""
    from . import __version__
    from .jit import cache_dir

    info: dict = {
        "flashcuda": __version__,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "cuda-core": _version("cuda-core"),
        "cuda-bindings": _version("cuda-bindings"),
    }
    try:
        from .jit import nvrtc_version

        info["nvrtc"] = nvrtc_version()
    except Exception as exc:  # no NVRTC library found
        info["nvrtc"] = f"unavailable ({type(exc).__name__}: {exc})"
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda or "none (CPU build)"
        gpus = []
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                from .jit import arch_for

                gpus.append({
                    "index": i, "name": p.name, "sm": f"{p.major}.{p.minor}",
                    "target": arch_for(p.major, p.minor), "sms": p.multi_processor_count,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                })
        info["gpus"] = gpus
    except Exception as exc:
        info["gpus"] = []
        info["torch_error"] = str(exc)
    info["driver"] = _driver_version()
    d = cache_dir()
    info["cache_dir"] = str(d)
    try:
        info["cache_entries"] = sum(1 for _ in d.glob("*.json")) if d.is_dir() else 0
    except OSError:
        info["cache_entries"] = 0
    return info


def _driver_version() -> str:
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return f"none ({err.name if hasattr(err, 'name') else err})"
        err, v = driver.cuDriverGetVersion()
        return f"CUDA {v // 1000}.{(v % 1000) // 10}" if int(err) == 0 else "unknown"
    except Exception as exc:
        return f"not found ({type(exc).__name__}: no CUDA driver library on this machine)"


def render(info: dict) -> list[str]:
    lines = [
        f"flashcuda      {info['flashcuda']}  (python {info['python']})",
        f"torch          {info['torch']}  (built for CUDA: {info.get('torch_cuda', '?')})",
        f"cuda-core      {info['cuda-core']}   cuda-bindings {info['cuda-bindings']}",
        f"NVRTC          {info['nvrtc']}",
        f"CUDA driver    {info['driver']}",
    ]
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(
                f"GPU {g['index']}          {g['name']}  sm {g['sm']} (target {g['target']}), "
                f"{g['sms']} SMs, {g['memory_gib']} GiB"
            )
    else:
        lines.append("GPU            none usable here: the CUDA kernels need an NVIDIA GPU (sm 8.0+);")
        lines.append("               attention runs on the portable PyTorch path, kernels still compile")
    lines.append(f"kernel cache   {info['cache_dir']}  ({info['cache_entries']} entries)")
    return lines

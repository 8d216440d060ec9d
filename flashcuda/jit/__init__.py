"""The JIT layer: NVRTC compile -> content-keyed disk cache -> module load -> launch (DESIGN.md §6)."""

from .cache import CacheError, DiskCache, cache_dir
from .compiler import CompileError, CompileResult, Resources, arch_for, compile_spec, nvrtc_version
from .registry import all_variants, register
from .runtime import (
    CompiledKernel,
    KernelPerformanceWarning,
    PreparedLaunch,
    build_cubin,
    device_arch,
    disk_cache,
    get_kernel,
    launch_stream,
    reset_disk_cache,
)
from .spec import KERNELS_DIR, KernelSpec

__all__ = [
    "KERNELS_DIR", "CacheError", "CompileError", "CompileResult", "CompiledKernel", "DiskCache",
    "KernelPerformanceWarning", "KernelSpec", "PreparedLaunch", "Resources", "all_variants",
    "arch_for", "build_cubin", "cache_dir", "compile_spec", "device_arch", "disk_cache",
    "get_kernel", "launch_stream", "nvrtc_version", "register", "reset_disk_cache",
]

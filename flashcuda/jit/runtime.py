"""Module load per (device, primary context) and launch on torch's current stream.

    kernel = get_kernel(spec, device)          # compile (or cache hit) + load, memoised
    kernel.launch(grid, block, q, k, np.int32(n), np.float32(scale), shared_mem=bytes)

Arguments: torch tensors go as device pointers, None as a null pointer, numpy scalars
(np.int32, np.int64, np.uint32, np.float32) at their own width. Plain Python ints and floats are
refused: cuda.core would pack an int as a 64-bit pointer, which silently breaks an `int` parameter.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from .._log import logger
from .cache import DiskCache
from .compiler import COMPILE_OPTIONS, arch_for, compile_spec, nvrtc_version
from .spec import KernelSpec

_SCALARS = (np.int32, np.int64, np.uint32, np.uint64, np.float32)
_DEFAULT_SMEM_LIMIT = 48 * 1024

_lock = threading.RLock()
_cache: DiskCache | None = None
_kernels: dict[tuple[int, str], CompiledKernel] = {}
_thread = threading.local()


def disk_cache() -> DiskCache:
    global _cache
    with _lock:
        if _cache is None:
            _cache = DiskCache()
        return _cache


def reset_disk_cache() -> None:
    """Forget the cache object (tests change FLASHCUDA_CACHE_DIR) and every loaded kernel."""
    global _cache
    with _lock:
        _cache = None
        _kernels.clear()


def tool_versions() -> str:
    from .. import __version__

    return f"nvrtc={nvrtc_version()};flashcuda={__version__}"


def build_cubin(spec: KernelSpec, arch: str) -> tuple[bytes, bool, float]:
    """(cubin, cache_hit, seconds) for `spec` on `arch`, through the disk cache."""
    key = spec.key(arch, COMPILE_OPTIONS, tool_versions())
    start = time.perf_counter()

    def build() -> bytes:
        result = compile_spec(spec, arch)
        logger.info("compiled %s for %s in %.2fs", spec.name, arch, result.seconds)
        return result.cubin

    cubin, hit = disk_cache().get_or_build(f"{spec.name}.{arch}", key, build)
    return cubin, hit, time.perf_counter() - start


def _make_current(device_index: int):
    """Make the device's primary context current on this thread (autograd's backward thread
    may have none) and return the cuda.core Device."""
    from cuda.core import Device

    per_thread = getattr(_thread, "devices", None)
    if per_thread is None:
        per_thread = _thread.devices = {}
    dev = per_thread.get(device_index)
    if dev is None or getattr(_thread, "current", None) != device_index:
        dev = Device(device_index)
        dev.set_current()
        per_thread[device_index] = dev
        _thread.current = device_index
    return dev


class _TorchStream:
    """Hands torch's stream handle to cuda.core through the __cuda_stream__ protocol."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@dataclass
class CompiledKernel:
    spec: KernelSpec
    device_index: int
    arch: str
    kernel: object  # cuda.core Kernel
    smem_limit: int = _DEFAULT_SMEM_LIMIT
    cache_hit: bool = False
    load_seconds: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    def _raise_smem_limit(self, nbytes: int) -> None:
        from cuda.bindings import driver

        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        handle = self.kernel.handle
        if isinstance(handle, driver.CUkernel):
            (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle, self.device_index)
        else:
            (err,) = driver.cuFuncSetAttribute(handle, attr, nbytes)
        if int(err) != 0:
            raise RuntimeError(
                f"kernel {self.name}: cannot raise dynamic shared memory to {nbytes} bytes ({err})"
            )
        self.smem_limit = nbytes

    def launch(self, grid, block, *args, shared_mem: int = 0, stream=None) -> None:
        """Launch on `stream` (a torch.cuda.Stream) or torch's current stream of the device."""
        import torch
        from cuda.core import LaunchConfig, launch

        packed = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if a.device.type != "cuda" or a.device.index != self.device_index:
                    raise ValueError(
                        f"kernel {self.name}: argument {i} is on {a.device}, expected cuda:{self.device_index}"
                    )
                packed.append(a.data_ptr())
            elif a is None:
                packed.append(0)
            elif isinstance(a, _SCALARS) or hasattr(a, "__cuda_tensor_map__"):
                packed.append(a)
            else:
                raise TypeError(
                    f"kernel {self.name}: argument {i} has type {type(a).__name__}; pass tensors, None, "
                    "or fixed-width numpy scalars (np.int32, np.float32, ...)"
                )
        _make_current(self.device_index)
        if shared_mem > self.smem_limit:
            self._raise_smem_limit(shared_mem)
        if stream is None:
            stream = torch.cuda.current_stream(self.device_index)
        config = LaunchConfig(grid=grid, block=block, shmem_size=shared_mem)
        launch(_TorchStream(stream.cuda_stream), config, self.kernel, *packed)


def device_arch(device_index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return arch_for(major, minor)


def get_kernel(spec: KernelSpec, device=None) -> CompiledKernel:
    """Compile (or load from cache) and load `spec` for `device` (torch.device, int or None)."""
    import torch

    if device is None:
        device_index = torch.cuda.current_device()
    elif isinstance(device, int):
        device_index = device
    else:
        device = torch.device(device)
        device_index = device.index if device.index is not None else torch.cuda.current_device()
    memo = (device_index, spec.name + "|" + repr(spec.defines))
    kernel = _kernels.get(memo)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _kernels.get(memo)
        if kernel is not None:
            return kernel
        from cuda.core import ObjectCode

        start = time.perf_counter()
        arch = device_arch(device_index)
        cubin, hit, _ = build_cubin(spec, arch)
        _make_current(device_index)
        module = ObjectCode.from_cubin(cubin, name=spec.name)
        handle = module.get_kernel(spec.entry_name)
        kernel = CompiledKernel(spec, device_index, arch, handle, cache_hit=hit,
                                load_seconds=time.perf_counter() - start)
        logger.log(logging.DEBUG, "loaded %s on cuda:%d (%s, cache %s, %.3fs)", spec.name,
                   device_index, arch, "hit" if hit else "miss", kernel.load_seconds)
        _kernels[memo] = kernel
        return kernel

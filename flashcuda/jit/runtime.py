"""Module load per (device, primary context) and launch on torch's current stream.

Load and launch go straight through the driver API by ctypes into libcuda (context set-up,
cuModuleLoadData, function attributes, the parameter-list check, cuLaunchKernel with pointers
into one packed argument buffer). A cache hit in a new process (target 50 ms) cannot afford the
Python bindings' imports: cuda.core costs ~100 ms, cuda.bindings.driver ~20 ms and
cuda.bindings.nvrtc ~70 ms (cuda.pathfinder; session 12's profile of the first call); cuda.core
is imported for NVRTC compiles only, cuda.bindings.driver for the `function` object of tools.

    kernel = get_kernel(spec, device)          # compile (or cache hit) + load, memoised
    kernel.launch(grid, block, q, k, np.int32(n), np.float32(scale), shared_mem=bytes)

Arguments: torch tensors go as device pointers, None as a null pointer, numpy scalars
(np.int32, np.int64, np.uint32, np.float32) at their own width, and any object with a
`__cuda_tensor_map__()` method (flashcuda.jit.tensor_map.TensorMap) as its 128 bytes at 64-byte
alignment, for a `const __grid_constant__` CUtensorMap parameter. Plain Python ints and floats are
refused: their width is ambiguous, and a wrong width silently corrupts every later parameter.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np

from .._log import logger
from .cache import DiskCache
from .compiler import COMPILE_OPTIONS, arch_for, compile_spec, nvrtc_version
from .spec import KernelSpec

# numpy scalar type -> (struct code, size/alignment in bytes)
_SCALARS: dict[type, tuple[str, int]] = {
    np.int32: ("i", 4), np.uint32: ("I", 4), np.int64: ("q", 8), np.uint64: ("Q", 8),
    np.float32: ("f", 4),
}
# pack code -> (struct format, size, alignment): the C rule for each parameter type. 'M' is a
# CUtensorMap (CUDA's `alignas(64) unsigned long long opaque[16]`), packed as raw bytes.
_CODES: dict[str, tuple[str, int, int]] = {
    "i": ("i", 4, 4), "I": ("I", 4, 4), "q": ("q", 8, 8), "Q": ("Q", 8, 8), "f": ("f", 4, 4),
    "M": ("128s", 128, 64),
}
TENSOR_MAP_BYTES = 128
_DEFAULT_SMEM_LIMIT = 48 * 1024

_lock = threading.RLock()
_cache: DiskCache | None = None
_kernels: dict[tuple[int, str], CompiledKernel] = {}
_contexts: dict[int, object] = {}


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


class KernelPerformanceWarning(UserWarning):
    """A kernel compiled correct but slower than the one measured (ptxas serialised its wgmma)."""


def build_cubin(spec: KernelSpec, arch: str) -> tuple[bytes, bool, float]:
    """(cubin, cache_hit, seconds) for `spec` on `arch`, through the disk cache."""
    key = spec.key(arch, COMPILE_OPTIONS, tool_versions())
    start = time.perf_counter()

    def build() -> bytes:
        result = compile_spec(spec, arch)
        logger.info("compiled %s for %s in %.2fs", spec.name, arch, result.seconds)
        if notes := result.performance_notes():
            # (a newer NVRTC than the ones the project builds clean with: correct, but slower
            # than measured; said at the compile -- the disk cache serves it silently after)
            warnings.warn(KernelPerformanceWarning(
                f"NVRTC {nvrtc_version()} built {spec.name} for {arch} with a ptxas performance "
                f"note: {notes[0]} -- results are exact, speed may fall short of the measured "
                f"(`flashcuda check --arch {arch}` lists every kernel; please report it)"),
                stacklevel=2)
        return result.cubin

    cubin, hit = disk_cache().get_or_build(f"{spec.name}.{arch}", key, build)
    return cubin, hit, time.perf_counter() - start


_vp, _u32, _i32, _sz = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_size_t
# The libcuda entry points flashcuda calls, with their C parameter lists (every one returns a
# CUresult; tests/cpu checks the counts against cuda.bindings' declarations).
LIBCUDA_SIGNATURES = {
    "cuInit": [_u32],
    "cuDeviceGet": [ctypes.POINTER(_i32), _i32],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_vp), _i32],
    "cuCtxGetCurrent": [ctypes.POINTER(_vp)],
    "cuCtxSetCurrent": [_vp],
    "cuModuleLoadData": [ctypes.POINTER(_vp), ctypes.c_char_p],
    "cuModuleGetFunction": [ctypes.POINTER(_vp), _vp, ctypes.c_char_p],
    "cuFuncGetAttribute": [ctypes.POINTER(_i32), _i32, _vp],
    "cuFuncSetAttribute": [_vp, _i32, _i32],
    "cuGetErrorName": [_i32, ctypes.POINTER(ctypes.c_char_p)],
    "cuGetErrorString": [_i32, ctypes.POINTER(ctypes.c_char_p)],
    "cuLaunchKernel": [_vp, _u32, _u32, _u32, _u32, _u32, _u32, _u32, _vp, _vp, _vp],
    # CUDA 12.0+ drivers (PreparedLaunch's programmatic launches fall back without it)
    "cuLaunchKernelEx": [_vp, _vp, _vp, _vp],
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ctypes.POINTER(_i32), _vp, _i32, _sz],
    # CUDA 12.4+ drivers only (check_abi skips the check without it)
    "cuFuncGetParamInfo": [_vp, _sz, ctypes.POINTER(_sz), ctypes.POINTER(_sz)],
}


@functools.cache
def _libcuda():
    """libcuda's entry points through ctypes (the launch path of every call: the cuda.bindings
    wrappers build Python objects per argument and cost several microseconds each; a ctypes call
    costs about one; and importing them costs more than a cache hit may take). libcuda.so.1 is
    the driver library cuda.bindings loads too."""
    lib = ctypes.CDLL("libcuda.so.1")
    for name, args in LIBCUDA_SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = args
            fn.restype = ctypes.c_int
    return lib


# CUfunction_attribute values (cuda.h; tests/cpu checks them against cuda.bindings)
FUNC_ATTRIBUTES = {"MAX_THREADS_PER_BLOCK": 0, "SHARED_SIZE_BYTES": 1, "CONST_SIZE_BYTES": 2,
                   "LOCAL_SIZE_BYTES": 3, "NUM_REGS": 4, "PTX_VERSION": 5, "BINARY_VERSION": 6,
                   "CACHE_MODE_CA": 7, "MAX_DYNAMIC_SHARED_SIZE_BYTES": 8,
                   "PREFERRED_SHARED_MEMORY_CARVEOUT": 9}


def _cu_error(err: int, what: str) -> RuntimeError:
    """A readable error for a failed driver call: the CUresult's name and description."""
    lib = _libcuda()
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    if lib.cuGetErrorName(err, ctypes.byref(name)) or not name.value:
        return RuntimeError(f"{what} failed: CUresult {err}")
    lib.cuGetErrorString(err, ctypes.byref(text))
    return RuntimeError(f"{what} failed: {name.value.decode()} "
                        f"({text.value.decode() if text.value else ''})")


def _call(what: str, fn, *args) -> None:
    """Call a libcuda function; raise _cu_error on a non-zero CUresult."""
    err = fn(*args)
    if err:
        raise _cu_error(err, what)


def _make_current(device_index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread. Checked on
    every launch: autograd's backward thread or a user thread may have none, or another device's."""
    ctx = _contexts.get(device_index)
    lib = _libcuda()
    if ctx is None:
        with _lock:
            _call("cuInit", lib.cuInit, 0)
            dev, primary = ctypes.c_int(), ctypes.c_void_p()
            _call("cuDeviceGet", lib.cuDeviceGet, ctypes.byref(dev), device_index)
            _call("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain,
                  ctypes.byref(primary), dev)
            ctx = _contexts[device_index] = primary.value or 0
    current = ctypes.c_void_p()
    err = lib.cuCtxGetCurrent(ctypes.byref(current))
    if err:
        raise _cu_error(err, "cuCtxGetCurrent")
    if (current.value or 0) != ctx:
        err = lib.cuCtxSetCurrent(ctx)
        if err:
            raise _cu_error(err, "cuCtxSetCurrent")


def launch_stream(device_index: int) -> int:
    """Make the device's primary context current on this thread and return torch's current
    stream there, as the driver's handle: what each PreparedLaunch call does first, done once by
    a caller that launches several kernels in a row (PreparedLaunch's `handle=`)."""
    _make_current(device_index)
    return _current_stream_handle(device_index)


def _is_tensor_map(a) -> bool:
    return hasattr(type(a), "__cuda_tensor_map__")


def pack_code(a) -> str:
    """Pack code of one kernel argument (see pack_args and _CODES)."""
    import torch

    if isinstance(a, torch.Tensor) or a is None:
        return "Q"
    if _is_tensor_map(a):
        return "M"
    return _SCALARS[type(a)][0]


def pack_size(code: str) -> int:
    """Bytes a kernel parameter of pack code `code` occupies."""
    return _CODES[code][1]


@functools.lru_cache(maxsize=1024)
def _layout(codes: str) -> tuple[struct.Struct, tuple[int, ...]]:
    """A C parameter list's layout: each argument's offset is the end of the one before it,
    rounded up to its own alignment (_CODES); explicit pad bytes keep the struct unaligned ('=')."""
    fmt = ["="]
    offsets = []
    pos = 0
    for c in codes:
        f, size, align = _CODES[c]
        pad = -pos % align
        if pad:
            fmt.append(f"{pad}x")
        pos += pad
        offsets.append(pos)
        fmt.append(f)
        pos += size
    return struct.Struct("".join(fmt)), tuple(offsets)


def pack_args(name: str, args: tuple,
              device_index: int | None = None) -> tuple[bytes, tuple[int, ...]]:
    """Kernel arguments packed at natural alignment, and each one's offset in the buffer:
    tensors -> 8-byte device pointers, None -> null pointer, numpy scalars at their own width,
    tensor maps (`__cuda_tensor_map__()`) -> their 128 bytes at a 64-byte aligned offset.
    With `device_index`, every tensor must live on that CUDA device (ValueError otherwise)."""
    import torch

    codes = []
    values = []
    for i, a in enumerate(args):
        scalar = _SCALARS.get(type(a))
        if scalar is not None:
            codes.append(scalar[0])
            values.append(a.item())
        elif isinstance(a, torch.Tensor):
            if device_index is not None and a.get_device() != device_index:
                raise ValueError(f"kernel {name}: argument {i} is on {a.device}, expected "
                                 f"cuda:{device_index}")
            codes.append("Q")
            values.append(a.data_ptr())
        elif a is None:
            codes.append("Q")
            values.append(0)
        elif _is_tensor_map(a):
            raw = bytes(a.__cuda_tensor_map__())
            if len(raw) != TENSOR_MAP_BYTES:
                raise TypeError(f"kernel {name}: argument {i} ({type(a).__name__}) gives a "
                                f"{len(raw)}-byte tensor map, expected {TENSOR_MAP_BYTES}")
            codes.append("M")
            values.append(raw)
        else:
            raise TypeError(
                f"kernel {name}: argument {i} has type {type(a).__name__}; pass tensors, None, "
                "or fixed-width numpy scalars (np.int32, np.int64, np.float32, ...)"
            )
    layout, offsets = _layout("".join(codes))
    return layout.pack(*values), offsets


def _current_stream_handle(device_index: int) -> int:
    """torch's current stream on the device, as the driver's handle (an int)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


@dataclass
class CompiledKernel:
    spec: KernelSpec
    device_index: int
    arch: str
    module_handle: int  # CUmodule
    function_handle: int  # CUfunction, as the integer the driver's C API takes
    smem_limit: int = _DEFAULT_SMEM_LIMIT
    cache_hit: bool = False
    load_seconds: float = 0.0
    abi_checked: bool = False

    @property
    def function(self):
        """The CUfunction as a cuda.bindings object (for tools that call the bindings, e.g. the
        occupancy query; the launch path uses function_handle)."""
        from cuda.bindings import driver

        return driver.CUfunction(self.function_handle)

    @property
    def name(self) -> str:
        return self.spec.name

    def attribute(self, attr: str) -> int:
        """A CUfunction attribute, e.g. 'NUM_REGS', 'LOCAL_SIZE_BYTES', 'MAX_THREADS_PER_BLOCK'."""
        if attr not in FUNC_ATTRIBUTES:
            raise ValueError(f"attribute: expected one of {', '.join(FUNC_ATTRIBUTES)}, got {attr!r}")
        value = ctypes.c_int()
        _call(f"cuFuncGetAttribute({attr})", _libcuda().cuFuncGetAttribute, ctypes.byref(value),
              FUNC_ATTRIBUTES[attr], self.function_handle)
        return value.value

    def check_abi(self, args: tuple, packed: bytes, offsets: list[int]) -> None:
        """Compare the packed arguments with the kernel's own parameter list (cuFuncGetParamInfo,
        CUDA 12.4+): count, offsets and sizes. A Python/C mismatch would otherwise read garbage."""
        info = getattr(_libcuda(), "cuFuncGetParamInfo", None)
        if info is None:
            return
        k_off, k_size = ctypes.c_size_t(), ctypes.c_size_t()

        def param(i: int) -> bool:
            return info(self.function_handle, i, ctypes.byref(k_off), ctypes.byref(k_size)) == 0

        # Offsets are compared relative to the first parameter's: ptxas may start the parameter
        # block past 0 (a kernel taking 64-byte aligned tensor maps had its first at 48, so that
        # it lands 64-aligned in the constant bank); kernelParams does not depend on where.
        base = None
        for i, off in enumerate(offsets):
            if not param(i):
                raise TypeError(f"kernel {self.name}: got {len(args)} arguments, the kernel takes {i}")
            base = k_off.value - off if base is None else base
            size = pack_size(pack_code(args[i]))
            if k_off.value - base != off or k_size.value != size:
                raise TypeError(
                    f"kernel {self.name}: argument {i} ({type(args[i]).__name__}) packed at offset "
                    f"{off}, {size} bytes; the kernel expects offset {k_off.value}, "
                    f"{k_size.value} bytes"
                )
        if param(len(offsets)):
            raise TypeError(f"kernel {self.name}: got {len(args)} arguments, the kernel takes more")

    def resident_blocks(self, threads: int, dynamic_smem: int = 0) -> int:
        """CTAs of `threads` threads and `dynamic_smem` bytes of dynamic shared memory that one SM
        holds at once (the driver's occupancy calculator: registers, shared memory, block
        limits); 0 when even one does not fit."""
        found = ctypes.c_int()
        _make_current(self.device_index)
        if dynamic_smem > self.smem_limit:
            self._raise_smem_limit(dynamic_smem)
        _call(f"kernel {self.name}: occupancy query", _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor,
              ctypes.byref(found), self.function_handle, threads, dynamic_smem)
        return found.value

    def _raise_smem_limit(self, nbytes: int) -> None:
        _call(f"kernel {self.name}: raising dynamic shared memory to {nbytes} bytes",
              _libcuda().cuFuncSetAttribute, self.function_handle,
              FUNC_ATTRIBUTES["MAX_DYNAMIC_SHARED_SIZE_BYTES"], nbytes)
        self.smem_limit = nbytes

    def launch(self, grid, block, *args, shared_mem: int = 0, stream=None) -> None:
        """Launch on `stream` (a torch.cuda.Stream) or torch's current stream of the device."""
        packed, offsets = pack_args(self.name, args, self.device_index)
        if not self.abi_checked:
            self.check_abi(args, packed, offsets)
            self.abi_checked = True
        # kernelParams: an array of pointers to each argument's bytes; the driver reads each
        # parameter's size from the cubin, so no buffer size has to match the kernel's.
        params = ctypes.create_string_buffer(packed, max(len(packed), 1))
        base = ctypes.addressof(params)
        pointers = (ctypes.c_void_p * max(len(offsets), 1))(*[base + o for o in offsets])
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        _make_current(self.device_index)
        if shared_mem > self.smem_limit:
            self._raise_smem_limit(shared_mem)
        handle = (_current_stream_handle(self.device_index) if stream is None
                  else stream.cuda_stream)
        err = _libcuda().cuLaunchKernel(self.function_handle, *grid, *block, shared_mem, handle,
                                        pointers, None)
        if err:
            raise _cu_error(err, f"launching {self.name} grid={grid} block={block} "
                                 f"smem={shared_mem}")


# cuLaunchKernelEx's configuration (cuda.h: CUlaunchAttribute, CUlaunchConfig) for a launch with
# programmatic stream serialization: the kernel may start while the previous kernel in the stream
# is still running, once every CTA of that one has executed griddepcontrol.launch_dependents (or
# exited); it must execute griddepcontrol.wait before it reads what the previous kernel wrote.
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


class PreparedLaunch:
    """A launch whose grid, block, shared memory, argument kinds and trailing argument values are
    fixed (what a plan of a kernel family decides once), for the per-call hot path.

        launch = PreparedLaunch(kernel, grid, block, smem, example_args, fixed=len(constants))
        launch(map_q.raw, map_k.raw, map_v.raw, out.data_ptr(), lse.data_ptr())

    `example_args` are the arguments as kernel.launch takes them; their kinds set the layout (as
    pack_args packs it, checked against the kernel's parameter list once) and their last `fixed`
    values are packed once. A call passes the leading values raw (a device pointer as an int for
    a tensor, a tensor map's 128 bytes, a Python number for a scalar) and packs them with one
    struct.pack_into into a parameter buffer of the calling thread's (the driver copies the
    parameters during cuLaunchKernel, so the buffer is free again when the call returns), then
    launches on torch's current stream (or on `handle`, a caller's `launch_stream`, for several
    launches in a row: the context check and the stream lookup once). The caller owns the values'
    meaning: nothing here checks a pointer's device (kernel.launch does; a family's plan key
    holds the device).
    """

    def __init__(self, kernel: CompiledKernel, grid, block, shared_mem: int, example_args: tuple,
                 fixed: int = 0, programmatic: bool = False) -> None:
        packed, offsets = pack_args(kernel.name, example_args, kernel.device_index)
        if not kernel.abi_checked:
            kernel.check_abi(example_args, packed, offsets)
            kernel.abi_checked = True
        if shared_mem > kernel.smem_limit:
            _make_current(kernel.device_index)
            kernel._raise_smem_limit(shared_mem)
        codes = "".join(pack_code(a) for a in example_args)
        free = len(codes) - fixed
        full, self.offsets = _layout(codes)
        # the leading values' struct ends where the first fixed value starts (its own padding
        # included), so packing it never writes over the fixed tail
        self.head = _layout(codes[:free])[0] if free else struct.Struct("=")
        self.tail = packed[self.offsets[free]:] if fixed else b""
        self.tail_at = self.offsets[free] if fixed else full.size
        self.size = full.size
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.shared_mem = shared_mem
        # programmatic: launched with programmatic stream serialization (the kernel waits for
        # its predecessor with griddepcontrol.wait), where the driver has cuLaunchKernelEx
        self.programmatic = (programmatic
                             and getattr(_libcuda(), "cuLaunchKernelEx", None) is not None)
        self._launch = None  # cuLaunchKernel with all but the stream and parameters bound
        self._local = threading.local()

    def _buffers(self) -> tuple:
        """This thread's parameter buffer (fixed tail written), its kernelParams array and, for a
        programmatic launch, its launch configuration (the stream set per call)."""
        params = ctypes.create_string_buffer(max(self.size, 1))
        base = ctypes.addressof(params)
        ctypes.memmove(base + self.tail_at, self.tail, len(self.tail))
        pointers = (ctypes.c_void_p * max(len(self.offsets), 1))(*[base + o for o in self.offsets])
        config = None
        if self.programmatic:
            attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
            config = _LaunchConfig(*self.grid, *self.block, self.shared_mem, None,
                                   ctypes.pointer(attr), 1)
            config._attr = attr  # (kept alive with the config)
        self._local.buffers = (params, pointers, config)
        return params, pointers, config

    def __call__(self, *values, stream=None, handle: int | None = None) -> None:
        buffers = getattr(self._local, "buffers", None)
        params, pointers, config = buffers if buffers is not None else self._buffers()
        self.head.pack_into(params, 0, *values)
        if handle is None:
            index = self.kernel.device_index
            _make_current(index)
            handle = _current_stream_handle(index) if stream is None else stream.cuda_stream
        if config is not None:
            config.stream = handle
            err = _libcuda().cuLaunchKernelEx(ctypes.byref(config), self.kernel.function_handle,
                                              pointers, None)
        else:
            launch = self._launch
            if launch is None:  # (bound at the first launch: constructing needs no driver)
                launch = self._launch = functools.partial(
                    _libcuda().cuLaunchKernel, self.kernel.function_handle, *self.grid,
                    *self.block, self.shared_mem)
            err = launch(handle, pointers, None)
        if err:
            raise _cu_error(err, f"launching {self.kernel.name} grid={self.grid} "
                                 f"block={self.block} smem={self.shared_mem}")


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
        start = time.perf_counter()
        arch = device_arch(device_index)
        cubin, hit, _ = build_cubin(spec, arch)
        _make_current(device_index)
        lib = _libcuda()
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _call(f"loading module {spec.name}", lib.cuModuleLoadData, ctypes.byref(module), cubin)
        _call(f"finding {spec.entry_name} in {spec.name}", lib.cuModuleGetFunction,
              ctypes.byref(function), module, spec.entry_name.encode())
        kernel = CompiledKernel(spec, device_index, arch, module.value or 0, function.value or 0,
                                cache_hit=hit, load_seconds=time.perf_counter() - start)
        logger.log(logging.DEBUG, "loaded %s on cuda:%d (%s, cache %s, %.3fs)", spec.name,
                   device_index, arch, "hit" if hit else "miss", kernel.load_seconds)
        _kernels[memo] = kernel
        return kernel

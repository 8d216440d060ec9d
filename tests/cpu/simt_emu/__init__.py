"""Run a kernel's CUDA source on the CPU: the decode kernels, the SIMT flash forward / backward
and the sm80 tensor-core forward / backward, checked in CI against the GPU tests' float64
oracles before and between GPU runs. Not a GPU result: no timing, no memory model beyond
cp.async's groups; the sm90 kernels (wgmma, TMA, mbarriers) are not emulated.

    kernel = build(spec)                       # g++ of the rendered source, cached by its text
    kernel.launch(grid, block, *args, shared_mem=n)  # as jit's CompiledKernel, on CPU tensors
    emulate(monkeypatch, fwd_decode)           # a family's launches run here instead

How: prelude.h maps CUDA's keywords and intrinsics to the host; every thread of a CTA is a
fiber on its own stack (a register switch on x86-64, ucontext elsewhere) switched at
__syncthreads and at each warp-collective operation — shuffles, ldmatrix, mma.sync m16n8k16,
done as exchanges in the PTX ISA's fragment layouts (runtime.inc). shim/ holds host forms of the
three headers with inline PTX (common/types.cuh, smem.cuh, sm80_ptx.cuh); online_softmax.cuh and
tile_simt.cuh take host forms under FC_HOST_EMULATION; arch-dependent code takes its sm_80 form.
Two textual rewrites make shared memory one object per CTA (render below). A cp.async copy lands
at the wait that covers it, its destination reading as NaN (0xff bytes) until then, so a stage
read early or overwritten while still needed shows in the result. Shared memory starts as 0xff
bytes in every CTA.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from flashcuda.jit import KernelSpec, PreparedLaunch
from flashcuda.jit.runtime import pack_args
from flashcuda.jit.spec import KERNELS_DIR
from flashcuda.ops.call import SMEM_OPTIN

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")
# hidden symbols and no GNU-unique ones: each kernel's library keeps its own statics (a template's
# static `__shared__` object of one kernel would otherwise bind to another library's, smaller one)
FLAGS = ("-std=c++20", "-O1", "-fvisibility=hidden", "-fno-gnu-unique", "-shared", "-fPIC",
         "-Wno-unknown-pragmas", "-DFC_HOST_EMULATION")
# FLASHCUDA_EMU_ASAN=1: kernels built with AddressSanitizer, a memcheck of their global and
# shared accesses on the host (run python under LD_PRELOAD=$(g++ -print-file-name=libasan.so)
# ASAN_OPTIONS=detect_leaks=0; torch's CPU tensors come from malloc, so each has red zones)
if os.environ.get("FLASHCUDA_EMU_ASAN") == "1":
    FLAGS += ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")
CACHE = Path(tempfile.gettempdir()) / "flashcuda-simt-emu"

_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+(?:\s+[\w:]+)*?)\s+(\w+)\s*\[\s*\]\s*;")
_SHARED = re.compile(r"__shared__\s+(?:__align__\(\d+\)\s+)?([\w:<>, ]+?)\s+(\w+)((?:\[[^\]]+\])*)\s*;")


def available() -> str | None:
    """None if the emulator can build here, else why not."""
    if shutil.which(CXX) is None:
        return f"no host C++ compiler ({CXX})"
    return None


def render(spec: KernelSpec, kernels_dir: Path = KERNELS_DIR) -> str:
    """The program text g++ compiles: the spec's text (what NVRTC sees; its source read from
    `kernels_dir`) with shared memory rewritten — `extern __shared__ T name[];` becomes the
    launch's dynamic buffer, `__shared__ X name;` one object the CTA's fibers share — then the
    runtime."""
    text = spec.render((kernels_dir / spec.source).read_text())
    text = _EXTERN_SHARED.sub(r"\1* \2 = static_cast<\1*>(emu::dynamic_smem());", text)
    count = iter(range(1, 1 << 30))
    text = _SHARED.sub(lambda m: f"auto& {m[2]} = emu::static_shared<{m[1]}{m[3]}, "
                                 f"{next(count)}>();", text)
    return text + '\n#include "runtime.inc"\n'


class HostKernel:
    """A kernel built for the host; stands in for jit's CompiledKernel where a family plans and
    launches (name, device_index, abi_checked, smem_limit, resident_blocks)."""

    def __init__(self, name: str, library: Path, resident: int = 3) -> None:
        self.name = name
        self.device_index = None
        self.abi_checked = True  # (the parameter layout is the C++ signature's own, below)
        self.smem_limit = 1 << 30
        self.resident = resident
        self._lib = ctypes.CDLL(str(library))
        self._lib.emu_launch.restype = ctypes.c_int
        self._lib.emu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
            ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]

    def resident_blocks(self, threads: int, dynamic_smem: int = 0) -> int:
        return self.resident

    def run_packed(self, params: int, grid: tuple, block: tuple, smem: int) -> None:
        """Every CTA of `grid`, the kernel reading its arguments at address `params` (packed as
        for cuLaunchKernel). RuntimeError on a deadlock, a __trap() or a bad shared-memory
        access."""
        error = ctypes.create_string_buffer(512)
        if self._lib.emu_launch(params, *grid, *block, smem, error, len(error)):
            raise RuntimeError(f"{self.name}: {error.value.decode()}")

    def launch(self, grid, block, *args, shared_mem: int = 0, stream=None) -> None:
        """CompiledKernel.launch's call: the arguments packed as jit packs them (CPU tensors'
        addresses for device pointers)."""
        packed, _ = pack_args(self.name, args)
        params = ctypes.create_string_buffer(packed, max(len(packed), 1))
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        self.run_packed(ctypes.addressof(params), grid, block, shared_mem)


_lock = threading.Lock()


def build(spec: KernelSpec, resident: int = 3, kernels_dir: Path = KERNELS_DIR) -> HostKernel:
    """Compile `spec` for the host (cached in CACHE by the text and the emulator's sources);
    `kernels_dir`: where its source file is (the project's headers are always the project's)."""
    text = render(spec, kernels_dir)
    h = hashlib.sha256(text.encode())
    for path in sorted([*HERE.glob("*.h"), *HERE.glob("*.inc"), *HERE.glob("shim/**/*.cuh"),
                        *(p for p in KERNELS_DIR.glob("**/*.cuh"))]):
        h.update(path.read_bytes())
    h.update(" ".join((CXX, *FLAGS)).encode())
    library = CACHE / f"{spec.name}-{h.hexdigest()[:16]}.so"
    with _lock:
        if not library.exists():
            CACHE.mkdir(parents=True, exist_ok=True)
            source = library.with_suffix(f".{os.getpid()}.cpp")  # (per process: no torn text)
            source.write_text(text)
            partial = library.with_suffix(f".{os.getpid()}.tmp")
            cmd = [CXX, *FLAGS, "-include", str(HERE / "prelude.h"), f"-I{HERE / 'shim'}",
                   f"-I{HERE}", f"-I{KERNELS_DIR}", str(source), "-o", str(partial)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{spec.name}: host build failed\n{done.stderr[-4000:]}")
            partial.replace(library)
    return HostKernel(spec.name, library, resident)


class EmuLaunch(PreparedLaunch):
    """PreparedLaunch on a HostKernel: the same packed parameters, run by the emulator (a
    programmatic launch as a plain one: the grids run one after another here)."""

    def __init__(self, *args, programmatic: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked_programmatic = programmatic  # (what the family's plan asked for)

    def __call__(self, *values, stream=None, handle: int | None = None) -> None:
        buffers = getattr(self._local, "buffers", None)
        params, _, _ = buffers if buffers is not None else self._buffers()
        self.head.pack_into(params, 0, *values)
        self.kernel.run_packed(ctypes.addressof(params), self.grid, self.block, self.shared_mem)


def _device_reason(device, smem_bytes: int, what: str) -> str | None:
    """ops.fwd_simt.device_reason for the emulated GPU (an H100 / H200's shared memory)."""
    return None if smem_bytes <= SMEM_OPTIN else f"{what} needs {smem_bytes} bytes of shared memory"


# The families' _device_info on the emulated GPU: an H100 / H200 (sm_90; 227 KB of shared memory
# per block, 228 KB per SM), in the shape each family's own returns.
_DEVICE_INFO = {"flashcuda.ops.fwd_sm80": ((9, 0), SMEM_OPTIN, 233472),
                "flashcuda.ops.bwd_sm80": ((9, 0), SMEM_OPTIN)}


def emulate(monkeypatch, module, sms: int = 132, resident: int = 3) -> None:
    """Make `module` (a kernel family: fwd_decode) build its kernels for the host and launch them
    here, on CPU tensors, as if on a GPU of `sms` SMs holding `resident` CTAs each."""
    monkeypatch.setattr(module, "get_kernel", lambda spec, device=None: build(spec, resident))
    for name, value in (("PreparedLaunch", EmuLaunch), ("launch_stream", lambda index: 0),
                        ("_device_ok", lambda device: (True, sms)), ("on_cuda", lambda d: True),
                        ("_programmatic", lambda device: True),
                        ("_smem_optin", lambda device: SMEM_OPTIN),
                        ("device_reason", _device_reason), ("_device_index", lambda device: 0),
                        ("_device_info", lambda index: _DEVICE_INFO[module.__name__])):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)
    plans = getattr(module, "_plans", None)
    if plans is not None:
        monkeypatch.setattr(module, "_plans", type(plans)(plans.build))


def gpu_suite(gpu_module: str, families: tuple, skip: set[str] = frozenset()):
    """A GPU test module's tests for a CPU test module to collect, run by the emulator:
    (the GPU module, its test functions but `skip`, an autouse fixture that emulates `families`
    and sets the GPU module's DEVICE to the CPU). The GPU module's own mark (gpu) stays its own.

        on_gpu, tests, emulated = simt_emu.gpu_suite("tests.gpu.test_fwd_sm80", (fwd_sm80,))
        globals().update(tests)
    """
    on_gpu = importlib.import_module(gpu_module)
    tests = {name: test for name, test in vars(on_gpu).items()
             if name.startswith("test_") and name not in skip}

    @pytest.fixture(autouse=True)
    def emulated(monkeypatch):
        for family in families:
            emulate(monkeypatch, family)
        monkeypatch.setattr(on_gpu, "DEVICE", "cpu")

    return on_gpu, tests, emulated

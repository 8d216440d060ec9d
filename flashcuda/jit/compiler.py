"""NVRTC: rendered source -> cubin for an explicit target, with ptxas' resource report.

Always to cubin (never PTX handed to the driver: a newer NVRTC's PTX fails on an older driver) and
always for an explicit ``sm_XX[a]``, so NVRTC needs no GPU and no driver (the CPU lane relies on it).
"""

from __future__ import annotations

import ctypes
import os
import re
import site
import sys
import threading
import time
from dataclasses import dataclass
from functools import cache

from .spec import KERNELS_DIR, KernelSpec

# Options every kernel is built with. -lineinfo costs nothing at run time and lets
# compute-sanitizer name source lines; ptxas -v gives the register / spill / stack report.
COMPILE_OPTIONS: tuple[str, ...] = ("-std=c++17", "-lineinfo", "-Xptxas=-v")


class CompileError(RuntimeError):
    """NVRTC rejected a kernel. Carries the specialisation name and the compiler log."""

    def __init__(self, name: str, arch: str, log: str):
        self.name = name
        self.arch = arch
        self.log = log
        super().__init__(f"NVRTC failed to compile kernel {name!r} for {arch}:\n{log.strip()}")


@dataclass(frozen=True)
class Resources:
    """ptxas' report for one entry function."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0 or self.stack_bytes > 0


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str
    seconds: float

    def resources(self) -> dict[str, Resources]:
        return parse_ptxas_report(self.log)

    def performance_notes(self) -> list[str]:
        """ptxas' "Potential Performance Loss" notes (C75xx: wgmma serialised, e.g. behind a
        compiler-inserted warpgroup arrive on a divergent path), one per line, without the
        "ptxas info :" prefix. The kernel is correct but slower than the one measured; the CPU
        lane keeps every shipped variant free of them under the NVRTC CI installs."""
        return [line.split(":", 1)[-1].strip() for line in self.log.splitlines()
                if "performance loss" in line.lower()]


_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_report(log: str) -> dict[str, Resources]:
    """Entry name -> resources, read from `ptxas -v` output in the NVRTC log."""
    out: dict[str, Resources] = {}
    name = None
    frame = (0, 0, 0)
    for line in log.splitlines():
        if m := _FUNC.search(line):
            name, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and name:
            frame = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _REGS.search(line)) and name:
            smem = _SMEM.search(line)
            out[name] = Resources(
                registers=int(m.group(1)),
                stack_bytes=frame[0],
                spill_stores=frame[1],
                spill_loads=frame[2],
                shared_bytes=int(smem.group(1)) if smem else 0,
            )
            name = None
    return out


# Where cuda.pathfinder (which cuda.bindings loads NVRTC through) looks first on Linux: the CUDA
# wheels' library directories under each site-packages directory, these sonames in this order.
NVRTC_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12")
NVRTC_WHEEL_DIRS = ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib")


def _site_dirs() -> list[str]:
    """site-packages directories in cuda.pathfinder's order (a venv's own first, then the user
    site, then the system's)."""
    getsitepackages = getattr(site, "getsitepackages", None)  # (absent in old virtualenvs)
    dirs = list(getsitepackages()) if getsitepackages else []
    if site.ENABLE_USER_SITE and (user := site.getusersitepackages()):
        dirs.insert(1 if sys.prefix != sys.base_prefix else 0, user)
    return dirs


def _load_nvrtc() -> ctypes.CDLL | None:
    """The NVRTC library by ctypes: the one already in the process if any, else the first a CUDA
    wheel provides (what cuda.pathfinder would find first; once loaded, cuda.pathfinder finds it
    already loaded and cuda.bindings compiles with this very library). None when neither: the
    caller asks cuda.bindings (its full search: conda, CUDA_HOME, the system)."""
    if not sys.platform.startswith("linux"):
        return None
    for soname in NVRTC_SONAMES:
        try:
            return ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            pass
    for rel in NVRTC_WHEEL_DIRS:
        for parent in _site_dirs():
            for soname in NVRTC_SONAMES:
                path = os.path.join(parent, rel, soname)
                if os.path.isfile(path):
                    try:
                        return ctypes.CDLL(path)
                    except OSError:
                        return None
    return None


@cache
def nvrtc_version() -> str:
    """major.minor of the NVRTC that compiles the kernels (part of every cache key). Asked of the
    library through ctypes where a CUDA wheel provides it: importing cuda.bindings.nvrtc costs
    ~70 ms (cuda.pathfinder), more than a cache hit in a new process may take (50 ms)."""
    lib = _load_nvrtc()
    if lib is not None:
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int)] * 2
        lib.nvrtcVersion.restype = ctypes.c_int
        err = lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        if err:
            raise RuntimeError(f"nvrtcVersion failed: nvrtcResult {err}")
        return f"{major.value}.{minor.value}"
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


# cuda.core's first import is not safe from two threads at once (the second can see the
# package half initialised: "cannot import name 'Program'"), so compile_spec's lazy import holds
# this lock.
_import_lock = threading.Lock()


def compile_spec(spec: KernelSpec, arch: str) -> CompileResult:
    """Compile `spec` for `arch` (e.g. 'sm_80', 'sm_90a'). Raises CompileError with the log.
    Callable from several threads at once."""
    with _import_lock:
        from cuda.core import Program, ProgramOptions

    options = ProgramOptions(
        name=spec.source,
        arch=arch,
        std="c++17",
        lineinfo=True,
        ptxas_options=["-v"],
        include_path=[str(KERNELS_DIR)],
    )
    start = time.perf_counter()
    log_lines: list[str] = []

    class _Log:
        def write(self, text: str) -> None:
            log_lines.append(text)

    try:
        program = Program(spec.render(), "c++", options)
        obj = program.compile("cubin", logs=_Log())
    except Exception as exc:  # cuda.core raises its own error type with the log inside
        raise CompileError(spec.name, arch, "".join(log_lines) + "\n" + str(exc)) from None
    return CompileResult(bytes(obj.code), "".join(log_lines), time.perf_counter() - start)


def arch_for(major: int, minor: int) -> str:
    """The NVRTC target for a compute capability: the arch-specific 'a' target from sm_90 on
    (wgmma, setmaxnreg and friends need it; older kernels lose nothing by it)."""
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"

"""The JIT layer on a machine with no GPU: NVRTC compile, resource report, errors, disk cache."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashcuda.jit import (
    CacheError,
    CompileError,
    DiskCache,
    KernelSpec,
    build_cubin,
    compile_spec,
    disk_cache,
    reset_disk_cache,
)

SMOKE = KernelSpec.make("smoke_axpb", "common/smoke.cu")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_compile_to_cubin_with_resource_report(arch):
    result = compile_spec(SMOKE, arch)
    assert result.cubin[:4] == b"\x7fELF"  # a cubin, not PTX
    res = result.resources()["smoke_axpb"]
    assert 0 < res.registers < 64
    assert not res.spills


def test_first_compiles_from_two_threads_at_once():
    """A fresh process whose first two compiles run in two threads together: both succeed
    (cuda.core's first import, which compile_spec makes lazily, is not thread-safe by itself)."""
    code = textwrap.dedent("""
        from concurrent.futures import ThreadPoolExecutor
        from flashcuda.jit import KernelSpec, compile_spec
        spec = KernelSpec.make("smoke_axpb", "common/smoke.cu")
        with ThreadPoolExecutor(4) as ex:
            done = list(ex.map(lambda a: compile_spec(spec, a).cubin[:4],
                               ["sm_80", "sm_90a", "sm_80", "sm_90a"]))
        assert done == [b"\\x7fELF"] * 4, done
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


def test_compile_error_names_kernel_file_and_line(tmp_path):
    src = tmp_path / "broken.cu"
    src.write_text('#include "common/types.cuh"\n\nextern "C" __global__ void broken(float* x) {\n'
                   "  x[0] = undefined_symbol;\n}\n")
    spec = KernelSpec.make("broken_kernel_f32", str(src), entry="broken")
    with pytest.raises(CompileError) as info:
        compile_spec(spec, "sm_80")
    msg = str(info.value)
    assert "broken_kernel_f32" in msg and "sm_80" in msg
    assert f"{src}(4)" in msg, msg  # NVRTC's file(line) of the bad statement
    assert "undefined_symbol" in info.value.log


def test_key_changes_with_header_defines_arch_and_options(tmp_path, monkeypatch):
    base = SMOKE.key("sm_80", ("-a",), "v1")
    assert base == SMOKE.key("sm_80", ("-a",), "v1")
    assert base != SMOKE.key("sm_90a", ("-a",), "v1")
    assert base != SMOKE.key("sm_80", ("-b",), "v1")
    assert base != SMOKE.key("sm_80", ("-a",), "v2")
    other = KernelSpec.make("smoke_axpb", "common/smoke.cu", defines={"X": 1})
    assert base != other.key("sm_80", ("-a",), "v1")
    # Headers are part of the key: a copy of the tree with one header changed gives another key.
    import flashcuda.jit.spec as spec_mod

    tree = tmp_path / "kernels"
    (tree / "common").mkdir(parents=True)
    for name in ("smoke.cu", "types.cuh"):
        (tree / "common" / name).write_text((spec_mod.KERNELS_DIR / "common" / name).read_text())
    monkeypatch.setattr(spec_mod, "KERNELS_DIR", tree)
    k1 = SMOKE.key("sm_80", (), "v")
    (tree / "common" / "types.cuh").write_text((tree / "common" / "types.cuh").read_text() + "\n// x\n")
    assert SMOKE.key("sm_80", (), "v") != k1


def _entry_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.suffix in (".cubin", ".json"))


def test_cache_miss_then_hit_then_new_process_hit():
    cubin, hit, _ = build_cubin(SMOKE, "sm_80")
    assert not hit
    cubin2, hit2, _ = build_cubin(SMOKE, "sm_80")
    assert hit2 and cubin2 == cubin
    code = "from flashcuda.jit import build_cubin, KernelSpec\n" \
           "c, hit, s = build_cubin(KernelSpec.make('smoke_axpb', 'common/smoke.cu'), 'sm_80')\n" \
           "print('HIT' if hit else 'MISS', s)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=os.environ.copy())
    assert out.stdout.startswith("HIT"), out.stdout + out.stderr


def test_truncated_or_corrupt_entry_is_rebuilt():
    cubin, _, _ = build_cubin(SMOKE, "sm_80")
    d = disk_cache().path
    cubin_file = next(d.glob("*.cubin"))
    cubin_file.write_bytes(cubin[: len(cubin) // 2])  # truncated
    reset_disk_cache()
    again, hit, _ = build_cubin(SMOKE, "sm_80")
    assert not hit and again == cubin
    meta = next(d.glob("*.json"))
    meta.write_text("{not json")
    reset_disk_cache()
    again, hit, _ = build_cubin(SMOKE, "sm_80")
    assert not hit and again == cubin
    assert json.loads(meta.read_text())["size"] == len(cubin)


def test_group_or_world_writable_cache_dir_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(CacheError, match="writable by group or others"):
        DiskCache(d)
    d.chmod(0o770)
    with pytest.raises(CacheError, match="chmod 700"):
        DiskCache(d)


def test_cache_dir_created_private(tmp_path):
    d = tmp_path / "new" / "cache"
    DiskCache(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create files owned by another user")
def test_foreign_owned_dir_refused_and_foreign_entry_is_a_miss(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    with pytest.raises(CacheError, match="owned by uid 12345"):
        DiskCache(d)
    mine = tmp_path / "mine"
    cache = DiskCache(mine)
    cache.store("e", "k" * 64, b"\x7fELFdata")
    for f in _entry_files(mine):
        os.chown(f, 12345, 12345)
    assert DiskCache(mine).load("e", "k" * 64) is None


def test_read_only_cache_dir_degrades_to_memory(tmp_path, caplog):
    if os.getuid() == 0:
        pytest.skip("root ignores directory permissions")
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    cache = DiskCache(d)
    assert not cache.writable
    data, hit = cache.get_or_build("e", "k" * 64, lambda: b"abc")
    assert data == b"abc" and not hit
    assert cache.get_or_build("e", "k" * 64, lambda: b"zzz") == (b"abc", True)


_RACE = textwrap.dedent("""
    import sys, time
    from flashcuda.jit import DiskCache
    from pathlib import Path
    cache = DiskCache(Path(sys.argv[1]))
    def build():
        time.sleep(float(sys.argv[2]))
        return b"\\x7fELF" + b"x" * 100000
    data, hit = cache.get_or_build("entry", "k" * 64, build)
    print("HIT" if hit else "BUILT", len(data))
""")


def test_two_processes_compiling_one_key_leave_one_valid_entry(tmp_path):
    d = tmp_path / "race"
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(d), "1.0"], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = sorted(p.communicate(timeout=60)[0].split()[0] for p in procs)
    assert outs == ["BUILT", "HIT"], outs  # the second waited on the lock, then hit
    names = [p.name for p in _entry_files(d)]
    assert len(names) == 2 and {Path(n).suffix for n in names} == {".cubin", ".json"}
    assert DiskCache(d).load("entry", "k" * 64) == b"\x7fELF" + b"x" * 100000
    assert not list(d.glob(".tmp-*"))


def test_process_killed_mid_compile_blocks_nothing(tmp_path):
    d = tmp_path / "killed"
    victim = subprocess.Popen([sys.executable, "-c", _RACE, str(d), "30"], stdout=subprocess.PIPE)
    lock = d / ("entry-" + "k" * 20 + ".lock")
    deadline = time.monotonic() + 20
    while not lock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert DiskCache(d).load("entry", "k" * 64) is None  # nothing half-written loads
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _RACE, str(d), "0"], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.startswith("BUILT"), out.stdout + out.stderr
    assert time.monotonic() - start < 20  # did not wait for a dead process's lock



_HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("LOCKED", flush=True)
    time.sleep(120)
""")


def test_lock_held_past_the_timeout_compiles_without_it(tmp_path, monkeypatch, caplog):
    """A live process holding an entry's lock for longer than LOCK_TIMEOUT_S (a hung compiler):
    the waiter warns once, builds without the lock and writes a valid entry (atomic writes), and
    does not wait for the holder."""
    import logging

    from flashcuda.jit import cache as cache_module

    d = tmp_path / "hung"
    cache = DiskCache(d)
    lock = d / ("entry-" + "k" * 20 + ".lock")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        monkeypatch.setattr(cache_module, "LOCK_TIMEOUT_S", 0.5)
        blob = b"\x7fELF" + b"h" * 5000
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            data, hit = cache.get_or_build("entry", "k" * 64, lambda: blob)
        elapsed = time.monotonic() - start
        assert (data, hit) == (blob, False)
        assert 0.5 <= elapsed < 10, elapsed
        warned = [r for r in caplog.records if "compiling without it" in r.getMessage()]
        assert len(warned) == 1
        assert holder.poll() is None  # the holder still holds the lock
        assert DiskCache(d).load("entry", "k" * 64) == blob
        assert not list(d.glob(".tmp-*"))
    finally:
        holder.kill()
        holder.wait()


def test_uncreatable_cache_dir_degrades_to_memory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cache = DiskCache(blocker / "cache")
    assert not cache.writable
    assert cache.get_or_build("e", "k" * 64, lambda: b"abc") == (b"abc", False)
    assert cache.get_or_build("e", "k" * 64, lambda: b"zzz") == (b"abc", True)


def test_kernel_arguments_are_packed_like_the_c_parameter_list():
    import struct

    import numpy as np

    from flashcuda.jit.runtime import pack_args

    buf, offsets = pack_args("k", (None, np.int32(7), np.int64(-2), np.float32(1.5), np.int32(3),
                                   None, np.int32(9)))
    # void* @0, int @8, (pad) long long @16, float @24, int @28, void* @32, int @40 -> 44 bytes
    assert list(offsets) == [0, 8, 16, 24, 28, 32, 40] and len(buf) >= 44
    assert struct.unpack_from("<Q", buf, 0)[0] == 0
    assert struct.unpack_from("<i", buf, 8)[0] == 7
    assert struct.unpack_from("<q", buf, 16)[0] == -2
    assert struct.unpack_from("<f", buf, 24)[0] == 1.5
    assert struct.unpack_from("<i", buf, 28)[0] == 3
    with pytest.raises(TypeError, match="argument 1 has type int"):
        pack_args("k", (None, 5))
    with pytest.raises(TypeError, match="argument 0 has type float"):
        pack_args("k", (1.0,))


class _FakeKernel:
    """What PreparedLaunch reads of a CompiledKernel before any driver call."""

    name = "fake"
    device_index = -1  # CPU tensors' get_device()
    abi_checked = True
    smem_limit = 1 << 20


def test_prepared_launch_packs_what_pack_args_packs():
    """A prepared launch's buffer, once a call packed its leading values into it, holds the bytes
    pack_args gives for the same arguments: tensor maps 64-aligned, pointers, the fixed scalar
    tail (int32 after int64 after a pointer: padding included), in every thread's own buffer."""
    import ctypes
    import threading

    import numpy as np
    import torch

    from flashcuda.jit.runtime import PreparedLaunch, pack_args
    from flashcuda.jit.tensor_map import TensorMap

    rng = np.random.default_rng(3)
    maps = [TensorMap(bytes(rng.integers(0, 256, 128, dtype=np.uint8))) for _ in range(3)]
    x, y = torch.zeros(4), torch.zeros(6)
    tail = (np.int64(-5), np.int32(7), np.float32(0.25), np.int64(1 << 40), np.int32(-1))
    args = (*maps, x, y, *tail)
    launch = PreparedLaunch(_FakeKernel(), (3,), (384,), 4096, args, fixed=len(tail))
    want, offsets = pack_args("fake", args)
    assert launch.offsets == offsets and launch.size == len(want)

    def packed_here() -> bytes:
        params, pointers, _ = launch._buffers()  # (no launch configuration: not programmatic)
        launch.head.pack_into(params, 0, *(m.raw for m in maps), x.data_ptr(), y.data_ptr())
        base = ctypes.addressof(params)
        assert [pointers[i] - base for i in range(len(offsets))] == list(offsets)
        return bytes(params)[:launch.size]

    assert packed_here() == want
    other: list[bytes] = []
    t = threading.Thread(target=lambda: other.append(packed_here()))
    t.start()
    t.join()
    assert other == [want]
    everything_fixed = PreparedLaunch(_FakeKernel(), (1,), (32,), 0, args, fixed=len(args))
    params, _, _ = everything_fixed._buffers()
    assert bytes(params)[:everything_fixed.size] == want


def _full_disk(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_cache_disk_degrades_to_memory_with_one_warning(tmp_path, monkeypatch, caplog):
    import logging

    from flashcuda.jit import cache as cache_mod

    d = tmp_path / "full"
    cache = DiskCache(d)
    assert cache.writable
    monkeypatch.setattr(cache_mod, "_atomic_write", _full_disk)
    with caplog.at_level(logging.WARNING, logger="flashcuda"):
        assert cache.get_or_build("e1", "a" * 64, lambda: b"one") == (b"one", False)
        assert cache.get_or_build("e2", "b" * 64, lambda: b"two") == (b"two", False)
        assert cache.get_or_build("e1", "a" * 64, lambda: b"zzz") == (b"one", True)  # memory
        assert cache.get_or_build("e2", "b" * 64, lambda: b"zzz") == (b"two", True)
    assert not cache.writable
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "No space left on device" in warnings[0].getMessage()
    assert "in memory only" in warnings[0].getMessage()
    assert not _entry_files(d)


def test_write_failing_after_the_temp_file_leaves_no_entry_and_no_temp(tmp_path, monkeypatch):
    """ENOSPC (or any error) at publish time: the temp file is removed, nothing half-written
    is ever found by the next process, and this process keeps the cubin in memory."""
    from flashcuda.jit import cache as cache_mod

    d = tmp_path / "fails_at_replace"
    cache = DiskCache(d)
    with monkeypatch.context() as m:
        m.setattr(cache_mod.os, "replace", _full_disk)
        assert cache.get_or_build("e", "k" * 64, lambda: b"\x7fELFx") == (b"\x7fELFx", False)
    assert not list(d.glob(".tmp-*")) and not _entry_files(d)
    assert DiskCache(d).load("e", "k" * 64) is None
    assert cache.load("e", "k" * 64) == b"\x7fELFx"


def test_unwritable_cache_dir_warns_once_and_serves_from_memory(tmp_path, monkeypatch, caplog):
    """A read-only cache directory (simulated through os.access, so it also holds as root):
    one warning however many caches and kernels, nothing written, everything served."""
    import logging

    from flashcuda.jit import cache as cache_mod

    d = tmp_path / "readonly"
    d.mkdir(mode=0o700)
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="flashcuda"):
        m.setattr(cache_mod.os, "access", lambda path, mode: False)
        caches = [DiskCache(d), DiskCache(d)]
        for i, cache in enumerate(caches):
            assert not cache.writable
            assert cache.get_or_build(f"e{i}", str(i) * 64, lambda: b"x") == (b"x", False)
            assert cache.get_or_build(f"e{i}", str(i) * 64, lambda: b"y") == (b"x", True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "not writable" in warnings[0], warnings
    assert not list(d.iterdir())


def test_nvrtc_version_by_ctypes_is_the_library_cuda_bindings_compiles_with():
    """nvrtc_version (part of every cache key) asks the wheel's NVRTC through ctypes instead of
    importing cuda.bindings.nvrtc (~70 ms of cuda.pathfinder on a cache hit); in a fresh process
    it must name the version cuda.bindings reports, and cuda.pathfinder must then find that very
    library already loaded (so the kernels are compiled by the NVRTC the key names). Without the
    bindings' import on the way."""
    script = textwrap.dedent("""
        import json, sys
        from flashcuda.jit.compiler import nvrtc_version
        v = nvrtc_version()
        imported = "cuda.bindings.nvrtc" in sys.modules
        from cuda.bindings import nvrtc
        import cuda.pathfinder as pf
        err, major, minor = nvrtc.nvrtcVersion()
        loaded = pf.load_nvidia_dynamic_lib("nvrtc")
        print(json.dumps({"ours": v, "bindings": f"{major}.{minor}", "imported": imported,
                          "found_via": loaded.found_via}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["ours"] == got["bindings"]
    assert not got["imported"]
    assert got["found_via"] == "was-already-loaded-from-elsewhere"


def test_function_attribute_values_match_the_driver_enum():
    """runtime.FUNC_ATTRIBUTES (the ctypes path's CUfunction_attribute values) against
    cuda.bindings' enum, name by name."""
    from cuda.bindings import driver

    from flashcuda.jit import runtime

    for name, value in runtime.FUNC_ATTRIBUTES.items():
        assert int(getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}")) == value


def test_libcuda_signatures_match_the_driver_declarations():
    """runtime.LIBCUDA_SIGNATURES (the ctypes argtypes of every driver entry point flashcuda
    calls) against cuda.bindings' C declarations (cydriver.pxd): the same parameter count and,
    for each parameter, a pointer where the C type is one, a size_t where it is size_t."""
    import ctypes
    import re
    from pathlib import Path

    import cuda.bindings

    from flashcuda.jit import runtime

    pxd = (Path(cuda.bindings.__file__).parent / "cydriver.pxd").read_text()
    for name, args in runtime.LIBCUDA_SIGNATURES.items():
        found = re.search(rf"cdef CUresult {name}\(([^)]*)\)", pxd)
        assert found, name
        params = [p.strip() for p in found.group(1).split(",") if p.strip()]
        assert len(params) == len(args), (name, params)
        for c_param, ours in zip(params, args, strict=True):
            c_type = c_param.rsplit(" ", 1)[0]
            if "*" in c_param:
                assert ours is ctypes.c_void_p or ours is ctypes.c_char_p or hasattr(
                    ours, "contents"), (name, c_param, ours)
            if c_type == "size_t":
                assert ours is ctypes.c_size_t, (name, c_param, ours)


NOTE = ("ptxas info    : (C7519) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to program dependence on compiler-inserted WG.AR in divergent path in "
        "the function 'smoke_axpb' in line 12")


def test_ptxas_performance_note_is_warned_at_the_compile(monkeypatch):
    """A kernel ptxas serialised (a newer NVRTC than the CPU lane's) still loads -- it is correct
    -- but the compile says so (a Python warning, shown by default), naming the kernel, the arch
    and the note; the cache hit after is silent, and a clean compile says nothing."""
    import warnings

    from flashcuda.jit import compiler as compiler_mod
    from flashcuda.jit import runtime as runtime_mod

    real = compiler_mod.compile_spec(SMOKE, "sm_80")
    assert real.performance_notes() == []
    noted = compiler_mod.CompileResult(real.cubin, real.log + "\n" + NOTE + "\n", real.seconds)
    assert noted.performance_notes() == [NOTE.split(":", 1)[1].strip()]
    monkeypatch.setattr(runtime_mod, "compile_spec", lambda spec, arch: noted)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cubin, hit, _ = build_cubin(SMOKE, "sm_80")
        again, hit2, _ = build_cubin(SMOKE, "sm_80")
    assert not hit and hit2 and cubin == again == real.cubin
    assert len(seen) == 1 and seen[0].category is runtime_mod.KernelPerformanceWarning, seen
    msg = str(seen[0].message)
    assert "smoke_axpb" in msg and "sm_80" in msg and "C7519" in msg

    reset_disk_cache()
    monkeypatch.setenv("FLASHCUDA_CACHE_DIR", str(Path(os.environ["FLASHCUDA_CACHE_DIR"]) / "2"))
    monkeypatch.setattr(runtime_mod, "compile_spec", lambda spec, arch: real)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert build_cubin(SMOKE, "sm_80")[1] is False
    assert not seen


def test_flashcuda_check_fails_on_a_performance_note_and_reports_spills(monkeypatch, capsys):
    import flashcuda.jit as jit_pkg
    from flashcuda import cli
    from flashcuda.jit import compiler as compiler_mod

    real = compiler_mod.compile_spec(SMOKE, "sm_80")
    noted = compiler_mod.CompileResult(real.cubin, real.log + "\n" + NOTE + "\n", real.seconds)
    monkeypatch.setattr(jit_pkg, "all_variants", lambda: [(SMOKE, ("sm_80",))])
    assert "0 bytes spill stores" in real.log
    spilled = compiler_mod.CompileResult(
        real.cubin, real.log.replace("0 bytes spill stores", "8 bytes spill stores"), real.seconds)
    assert spilled.resources()["smoke_axpb"].spill_stores == 8
    # spills are said (some sm80 variants spill by design, within the CPU lane's budgets), a
    # performance note fails the check
    for result, rc, status in ((real, 0, "ok "), (spilled, 0, "SPILLS "), (noted, 1, "PERF ")):
        monkeypatch.setattr(jit_pkg, "compile_spec", lambda spec, arch, r=result: r)
        assert cli.main(["check", "--arch", "sm_80"]) == rc
        out = capsys.readouterr().out
        assert f"\n{status}" in out and "smoke_axpb" in out, out


def test_programmatic_launch_structs_match_cuda_h():
    """PreparedLaunch's cuLaunchKernelEx arguments laid out as cuda.h's CUlaunchAttribute (id,
    pad to 8, a 64-byte value union: 72 bytes) and CUlaunchConfig (seven unsigned ints, the
    stream at 32, the attribute pointer at 40, their count at 48: 56 bytes); the attribute id of
    programmatic stream serialization is 6 (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)."""
    import ctypes

    from flashcuda.jit import runtime

    assert ctypes.sizeof(runtime._LaunchAttribute) == 72
    assert runtime._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(runtime._LaunchConfig) == 56
    assert runtime._LaunchConfig.shared_mem.offset == 24
    assert runtime._LaunchConfig.stream.offset == 32
    assert runtime._LaunchConfig.attrs.offset == 40
    assert runtime._LaunchConfig.num_attrs.offset == 48
    assert runtime._PROGRAMMATIC_STREAM_SERIALIZATION == 6

"""What the sm90 compile tests share (test_fwd_sm90_compile.py, test_bwd_sm90_compile.py and the
A/B variants' tests): building every variant once, the clean-compile checks, the dispatched
forward calls, and reading SASS / ELF with cuobjdump."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flashcuda.jit import compile_spec

ARCH = "sm_90a"
ENTRY_REGS = 168  # 65536 / 384 threads, rounded down to 8: the cap at entry (setmaxnreg moves it)
# (head dim, windowed, seqlen_q) for each kind of tiles the sm90 forward dispatches: the calls the
# forward A/B variants' tests build at (test_fwd_sm90_q_stages.py, _o_tma.py, _decode_ahead.py, ...)
FWD_DISPATCH_CASES = [(64, False, 4096), (64, True, 1024), (64, True, 16384), (128, False, 4096),
                      (128, True, 1024)]


def fwd_without_and_with(monkeypatch, env: str, off: str, head_dim: int, windowed: bool,
                         seqlen: int) -> tuple:
    """(without, default): the bf16 forward configs select_config picks for the call with
    env=off (a part of the work-tile boundary turned off) and with `env` unset (left unset)."""
    import torch

    from flashcuda.ops import fwd_sm90

    monkeypatch.setenv(env, off)
    without = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    monkeypatch.delenv(env)
    return without, fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)


def build_all(configs) -> dict:
    """{config name: CompileResult} for sm_90a, compiled in parallel."""
    import cuda.core  # noqa: F401  (import once here: importing it from several threads races)

    def build(cfg):
        return cfg.name, compile_spec(cfg.spec(), ARCH)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(pool.map(build, configs))


def assert_compiled_clean(result, name: str) -> None:
    """At most the entry register cap, no static shared memory, no spills or stack, and no ptxas
    warning or performance note."""
    res = result.resources()[name]
    assert res.registers <= ENTRY_REGS
    assert res.shared_bytes == 0, "all shared memory is dynamic (the config's smem_bytes)"
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res
    # ptxas says so when it ignores setmaxnreg (C7508) or serialises wgmma (C7510, C7515 ...).
    assert "warning" not in result.log.lower(), result.log
    # C7519 / C7520 & co. are "info" lines: wgmma serialised because it sits on a divergent path
    # (the notes the JIT warns of at run time: CompileResult.performance_notes).
    assert not result.performance_notes(), result.log


def cuobjdump() -> str | None:
    """$FLASHCUDA_CUOBJDUMP, PATH, the nvidia-cuda-cuobjdump wheel (the `test` extra installs it,
    with nvidia-cuda-nvdisasm next to it, which cuobjdump finds there; else $NVDISASM_PATH or
    PATH), or triton's bundled copy."""
    found = os.environ.get("FLASHCUDA_CUOBJDUMP") or shutil.which("cuobjdump")
    if not found:
        try:
            import nvidia

            for root in nvidia.__path__:
                for candidate in sorted(Path(root).glob("cu*/bin/cuobjdump"), reverse=True):
                    if os.access(candidate, os.X_OK):
                        return str(candidate)
        except ImportError:
            pass
        try:
            import triton

            candidate = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
            found = str(candidate) if candidate.exists() else None
        except ImportError:
            found = None
    return found


def dump(cubin: bytes, tmp_path: Path, flag: str) -> str:
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (pip install -e \".[test]\", or set FLASHCUDA_CUOBJDUMP)")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    proc = subprocess.run([tool, flag, str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "nvdisasm" in proc.stderr:
        pytest.skip("cuobjdump found no nvdisasm (set NVDISASM_PATH)")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def param_table(cubin: bytes, tmp_path: Path) -> dict[int, tuple[int, int]]:
    """The cubin's own kernel parameter table (EIATTR_KPARAM_INFO): ordinal -> (offset, size)."""
    elf = dump(cubin, tmp_path, "-elf")
    return {int(o, 16): (int(off, 16), int(size, 16)) for o, off, size in re.findall(
        r"Ordinal\s*:\s*0x([0-9a-f]+)\s+Offset\s*:\s*0x([0-9a-f]+)\s+Size\s*:\s*0x([0-9a-f]+)",
        elf)}


def assert_plan_key_follows_operands(plan_key, base, names) -> tuple:
    """A plan hit skips can_implement, so `plan_key(call)` must change with each named operand's
    strides, 16-byte alignment and dtype, and with lse's dtype — and stay the same for fresh
    tensors of the same layout, or data moved by 16 bytes. Returns the base key."""
    import dataclasses

    import torch

    key = plan_key(base)
    for name in names:
        t = getattr(base, name)
        wide = torch.zeros(t.shape[:-1] + (t.shape[-1] + 8,), dtype=t.dtype)[..., :t.shape[-1]]
        shifted = torch.zeros(t.numel() + 8, dtype=t.dtype)[8:].view(t.shape)  # +16 bytes
        odd = torch.zeros(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)      # +2 bytes
        assert plan_key(dataclasses.replace(base, **{name: wide})) != key, name
        assert plan_key(dataclasses.replace(base, **{name: shifted})) == key, name
        assert plan_key(dataclasses.replace(base, **{name: odd})) != key, name
        assert plan_key(dataclasses.replace(base, **{name: t.half()})) != key, name
    assert plan_key(dataclasses.replace(base, lse=base.lse.double())) != key
    return key


def clean_sass(cfg, tmp_path: Path) -> str:
    """Compile an sm90 config (an A/B variant, say) for sm_90a, assert it compiled clean
    (assert_compiled_clean) and return its SASS."""
    result = compile_spec(cfg.spec(), ARCH)
    assert_compiled_clean(result, cfg.name)
    return dump(result.cubin, tmp_path, "-sass")

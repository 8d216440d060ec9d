"""The sm90 forward's steady key-tile loop in SASS, counted on the CPU (no GPU needed).

    python scripts/sass_loop.py [--head-dim 64] [--seqlen 8192] [--list]
    FLASHCUDA_SM90_FWD_DEFINES=FC_NAME=1 python scripts/sass_loop.py ...   (an A/B variant)

Compiles the bf16 forward kernel dispatch picks for a call without a window
(fwd_sm90.select_config, with the environment's A/B variables; the windowed, masked-V kernels
run their loop in three copies, scanning and not, which this does not tell apart),
disassembles it with cuobjdump (the `test` extra's), and finds the consumers' key-tile loop.
Its head is the target of the back edge after the turn's second barrier
(`BAR.SYNC.DEFER_BLOCKING Rn, 0x100`: the first is a work tile's first key tile). A warp
skips the block jumped over by the loop's forward branch (the mask) on an unmasked tile, so
the instructions executed per consumer warp and unmasked key tile are the loop's length less
that block. At 49a5da0 (NVRTC 13.5 here, 13.0 on the device) this printed 436 at d64, which
is what ncu counted on the device (session 48, perf-notes). --list prints the loop's
instructions that are not float work (the bookkeeping).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

FLOAT_WORK = ("MUFU", "FMNMX", "FADD", "FFMA", "FMUL", "F2FP", "HGMMA", "SHFL")
_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_TURN = re.compile(r"BAR\.SYNC\.DEFER_BLOCKING R\d+, 0x100")


@dataclass
class Loop:
    head: int  # index of the loop's first instruction
    back: int  # index of its back-edge branch
    skipped: int  # instructions of the block an unmasked tile jumps over
    instructions: list[str]  # the whole loop, head to back edge
    mask: int | None = None  # position in `instructions` of the branch over that block

    @property
    def per_step(self) -> int:
        return self.back - self.head + 1 - self.skipped


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction of cuobjdump -sass output."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]


def opcode(text: str) -> str:
    return (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0]


def _target(text: str) -> int | None:
    m = re.search(r"BRA (?:P\d+, |`\(.*?\) )?0x([0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


def find_loop(sass: str) -> Loop:
    """The steady key-tile loop (see the module docstring); ValueError if the shape differs."""
    ins = instructions(sass)
    index = {a: i for i, (a, _) in enumerate(ins)}
    turns = [i for i, (_, s) in enumerate(ins) if _TURN.match(s)]
    if len(turns) < 2:
        raise ValueError(f"expected two turn barriers, found {len(turns)}")
    turn = turns[1]
    for i in range(turn, len(ins)):
        text = ins[i][1]
        target = _target(text)
        if target is None or target not in index:
            continue
        if turns[0] < index[target] < turn:  # (an mbarrier wait's retry jumps forward)
            head, back = index[target], i
            break
    else:
        raise ValueError("no back edge to before the turn barrier")
    body = [s for _, s in ins[head:back + 1]]
    # the mask's branch (uniform: P and a predicate)
    mask = next((k for k, s in enumerate(body) if re.search(r"BRA P\d+, 0x", s)), None)
    skipped = 0 if mask is None else index[_target(body[mask])] - (head + mask) - 1
    return Loop(head, back, skipped, body, mask)


def bookkeeping(loop: Loop) -> list[str]:
    """The loop's instructions an unmasked tile runs that are not float work or GEMMs."""
    body, mask = loop.instructions, loop.mask
    keep = body if mask is None else body[:mask + 1] + body[mask + 1 + loop.skipped:]
    return [s for s in keep if opcode(s) not in FLOAT_WORK]


def compile_sass(head_dim: int, seqlen: int) -> tuple[str, str]:
    """(kernel name, cuobjdump -sass text) of the dispatched bf16 forward kernel."""
    import torch

    from flashcuda.jit import compile_spec
    from flashcuda.ops import fwd_sm90

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.cpu.sm90_compile import cuobjdump

    cfg = fwd_sm90.select_config(torch.bfloat16, head_dim, False, seqlen)
    tool = cuobjdump()
    if tool is None:
        raise SystemExit('no cuobjdump: pip install -e ".[test]" (or set FLASHCUDA_CUOBJDUMP)')
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(compile_spec(cfg.spec(), "sm_90a").cubin)
        out = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True,
                             check=True, timeout=300).stdout
    return cfg.name, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--list", action="store_true", help="print the bookkeeping instructions")
    a = ap.parse_args()
    name, sass = compile_sass(a.head_dim, a.seqlen)
    loop = find_loop(sass)
    extra = bookkeeping(loop)
    print(f"{name}: loop {loop.back - loop.head + 1} instructions, {loop.skipped} skipped on "
          f"an unmasked tile: {loop.per_step} per consumer warp and key tile, "
          f"{len(extra)} of them not float work")
    counts = collections.Counter(opcode(s) for s in extra)
    print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common()))
    if a.list:
        print("\n".join("    " + s for s in extra))


if __name__ == "__main__":
    main()

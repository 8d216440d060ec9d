"""Run one of the synchronisation patterns of the sm90 kernels alone, for checking what
compute-sanitizer racecheck reports about it (docs/GUARANTEES.md), and check its values:

    compute-sanitizer --tool racecheck python scripts/racecheck_probe.py bulk ordered|racy|fenced
    compute-sanitizer --tool racecheck python scripts/racecheck_probe.py handoff ordered|racy|tx|reinit

bulk (flashcuda/kernels/common/bulk_copy_probe.cu): cp.async.bulk into shared memory, ordered by
mbarriers as in the backward's ring stages ("ordered"), read before the wait ("racy", a real
race), or ordered with a fence.proxy.async before the release ("fenced"); the values copied.
handoff (flashcuda/kernels/common/mbarrier_handoff_probe.cu): 32-bit shared words handed from one
thread to three warps through mbarriers, as the forward's V scanner's requests and verdicts:
"full" completed by a plain arrival ("ordered") or by an arrive.expect_tx and a bulk copy
("tx"), or the words read before the wait ("racy"), or with the fused forward kernel's
hand-over between its passes in the middle ("reinit": a vote and a go on two more mbarriers,
the ring's barriers invalidated and initialised anew between them); the words as written. If
racecheck reports the ordered patterns too, its reports on the kernels' same patterns are the
tool's model, not a race. Exits 1 when a mode other than "racy" gets wrong values.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from flashcuda.jit import KernelSpec, get_kernel

MODES = {"bulk": {"ordered": 0, "racy": 1, "fenced": 2},
         "handoff": {"ordered": 0, "racy": 1, "tx": 2, "reinit": 3}}


def run(probe: str, code: int) -> bool:
    """Launch the probe (one CTA, 128 threads) in mode `code`; True if its values are right."""
    if probe == "bulk":
        src = torch.randn(512, device="cuda")
        out = torch.full_like(src, float("nan"))
        want = src
    else:
        src = torch.randn(16, device="cuda")
        out = torch.zeros(12, dtype=torch.int32, device="cuda")
        want = torch.arange(4, device="cuda", dtype=torch.int32).repeat_interleave(3) + 1000
    name = {"bulk": "bulk_copy_probe", "handoff": "mbarrier_handoff_probe"}[probe]
    kernel = get_kernel(KernelSpec.make(name, f"common/{name}.cu"))
    kernel.launch((1, 1, 1), (128, 1, 1), src, out, np.int32(code))
    torch.cuda.synchronize()
    return torch.equal(out, want)


def main() -> None:
    probe = sys.argv[1] if len(sys.argv) > 1 else "bulk"
    mode = sys.argv[2] if len(sys.argv) > 2 else "ordered"
    if probe not in MODES or mode not in MODES[probe]:
        raise SystemExit(f"usage: racecheck_probe.py bulk|handoff MODE (bulk: "
                         f"{'|'.join(MODES['bulk'])}; handoff: {'|'.join(MODES['handoff'])})")
    right = run(probe, MODES[probe][mode])
    print(f"{probe} probe {mode}: values {'as expected' if right else 'DIFFER'}")
    if mode != "racy" and not right:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

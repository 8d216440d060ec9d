"""Run flashcuda/kernels/common/mbarrier_handoff_probe.cu: 32-bit shared-memory words handed from
one thread to three warps through mbarriers, as the forward's V scanner's requests (FC_MV_SCANNER):
"full" completed by a plain arrival (mode "ordered") or by an arrive.expect_tx and a bulk copy
(mode "tx"), or the words read before the wait (mode "racy", a real race). Under
compute-sanitizer racecheck this shows whether the tool reports the ordered hand-offs too (then
its reports on the scanner's words are the tool's model, not a race). Checks the words either
way.

    compute-sanitizer --tool racecheck python scripts/racecheck_handoff_probe.py ordered|racy|tx
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from flashcuda.jit import KernelSpec, get_kernel


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "ordered"
    code = {"ordered": 0, "racy": 1, "tx": 2}[mode]
    spec = KernelSpec.make("mbarrier_handoff_probe", "common/mbarrier_handoff_probe.cu")
    kernel = get_kernel(spec)
    src = torch.randn(16, device="cuda")
    dst = torch.zeros(12, dtype=torch.int32, device="cuda")
    kernel.launch((1, 1, 1), (128, 1, 1), src, dst, np.int32(code))
    torch.cuda.synchronize()
    want = torch.arange(4, device="cuda", dtype=torch.int32).repeat_interleave(3) + 1000
    same = torch.equal(dst, want)
    print(f"mbarrier_handoff_probe {mode}: words {'as written' if same else 'DIFFER'}")
    if mode != "racy" and not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

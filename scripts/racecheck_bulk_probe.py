"""Run flashcuda/kernels/common/bulk_copy_probe.cu: cp.async.bulk into shared memory, ordered by
mbarriers as in the sm90 kernels' ring stages (mode "ordered"), or read before the wait (mode
"racy", a real race), or ordered with a fence.proxy.async before the release (mode "fenced"). Under compute-sanitizer racecheck this shows whether the tool reports the
ordered pattern too (then its reports on the sm90 backward's lse2 / delta reads are the tool's
model, not a race). Checks the copied values either way.

    compute-sanitizer --tool racecheck python scripts/racecheck_bulk_probe.py ordered|racy|fenced
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from flashcuda.jit import KernelSpec, get_kernel


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "ordered"
    code = {"ordered": 0, "racy": 1, "fenced": 2}[mode]
    spec = KernelSpec.make("bulk_copy_probe", "common/bulk_copy_probe.cu")
    kernel = get_kernel(spec)
    src = torch.randn(512, device="cuda")
    dst = torch.full_like(src, float("nan"))
    kernel.launch((1, 1, 1), (128, 1, 1), src, dst, np.int32(code))
    torch.cuda.synchronize()
    same = torch.equal(src, dst)
    print(f"bulk_copy_probe {mode}: values {'equal' if same else 'DIFFER'}")
    if mode != "racy" and not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""First-call latency of the JIT, each in a new process (PERFORMANCE.md targets: compile of one
kernel <= 2 s; a cache hit in a new process <= 50 ms).

    python scripts/jit_latency.py [--kernel smoke|flash] > latency.json

cold: empty cache dir -> NVRTC compile + load + first launch.   warm: same dir, new process ->
cache hit + load + first launch. Times exclude interpreter start and `import torch`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import time, json, sys, torch
import numpy as np
torch.zeros(1, device="cuda"); torch.cuda.synchronize()      # CUDA context up before timing
kind = sys.argv[1]
t0 = time.perf_counter()
if kind == "smoke":
    from flashcuda.jit import KernelSpec, get_kernel
    x = torch.randn(1024, device="cuda"); y = torch.empty_like(x)
    k = get_kernel(KernelSpec.make("smoke_axpb", "common/smoke.cu"), x.device)
    k.launch((4,), (256,), x, y, np.float32(1), np.float32(0), np.int64(1024))
    hit = k.cache_hit
else:
    import flashcuda
    q = torch.randn(1, 512, 8, 128, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    flashcuda.flash_attn_func(q, q, q, causal=True)
    hit = None
torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - t0, "cache_hit": hit}))
"""


def run(kind: str, cache: str) -> dict:
    env = dict(os.environ, FLASHCUDA_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", CHILD, kind], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", default="smoke", choices=["smoke", "flash"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        cache = os.path.join(d, "cache")
        cold = run(args.kernel, cache)
        warm = [run(args.kernel, cache) for _ in range(3)]
    print(json.dumps({
        "kernel": args.kernel,
        "cold_seconds": cold["seconds"],
        "warm_seconds": sorted(w["seconds"] for w in warm)[1],
        "warm_all": [w["seconds"] for w in warm],
        "targets": {"cold_seconds": 2.0, "warm_seconds": 0.05},
    }))


if __name__ == "__main__":
    main()

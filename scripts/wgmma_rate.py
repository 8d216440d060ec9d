"""The tensor pipe's rate per wgmma shape (flashcuda/kernels/common/wgmma_rate.cu): m64nNk16 bf16
from shared memory, back to back, one CTA per SM with two (or three) warpgroups, for N in
--n (default 64 128 176, the N the header has wgmma_ss for). Prints, per N, FLOPs
per SM clock cycle (clock64, the slowest warpgroup) and TFLOP/s over the whole GPU (CUDA
events), the median of --repeats launches.

    PYTHONPATH=. python scripts/wgmma_rate.py [--n 64 128 176] [--warpgroups 2] [--iters 4096]

Question it answers (perf-notes, session 13, "d128 forward: 128 x 128 tiles"): does an N = 176
S GEMM cost more tensor-pipe cycles per FLOP than N = 128?
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from flashcuda.jit import KernelSpec, get_kernel


def spec(n: int, warpgroups: int) -> KernelSpec:
    return KernelSpec.make(f"wgmma_rate_n{n}_wg{warpgroups}", "common/wgmma_rate.cu",
                           defines={"FC_N": n, "FC_WARPGROUPS": warpgroups})


def smem_bytes(n: int, warpgroups: int) -> int:
    return 1024 + warpgroups * 64 * 128 * 2 + n * 128 * 2  # as the .cu's kSmemBytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[64, 128, 176])
    ap.add_argument("--warpgroups", type=int, default=2)
    ap.add_argument("--iters", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs, {a.warpgroups} warpgroups per CTA, "
          f"{a.iters} x 8 wgmma each")
    print(f"{'N':>5} {'FLOP/cycle/SM':>14} {'TFLOP/s':>9} {'vs N=128':>9}")
    rows = {}
    for n in a.n:
        kernel = get_kernel(spec(n, a.warpgroups))
        cycles = torch.zeros(sms * a.warpgroups, dtype=torch.int64, device="cuda")
        sink = torch.zeros(sms * a.warpgroups, dtype=torch.float32, device="cuda")
        flops_wg = a.iters * 8 * 2 * 64 * n * 16
        per_cycle, tflops = [], []
        for rep in range(a.repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            kernel.launch((sms, 1, 1), (128 * a.warpgroups, 1, 1), cycles, sink,
                          np.int32(a.iters), shared_mem=smem_bytes(n, a.warpgroups))
            end.record()
            torch.cuda.synchronize()
            if rep == 0:
                continue  # warm-up
            per_sm = cycles.view(sms, a.warpgroups).max(dim=1).values.double()
            per_cycle.append(statistics.median((flops_wg * a.warpgroups / per_sm).tolist()))
            tflops.append(flops_wg * a.warpgroups * sms / (start.elapsed_time(end) * 1e-3) / 1e12)
        rows[n] = (statistics.median(per_cycle), statistics.median(tflops))
    for n, (pc, tf) in rows.items():
        rel = f"{pc / rows[128][0]:.3f}" if 128 in rows else "-"
        print(f"{n:>5} {pc:>14.1f} {tf:>9.1f} {rel:>9}")


if __name__ == "__main__":
    main()

"""Sustained-load clocks and power of one forward, on a GPU: does a kernel slow down when it runs
back to back for seconds (the bench's do_bench windows) against the profiler's short bursts?

    python scripts/power_probe.py [--shape B S H D] [--causal] [--bwd] [--seconds 3]
                                  [--impls flashcuda sdpa_cudnn fa4] [--flush]

Per implementation: a warm-up, then calls back to back for --seconds (with --flush, each call
after a 256 MB memset, as the bench's timer does), a CUDA event every --window calls. Meanwhile
nvidia-smi samples the SM clock, power draw and the active clock-throttle reasons every 50 ms.
Prints per implementation the TFLOP/s of the first and last windows and the median of all, next
to the median SM clock and power over the run and the throttle reasons seen; then the same
implementations' TFLOP/s in a short burst (5 calls after 1 s idle, the profiler's conditions).
--bwd times the backward alone, as the bench does (one forward, then out.backward(dout,
retain_graph=True) per call; FLOPs 2.5 x the forward's). fa4 needs FLASHCUDA_BENCH_SITE
(scripts/fa4_carry.sh).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

import flashcuda

# (newer drivers name the throttle reasons "clocks_event_reasons")
QUERIES = ("clocks.sm,power.draw,clocks_event_reasons.active",
           "clocks.sm,power.draw,clocks_throttle_reasons.active", "clocks.sm,power.draw,pstate")


def smi_query() -> str:
    for query in QUERIES:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return query
    raise SystemExit("nvidia-smi answers none of the queries")


def make_attend(impl: str, causal: bool):
    if impl == "flashcuda":
        return lambda q, k, v: flashcuda.flash_attn_func(q, k, v, causal=causal)
    if impl == "sdpa_cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def attend(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                      v.transpose(1, 2), is_causal=causal)
        return attend
    if impl == "fa4":
        from flashcuda.bench import peers

        fa4 = peers.load_fa4()
        if fa4.status != "ok":
            raise SystemExit(f"fa4 is {fa4.status}: {fa4.detail}")
        return lambda q, k, v: fa4.forward(q, k, v, causal, q.shape[-1] ** -0.5)
    raise SystemExit(f"unknown impl {impl}")


def backward_of(attend, q, k, v):
    """A call that runs the backward of one recorded forward (the bench's backward timing)."""
    out = attend(q, k, v)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn_like(out)
    return lambda q_, k_, v_: out.backward(dout, retain_graph=True)


def summarize(smi_out: str) -> dict:
    """nvidia-smi's "clock, power, third field" lines (noheader, nounits) -> the median and
    extreme SM clock (MHz) and power (W), and how often each value of the third field (the
    clock-event reasons, or the pstate) was seen. Lines that do not parse are skipped."""
    clocks, power, third = [], [], collections.Counter()
    for line in smi_out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            continue
        try:
            clock, watts = float(fields[0]), float(fields[1])
        except ValueError:
            continue
        clocks.append(clock)
        power.append(watts)
        third[fields[2]] += 1
    if not clocks:
        return {"samples": 0}
    return {"samples": len(clocks), "clock_median": statistics.median(clocks),
            "clock_min": min(clocks), "power_median": statistics.median(power),
            "power_max": max(power), "reasons": dict(third)}


def describe(summary: dict) -> str:
    if not summary["samples"]:
        return "no nvidia-smi samples"
    return (f"SM clock median {summary['clock_median']:.0f} MHz (min {summary['clock_min']:.0f}), "
            f"power median {summary['power_median']:.0f} W (max {summary['power_max']:.0f}) | "
            f"clock-event reasons {summary['reasons']} ({summary['samples']} samples)")


def run(attend, q, k, v, seconds: float, window: int, flush: torch.Tensor | None) -> list[float]:
    """Milliseconds per call of each window of `window` calls over `seconds` (at least one)."""
    times = []
    t_end = time.perf_counter() + seconds
    while not times or time.perf_counter() < t_end:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(window):
            if flush is not None:
                flush.zero_()
            attend(q, k, v)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / window)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 16384, 16, 128],
                    metavar=("B", "S", "H", "D"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--flush", action="store_true")
    ap.add_argument("--impls", nargs="+", default=["flashcuda", "sdpa_cudnn"])
    a = ap.parse_args()
    b, s, h, d = a.shape
    flops = 4 * b * h * s * s * d / (2 if a.causal else 1) * (2.5 if a.bwd else 1)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=a.bwd)
               for _ in range(3))
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if a.flush else None
    tflops = lambda ms: flops / ms / 1e9  # noqa: E731
    print(f"shape {tuple(a.shape)} causal={a.causal} bwd={a.bwd} flush={a.flush} {a.seconds}s sustained, "
          f"{torch.cuda.get_device_name()}")
    query = smi_query()
    burst = {}
    for impl in a.impls:
        attend = make_attend(impl, a.causal)
        if a.bwd:
            attend = backward_of(attend, q, k, v)
        for _ in range(3):
            attend(q, k, v)
        torch.cuda.synchronize()
        time.sleep(1.0)
        burst[impl] = run(attend, q, k, v, 0.0, 5, flush)[0]
        time.sleep(1.0)
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=subprocess.PIPE, text=True)
        times = run(attend, q, k, v, a.seconds, a.window, flush)
        smi.terminate()
        smi_out = smi.communicate()[0]
        print(f"  {impl:11s} first {tflops(times[0]):6.1f}  last {tflops(times[-1]):6.1f}  "
              f"median {tflops(statistics.median(times)):6.1f} TFLOP/s ({len(times)} windows) | "
              + describe(summarize(smi_out)))
        time.sleep(2.0)
    print("  burst (5 calls after 1 s idle): " + ", ".join(
        f"{impl} {tflops(ms):.1f}" for impl, ms in burst.items()) + " TFLOP/s")


if __name__ == "__main__":
    main()

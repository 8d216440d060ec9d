"""GPU timing with CUDA events (PERFORMANCE.md, "Method").

Every measurement: an explicit warm-up first (at least `warmup_ms` of calls and at least 3 calls, so
compile, module load and clock ramp-up are out of the way), then per-call CUDA events around `fn`
with the L2 cache flushed before each call (a 256 MB buffer is zeroed), median and p10/p90 of the
per-call times. `triton.testing.do_bench` does exactly this when Triton is importable; otherwise
the same loop runs on torch.cuda.Event.

Serving latency is different: no flush, one call at a time, host wall-clock (launch overhead
included) and GPU time per call, p50/p90/p99.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

L2_FLUSH_BYTES = 256 * 1024 * 1024

# Calls an older triton.testing.do_bench (no return_mode="all") makes outside its timed loop when
# given warmup=0: 1 first call + 5 estimate calls + 1 warm-up call.
_DO_BENCH_SETUP_CALLS = 7


@dataclass(frozen=True)
class Timing:
    """Per-call times of one measurement, in milliseconds. n: timed repetitions."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    n: int
    method: str

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> Timing:
        return Timing(float(d["median_ms"]), float(d["p10_ms"]), float(d["p90_ms"]), int(d["n"]),
                      str(d["method"]))


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), q in [0, 1]."""
    if not values:
        raise ValueError("quantile of an empty sequence")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float], method: str) -> Timing:
    return Timing(quantile(samples_ms, 0.5), quantile(samples_ms, 0.1), quantile(samples_ms, 0.9),
                  len(samples_ms), method)


def events_ms(fn: Callable[[], object], calls: int) -> float:
    """GPU ms per call of `calls` back-to-back calls of fn, between two CUDA events (the probes'
    timer: scripts/ab_probe.py, masked_v_probe.py)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def tflops(flops: float, ms: float | None) -> float | None:
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def _do_bench():
    """triton.testing.do_bench if importable and new enough to take `quantiles`, else None."""
    try:
        from triton.testing import do_bench
    except Exception:  # noqa: BLE001 - any import failure means "use the event loop"
        return None
    try:
        if "quantiles" not in inspect.signature(do_bench).parameters:
            return None
    except (TypeError, ValueError):
        return None
    return do_bench


def timer_method(requested: str = "auto") -> str:
    """'triton.do_bench' or 'cuda_events' for a requested 'auto' | 'triton' | 'events'."""
    if requested == "events":
        return "cuda_events"
    if _do_bench() is not None:
        return "triton.do_bench"
    if requested == "triton":
        raise RuntimeError("--timer triton: triton.testing.do_bench (with quantiles) is not importable")
    return "cuda_events"


class Timer:
    """`timer(fn, grad_to_none=[...]) -> Timing`. One instance per run, so every number in a run
    is taken the same way."""

    def __init__(self, method: str = "auto", warmup_ms: float = 25.0, rep_ms: float = 100.0,
                 min_reps: int = 5, max_reps: int = 10_000):
        self.method = timer_method(method)
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.min_reps = min_reps
        self.max_reps = max_reps

    def describe(self) -> dict:
        return {"method": self.method, "warmup_ms": self.warmup_ms, "rep_ms": self.rep_ms,
                "l2_flush_bytes": L2_FLUSH_BYTES, "statistic": "median, p10, p90 of per-call times"}

    def warm_up(self, fn: Callable[[], object], grad_to_none=None) -> None:
        import torch

        start = time.perf_counter()
        calls = 0
        while calls < 3 or (time.perf_counter() - start) * 1e3 < self.warmup_ms:
            _clear_grads(grad_to_none)
            fn()
            calls += 1
            if calls % 8 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], object], grad_to_none=None) -> Timing:
        self.warm_up(fn, grad_to_none)
        if self.method == "triton.do_bench":
            return self._triton(fn, grad_to_none)
        return self._events(fn, grad_to_none)

    def _triton(self, fn, grad_to_none) -> Timing:
        do_bench = _do_bench()
        try:  # every per-call time (Triton >= 3.0): exact n and our own quantiles
            samples = do_bench(fn, warmup=0, rep=self.rep_ms, grad_to_none=grad_to_none,
                               return_mode="all")
            if isinstance(samples, (list, tuple)) and samples:
                return summarize([float(x) for x in samples], self.method)
        except (AssertionError, ValueError, TypeError):
            pass
        # Older Triton: its quantiles; n is inferred from the number of calls it made.
        calls = 0

        def counted():
            nonlocal calls
            calls += 1
            return fn()

        med, p10, p90 = do_bench(counted, warmup=0, rep=self.rep_ms, grad_to_none=grad_to_none,
                                 quantiles=[0.5, 0.1, 0.9])
        return Timing(float(med), float(p10), float(p90), max(1, calls - _DO_BENCH_SETUP_CALLS),
                      self.method)

    def _events(self, fn, grad_to_none) -> Timing:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
        n = int(min(self.max_reps, max(self.min_reps, self.rep_ms / estimate_ms)))
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            _clear_grads(grad_to_none)
            flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        del flush
        return summarize(samples, self.method)


def host_time_us(fn: Callable[[], object], grad_to_none=None, calls: int = 20,
                 spin_ms: float = 50.0) -> float | None:
    """Median host microseconds of one `fn()` call while the GPU is busy: a spin kernel of about
    `spin_ms` is queued first, so the calls only enqueue work and never wait for the GPU. A timed
    call whose host time exceeds the GPU time of (L2 flush + kernel) leaves the GPU idle inside its
    timed region and is measured as host time — this number shows when that can happen. None if
    it cannot be measured (the call synchronised, or the spin kernel is unavailable)."""
    import torch

    try:
        torch.cuda.synchronize()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        rate = getattr(props, "clock_rate", 0) or 2_000_000  # kHz; 2 GHz if torch does not say
        torch.cuda._sleep(int(spin_ms * rate))
        samples = []
        for _ in range(calls):
            _clear_grads(grad_to_none)
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a diagnostic: never fails a run
        _clear_grads(grad_to_none)
        return None
    _clear_grads(grad_to_none)
    med = quantile(samples, 0.5)
    return med if med < spin_ms * 1e3 / calls else None  # longer: some call waited for the GPU


# p90 / p10 of one timing from which a timing counts as unsteady (the report's ‡; the sweep then
# also measures its host exposure). The sweep at 4ee486d: 46 of 48 flashcuda timings at most
# 1.10; the d128 causal 512 forward 1.36, host-bound, and backward 1.96.
SPREAD_LIMIT = 1.25


def spread_too_wide(p10_ms: float | None, p90_ms: float | None) -> bool:
    """The unsteady rule: p90 at least SPREAD_LIMIT times p10 (False when either is missing)."""
    return bool(p10_ms and p90_ms and p90_ms >= SPREAD_LIMIT * p10_ms)


def is_unsteady(timing: Timing) -> bool:
    return spread_too_wide(timing.p10_ms, timing.p90_ms)


def exposure_summary(ms: Sequence[float], gpu_start_s: Sequence[float],
                     host_done_s: Sequence[float], host_us: Sequence[float]) -> dict:
    """Which timed calls the host may have slowed. A call is *exposed* when the GPU reached its
    start event (gpu_start_s, on the host's clock) before the host had finished enqueueing the
    call (host_done_s): then the GPU may have waited inside the measured time. Otherwise the
    whole call was queued before its timing began, so its host time cannot be in it."""
    exposed = [g < h for g, h in zip(gpu_start_s, host_done_s, strict=True)]
    hit = [m for m, e in zip(ms, exposed, strict=True) if e]
    ahead = [m for m, e in zip(ms, exposed, strict=True) if not e]
    return {"calls": len(ms), "exposed": sum(exposed),
            "exposed_median_ms": quantile(hit, 0.5) if hit else None,
            "ahead_median_ms": quantile(ahead, 0.5) if ahead else None,
            "host_median_us": quantile(host_us, 0.5) if host_us else None,
            "host_p90_us": quantile(host_us, 0.9) if host_us else None}


def timed_loop(fn: Callable[[], object], reps: int, flush, grad_to_none=None) -> dict:
    """The timed loop of do_bench (per call: clear grads, zero the flush buffer, start event, fn,
    end event; no synchronisation inside), with the host clock taken around each call and one
    anchor event recorded on an idle GPU, which puts the GPU's event times on the host clock.
    Returns the per-call ms with exposure_summary's fields."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    anchor = torch.cuda.Event(enable_timing=True)
    before, after = [0.0] * reps, [0.0] * reps
    now = time.perf_counter
    torch.cuda.synchronize()
    anchor.record()
    t0 = now()
    for i in range(reps):
        _clear_grads(grad_to_none)
        flush.zero_()
        starts[i].record()
        before[i] = now()
        fn()
        after[i] = now()
        ends[i].record()
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    gpu_start = [t0 + anchor.elapsed_time(s) * 1e-3 for s in starts]
    host_us = [(a - b) * 1e6 for a, b in zip(after, before, strict=True)]
    return {"ms": ms, **exposure_summary(ms, gpu_start, after, host_us)}


def host_exposure(fn: Callable[[], object], median_ms: float, grad_to_none=None,
                  rep_ms: float = 100.0) -> dict | None:
    """timed_loop for about `rep_ms` of calls (their count from `median_ms`, the timing just
    taken) without the per-call times: how many of the calls the host may have slowed, and the
    median time of those and of the others. None if it cannot be measured (a diagnostic: never
    fails a run)."""
    import torch

    _clear_grads(grad_to_none)
    try:
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
        reps = int(min(10_000, max(5, rep_ms / max(median_ms + 0.07, 1e-3))))
        out = timed_loop(fn, reps, flush, grad_to_none)
        del flush
    except Exception:  # noqa: BLE001
        _clear_grads(grad_to_none)
        return None
    _clear_grads(grad_to_none)
    out.pop("ms")
    return out


def spin_up(ms: float = 500.0) -> None:
    """Keep the GPU busy with matmuls for about `ms`, so the first measurement of a run is not
    taken while the clocks ramp up from idle (345 MHz at rest on the H200, 1980 MHz under load)."""
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _clear_grads(tensors) -> None:
    for t in tensors or ():
        t.grad = None


def first_call(fn: Callable[[], object]) -> tuple[float, object]:
    """(wall-clock ms, result) of one call including everything it triggers (compile, cache hit,
    module load), synchronised on both sides."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, result


def latency_percentiles(fn: Callable[[], object], n: int = 200, warmup: int = 20) -> dict:
    """Serving-style latency: each call alone (synchronised), no L2 flush.

    Returns wall-clock (host launch overhead included) and GPU (CUDA events) p50/p90/p99 in ms.
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    wall: list[float] = []
    gpu: list[float] = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(n):
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        gpu.append(start.elapsed_time(end))
    out = {"n": n}
    for label, samples in (("wall", wall), ("gpu", gpu)):
        for q in (50, 90, 99):
            out[f"{label}_p{q}_ms"] = quantile(samples, q / 100)
    return out


def capture(fn: Callable[[], object], warmup: int = 3) -> tuple[object, object]:
    """(graph, output): fn captured in a CUDA graph by torch's recipe (`warmup` calls on a side
    stream first, so kernels are loaded and plans made before the capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_latency(fn: Callable[[], object], n: int = 200, warmup: int = 3) -> dict:
    """Serving latency as a CUDA-graph serving stack sees it: one call captured in a CUDA graph
    (torch.cuda.graph, after `warmup` calls on a side stream, torch's capture recipe), then `n`
    replays queued back to back, each between two CUDA events: the GPU time of the call's own
    kernels with no host work in it (a replay's launch is one driver call). No L2 flush, as in
    latency_percentiles. Returns graph_p50/p90/p99 in ms; raises whatever capture raises (a
    peer that cannot be captured is recorded as such by the caller)."""
    import torch

    graph, _ = capture(fn, warmup)
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    samples = [start.elapsed_time(end) for start, end in events]
    del graph
    return {"graph_n": n, **{f"graph_p{q}_ms": quantile(samples, q / 100) for q in (50, 90, 99)}}

"""Was the GPU waiting for the host inside the sweep's timed calls? One process, on a GPU.

    python scripts/bench_timeline.py [--points B,S,H,D,causal ...] [--impls flashcuda sdpa_cudnn]
                                     [--rep-ms 100] [--no-gc-arm] [--sweep-arm]

The sweep times a call the way triton.testing.do_bench does: per timed call, zero a 256 MB
buffer (the L2 flush, ~65 us of GPU), record a start event, run the call, record an end event;
no synchronisation inside the loop, so the host runs ahead of the GPU whenever its time per call
is shorter than the GPU's. This repeats that loop (same order, same flush, same events, the
sweep's own `Impl`s and inputs) and also takes the host clock around every call, with one anchor
event recorded on an idle GPU to put the GPU's event times on the host clock. A timed call is
"ahead" when the GPU reached its start event only after the host had finished enqueueing the
whole call (its host time cannot be in the measurement) and "exposed" otherwise. Printed per
point, implementation and direction: median / p10 / p90 of the timed calls, the host time of
the call, how many calls were exposed and the median of each class — and the same loop with
Python's garbage collector off (a collection inside the host path is a long, rare stall), and
the call's GPU time alone (calls back to back, no flush). --sweep-arm also times each forward
with the sweep's own Timer (triton.testing.do_bench) in the same place, and runs the sweep's
run_point (forward only) for the point before and after, so a spread that only the sweep shows
can be pinned to the timer or to the process.
"""

from __future__ import annotations

import argparse
import gc

import torch

from flashcuda.bench import peers, sweep, timing

FLUSH_BYTES = timing.L2_FLUSH_BYTES  # the sweep's flush


def timeline(fn, reps: int, flush: torch.Tensor, grad_to_none=None) -> dict:
    """do_bench's loop with host timestamps (flashcuda.bench.timing.timed_loop, what the sweep
    runs again at an unsteady timing): per-call GPU ms and the exposed / ahead split."""
    return timing.timed_loop(fn, reps, flush, grad_to_none)


def back_to_back_ms(fn, calls: int = 50, grad_to_none=None) -> float:
    def call():
        timing._clear_grads(grad_to_none)
        fn()

    for _ in range(5):
        call()
    return timing.events_ms(call, calls)


def line(label: str, r: dict) -> str:
    s = timing.summarize(r["ms"], "timeline")

    def fmt(x):
        return f"{x * 1e3:7.1f}" if x is not None else "      -"

    return (f"  {label:<26} med {s.median_ms * 1e3:7.1f} p10 {s.p10_ms * 1e3:7.1f} "
            f"p90 {s.p90_ms * 1e3:7.1f} us | host {r['host_median_us']:6.1f} (p90 {r['host_p90_us']:6.1f}) "
            f"| exposed {r['exposed']:4d}/{r['calls']:<4d} med {fmt(r['exposed_median_ms'])} "
            f"ahead med {fmt(r['ahead_median_ms'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", nargs="+", default=["16,1024,16,128,1", "32,512,32,128,1",
                                                    "16,1024,32,64,1", "32,512,32,64,1",
                                                    "16,1024,16,128,0"])
    ap.add_argument("--impls", nargs="+", default=["flashcuda", "sdpa_cudnn", "sdpa_flash"])
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--no-gc-arm", action="store_true")
    ap.add_argument("--sweep-arm", action="store_true")
    ap.add_argument("--sweep-bwd", action="store_true", help="run_point times the backward too")
    args = ap.parse_args()
    loaders = {"flashcuda": peers.load_flashcuda, "fa4": peers.load_fa4}
    impls = [loaders[n]() if n in loaders else peers.load_sdpa(n) for n in args.impls]
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; per-call times in us")
    for text in args.points:
        b, s, h, d, c = (int(x) for x in text.split(","))
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (b, s, h, d)
        leaves = [torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen)
                  .requires_grad_() for _ in range(3)]
        dout = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen)
        print(f"B={b} S={s} H={h} D={d} causal={bool(c)}")
        point = sweep.SweepPoint(b, h, s, d, bool(c))
        if args.sweep_arm:
            sweep_line(point, impls, "run_point, before", args.sweep_bwd)
        for impl in impls:
            if impl.status != "ok":
                print(f"  {impl.name}: {impl.status}")
                continue
            with impl.context():
                prepared = impl.prepare(*leaves)

                def fwd(impl=impl, prepared=prepared, c=c, d=d):
                    return impl.forward(*prepared, bool(c), d ** -0.5)

                out = fwd()

                def bwd(out=out, dout=dout):
                    out.backward(dout, retain_graph=True)

                for direction, fn, g in (("fwd", fwd, None), ("bwd", bwd, leaves)):
                    gpu = back_to_back_ms(fn, grad_to_none=g)
                    reps = max(5, int(args.rep_ms / (gpu + 0.07)))
                    for _ in range(3):  # the sweep's warm-up
                        fn()
                    r = timeline(fn, reps, flush, g)
                    print(line(f"{impl.name} {direction}", r) + f" | back-to-back {gpu * 1e3:7.1f}")
                    if args.sweep_arm and direction == "fwd":
                        t = timing.Timer()(fn)
                        print(f"  {impl.name + ' fwd, sweep Timer':<26} med {t.median_ms * 1e3:7.1f} "
                              f"p10 {t.p10_ms * 1e3:7.1f} p90 {t.p90_ms * 1e3:7.1f} us (n {t.n})")
                    if not args.no_gc_arm:
                        gc.disable()
                        try:
                            r = timeline(fn, reps, flush, g)
                        finally:
                            gc.enable()
                        print(line(f"{impl.name} {direction} gc off", r))
                for t in leaves:
                    t.grad = None
                del out
            torch.cuda.empty_cache()
        if args.sweep_arm:
            del leaves, dout
            sweep_line(point, impls, "run_point, after", args.sweep_bwd)


def sweep_line(point, impls, label: str, bwd: bool) -> None:
    """The sweep's own run_point at `point`: every impl's forward median / p10 / p90."""
    entry = sweep.run_point(point, impls, timing.Timer(), fwd_only=not bwd)
    parts = []
    for name, res in entry["results"].items():
        t = res["fwd"].get("timing")
        if t:
            parts.append(f"{name} {t['median_ms'] * 1e3:.1f} ({t['p10_ms'] * 1e3:.1f}-"
                         f"{t['p90_ms'] * 1e3:.1f})")
    print(f"  [{label}] " + "; ".join(parts))


if __name__ == "__main__":
    main()

"""Same-process A/B of kernel variants: arms switched by the environment, interleaved per round.

    python scripts/ab_probe.py --arm def: --arm mb:FLASHCUDA_SM90_FWD_DEFINES=FC_MASK_BITS=0 \\
        [--shapes 32,512,16,64 16,1024,16,128 16,1024,32,128,8 ...] [--causal 0|1|both]
        [--direction fwd|bwd|both]
        [--rounds 15] [--calls 20] [--peer fa4 ...] [--out ab-probe.json]

Why: `gpu_lane.sh ab` benches each arm in separate processes, and between two processes the same
kernel read up to ±3-6% (session 18), more than the 1-3% a kernel change often moves. Here every
arm runs in one process on the same tensors: each arm "LABEL:VAR=VALUE[;VAR=VALUE]" (nothing
after the colon: the defaults) is set in os.environ around its calls (every switch the sm90
families read is part of their plan keys, so the switch picks that arm's kernel), and each
round runs the arms in a rotated order (round r starts at arm r mod n), so clock and thermal
drift fall on every arm alike. Round 0 compiles and warms up and is not counted.

Per shape, mask and direction: each arm's median ms per call over the rounds (CUDA events around
`--calls` back-to-back calls), its TFLOP/s, and against the first arm the median of the
per-round speed ratios (first arm's time / this arm's) with their p10-p90: a ratio whose p10-p90
excludes 1.00 is beyond this run's noise. The forward is flashcuda.flash_attn_func; the
backward is torch.autograd.grad through it (dq, dk, dv: PRE, MAIN and CONVERT), the forward run
once per arm and round outside the timed calls. The shapes should keep the GPU busier than the
host (a backward call costs ~0.3 ms of host time).

`--peer NAME` (repeatable; flashcuda.bench.peers' names, e.g. fa4 with FLASHCUDA_BENCH_SITE,
sdpa_cudnn) adds an arm that runs that implementation instead of flashcuda, in the same rotation
on the same tensors: a same-process ratio against a peer, where the sweep's points (separate
timed loops with a cache flush) move with the process and its host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable

from flashcuda.bench.timing import events_ms, quantile


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """"LABEL:VAR=VALUE[;VAR=VALUE]" -> (label, {var: value}); "LABEL:" is the defaults."""
    label, sep, spec = text.partition(":")
    if not sep or not label:
        raise ValueError(f"--arm: expected LABEL:VAR=VALUE[;VAR=VALUE] (or LABEL:), got {text!r}")
    env = {}
    for item in filter(None, spec.split(";")):
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise ValueError(f"--arm {label}: expected VAR=VALUE, got {item!r}")
        env[var] = value
    return label, env


def parse_shape(text: str) -> tuple[int, ...]:
    """"B,S,H,D" -> (batch, seqlen, heads, head dim); "B,S,H,D,HKV" adds the K / V heads (GQA:
    a divisor of H)."""
    parts = text.split(",")
    if len(parts) not in (4, 5) or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shapes: expected B,S,H,D[,HKV] of positive integers, got {text!r}")
    shape = tuple(int(p) for p in parts)
    if len(shape) == 5 and shape[2] % shape[4]:
        raise ValueError(f"--shapes: HKV must divide H, got {text!r}")
    return shape


def rotation(n: int, r: int) -> list[int]:
    """The arms' order in round r: arm r mod n first, then on in order."""
    return [(r + i) % n for i in range(n)]


def summarise(times: dict[str, list[float]], work: float) -> list[dict]:
    """times: arm -> ms per call, one per round (same rounds for every arm, first arm the base).
    Rows per arm: median ms, TFLOP/s, and the per-round speed ratios to the base (median, p10,
    p90)."""
    names = list(times)
    base = times[names[0]]
    rows = []
    for name in names:
        ts = times[name]
        if len(ts) != len(base) or not ts:
            raise ValueError(f"arm {name}: {len(ts)} rounds, the first arm has {len(base)}")
        ratios = [b / t for b, t in zip(base, ts, strict=True)]
        ms = statistics.median(ts)
        rows.append({"arm": name, "ms": ms, "tflops": work / ms / 1e9,
                     "ratio": statistics.median(ratios), "p10": quantile(ratios, 0.1),
                     "p90": quantile(ratios, 0.9)})
    return rows


def format_rows(title: str, rows: list[dict]) -> str:
    out = [title]
    for row in rows:
        beyond = "" if row["p10"] <= 1.0 <= row["p90"] else "  *"
        out.append(f"  {row['arm']:>10s} {row['ms']:9.4f} ms {row['tflops']:7.1f} TFLOP/s  "
                   f"x{row['ratio']:.3f} (p10-p90 {row['p10']:.3f}-{row['p90']:.3f}){beyond}")
    return "\n".join(out)


def _with_env(env: dict[str, str], fn: Callable[[], object]) -> object:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(arms: list[tuple[str, dict[str, str]]], shape: tuple[int, ...],
            causal: bool, direction: str, rounds: int, calls: int,
            peers: dict | None = None) -> dict[str, list[float]]:
    """Per arm, its ms per call in each counted round. `peers`: label -> a forward
    (q, k, v, causal) -> out run in place of flashcuda.flash_attn_func for that arm."""
    import torch

    import flashcuda

    peers = peers or {}
    b, s, h, d, *kv = shape
    q, k, v = (torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (h, kv[0] if kv else h, kv[0] if kv else h))
    dout = torch.randn_like(q)
    times: dict[str, list[float]] = {label: [] for label, _ in arms}
    for r in range(rounds + 1):  # round 0 compiles and warms up
        for i in rotation(len(arms), r):
            label, env = arms[i]
            fwd = peers.get(label, lambda q, k, v, causal: flashcuda.flash_attn_func(
                q, k, v, causal=causal))

            def one(fwd=fwd):
                if direction == "fwd":
                    with torch.no_grad():
                        return events_ms(lambda: fwd(q, k, v, causal), calls)
                out = fwd(q, k, v, causal)
                return events_ms(
                    lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), calls)

            t = _with_env(env, one)
            if r:
                times[label].append(t)
    return times


def load_peers(names: list[str]) -> dict:
    """name -> forward (q, k, v, causal) -> out, at the default scale; SystemExit naming the
    peer when it cannot be loaded."""
    from flashcuda.bench import peers as bench_peers

    out = {}
    if not names:  # (discover() with no names loads every peer)
        return out
    for impl in bench_peers.discover(names)[1:]:
        if impl.status != "ok":
            raise SystemExit(f"--peer {impl.name}: {impl.detail or impl.status}")

        def fwd(q, k, v, causal, impl=impl):
            prepared = impl.prepare(q, k, v)
            with impl.context():  # SDPA's peers pin their backend here
                return impl.forward(*prepared, causal, q.shape[-1] ** -0.5)

        out[impl.name] = fwd
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", default=[], type=parse_arm,
                    help="LABEL:VAR=VALUE[;VAR=VALUE] (repeat; the first is the base)")
    ap.add_argument("--shapes", nargs="+", type=parse_shape,  # B,S,H,D[,HKV]
                    default=[(32, 512, 16, 64), (16, 1024, 16, 128), (4, 4096, 16, 128)])
    ap.add_argument("--causal", choices=("0", "1", "both"), default="both")
    ap.add_argument("--direction", choices=("fwd", "bwd", "both"), default="fwd")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--peer", action="append", default=[],
                    help="a peer's name (flashcuda.bench.peers) as one more arm (repeat)")
    ap.add_argument("--out", default="", help="write the raw times and rows as JSON here")
    a = ap.parse_args(argv)
    if a.peer and any(len(shape) == 5 for shape in a.shapes):
        ap.error("--shapes: B,S,H,D,HKV (GQA) runs the flashcuda arms only; drop --peer")
    peers = load_peers(a.peer)
    a.arm += [(name, {}) for name in peers]
    if len(a.arm) < 2:
        ap.error("give at least two --arm (the first is the base)")
    if len({label for label, _ in a.arm}) != len(a.arm):
        ap.error("--arm labels must differ")
    if a.rounds < 1 or a.calls < 1:
        ap.error("--rounds and --calls must be >= 1")
    import torch

    from flashcuda.bench.sweep import attention_flops

    print(f"{torch.cuda.get_device_name()}: {a.rounds} rounds x {a.calls} calls per arm, arms "
          f"rotated per round; ratio = {a.arm[0][0]}'s time / the arm's ('*': p10-p90 excludes 1)")
    masks = {"0": (False,), "1": (True,), "both": (False, True)}[a.causal]
    directions = ("fwd", "bwd") if a.direction == "both" else (a.direction,)
    record = {"argv": sys.argv if argv is None else argv, "arms": dict(a.arm), "results": []}
    for shape in a.shapes:
        for causal in masks:
            for direction in directions:
                times = measure(a.arm, shape, causal, direction, a.rounds, a.calls, peers)
                b, s, h, d, *kv = shape
                rows = summarise(times, attention_flops(b, h, s, s, d, causal, direction))
                title = (f"-- {direction} {'x'.join(map(str, shape[:3]))} d{shape[3]}"
                         f"{f' kv{kv[0]}' if kv else ''}{' causal' if causal else ''}")
                print(format_rows(title, rows), flush=True)
                record["results"].append({"shape": shape, "causal": causal,
                                          "direction": direction, "times_ms": times,
                                          "rows": rows})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the sm90 backward's CTAs spend their time: one call's MAIN kernel, per CTA.

    python scripts/sm90_bwd_timeline.py --shape 4 4096 16 128 [--causal] [--kv-heads HKV]
                                        [--repeats N] [--out DIR]

Runs the backward (bf16; PRE, MAIN, CONVERT as dispatch runs them) with the timeline variant of
the MAIN kernel dispatch would pick (FC_TIMELINE, bwd_sm90.run_timeline): each CTA (one per key
block, KV head and batch) writes %globaltimer at its entry, the producer's first
TMA issue and last TMA issue, K / V arrival (consumer 0, after its wait), step 0's data arrival
(= the first step's start), the last step's end, each consumer's exit (dK / dV stores issued) and
the dQ writer's end, plus its SM, its step count and its block index; and, inside step 0, S^T's
arrival, the dS^T barrier and the step's end, then step 1's end (a causal CTA's step 0 is its
masked one). A few warm-up calls, then the last call's records are analysed:
  - CTAs, SMs used, waves (CTAs per SM), makespan;
  - per CTA, median / p10 / p90 (us) of: entry -> K / V, K / V -> first step, the steps' span,
    step 0 in three parts and whole, step 1, each later step, the time per step (span / steps),
    last step -> exit, exit -> CTA end (the dQ writer's drain, the other consumer), the CTA's
    span (entry -> end);
  - the idle gaps on each SM between one CTA's end and the next CTA's entry;
  - the fixed cost per CTA: median of (span - steps x per-step), per-step the median over CTAs,
    and a least-squares fit span = fixed + per_step x steps where step counts differ (causal).
Writes timeline-bwd-<label>.json (raw records + summary) and, with matplotlib, a PNG (one row per
SM, each CTA's phases coloured). The variant is never dispatched.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# the words of a CTA's record (bwd_sm90.TIMELINE_FIELDS, the .cu's kTl* indices)
WORDS = 16
FIELDS = {"id": 0, "block": 1, "entry": 2, "first_tma": 3, "produced": 4, "kv": 5,
          "first_step": 6, "last_step": 7, "exit0": 8, "exit1": 9, "dq_end": 10, "merged": 11,
          "s0": 12, "bar0": 13, "end0": 14, "end1": 15}
TIMES = ("entry", "first_tma", "produced", "kv", "first_step", "last_step", "exit0", "exit1",
         "dq_end", "merged", "s0", "bar0", "end0", "end1")
# (label, from, to) of the per-CTA intervals the summary reports; "end" is the CTA's last time
PHASES = (
    ("entry -> first TMA issue", "entry", "first_tma"),
    ("entry -> K/V arrival", "entry", "kv"),
    ("K/V arrival -> first step", "kv", "first_step"),
    ("steps span (first -> last step)", "first_step", "last_step"),
    ("step 0: issue -> S^T landed", "first_step", "s0"),
    ("step 0: S^T landed -> dS^T barrier", "s0", "bar0"),
    ("step 0: dS^T barrier -> done", "bar0", "end0"),
    ("step 0 (first step -> its end)", "first_step", "end0"),
    ("step 1 (step 0's end -> its end)", "end0", "end1"),
    ("last step -> exit (epilogue)", "last_step", "exit0"),
    ("last step -> dK / dV summed (pieces)", "last_step", "merged"),
    ("exit -> CTA end", "exit0", "end"),
    ("CTA span (entry -> end)", "entry", "end"),
)


def decode(raw: np.ndarray) -> list[dict]:
    """The kernel's buffer (kTimelineWords uint64 per CTA, in linear block order) as one dict per
    CTA that recorded (entry and exit written): its linear index, SM, steps, block index and
    times (ns; 0 where no thread wrote, e.g. dq_end without a dQ writer warp), plus `end`, the
    latest of its threads' final times."""
    a = np.asarray(raw, dtype=np.uint64).reshape(-1, WORDS)
    out = []
    for cta, row in enumerate(a):
        w = [int(x) for x in row]
        if w[FIELDS["entry"]] == 0 or w[FIELDS["exit0"]] == 0:
            continue
        ident, block = w[FIELDS["id"]], w[FIELDS["block"]]
        rec = {"cta": cta, "sm": ident >> 32, "steps": ident & 0xFFFFFFFF,
               "block": [block & 0xFFFFFFFF, (block >> 32) & 0xFFFF, block >> 48]}
        rec.update({name: w[FIELDS[name]] for name in TIMES})
        rec["end"] = max(rec[n] for n in ("produced", "exit0", "exit1", "dq_end"))
        out.append(rec)
    return out


def _stats(values) -> dict:
    v = np.asarray(values, dtype=np.float64) / 1e3
    if v.size == 0:
        return {"count": 0, "median": float("nan"), "p10": float("nan"), "p90": float("nan")}
    return {"count": int(v.size), "median": float(np.median(v)),
            "p10": float(np.percentile(v, 10)), "p90": float(np.percentile(v, 90))}


def _interval(r: dict, a: str, b: str) -> int | None:
    """r[b] - r[a] in ns, or None when either was not recorded (a CTA without steps has no first
    / last step)."""
    if not r[a] or not r[b] or (r["steps"] == 0 and ("first_step" in (a, b)
                                                     or "last_step" in (a, b))):
        return None
    return r[b] - r[a]


def summarise(records: list[dict], grid_ctas: int | None = None) -> dict:
    """Counts, per-phase quantiles (us), per-SM idle gaps and the fixed cost per CTA."""
    if not records:
        raise ValueError("no timeline records: did the backward run the timeline variant?")
    t0 = min(r["entry"] for r in records)
    t_end = max(r["end"] for r in records)
    by_sm: dict[int, list[dict]] = {}
    for r in records:
        by_sm.setdefault(r["sm"], []).append(r)
    phases = {}
    for label, a, b in PHASES:
        phases[label] = _stats([d for r in records if (d := _interval(r, a, b)) is not None])
    stepped = [r for r in records if r["steps"] > 0]
    per_step = [(r["last_step"] - r["first_step"]) / r["steps"] for r in stepped]
    phases["time per step (span / steps)"] = _stats(per_step)
    phases["each step after step 1 ((last - step 1's end) / (steps - 2))"] = _stats(
        [(r["last_step"] - r["end1"]) / (r["steps"] - 2) for r in stepped
         if r["steps"] > 2 and r["end1"]])
    t_step = float(np.median(per_step)) if per_step else 0.0  # ns
    spans = np.array([r["end"] - r["entry"] for r in records], dtype=np.float64)
    steps = np.array([r["steps"] for r in records], dtype=np.float64)
    fixed = _stats(spans - steps * t_step)
    if len(set(steps.tolist())) > 1:
        slope, intercept = np.polyfit(steps, spans, 1)
        fit = {"fixed_us": float(intercept) / 1e3, "per_step_us": float(slope) / 1e3}
    else:  # one step count: no slope to separate
        fit = {"fixed_us": float("nan"), "per_step_us": float("nan")}
    gaps, overlaps, first_entry, last_end = [], 0, [], []
    for rs in by_sm.values():
        rs = sorted(rs, key=lambda r: r["entry"])
        first_entry.append(rs[0]["entry"] - t0)
        last_end.append(t_end - max(r["end"] for r in rs))
        for prev, nxt in zip(rs, rs[1:], strict=False):
            gap = nxt["entry"] - prev["end"]
            if gap < 0:
                overlaps += 1  # two CTAs on one SM at once (not expected: one fits per SM)
            else:
                gaps.append(gap)
    per_sm = [len(rs) for rs in by_sm.values()]
    return {
        "ctas": len(records),
        "grid_ctas": grid_ctas if grid_ctas is not None else len(records),
        "sms": len(by_sm),
        "waves": len(records) / len(by_sm),
        "ctas_per_sm": {"min": min(per_sm), "max": max(per_sm)},
        "makespan_us": (t_end - t0) / 1e3,
        "steps": {"total": int(steps.sum()), "min": int(steps.min()), "max": int(steps.max()),
                  "median": float(np.median(steps))},
        "phases_us": phases,
        "idle_gap_us": _stats(gaps),
        "overlapping_ctas": overlaps,
        "sm_first_entry_us": _stats(first_entry),
        "sm_idle_at_end_us": _stats(last_end),
        "fixed_per_cta_us": fixed,
        "per_step_us": t_step / 1e3,
        "fit": fit,
    }


def _q(s: dict) -> str:
    return f"{s['median']:8.2f} {s['p10']:8.2f} {s['p90']:8.2f}  x{s['count']}"


def report(s: dict) -> str:
    lines = [
        f"{s['ctas']} CTAs (grid {s['grid_ctas']}) on {s['sms']} SMs: {s['waves']:.2f} waves "
        f"({s['ctas_per_sm']['min']}-{s['ctas_per_sm']['max']} CTAs per SM); makespan "
        f"{s['makespan_us']:.1f} us; steps per CTA {s['steps']['min']}-{s['steps']['max']} "
        f"(median {s['steps']['median']:g}, {s['steps']['total']} in all)",
        f"{'per CTA (us)':40s} {'median':>8s} {'p10':>8s} {'p90':>8s}",
    ]
    for label, st in s["phases_us"].items():
        lines.append(f"  {label:38s} {_q(st)}")
    lines += [
        f"  {'idle gap on an SM (end -> next entry)':38s} {_q(s['idle_gap_us'])}",
        f"  {'SM first entry after the kernel start':38s} {_q(s['sm_first_entry_us'])}",
        f"  {'SM idle at the end (-> makespan)':38s} {_q(s['sm_idle_at_end_us'])}",
        f"fixed cost per CTA (span - steps x {s['per_step_us']:.3f} us): "
        f"median {s['fixed_per_cta_us']['median']:.2f} us (p10 {s['fixed_per_cta_us']['p10']:.2f},"
        f" p90 {s['fixed_per_cta_us']['p90']:.2f})",
    ]
    fit = s["fit"]
    if fit["fixed_us"] == fit["fixed_us"]:  # not NaN
        lines.append(f"fit: span = {fit['fixed_us']:.2f} us + {fit['per_step_us']:.3f} us per step")
    if s["overlapping_ctas"]:
        lines.append(f"warning: {s['overlapping_ctas']} CTA pairs overlapped on one SM")
    return "\n".join(lines)


# the phases the plot colours, in order: (from, to, label)
BANDS = (("entry", "kv", "K/V load"), ("kv", "first_step", "pipeline fill"),
         ("first_step", "last_step", "steps"), ("last_step", "exit0", "epilogue"),
         ("exit0", "end", "drain"))


def plot(records: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t0 = min(r["entry"] for r in records)
    sms = {sm: i for i, sm in enumerate(sorted({r["sm"] for r in records}))}
    colours = ("tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple")
    fig, ax = plt.subplots(figsize=(12, max(4, len(sms) * 0.05 + 2)))
    for (a, b, label), colour in zip(BANDS, colours, strict=True):
        lefts, widths, ys = [], [], []
        for r in records:
            if not r[a] or not r[b] or r[b] < r[a]:
                continue
            lefts.append((r[a] - t0) / 1e3)
            widths.append((r[b] - r[a]) / 1e3)
            ys.append(sms[r["sm"]])
        ax.barh(ys, widths, left=lefts, height=0.9, color=colour, linewidth=0, label=label)
    ax.set_xlabel("time since the first CTA's entry (us)")
    ax.set_ylabel("SM (sorted by id)")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    import torch

    from flashcuda.ops import bwd_sm90, fwd_sm90
    from flashcuda.ops.call import BwdCall, FwdCall

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[4, 4096, 16, 128],
                    metavar=("B", "S", "H", "D"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--kv-heads", type=int, default=0, help="KV heads (GQA; default H)")
    ap.add_argument("--repeats", type=int, default=5, help="calls, the last one recorded")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    b, s, h, d = a.shape
    hkv = a.kv_heads or h
    dev = torch.device("cuda")
    q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    out, dout = torch.empty_like(q), torch.randn_like(q)
    lse = torch.empty(b, h, s, device=dev, dtype=torch.float32)
    window = (None, 0) if a.causal else (None, None)
    fwd = FwdCall(q, k, v, out, lse, d ** -0.5, *window)
    if why := fwd_sm90.can_implement(fwd):
        raise SystemExit(f"fwd_sm90 cannot run this shape (its out / lse feed the backward): {why}")
    fwd_sm90.run(fwd)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    call = BwdCall(q, k, v, out, dout, lse, *grads, d ** -0.5, *window, False)
    if why := bwd_sm90.can_implement(call):
        raise SystemExit(f"bwd_sm90 cannot run this shape: {why}")

    # the whole backward's time, default MAIN against the timeline variant (CUDA events)
    def timed(fn, n=5):
        fn()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) * 1e3 / n

    cfg, scratch = bwd_sm90.run_timeline(call)  # (builds the plan; its buffer reused below)
    t_default = timed(lambda: bwd_sm90.run(call))
    t_timeline = timed(lambda: bwd_sm90.run(call, timeline=scratch))
    for _ in range(max(0, a.repeats - 1)):
        bwd_sm90.run_timeline(call)
    cfg, buf = bwd_sm90.run_timeline(call)
    torch.cuda.synchronize()
    records = decode(buf.cpu().numpy().view(np.uint64).reshape(-1))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = cfg.grid(call)
    summary = summarise(records, grid[0] * grid[1] * grid[2])
    parts = {}
    if cfg.wave_split:  # the last-wave split: MAIN's records, then the pieces' (from `total`)
        total = grid[0] * grid[1] * grid[2]
        parts = {name: summarise(rs) for name, rs in (
            ("MAIN", [r for r in records if r["cta"] < total]),
            ("pieces", [r for r in records if r["cta"] >= total])) if rs}
        summary["parts"] = parts
    summary["backward_us"] = {"default": t_default, "timeline": t_timeline}
    label = (f"{cfg.name}-B{b}-S{s}-H{h}{f'-KV{hkv}' if hkv != h else ''}"
             f"{'-causal' if a.causal else ''}")
    print(f"{label}: grid {grid}, {sms} SMs on the device; whole backward (PRE + MAIN + CONVERT) "
          f"{t_default:.1f} us default, {t_timeline:.1f} us with the timeline MAIN")
    print(report(summary))
    for name, part in parts.items():
        print(f"-- {name} alone\n{report(part)}")
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"timeline-bwd-{label}.json").write_text(json.dumps(
        {"shape": a.shape, "kv_heads": hkv, "causal": a.causal, "config": cfg.name,
         "grid": list(grid), "device_sms": sms, "summary": summary, "fields": FIELDS,
         "records": records}, indent=1))
    if plot(records, outdir / f"timeline-bwd-{label}.png", label):
        print(f"wrote {outdir / f'timeline-bwd-{label}.png'}")


if __name__ == "__main__":
    main()

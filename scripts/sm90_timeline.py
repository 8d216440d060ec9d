"""Where the sm90 forward's persistent CTAs spend their time: one call's timeline, per work tile.

    python scripts/sm90_timeline.py --shape 1 2048 32 128 --causal [--snake 0|1] [--out DIR]

Runs the timeline variant of the kernel dispatch would pick for the shape (bf16; FC_TIMELINE:
each consumer warpgroup writes, per work tile it finishes, {SM, work tile, key tiles, start ns,
Q ready ns, epilogue start ns, end ns} from the GPU's global timer) a few times and analyses the
last run:
  - makespan, and how late the last CTA ends against the average CTA (the tail a better balance
    could win back);
  - a least-squares fit  duration = fixed + per_key_tile * key_tiles  over all work tiles (the
    fixed cost per work tile is what a key-tile-only balance model leaves out);
  - the work tiles' durations by key tiles, and the CTAs' end times (quantiles);
  - the phases of a work tile (medians): start -> Q ready (the wait for the work tile's Q),
    Q ready -> epilogue start (the key tiles, with its own fit per key tile) and the epilogue
    (O / lse normalised and stored).
Writes timeline-<label>.json (raw entries + summary) and, with matplotlib, a Gantt chart PNG.
The variant is never dispatched; it runs here through the same plan helpers as the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

FIELDS = ("sm", "tile", "key_tiles", "start_ns", "q_try_ns", "q_ready_ns", "s0_ns", "first_ns",
          "drain_ns", "epilogue_ns", "end_ns")
# per entry, the .cu's kTimelineWords (word 1 holds the setup time and the key tiles, word 6 the
# first S and the first tile as offsets from Q ready)
WORDS = 8


def decode(raw: np.ndarray, grid: int, consumers: int, slots: int) -> list[dict]:
    """The kernel's buffer ([grid][consumers][slots][WORDS] uint64) as one dict per recorded
    work tile, with its CTA and consumer; unused slots (all zero) are skipped."""
    a = np.asarray(raw, dtype=np.uint64).reshape(grid, consumers, slots, WORDS)
    out = []
    for cta in range(grid):
        for c in range(consumers):
            for s in range(slots):
                w0, w1, start, q_ready, epilogue, end, w6, drain = (int(x) for x in a[cta, c, s])
                if start == 0 and end == 0:
                    continue
                # w1: setup ns (start -> the q_full wait's first try) << 32 | key tiles; w6: first
                # S ready << 32 | first tile done, ns after Q ready
                out.append({"cta": cta, "consumer": c, "sm": w0 >> 32, "tile": w0 & 0xFFFFFFFF,
                            "key_tiles": w1 & 0xFFFFFFFF, "start_ns": start,
                            "q_try_ns": start + (w1 >> 32), "q_ready_ns": q_ready,
                            "s0_ns": q_ready + (w6 >> 32), "first_ns": q_ready + (w6 & 0xFFFFFFFF),
                            "drain_ns": drain, "epilogue_ns": epilogue, "end_ns": end})
    return out


def summarise(entries: list[dict]) -> dict:
    """Makespan, tail, the fixed / per-key-tile cost fit and quantiles (times in microseconds,
    relative to the earliest start)."""
    if not entries:
        raise ValueError("no timeline entries: did the kernel run the timeline variant?")
    t0 = min(e["start_ns"] for e in entries)
    end = max(e["end_ns"] for e in entries)
    cta_end: dict[int, int] = {}
    for e in entries:
        cta_end[e["cta"]] = max(cta_end.get(e["cta"], 0), e["end_ns"])
    ends = np.array(sorted(cta_end.values()), dtype=np.float64) - t0
    dur = np.array([e["end_ns"] - e["start_ns"] for e in entries], dtype=np.float64)
    tiles = np.array([e["key_tiles"] for e in entries], dtype=np.float64)
    if len(set(tiles.tolist())) > 1:
        per_tile, fixed = np.polyfit(tiles, dur, 1)
    else:  # one key-tile count: the fit is a mean (no slope to separate)
        per_tile, fixed = float("nan"), float(dur.mean())
    by_tiles = {}
    for n in sorted(set(tiles.astype(int).tolist())):
        d = dur[tiles == n]
        by_tiles[n] = {"count": int(d.size), "median_us": float(np.median(d)) / 1e3}
    makespan = (end - t0) / 1e3
    busy = [e for e in entries if e["key_tiles"] > 0]
    phases = {name: float(np.median([(e[b] - e[a]) for e in busy])) / 1e3 if busy else float("nan")
              for name, a, b in (("setup", "start_ns", "q_try_ns"),
                                 ("q_wait", "q_try_ns", "q_ready_ns"),
                                 ("key_tiles", "q_ready_ns", "epilogue_ns"),
                                 ("epilogue", "epilogue_ns", "end_ns"),
                                 # the key-tile phase's parts (session 16)
                                 ("first_s", "q_ready_ns", "s0_ns"),
                                 ("first_softmax", "s0_ns", "first_ns"),
                                 ("steps", "first_ns", "drain_ns"),
                                 ("drain", "drain_ns", "epilogue_ns"))}
    body = np.array([e["epilogue_ns"] - e["q_ready_ns"] for e in busy], dtype=np.float64)
    body_tiles = np.array([e["key_tiles"] for e in busy], dtype=np.float64)
    if len(set(body_tiles.tolist())) > 1:
        body_per_tile, body_fixed = np.polyfit(body_tiles, body, 1)
    else:
        body_per_tile, body_fixed = float("nan"), float(body.mean()) if busy else float("nan")
    return {
        "work_tiles": len(entries),
        "ctas": len(cta_end),
        "makespan_us": makespan,
        "cta_end_us": {"min": float(ends.min()) / 1e3, "median": float(np.median(ends)) / 1e3,
                       "mean": float(ends.mean()) / 1e3, "max": float(ends.max()) / 1e3},
        "tail_us": makespan - float(ends.mean()) / 1e3,
        "fit": {"fixed_us": float(fixed) / 1e3, "per_key_tile_us": float(per_tile) / 1e3},
        "by_key_tiles": by_tiles,
        "phases_median_us": phases,
        "key_tiles_fit": {"fixed_us": float(body_fixed) / 1e3,
                          "per_key_tile_us": float(body_per_tile) / 1e3},
    }


def report(s: dict) -> str:
    fit = s["fit"]
    lines = [
        f"{s['work_tiles']} work-tile records on {s['ctas']} CTAs; "
        f"makespan {s['makespan_us']:.1f} us",
        "CTA end (us): min {min:.1f}  median {median:.1f}  mean {mean:.1f}  max {max:.1f}".format(
            **s["cta_end_us"]),
        f"tail (makespan - mean CTA end): {s['tail_us']:.1f} us "
        f"({100 * s['tail_us'] / s['makespan_us']:.0f}% of the call)",
        f"duration fit: {fit['fixed_us']:.2f} us per work tile + "
        f"{fit['per_key_tile_us']:.3f} us per key tile",
        "phases (median us): setup {setup:.2f}, Q wait {q_wait:.2f}, key tiles {key_tiles:.2f}, "
        "epilogue "
        "{epilogue:.2f}".format(**s["phases_median_us"]),
        "key-tile phase (median us): first S {first_s:.2f}, first tile's softmax "
        "{first_softmax:.2f}, other tiles {steps:.2f}, last P V {drain:.2f}".format(
            **s["phases_median_us"]),
        f"key-tile phase fit: {s['key_tiles_fit']['fixed_us']:.2f} us + "
        f"{s['key_tiles_fit']['per_key_tile_us']:.3f} us per key tile",
        "key tiles: median duration (us), count",
    ]
    for n, v in s["by_key_tiles"].items():
        lines.append(f"  {n:4d}: {v['median_us']:8.2f}  x{v['count']}")
    return "\n".join(lines)


def plot(entries: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t0 = min(e["start_ns"] for e in entries)
    top = max(e["key_tiles"] for e in entries) or 1
    fig, ax = plt.subplots(figsize=(11, 6))
    cmap = plt.get_cmap("viridis")
    for e in entries:
        ax.barh(e["cta"] + 0.45 * e["consumer"], (e["end_ns"] - e["start_ns"]) / 1e3,
                left=(e["start_ns"] - t0) / 1e3, height=0.45,
                color=cmap(e["key_tiles"] / top), linewidth=0)
    ax.set_xlabel("time since the first work tile started (us)")
    ax.set_ylabel("CTA (two bars: consumer warpgroups)")
    ax.set_title(title + " — colour: key tiles of the work tile")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    import torch

    from flashcuda.jit import get_kernel
    from flashcuda.ops import fwd_sm90
    from flashcuda.ops.call import FwdCall

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 2048, 32, 128],
                    metavar=("B", "S", "H", "D"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--snake", choices=("auto", "0", "1"), default="auto",
                    help="the work-tile order (auto: dispatch's rule)")
    ap.add_argument("--first-pass", action="store_true",
                    help="time the first of a windowed call's two passes (fwd_sm90.first_pass) "
                         "instead of the masked-V kernel (FLASHCUDA_SM90_FWD_MASKED_V=0 in the "
                         "environment times the kernel without masked V)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    b, s, h, d = a.shape
    dev = torch.device("cuda")
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device=dev, dtype=torch.float32)
    call = FwdCall(q, k, v, out, lse, d ** -0.5, None, 0 if a.causal else None)
    if why := fwd_sm90.can_implement(call):
        raise SystemExit(f"fwd_sm90 cannot run this shape: {why}")
    cfg = fwd_sm90.select_config(call.dtype, d, call.is_local, call.seqlen_q)
    if a.snake != "auto":
        cfg = dataclasses.replace(cfg, snake=a.snake == "1")
    flags = None
    if a.first_pass:
        if not cfg.masked_v:
            raise SystemExit(f"{cfg.name} has no two passes (a windowed call's masked-V kernel has)")
        cfg = fwd_sm90.first_pass(cfg)
    cfg = dataclasses.replace(cfg, timeline=True)
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    grid = cfg.grid(call, sms)
    by_block = fwd_sm90.schedule_arg(call, cfg, props.L2_cache_size, grid[0])  # (the L2 sections)
    slots = math.ceil(cfg.work_tiles(call) / grid[0]) + 1
    buf = torch.zeros(grid[0] * cfg.consumers * slots * WORDS, dtype=torch.int64, device=dev)
    kernel = get_kernel(cfg.spec(), dev)
    if cfg.nan_flags:
        flags = torch.empty(grid[0] * fwd_sm90.NAN_FLAG_BYTES, dtype=torch.uint8, device=dev)
    for _ in range(a.repeats):
        buf.zero_()
        args = fwd_sm90.kernel_args(call, cfg, by_block, grid[0], nan_flags=flags)
        kernel.launch(grid, (cfg.threads, 1, 1), *args, buf, np.int32(slots),
                      shared_mem=cfg.smem_bytes)
    torch.cuda.synchronize()
    entries = decode(buf.cpu().numpy().view(np.uint64), grid[0], cfg.consumers, slots)
    summary = summarise(entries)
    label = f"{cfg.name}-B{b}-S{s}-H{h}{'-causal' if a.causal else ''}"
    print(f"{label}: grid {grid[0]}, {cfg.work_tiles(call)} work tiles")
    print(report(summary))
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"timeline-{label}.json").write_text(json.dumps(
        {"shape": a.shape, "causal": a.causal, "config": cfg.name, "grid": grid[0],
         "summary": summary, "fields": FIELDS, "entries": entries}, indent=1))
    if plot(entries, outdir / f"timeline-{label}.png", label):
        print(f"wrote {outdir / f'timeline-{label}.png'}")


if __name__ == "__main__":
    main()

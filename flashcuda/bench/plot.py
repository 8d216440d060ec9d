"""PNG plots of a run record, written next to it (matplotlib's object API with the Agg canvas, so
no global backend is switched and no display is needed).

sweep: one panel per (head dim, causal, direction), TFLOP/s against seqlen (log2 axis), one line per
implementation, the measured matmul ceiling as a dashed line; points where flashcuda's output was
wrong are drawn as red crosses, not as part of its line.
ladder: a horizontal bar per rung, % of the ceiling that judges it.
decode (the decode extra): one panel per batch, GB/s of the KV cache against the cache length
(log2 axis), one line per implementation, the measured copy bandwidth as a dashed line; wrong
outputs as red crosses.
"""

from __future__ import annotations

from pathlib import Path

from .ceilings import copy_ceiling_gbps, matmul_ceiling_tflops
from .peers import LABELS
from .sweep import point_tflops

STYLE = {
    "flashcuda": {"color": "black", "linewidth": 2.5, "marker": "o"},
    "flashcuda_kvcache": {"color": "black", "linewidth": 2.5, "marker": "o"},
    "sdpa_flash": {"color": "tab:blue", "marker": "s"},
    "sdpa_cudnn": {"color": "tab:green", "marker": "^"},
    "sdpa_efficient": {"color": "tab:purple", "marker": "v"},
    "sdpa_math": {"color": "tab:gray", "marker": "x"},
    "fa2": {"color": "tab:orange", "marker": "D"},
    "fa4": {"color": "tab:red", "marker": "P"},
    "triton_tutorial": {"color": "tab:brown", "marker": "*", "linestyle": ":"},
}


def _figure(nrows: int, ncols: int, size: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _legend(fig, axes, ncol: int) -> None:
    """One legend below the panels: every label any panel drew, once."""
    seen: dict = {}
    for row in axes:
        for ax in row:
            h, lab = ax.get_legend_handles_labels()
            for k, v in zip(lab, h, strict=True):
                seen.setdefault(k, v)
    fig.legend(list(seen.values()), list(seen.keys()), loc="outside lower center",
               ncol=min(len(seen), ncol), fontsize=8)


def _stamp(rec: dict) -> str:
    """'GPU · commit' of a record, for a figure's title."""
    gpu = (rec.get("gpu") or {}).get("name", "?")
    return f"{gpu} · {((rec.get('commit') or {}).get('sha') or 'unknown')[:8]}"


def plot_sweep(rec: dict, path: Path | str) -> Path | None:
    """Write the sweep figure to `path`; None when the record has no points."""
    points = rec.get("points") or []
    if not points:
        return None
    panels = sorted({(p["headdim"], p["causal"]) for p in points})
    dirs = ["fwd"] + (["bwd"] if not (rec.get("config") or {}).get("fwd_only") else [])
    impls = [n for n in (rec.get("peers") or {}) if (rec["peers"][n].get("status") == "ok")]
    if "flashcuda" not in impls:
        impls.insert(0, "flashcuda")
    ceiling = matmul_ceiling_tflops(rec.get("ceilings") or {})
    fig, axes = _figure(len(dirs), len(panels), (4.2 * len(panels), 3.6 * len(dirs)))
    for row, d in enumerate(dirs):
        for col, (hd, causal) in enumerate(panels):
            ax = axes[row][col]
            sel = sorted((p for p in points if p["headdim"] == hd and p["causal"] == causal),
                         key=lambda p: p["seqlen"])
            for name in impls:
                xs, ys, bad_x, bad_y = [], [], [], []
                for p in sel:
                    y = point_tflops(p, name, d)
                    if y is None:
                        continue
                    wrong = name == "flashcuda" and (p.get("check") or {}).get("ok") is False
                    (bad_x if wrong else xs).append(p["seqlen"])
                    (bad_y if wrong else ys).append(y)
                style = STYLE.get(name, {})
                if xs:
                    ax.plot(xs, ys, label=LABELS.get(name, name), markersize=4,
                            zorder=4 if name == "flashcuda" else 2, **style)
                if bad_x:
                    ax.scatter(bad_x, bad_y, color="red", marker="x", s=60, zorder=5,
                               label="flashcuda (WRONG output)")
            if ceiling:
                ax.axhline(ceiling, color="gray", linestyle="--", linewidth=1,
                           label=f"matmul ceiling {ceiling:.0f}")
            ax.set_xscale("log", base=2)
            seqlens = sorted({p["seqlen"] for p in sel})
            ax.set_xticks(seqlens, [_size_label(x) for x in seqlens])
            ax.minorticks_off()
            ax.set_title(f"{d} · d{hd} · {'causal' if causal else 'non-causal'}", fontsize=10)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
    _legend(fig, axes, 5)
    fig.suptitle(f"flashcuda {(rec.get('config') or {}).get('dtype', '')} · {_stamp(rec)} · "
                 f"{rec.get('created_utc', '')}", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def _size_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_ladder(rec: dict, path: Path | str) -> Path | None:
    rungs = [r for r in (rec.get("ladder") or {}).get("rungs") or []
             if (r.get("_derived") or {}).get("pct") is not None]
    if not rungs:
        return None
    fig, axes = _figure(1, 1, (7.5, 0.35 * len(rungs) + 1.5))
    ax = axes[0][0]
    names = [str(r["_derived"]["label"]) for r in rungs]
    pct = [r["_derived"]["pct"] for r in rungs]
    ax.barh(range(len(rungs)), pct, color="tab:blue")
    ax.set_yticks(range(len(rungs)), names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(85, color="gray", linestyle="--", linewidth=1, label="85% target (memory-bound)")
    ax.set_xlabel("% of the ceiling that judges the rung (copy bandwidth or matmul)")
    ax.legend(fontsize=8)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def plot_decode(rec: dict, path: Path | str) -> Path | None:
    """Write the decode extra's figure to `path`; None when the record has none."""
    dc = (rec.get("extras") or {}).get("decode") or {}
    points = [p for p in dc.get("points") or [] if p.get("impls")]
    if not points:
        return None
    from .report import DECODE_LABELS

    batches = sorted({p["batch"] for p in points})
    names: list[str] = []
    for p in points:
        names += [n for n in p["impls"] if n not in names]
    copy = copy_ceiling_gbps(rec.get("ceilings") or {})
    fig, axes = _figure(1, len(batches), (4.6 * len(batches), 3.8))
    for col, b in enumerate(batches):
        ax = axes[0][col]
        sel = sorted((p for p in points if p["batch"] == b), key=lambda p: p["cache_seqlen"])
        for name in names:
            xs, ys, bad_x, bad_y = [], [], [], []
            for p in sel:
                r = p["impls"].get(name) or {}
                if r.get("status") != "ok" or r.get("gbps") is None:
                    continue
                wrong = (r.get("check") or {}).get("ok") is False
                (bad_x if wrong else xs).append(p["cache_seqlen"])
                (bad_y if wrong else ys).append(r["gbps"])
            style = dict(STYLE.get(name, {}))
            if name == "flashcuda" and "flashcuda_kvcache" in names:
                style.update(linestyle="--", linewidth=1.5, marker="s")
            if name == "flashcuda_plain":
                style = {"color": "gray", "linestyle": ":", "linewidth": 1.5, "marker": "o"}
            if xs:
                ax.plot(xs, ys, label=DECODE_LABELS.get(name, LABELS.get(name, name)),
                        markersize=4, zorder=4 if name.startswith("flashcuda") else 2, **style)
            if bad_x:
                ax.scatter(bad_x, bad_y, color="red", marker="x", s=60, zorder=5,
                           label="WRONG output")
        if copy:  # bytes a copy moves per second (read + written): the memory's bandwidth
            ax.axhline(copy, color="gray", linestyle="--", linewidth=1,
                       label=f"copy ceiling {copy:.0f} GB/s")
        lengths = sorted({p["cache_seqlen"] for p in sel})
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_size_label(x) for x in lengths])
        ax.minorticks_off()
        ax.set_title(f"decode · batch {b} · {(dc.get('shape') or {}).get('nheads')} over "
                     f"{(dc.get('shape') or {}).get('nheads_kv')} heads · "
                     f"d{(dc.get('shape') or {}).get('headdim')}", fontsize=10)
        ax.set_xlabel("cached keys")
        ax.set_ylabel("GB/s of the KV cache")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    _legend(fig, axes, 4)
    fig.suptitle(f"flashcuda decode {dc.get('dtype', '')} · {_stamp(rec)}", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path

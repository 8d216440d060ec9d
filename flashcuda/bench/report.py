"""Terminal output of a run (rich): the user-facing path, so printing here is the point.

Every function takes a run record (record.py), so a saved record renders exactly like a live run
(`flashcuda bench show RECORD.json`). The summary is built to be the last lines of the output:
one compact row per sweep point.
"""

from __future__ import annotations

import io
from collections.abc import Iterable

from rich import box
from rich.console import Console
from rich.table import Table

from .ceilings import copy_ceiling_gbps, fp32_ceiling_tflops, matmul_ceiling_tflops
from .peers import LABELS, SHORT
from .sweep import best_peer, point_tflops, ratio
from .timing import SPREAD_LIMIT, spread_too_wide

GIB = 1024**3


def fmt(x: float | None, spec: str = ".0f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def fmt_tf(x: float | None) -> str:
    """TFLOP/s: whole numbers, but enough digits for a slow path to read as non-zero."""
    if x is None:
        return "–"
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def fmt_ratio(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.2f}×" if x >= 0.095 else f"{x:.3f}×"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def make_console(width: int | None = None) -> Console:
    """A console that does not wrap tables at 80 columns when stdout is captured (GPU machine)."""
    probe = Console()
    if probe.is_terminal:
        return probe
    return Console(width=width or 200, soft_wrap=False)


def render_text(renderables: Iterable, width: int = 160) -> str:
    """Plain text of `renderables` (tests, logs)."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False)
    for r in renderables:
        console.print(r)
    return buf.getvalue()


def check_label(point: dict) -> str:
    fc = (point.get("results") or {}).get("flashcuda", {})
    fwd_status = fc.get("fwd", {}).get("status")
    if fwd_status == "absent":
        return "absent"
    if fwd_status == "failed" or fc.get("bwd", {}).get("status") == "failed":
        return "FAILED"
    ok = (point.get("check") or {}).get("ok")
    return {True: "ok", False: "WRONG", None: "–"}[ok]


def _trusted(point: dict) -> bool:
    """A ratio for flashcuda is shown only where its output matched the reference."""
    return (point.get("check") or {}).get("ok") is not False


def _shape(point: dict) -> str:
    return f"{point['batch']}×{point['nheads']}"


def _causal(point: dict) -> str:
    return "yes" if point["causal"] else "no"


def header_lines(rec: dict) -> list[str]:
    gpu = rec.get("gpu") or {}
    commit = rec.get("commit") or {}
    v = rec.get("versions") or {}
    cfg = rec.get("config") or {}
    sha = commit.get("sha") or "unknown"
    dirty = {True: " (dirty)", False: "", None: " (dirty: unknown)"}[commit.get("dirty")]
    lines = [
        f"flashcuda bench {rec.get('kind')} · {rec.get('created_utc')} · commit "
        f"{sha[:12]}{dirty} [{commit.get('source')}]",
        f"GPU {gpu.get('name', '?')} ({gpu.get('sm_count', '?')} SMs, sm {gpu.get('capability', '?')})"
        f" · torch {v.get('torch')} CUDA {v.get('torch_cuda')} · cuDNN {v.get('cudnn')} · NVRTC "
        f"{v.get('nvrtc')} · driver API {v.get('cuda_driver_api')}",
    ]
    for when, key in (("start", "nvidia_smi"), ("end", "nvidia_smi_after")):
        smi = gpu.get(key) or {}
        if smi:
            lines.append(f"nvidia-smi at {when}: driver {smi.get('driver_version')} · SM clock "
                         f"{smi.get('clocks.sm')} / {smi.get('clocks.max.sm')} MHz · power "
                         f"{smi.get('power.draw')} / {smi.get('power.limit')} W · "
                         f"{smi.get('temperature.gpu')} C · {smi.get('pstate')}")
    if cfg:
        line = f"dtype {cfg.get('dtype')} · timer {(rec.get('timer') or {}).get('method')}"
        if rec.get("kind") == "sweep":
            line += f" · fwd-only {cfg.get('fwd_only')}"
        lines.append(line)
    return lines


def ceilings_table(rec: dict) -> Table:
    t = Table(title="Ceilings (same run)", box=box.SIMPLE_HEAD)
    for col in ("ceiling", "value", "median ms", "p10–p90 ms", "n"):
        t.add_column(col, justify="left" if col == "ceiling" else "right")
    for name, c in ((rec.get("ceilings") or {}).get("results") or {}).items():
        if c.get("status") != "ok":
            t.add_row(name, f"failed: {c.get('error', '')[:60]}", "", "", "")
            continue
        tm = c["timing"]
        value = f"{c['tflops']:.0f} TFLOP/s" if "tflops" in c else f"{c['gbps']:.0f} GB/s"
        t.add_row(name, value, f"{tm['median_ms']:.3f}", f"{tm['p10_ms']:.3f}–{tm['p90_ms']:.3f}",
                  str(tm["n"]))
    return t


def peers_table(rec: dict) -> Table:
    t = Table(title="Implementations", box=box.SIMPLE_HEAD)
    t.add_column("name")
    t.add_column("status")
    t.add_column("detail", overflow="fold")
    for name, p in (rec.get("peers") or {}).items():
        t.add_row(LABELS.get(name, name), p.get("status", "?"), p.get("detail", ""))
    return t


def sweep_table(rec: dict) -> Table:
    """One row per (point, direction): flashcuda TFLOP/s, % of the matmul ceiling, each peer's
    TFLOP/s with flashcuda's ratio to it, the best peer ratio and the correctness check."""
    peers_meta = rec.get("peers") or {}
    ceiling = matmul_ceiling_tflops(rec.get("ceilings") or {})
    names = [n for n in peers_meta if n != "flashcuda" and peers_meta[n].get("status") == "ok"]
    t = Table(title="TFLOP/s (flashcuda ÷ peer)", box=box.SIMPLE_HEAD)
    for col in ("hd", "seqlen", "B×H", "causal", "dir", "flashcuda", "% mm"):
        t.add_column(col, justify="right")
    for n in names:
        t.add_column(LABELS.get(n, n), justify="right")
    t.add_column("vs best", justify="right")
    t.add_column("check")
    for p in rec.get("points") or []:
        for d in ("fwd", "bwd"):
            fc = point_tflops(p, "flashcuda", d)
            trusted = _trusted(p)
            cells = []
            for n in names:
                pt = point_tflops(p, n, d)
                status = (p.get("results") or {}).get(n, {}).get(d, {}).get("status")
                if pt is None:
                    cells.append({"skipped": "skip", "failed": "fail"}.get(status, "–"))
                else:
                    r = ratio(fc, pt) if trusted else None
                    cells.append(f"{fmt_tf(pt)} ({fmt_ratio(r)})" if r is not None else fmt_tf(pt))
            bname, bt = best_peer(p, d, peers_meta)
            best = fmt_ratio(ratio(fc, bt)) if trusted else "wrong"
            pct = ratio(fc, ceiling)
            t.add_row(str(p["headdim"]), str(p["seqlen"]), _shape(p), _causal(p), d, fmt_tf(fc),
                      "–" if pct is None else f"{100 * pct:.0f}%", *cells, best + (f" {SHORT.get(bname, bname)}" if bname and trusted else ""),
                      check_label(p))
    return t


def extras_tables(rec: dict) -> list:
    ex = rec.get("extras") or {}
    out = []
    fc = ex.get("first_call")
    if fc:
        t = Table(title="First call in a new process (fwd 1×1024×16×128 causal)", box=box.SIMPLE_HEAD)
        for col in ("cache", "status", "first fwd", "2nd fwd", "first bwd", "target", "meets",
                    "import flashcuda", "process"):
            t.add_column(col, justify="right")
        for phase in ("cold", "warm"):
            r = fc.get(phase) or {}
            target = (fc.get("targets") or {}).get(f"{phase}_first_fwd_s")
            t.add_row(phase, r.get("status", "?"), _ms(r.get("first_fwd_s")), _ms(r.get("second_fwd_s")),
                      _ms(r.get("first_bwd_s")), _ms(target), {True: "yes", False: "NO", None: "–"}[r.get("meets_target")],
                      _ms(r.get("import_flashcuda_s")), _ms(r.get("process_s")))
        out.append(t)
        for phase in ("cold", "warm"):
            r = fc.get(phase) or {}
            if r.get("status") == "failed" or r.get("bwd_error"):
                out.append(f"first call {phase}: {r.get('error') or r.get('bwd_error')}")
    sv = ex.get("serving")
    if sv:
        sh = sv.get("shape") or {}
        t = Table(title=f"Serving latency ({sh.get('batch')}×{sh.get('nheads')} heads, seqlen "
                  f"{sh.get('seqlen')}, d{sh.get('headdim')}, causal, no grad), ms", box=box.SIMPLE_HEAD)
        for col in ("impl", "wall p50", "wall p90", "wall p99", "gpu p50", "gpu p99",
                    "graph p50"):
            t.add_column(col, justify="right")
        errors = []
        for name, r in (sv.get("impls") or {}).items():
            if r.get("status") != "ok":
                t.add_row(LABELS.get(name, name), r.get("status", "?"), "", "", "", "", "")
                if r.get("error"):
                    errors.append(f"serving {name}: {r['error']}")
                continue
            graph = (f"{r['graph_p50_ms']:.3f}" if "graph_p50_ms" in r
                     else "failed" if r.get("graph_error") else "")
            if r.get("graph_error"):
                errors.append(f"serving {name}, CUDA graph: {r['graph_error']}")
            t.add_row(LABELS.get(name, name), *(f"{r[k]:.3f}" for k in (
                "wall_p50_ms", "wall_p90_ms", "wall_p99_ms", "gpu_p50_ms", "gpu_p99_ms")), graph)
        out += [t, *errors]
    mem = ex.get("memory")
    if mem:
        sh = mem.get("shape") or {}
        t = Table(title=f"Peak extra memory, {sh.get('batch')}×{sh.get('nheads')}×"
                  f"{sh.get('seqlen')}×d{sh.get('headdim')}", box=box.SIMPLE_HEAD,
                  caption=f"fp32 scores alone: {fmt_bytes(mem.get('scores_bytes_fp32'))}; "
                          f"q: {fmt_bytes(mem.get('io_bytes'))}")
        for col in ("impl", "fwd (no grad)", "fwd + bwd"):
            t.add_column(col, justify="right")
        errors = []
        for name, r in (mem.get("impls") or {}).items():
            if r.get("status") != "ok":
                t.add_row(name, r.get("status", "?"), "")
                if r.get("error"):
                    errors.append(f"memory {name}: {r['error']}")
                continue
            t.add_row(name, fmt_bytes(r.get("fwd_peak_extra_bytes")), fmt_bytes(r.get("fwd_bwd_peak_extra_bytes")))
        out += [t, *errors]
    lc = ex.get("long_context")
    if lc:
        t = Table(title="Single head, seqlen 65536, causal", box=box.SIMPLE_HEAD)
        for col in ("status", "fwd ms", "fwd TFLOP/s", "fwd peak extra", "fwd+bwd peak extra",
                    "naive scores", "check"):
            t.add_column(col, justify="right")
        chk = lc.get("check") or {}
        t.add_row(lc.get("status", "?"),
                  fmt((lc.get("fwd_timing") or {}).get("median_ms"), ".2f"), fmt(lc.get("fwd_tflops")),
                  fmt_bytes(lc.get("fwd_peak_extra_bytes")), fmt_bytes(lc.get("fwd_bwd_peak_extra_bytes")),
                  fmt_bytes(lc.get("naive_scores_bytes_fp32")),
                  {True: "ok", False: "WRONG", None: "–"}[chk.get("ok")])
        out.append(t)
        if lc.get("error"):
            out.append(f"seqlen 65536: {lc['error']}")
    dc = ex.get("decode")
    if dc:
        out += decode_tables(dc)
    return out


DECODE_LABELS = {"flashcuda_kvcache": "fc kvcache", "flashcuda": "fc flash_attn_func",
                 "flashcuda_plain": "fc unpacked", "flashcuda_graph": "fc kvcache graph",
                 "flashcuda_paged": "fc paged", "flashcuda_paged_graph": "fc paged graph"}


def decode_tables(dc: dict) -> list:
    """The decode extra: one row per cache length, median ms and the KV cache's GB/s per impl
    (WRONG where the output missed the float64 check, failed with its error below)."""
    sh = dc.get("shape") or {}
    names: list[str] = []
    for p in dc.get("points") or []:
        names += [n for n in p.get("impls") or {} if n not in names]
    t = Table(title=f"Decode ({sh.get('nheads')} query heads over {sh.get('nheads_kv')} KV "
              f"heads, d{sh.get('headdim')}, one query per sequence, no grad): median ms (GB/s "
              "of the KV cache)", box=box.SIMPLE_HEAD)
    t.add_column("batch", justify="right")
    t.add_column("cache seqlen", justify="right")
    t.add_column("KV bytes", justify="right")
    for n in names:
        t.add_column(DECODE_LABELS.get(n, LABELS.get(n, n)), justify="right")
    errors = []
    for p in dc.get("points") or []:
        cells = []
        for n in names:
            r = (p.get("impls") or {}).get(n) or {}
            if r.get("status") != "ok":
                cells.append(r.get("status", "–"))
                if r.get("error"):
                    errors.append(f"decode {p.get('batch')} x {p.get('cache_seqlen')} {n}: "
                                  f"{r['error']}")
                continue
            ms = (r.get("timing") or {}).get("median_ms")
            wrong = "" if (r.get("check") or {}).get("ok", True) else " WRONG"
            cells.append(f"{fmt(ms, '.3f')} ({fmt(r.get('gbps'), '.0f')}){wrong}")
        t.add_row(str(p.get("batch")), str(p.get("cache_seqlen")), fmt_bytes(p.get("kv_bytes")),
                  *cells)
    return [t, *errors]


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.1f} ms"


def summary_table(rec: dict) -> Table:
    """The compact end-of-run table: one row per point, flashcuda fwd/bwd TFLOP/s and the ratio to
    the best peer (named). A point whose check failed shows WRONG instead of a ratio."""
    peers_meta = rec.get("peers") or {}
    ceiling = matmul_ceiling_tflops(rec.get("ceilings") or {})
    copy = copy_ceiling_gbps(rec.get("ceilings") or {})
    title = f"summary · {(rec.get('gpu') or {}).get('name', '?')} · matmul {fmt(ceiling)} TFLOP/s"
    if copy:
        title += f" · copy {copy / 1000:.2f} TB/s"
    t = Table(title=title, box=box.SIMPLE, pad_edge=False, padding=(0, 1), show_edge=False)
    for col in ("hd", "seqlen", "causal", "fwd", "best fwd", "×", "bwd", "best bwd", "×", "check"):
        t.add_column(col, justify="right")
    marked, spread = False, False
    exposures: list[str] = []
    for p in rec.get("points") or []:
        row = [str(p["headdim"]), str(p["seqlen"]), _causal(p)]
        for d in ("fwd", "bwd"):
            fc = point_tflops(p, "flashcuda", d)
            bname, bt = best_peer(p, d, peers_meta)
            mark = HOST_MARK if host_bound(p, "flashcuda", d) else ""
            marked |= bool(mark)
            if unsteady(p, "flashcuda", d):
                mark += SPREAD_MARK
                spread = True
                if line := exposure_line(p, "flashcuda", d):
                    exposures.append(line)
            row += [fmt_tf(fc) + mark, f"{fmt_tf(bt)} {SHORT.get(bname, '')}".strip(),
                    fmt_ratio(ratio(fc, bt)) if _trusted(p) else "WRONG"]
        row.append(check_label(p))
        t.add_row(*row)
    notes = []
    if marked:
        notes.append(f"{HOST_MARK} host-bound: the call's host time (host_us, GPU kept busy) is at "
                     f"least {HOST_BOUND_SHARE:.0%} of the measured time per call")
    if spread:
        notes.append(f"{SPREAD_MARK} unsteady: the timing's p90 is at least {SPREAD_LIMIT:.2f}× its "
                     f"p10 (the median is no stable figure there; see the record's p10 / p90)")
        notes += exposures
    if notes:
        t.caption = "\n".join(notes)
    return t


HOST_MARK = "†"
HOST_BOUND_SHARE = 0.8
SPREAD_MARK = "‡"


def unsteady(p: dict, impl: str, direction: str) -> bool:
    """Whether `impl`'s timing at point `p` spreads too widely for its median to mean much:
    p90 at least SPREAD_LIMIT times p10."""
    r = ((p.get("results") or {}).get(impl) or {}).get(direction) or {}
    tm = r.get("timing") or {}
    return spread_too_wide(tm.get("p10_ms"), tm.get("p90_ms"))


def exposure_line(p: dict, impl: str, direction: str) -> str | None:
    """One caption line for a timing the sweep re-ran with host timestamps (the record's
    `exposure`): how many calls the host may have slowed, and the medians of both kinds."""
    r = ((p.get("results") or {}).get(impl) or {}).get(direction) or {}
    ex = r.get("exposure")
    if not ex or not ex.get("calls"):
        return None

    def us(ms):
        return f"{ms * 1e3:.0f} µs" if ms is not None else "-"

    mask = "causal" if p["causal"] else "full"
    return (f"  d{p['headdim']} {p['seqlen']} {mask} {direction}: {ex['exposed']} of "
            f"{ex['calls']} calls host-exposed on a re-run (median {us(ex['exposed_median_ms'])} "
            f"exposed, {us(ex['ahead_median_ms'])} queued ahead; host "
            f"{ex['host_median_us']:.0f} µs per call)")


def host_bound(p: dict, impl: str, direction: str) -> bool:
    """Whether `impl`'s timed calls at point `p` may contain host time: its host microseconds
    per call (recorded since session 3) reach HOST_BOUND_SHARE of the measured median."""
    r = ((p.get("results") or {}).get(impl) or {}).get(direction) or {}
    host, med = r.get("host_us"), (r.get("timing") or {}).get("median_ms")
    return bool(host and med and host * 1e-3 >= HOST_BOUND_SHARE * med)


def verdict_lines(rec: dict, path: str | None = None) -> list[str]:
    peers_meta = rec.get("peers") or {}
    points = rec.get("points") or []
    lines = []
    for d in ("fwd", "bwd"):
        ratios = [ratio(point_tflops(p, "flashcuda", d), best_peer(p, d, peers_meta)[1])
                  for p in points if _trusted(p)]
        ratios = [r for r in ratios if r is not None]
        if ratios:
            lines.append(f"{d}: flashcuda ÷ best peer min {fmt_ratio(min(ratios))} max "
                         f"{fmt_ratio(max(ratios))} over {len(ratios)} points")
    labels = [check_label(p) for p in points]
    if labels:
        lines.append(f"check: {labels.count('ok')}/{len(labels)} ok, {labels.count('WRONG')} wrong, "
                     f"{labels.count('FAILED')} failed, {labels.count('absent')} absent")
    if rec.get("errors"):
        lines.append(f"errors: {len(rec['errors'])} (see the record)")
    if path:
        lines.append(f"record: {path}")
    return lines


def ladder_table(rec: dict) -> Table:
    """Each rung's numbers as returned by run_ladder_bench, plus % of the ceiling it is judged by."""
    ladder = rec.get("ladder") or {}
    rungs = ladder.get("rungs") or []
    ceil = rec.get("ceilings") or {}
    copy, mm16, mm32 = copy_ceiling_gbps(ceil), matmul_ceiling_tflops(ceil), fp32_ceiling_tflops(ceil)
    keys: list[str] = []
    for r in rungs:
        keys += [k for k in r if k not in keys and k != "_derived"]
    t = Table(title="Ladder", box=box.SIMPLE_HEAD,
              caption=f"judged against: copy {fmt(copy)} GB/s · matmul {fmt(mm16)} TFLOP/s "
                      f"(tensor cores) · {fmt(mm32)} TFLOP/s (fp32)")
    for k in keys:
        t.add_column(k, overflow="fold")
    t.add_column("% copy bw", justify="right")
    t.add_column("% matmul", justify="right")
    for r in rungs:
        der = r.get("_derived") or {}
        t.add_row(*(_cell(r.get(k)) for k in keys), fmt(der.get("pct_copy"), ".1f"),
                  fmt(der.get("pct_matmul"), ".1f") + (f" ({der['matmul_ref']})" if der.get("matmul_ref") else ""))
    return t


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_run(console: Console, rec: dict, path: str | None = None, summary: bool = True) -> None:
    for line in header_lines(rec):
        console.print(line, highlight=False, markup=False)
    console.print(ceilings_table(rec))
    if rec.get("peers"):
        console.print(peers_table(rec))
    if rec.get("kind") == "ladder":
        console.print(ladder_table(rec))
        if (rec.get("ladder") or {}).get("status") not in (None, "ok"):
            console.print(f"ladder: {rec['ladder'].get('status')} {rec['ladder'].get('error', '')}",
                          highlight=False, markup=False)
    else:
        if rec.get("points"):
            console.print(sweep_table(rec))
        for t in extras_tables(rec):
            console.print(t, markup=False, highlight=False)
    for e in rec.get("errors") or []:
        console.print(f"error: {e}", highlight=False, markup=False)
    if summary and rec.get("kind") == "sweep" and rec.get("points"):
        console.print(summary_table(rec))
    for line in verdict_lines(rec, path):
        console.print(line, highlight=False, markup=False)

"""`flashcuda bench [sweep|ladder|show]`: argument parsing and the order of a run.

    flashcuda bench --quick                 # 8 points + peers + extras, < 3 min on an H200
    flashcuda bench                         # the standard sweep of PERFORMANCE.md
    flashcuda bench --seqlens 2k 8k --headdims 128 --causal 1 --fwd-only
    flashcuda bench ladder [--quick]        # the teaching kernels against the ceilings
    flashcuda bench show bench-out/sweep-....json   # re-render a saved record (tables + plot)
    flashcuda bench --list                  # the selected points and their FLOPs, no GPU needed

A run measures, in one process: ceilings, then every sweep point (flashcuda and the peers on the
same inputs, with a correctness spot-check), then the extras (first call in new processes,
serving latency, peak memory, seqlen 65536). The record is rewritten after every point, so a run
that is cut short still leaves its numbers. Exit status: 0 when flashcuda ran and matched the
reference at every point, 1 otherwise (absent, failed or wrong somewhere), 2 when no GPU is usable.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console

from . import record as rec_mod
from .peers import PEER_NAMES, REFERENCE_ORDER
from .sweep import (
    DTYPES,
    QUICK_HEADDIMS,
    QUICK_SEQLENS,
    STANDARD_HEADDIMS,
    STANDARD_SEQLENS,
    SweepPoint,
    best_peer,
    point_tflops,
    ratio,
    standard_points,
)

EXTRAS = ("first-call", "serving", "memory", "long", "decode")
DEFAULT_OUT = "bench-out"
# Environment switches that change which kernel or tiles run; a record keeps the ones that are set
# (an A/B of FLASHCUDA_BWD_SM80_CONFIG values must be told apart from its records alone).
KERNEL_ENV = ("FLASHCUDA_BWD_SM80_CONFIG", "FLASHCUDA_FORCE_KERNEL", "FLASHCUDA_ENABLE_SM90",
              "FLASHCUDA_SM90_TILES", "FLASHCUDA_SM90_PERSISTENT", "FLASHCUDA_SM90_PINGPONG",
              "FLASHCUDA_SM90_SNAKE", "FLASHCUDA_ENABLE_SM90_BWD", "FLASHCUDA_SM90_BWD_WATCHDOG",
              "FLASHCUDA_SM90_BWD_FENCE", "FLASHCUDA_SM90_BWD_DQ",
              "FLASHCUDA_SM80_FWD_ROWSUM", "FLASHCUDA_SM80_FWD_MASKED_V",
              "FLASHCUDA_DECODE_STAGES", "FLASHCUDA_DECODE_UNROLL", "FLASHCUDA_DECODE_WAVES",
              "FLASHCUDA_DECODE_COMBINE", "FLASHCUDA_DECODE_MMA",
              "FLASHCUDA_DECODE_MMA_STAGES", "FLASHCUDA_DECODE_COMBINE_QUADS",
              "FLASHCUDA_DECODE_CTAS_PER_SM")


def parse_size(text: str) -> int:
    """'512' -> 512, '1k' -> 1024, '16K' -> 16384."""
    t = text.strip().lower()
    try:
        n = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512, 1024 or 1k)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def _flatten(values, conv) -> list:
    out = []
    for v in values or ():
        for part in str(v).split(","):
            if part.strip():
                out.append(conv(part))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashcuda bench",
        description="Time flashcuda against its peers and the hardware ceilings (PERFORMANCE.md); "
                    "writes a JSON run record and PNG plots.")
    p.add_argument("mode", nargs="?", default="sweep", choices=("sweep", "ladder", "show"),
                   help="sweep (default), ladder, or show a saved record")
    p.add_argument("record", nargs="?", help="show: the record to render")
    p.add_argument("--quick", action="store_true",
                   help=f"seqlen {'/'.join(map(str, QUICK_SEQLENS))}, head dim "
                        f"{'/'.join(map(str, QUICK_HEADDIMS))}, causal both (< 3 min)")
    p.add_argument("--seqlens", nargs="+", metavar="S", help="e.g. 512 1k 2k or 512,1024")
    p.add_argument("--headdims", nargs="+", metavar="D", help="e.g. 64 128")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--fwd-only", action="store_true", help="time forward only")
    p.add_argument("--peers", default="all",
                   help=f"comma list of {','.join(PEER_NAMES)}, or all / none (default all)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"directory for the record and plots "
                                                      f"(default ./{DEFAULT_OUT}/)")
    p.add_argument("--skip", default="", help=f"comma list of extras to skip: {','.join(EXTRAS)}")
    p.add_argument("--no-extras", action="store_true", help="skip all extras")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--timer", choices=("auto", "triton", "events"), default="auto",
                   help="auto: triton.testing.do_bench when importable, else CUDA events")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the selected points and exit")
    p.add_argument("--print-summary", action=argparse.BooleanOptionalAction, default=True,
                   help="end with the compact one-row-per-point table (default on)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        seqlens = _flatten(args.seqlens, parse_size) if args.seqlens else None
        headdims = _flatten(args.headdims, parse_size) if args.headdims else None
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.seqlens = seqlens or list(QUICK_SEQLENS if args.quick else STANDARD_SEQLENS)
    args.headdims = headdims or list(QUICK_HEADDIMS if args.quick else STANDARD_HEADDIMS)
    args.causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    if peers == ["all"]:
        peers = list(PEER_NAMES)
    elif peers == ["none"]:
        peers = []
    unknown = [x for x in peers if x not in PEER_NAMES]
    if unknown:
        parser.error(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEER_NAMES)}")
    args.peer_names = peers
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    if skip - set(EXTRAS):
        parser.error(f"unknown extra(s) {', '.join(sorted(skip - set(EXTRAS)))}; known: {', '.join(EXTRAS)}")
    args.extras = [] if args.no_extras else [e for e in EXTRAS if e not in skip]
    if args.mode == "show" and not args.record:
        parser.error("show needs the path of a record")
    return args


def selected_points(args: argparse.Namespace) -> list[SweepPoint]:
    return standard_points(args.seqlens, args.headdims, args.causals, args.dtype)


def run_config(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "quick": args.quick, "seqlens": args.seqlens,
            "headdims": args.headdims, "causal": args.causals, "fwd_only": args.fwd_only,
            "peers_requested": args.peer_names, "extras": args.extras, "seed": args.seed,
            "tokens_per_batch": 16384, "model_dim": 2048, "layout": "BSHD (SDPA: transposed view)",
            "forward_mode": "training forward (inputs require grad)",
            "backward": "out.backward(dout, retain_graph=True) alone",
            "flops": "fwd 4·B·H·Sq·Sk·D, halved when causal (Sq == Sk); bwd 2.5 × fwd",
            "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if os.environ.get(k)}}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help or a usage error: argparse has printed it
        return int(exc.code or 0)
    console = _console()
    if args.mode == "show":
        return show(args, console)
    if args.list:
        return list_points(args, console)
    import torch

    if not torch.cuda.is_available():
        console.print("flashcuda bench: no CUDA GPU is usable here (torch.cuda.is_available() is "
                      "False); nothing measured.", markup=False)
        return 2
    if args.mode == "ladder":
        return run_ladder(args, argv, console)
    return run_sweep(args, argv, console)


def _console() -> Console:
    from .report import make_console

    return make_console()


def list_points(args, console: Console) -> int:
    from rich.table import Table

    t = Table(title="selected points")
    for col in ("hd", "seqlen", "batch", "nheads", "causal", "dtype", "fwd GFLOP", "bwd GFLOP"):
        t.add_column(col, justify="right")
    for p in selected_points(args):
        t.add_row(str(p.headdim), str(p.seqlen), str(p.batch), str(p.nheads), str(p.causal),
                  p.dtype, f"{p.flops('fwd') / 1e9:.1f}", f"{p.flops('bwd') / 1e9:.1f}")
    console.print(t)
    return 0


def show(args, console: Console) -> int:
    from .report import print_run

    path = Path(args.record)
    try:
        rec = rec_mod.load_record(path)
    except (OSError, ValueError) as exc:
        console.print(f"flashcuda bench show: {exc}", markup=False)
        return 1
    if not args.no_plot:  # (x.json -> x.png; a gzipped x.json.gz too)
        stem = path.name.removesuffix(".gz").removesuffix(".json")
        _plots(rec, path.with_name(stem + ".png"), console)
    print_run(console, rec, str(path), summary=args.print_summary)
    return exit_status(rec)


def exit_status(rec: dict) -> int:
    from .report import check_label

    if rec.get("kind") == "ladder":
        return 0 if (rec.get("ladder") or {}).get("status") == "ok" else 1
    labels = [check_label(p) for p in rec.get("points") or []]
    return 0 if labels and all(x == "ok" for x in labels) else 1


def _plots(rec: dict, png: Path, console: Console) -> None:
    try:
        from .plot import plot_decode, plot_ladder, plot_sweep

        made = [(plot_ladder if rec.get("kind") == "ladder" else plot_sweep)(rec, png),
                plot_decode(rec, png.with_name(png.stem + "-decode.png"))]
        for m in made:
            if m:
                console.print(f"plot: {m}", markup=False, highlight=False)
    except Exception as exc:  # noqa: BLE001 - a plot must never lose the record
        rec.setdefault("errors", []).append(f"plot: {type(exc).__name__}: {exc}")


def _point_line(i: int, n: int, entry: dict, peers: dict, seconds: float) -> str:
    from .report import check_label, fmt_ratio, fmt_tf

    parts = [f"[{i}/{n}] d{entry['headdim']} s{entry['seqlen']} {'causal' if entry['causal'] else 'full'}"]
    for d in ("fwd", "bwd"):
        fc = point_tflops(entry, "flashcuda", d)
        name, bt = best_peer(entry, d, peers)
        parts.append(f"{d} {fmt_tf(fc)} vs {fmt_tf(bt)} {name or ''} ({fmt_ratio(ratio(fc, bt))})")
    parts.append(f"check {check_label(entry)} · {seconds:.1f}s")
    return " | ".join(parts)


def run_sweep(args, argv: list[str], console: Console) -> int:
    import torch

    from .ceilings import measure_ceilings
    from .peers import discover
    from .report import print_run
    from .sweep import run_point
    from .timing import Timer, spin_up

    started = time.perf_counter()
    timer = Timer(args.timer, args.warmup_ms, args.rep_ms)
    points = selected_points(args)
    rec = rec_mod.new_record("sweep", argv, run_config(args), timer.describe())
    out_dir = Path(args.out)
    stem = rec_mod.record_stem(rec)
    impls = discover(args.peer_names)
    rec["peers"] = {i.name: i.status_dict() for i in impls}
    for i in impls:
        console.print(f"{i.label:>12}: {i.status} {i.detail}", markup=False, highlight=False)

    console.print("measuring ceilings ...", markup=False)
    spin_up()
    rec["ceilings"] = measure_ceilings(timer, args.dtype)
    path = rec_mod.write_record(rec, out_dir, stem)

    def sweep_loop(on_impl, on_point):
        for idx, point in enumerate(points, 1):
            t0 = time.perf_counter()
            try:
                entry = run_point(point, impls, timer, args.fwd_only, on_impl, seed=args.seed + idx)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory allocating inputs
                entry = {**point.to_dict(), "results": {}, "check": {"ok": None},
                         "error": f"{type(exc).__name__}: {exc}"}
                rec["errors"].append(f"{point.key}: {entry['error']}")
            entry["seconds"] = time.perf_counter() - t0
            rec["points"].append(entry)
            rec_mod.write_record(rec, out_dir, stem)
            on_point(idx, entry)

    if console.is_terminal:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            task = progress.add_task("sweep", total=len(points) * len(impls))

            def on_impl(name):
                progress.update(task, advance=1, description=f"sweep · {name}")

            def on_point(idx, entry):
                console.print(_point_line(idx, len(points), entry, rec["peers"], entry["seconds"]),
                              markup=False, highlight=False)

            sweep_loop(on_impl, on_point)
    else:
        sweep_loop(None, lambda idx, entry: console.print(
            _point_line(idx, len(points), entry, rec["peers"], entry["seconds"]),
            markup=False, highlight=False))

    _extras(args, rec, impls, timer, console, out_dir, stem)
    rec["gpu"]["nvidia_smi_after"] = rec_mod.nvidia_smi(torch.cuda.current_device())
    rec["seconds"] = time.perf_counter() - started
    if not args.no_plot:
        _plots(rec, out_dir / f"{stem}.png", console)
    path = rec_mod.write_record(rec, out_dir, stem)
    print_run(console, rec, str(path), summary=args.print_summary)
    return exit_status(rec)


def _extras(args, rec: dict, impls, timer, console: Console, out_dir: Path, stem: str) -> None:
    from . import extras

    by_name = {i.name: i for i in impls}
    fc = by_name["flashcuda"]
    ref = next((by_name[n] for n in REFERENCE_ORDER if n in by_name and by_name[n].status == "ok"),
               None)
    jobs = {
        "first-call": ("first_call", lambda: extras.measure_first_call(args.dtype)),
        "serving": ("serving", lambda: extras.measure_serving(impls, args.dtype)),
        "memory": ("memory", lambda: extras.measure_memory(fc, args.dtype)),
        "long": ("long_context", lambda: extras.measure_long_context(fc, ref, timer, args.dtype)),
        "decode": ("decode", lambda: extras.measure_decode(impls, timer, args.dtype)),
    }
    for name in args.extras:
        key, job = jobs[name]
        console.print(f"extra: {name} ...", markup=False)
        try:
            rec["extras"][key] = job()
        except Exception as exc:  # noqa: BLE001
            rec["extras"][key] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:600]}
        rec_mod.write_record(rec, out_dir, stem)


def run_ladder(args, argv: list[str], console: Console) -> int:
    import torch

    from .ceilings import judge_rung, measure_ceilings
    from .report import print_run
    from .timing import Timer, spin_up

    timer = Timer(args.timer, args.warmup_ms, args.rep_ms)
    rec = rec_mod.new_record("ladder", argv, {"quick": args.quick, "dtype": args.dtype},
                             timer.describe())
    out_dir = Path(args.out)
    stem = rec_mod.record_stem(rec)
    console.print("measuring ceilings ...", markup=False)
    spin_up()
    rec["ceilings"] = measure_ceilings(timer, args.dtype, fp32=True)
    rec_mod.write_record(rec, out_dir, stem)
    try:
        from .ladder import run_ladder_bench
    except ImportError as exc:
        rec["ladder"] = {"status": "absent", "error": f"{type(exc).__name__}: {exc}", "rungs": []}
    else:
        try:
            rows = run_ladder_bench(torch.device("cuda", torch.cuda.current_device()), args.quick,
                                    timer=timer)
            rungs = [{**dict(r), "_derived": judge_rung(dict(r), rec["ceilings"])} for r in rows]
            rec["ladder"] = {"status": "ok", "rungs": rungs}
        except Exception as exc:  # noqa: BLE001
            rec["ladder"] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:600],
                             "rungs": []}
    if not args.no_plot:
        _plots(rec, out_dir / f"{stem}.png", console)
    path = rec_mod.write_record(rec, out_dir, stem)
    print_run(console, rec, str(path), summary=False)
    return exit_status(rec)

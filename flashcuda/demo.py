"""`flashcuda demo`: the main job. Attention on a realistic problem, checked against a float64
oracle and timed against PyTorch's SDPA backends, with a table and a TFLOP/s-vs-seqlen plot.

With no GPU it runs the portable PyTorch path (the same tile loop) on a small problem, checks it,
and shows the CUDA kernels compiling for sm_90a with NVRTC.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashcuda demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--plot-seqlens", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192, 16384],
                   help="seqlens of the plot, at batch*seqlen tokens (empty: no plot)")
    p.add_argument("--out", type=Path, default=Path("flashcuda-demo"))
    return p


def _check(q, k, v, out, causal: bool, console: Console) -> bool:
    """FlashAttention's rule on a slice (batch 0, two heads): our error vs the float64 oracle must
    be at most 2x the error of the same attention computed by PyTorch in the input dtype."""
    import torch

    from .reference import attention_ref

    sl = (slice(0, 1), slice(None), slice(0, 2))
    qs, ks, vs = q[sl], k[:1, :, :2], v[:1, :, :2]
    ref, _ = attention_ref(qs, ks, vs, causal=causal)
    same_dtype, _ = attention_ref(qs, ks, vs, causal=causal, upcast=False)
    ours = (out[sl].double() - ref.double()).abs().max().item()
    torch_err = (same_dtype.double() - ref.double()).abs().max().item()
    ok = bool(torch.isfinite(out).all()) and ours <= 2 * torch_err + 1e-6
    console.print(f"check vs float64 oracle: max error {ours:.2e} (PyTorch in {q.dtype}: "
                  f"{torch_err:.2e}) -> {'[green]ok' if ok else '[red]FAILED'}")
    return ok


def _flops(b: int, h: int, s: int, d: int, causal: bool) -> float:
    return 4 * b * h * s * s * d / (2 if causal else 1)


def _gpu(args, console: Console) -> int:
    import torch

    import flashcuda

    from .bench.peers import discover
    from .bench.timing import Timer

    dtype = getattr(torch, DTYPES[args.dtype])
    b, h, s, d = args.batch, args.heads, args.seqlen, args.headdim
    console.print(f"[bold]flashcuda demo[/] on {torch.cuda.get_device_name()}: batch {b}, heads {h}, "
                  f"seqlen {s}, head dim {d}, {args.dtype}, causal={args.causal}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    impls = [i for i in discover(["flashcuda", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"])
             if i.status == "ok"]
    timer = Timer()
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("first call (compile or cache hit)", total=2 + len(impls))
        t0 = time.perf_counter()
        out = flashcuda.flash_attn_func(q, k, v, causal=args.causal)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        progress.advance(task)
        progress.update(task, description="checking against the float64 oracle")
        ok = _check(q, k, v, out, args.causal, console)
        progress.advance(task)
        for impl in impls:
            progress.update(task, description=f"timing {impl.label}")
            prepared = impl.prepare(q, k, v)
            try:
                with impl.context():
                    t = timer(lambda impl=impl, p=prepared: impl.forward(*p, args.causal, d ** -0.5))
                rows.append((impl.label, t.median_ms))
            except Exception as exc:  # a peer that cannot run this point is reported, not hidden
                rows.append((impl.label, None))
                console.print(f"{impl.label}: {type(exc).__name__}: {exc}".splitlines()[0])
            progress.advance(task)
    console.print(f"first call: {first:.2f} s")
    flops = _flops(b, h, s, d, args.causal)
    table = Table(title="forward, median of repeats")
    for col in ("implementation", "ms", "TFLOP/s", "flashcuda speed-up"):
        table.add_column(col, justify="right")
    ours = rows[0][1] if rows and rows[0][0].lower().startswith("flashcuda") else None
    for label, ms in rows:
        if ms is None:
            table.add_row(label, "failed", "", "")
        else:
            table.add_row(label, f"{ms:.3f}", f"{flops / ms / 1e9:.0f}",
                          f"{ms / ours:.2f}x" if ours else "")
    console.print(table)
    if args.plot_seqlens:
        _plot(args, impls, timer, console)
    return 0 if ok else 1


def _plot(args, impls, timer, console: Console) -> None:
    import torch

    tokens = args.batch * args.seqlen
    dtype = getattr(torch, DTYPES[args.dtype])
    series: dict[str, list[tuple[int, float]]] = {i.label: [] for i in impls}
    with Progress(console=console) as progress:
        task = progress.add_task("TFLOP/s vs seqlen", total=len(args.plot_seqlens) * len(impls))
        for s in args.plot_seqlens:
            b = max(1, tokens // s)
            q, k, v = (torch.randn(b, s, args.heads, args.headdim, device="cuda", dtype=dtype)
                       for _ in range(3))
            for impl in impls:
                try:
                    p = impl.prepare(q, k, v)
                    with impl.context():
                        t = timer(lambda impl=impl, p=p: impl.forward(*p, args.causal, args.headdim ** -0.5))
                    series[impl.label].append((s, _flops(b, args.heads, s, args.headdim, args.causal)
                                               / t.median_ms / 1e9))
                except Exception:
                    pass
                progress.advance(task)
            del q, k, v
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in series.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                    linewidth=2.5 if label.lower().startswith("flashcuda") else 1.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s (forward)")
    ax.set_title(f"{torch.cuda.get_device_name()}, {args.dtype}, head dim {args.headdim}, "
                 f"{args.heads} heads, {tokens} tokens, causal={args.causal}")
    ax.grid(alpha=0.3)
    ax.legend()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "demo-tflops.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    console.print(f"plot: {path}")


def _cpu(args, console: Console) -> int:
    import torch

    import flashcuda

    from .jit import compile_spec

    b, h, s, d = 1, 4, 257, 64
    console.print("[bold]flashcuda demo[/]: no usable CUDA GPU here, so attention runs on the portable "
                  "PyTorch path (the kernels' tile loop in torch).")
    console.print(f"problem: batch {b}, heads {h}, seqlen {s}, head dim {d}, fp32, causal={args.causal}")
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    out = flashcuda.flash_attn_func(q, k, v, causal=args.causal)
    ok = _check(q, k, v, out, args.causal, console)
    try:
        from .ops import fwd_sm80, fwd_sm90

        # The kernel an H100/H200 runs for the GPU demo's problem: the sm90a forward where it
        # has the head dim, else the sm80 one with its tiles for 227 KiB of shared memory.
        if args.headdim in fwd_sm90.HEAD_DIMS:
            cfg = fwd_sm90.select_config(torch.bfloat16, args.headdim, args.causal, args.seqlen)
        else:
            cfg = fwd_sm80.select_config(torch.bfloat16, args.headdim, 227 * 1024, 228 * 1024)
        spec = cfg.spec()
    except Exception:  # the tensor-core family missing: fall back to any registered variant
        from .jit import all_variants

        spec = all_variants()[0][0]
    with Progress(console=console, transient=True) as progress:
        progress.add_task(f"NVRTC: compiling {spec.name} for sm_90a", total=None)
        result = compile_spec(spec, "sm_90a")
    res = result.resources().get(spec.entry_name)
    console.print(f"NVRTC compiled {spec.name} for sm_90a in {result.seconds:.1f} s "
                  f"({len(result.cubin)} bytes of cubin"
                  + (f", {res.registers} registers, {res.spill_stores} bytes spilled" if res else "") + ").")
    console.print("The CUDA kernels need an NVIDIA GPU (sm 8.0+) to run; run `flashcuda demo` there.")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    import torch

    if torch.cuda.is_available():
        return _gpu(args, console)
    return _cpu(args, console)

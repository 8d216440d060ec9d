"""Ladder benchmark: achieved GB/s of the memory-bound rungs, TFLOP/s of the matrix rungs, and
the naive attention pipeline's time and peak memory.

Method (PERFORMANCE.md): random normal inputs; every rung is timed by the same `Timer` as the
ceilings it is judged against (timing.py: warm-up, a 256 MB L2 flush before each call, one pair of
CUDA events per call with no host synchronisation between calls, median). That matters for the
memory-bound rungs: a call that waits for the previous one to finish (`end.synchronize()` after
each call, as this file did until the rungs were tuned) starts its events on an idle GPU, so the
Python entry point's host time (checks, dispatch, argument packing: ~60-90 µs per call on the
H200's host) lands inside the measurement: 40-50% of a 0.15 ms call. With the flush and calls
queued back to back the GPU runs behind the host and only GPU time is counted.

Memory-bound rungs run in fp32, bf16 and fp16 (MEMORY_DTYPES: the 16-bit softmax and transpose
have their own code paths, which bf16 and fp16 share but for the conversions) on 256M elements in
every mode (1 GiB per fp32 tensor, 512 MiB per 16-bit one: 17x the 60 MB L2, and per-call times of
0.25-0.8 ms, next to the copy ceiling's 2 GiB); --quick shortens only the timing loop and the
matmul / attention sizes. `bytes` is the minimum traffic the
rung must move (every input read once, every output written once), so GB/s compares directly with
the device-to-device copy ceiling (bytes read + written) that the caller measures in the same
run. FLOPs: 2·M·N·K for a matmul; 4·B·H·Sq·Sk·D for attention (the FlashAttention convention; the
naive pipeline computes the masked half too, so a causal row counts the full 4·B·H·S²·D).

Row keys: rung, dtype, size (human-readable shape), median_ms, then gbps + bytes or tflops +
flops; attention rows add causal, peak_mem_bytes (torch.cuda.max_memory_allocated after a reset,
inputs included) and extra_mem_bytes (the part the call itself allocated, output included).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import ladder
from .timing import Timer

# 256M elements in both modes: at 32M (the old --quick size, 64-128 MB per tensor) a bf16 scale
# moved 134 MB in ~31 µs at copy speed, so any per-call overhead and the L2 (60 MB) weighed on it.
MEMORY_ELEMENTS = 1 << 28
QUICK_REP_MS = 40.0  # --quick: the timing loop per rung (a full run uses the Timer's own)
MEMORY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROW_LENGTH = 4096  # row sum / softmax rows
SEQLENS = (1024, 2048, 4096, 8192)
QUICK_SEQLENS = (1024, 2048)
TOKENS = 16384  # batch = TOKENS // seqlen (PERFORMANCE.md's standard sweep)
HEAD_DIM = 128
NHEADS = 2048 // HEAD_DIM

_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def time_ms(timer: Timer, fn: Callable[[], object]) -> float:
    """Median milliseconds per call of `fn`, measured by `timer` (see the module docstring)."""
    return timer(fn).median_ms


def _bandwidth_row(rung: str, dtype: torch.dtype, size: str, ms: float, nbytes: int) -> dict:
    return {"rung": rung, "dtype": _NAMES[dtype], "size": size, "median_ms": ms,
            "gbps": nbytes / (ms * 1e-3) / 1e9, "bytes": nbytes}


def _flops_row(rung: str, dtype: torch.dtype, size: str, ms: float, flops: int) -> dict:
    return {"rung": rung, "dtype": _NAMES[dtype], "size": size, "median_ms": ms,
            "tflops": flops / (ms * 1e-3) / 1e12, "flops": flops}


def _memory_rows(device: torch.device, dtype: torch.dtype, n: int, timer: Timer) -> list[dict]:
    es = dtype.itemsize
    rows: list[dict] = []
    x = torch.randn(n, device=device, dtype=dtype)
    y = torch.randn(n, device=device, dtype=dtype)
    out = torch.empty_like(x)
    size = str(n)
    ms = time_ms(timer, lambda: ladder.vector_add(x, y, out=out))
    rows.append(_bandwidth_row("vector_add", dtype, size, ms, 3 * n * es))
    ms = time_ms(timer, lambda: ladder.scale(x, 1.5, out=out))
    rows.append(_bandwidth_row("scale", dtype, size, ms, 2 * n * es))
    ms = time_ms(timer, lambda: ladder.exp(x, out=out))
    rows.append(_bandwidth_row("exp", dtype, size, ms, 2 * n * es))
    ms = time_ms(timer, lambda: ladder.dot(x, y))
    rows.append(_bandwidth_row("dot", dtype, size, ms, 2 * n * es))

    x2 = x.view(n // ROW_LENGTH, ROW_LENGTH)
    o2 = out.view(n // ROW_LENGTH, ROW_LENGTH)
    size2 = f"{n // ROW_LENGTH}x{ROW_LENGTH}"
    sums = torch.empty(n // ROW_LENGTH, device=device, dtype=dtype)
    ms = time_ms(timer, lambda: ladder.row_sum(x2, out=sums))
    rows.append(_bandwidth_row("row_sum", dtype, size2, ms, (n + n // ROW_LENGTH) * es))
    ms = time_ms(timer, lambda: ladder.softmax(x2, out=o2))
    rows.append(_bandwidth_row("softmax", dtype, size2, ms, 2 * n * es))

    side = int(n ** 0.5)
    xs = x[: side * side].view(side, side)
    os_ = out[: side * side].view(side, side)
    ms = time_ms(timer, lambda: ladder.transpose(xs, out=os_))
    rows.append(_bandwidth_row("transpose", dtype, f"{side}x{side}", ms, 2 * side * side * es))
    return rows


def _matmul_rows(device: torch.device, quick: bool, timer: Timer) -> list[dict]:
    rows: list[dict] = []
    cases = [(torch.float32, False, 2048 if quick else 4096),
             (torch.bfloat16, True, 4096 if quick else 8192),
             (torch.float16, True, 4096 if quick else 8192)]
    for dtype, tensor_cores, n in cases:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        c = torch.empty(n, n, device=device, dtype=dtype)
        ms = time_ms(timer, lambda a=a, b=b, c=c, tc=tensor_cores:
                     ladder.matmul(a, b, out=c, tensor_cores=tc))
        rung = "matmul_mma" if tensor_cores else "matmul_simt"
        rows.append(_flops_row(rung, dtype, f"{n}x{n}x{n}", ms, 2 * n ** 3))
        del a, b, c
    return rows


def _attention_rows(device: torch.device, quick: bool, timer: Timer) -> list[dict]:
    rows: list[dict] = []
    dtype = torch.bfloat16
    for seqlen in QUICK_SEQLENS if quick else SEQLENS:
        batch = max(1, TOKENS // seqlen)
        q, k, v = (torch.randn(batch, seqlen, NHEADS, HEAD_DIM, device=device, dtype=dtype)
                   for _ in range(3))
        size = f"B={batch},S={seqlen},H={NHEADS},D={HEAD_DIM}"
        flops = 4 * batch * NHEADS * seqlen * seqlen * HEAD_DIM
        half = flops // 2  # each of the two GEMMs

        ms = time_ms(timer, lambda q=q, k=k: ladder.attention_scores(q, k))
        rows.append(_flops_row("attention_scores", dtype, size, ms, half))
        scores = ladder.attention_scores(q, k)
        ms = time_ms(timer, lambda s=scores: ladder.softmax(s, out=s))
        rows.append(_bandwidth_row("attention_softmax", torch.float32, size, ms, 2 * scores.numel() * 4))
        ms = time_ms(timer, lambda s=scores, v=v: ladder.attention_pv(s, v))
        rows.append(_flops_row("attention_pv", dtype, size, ms, half))
        del scores

        for causal in (False, True):
            ms = time_ms(timer, lambda q=q, k=k, v=v, c=causal:
                         ladder.naive_attention(q, k, v, causal=c))
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            ladder.naive_attention(q, k, v, causal=causal)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(device)
            row = _flops_row("naive_attention", dtype, size, ms, flops)
            row.update(causal=causal, peak_mem_bytes=peak, extra_mem_bytes=peak - before)
            rows.append(row)
        del q, k, v
    return rows


def run_ladder_bench(device: torch.device | str | int, quick: bool,
                     timer: Timer | None = None) -> list[dict]:
    """Time every ladder rung on `device`; `quick` shrinks the matmul / attention sizes and the
    timing loop (not the memory-bound sizes). `timer`: the run's Timer, so the rungs are timed
    exactly as the copy ceiling was (default: Timer(), with a shorter loop when quick). Returns
    one dict per (rung, dtype, size); see the module docstring."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    if timer is None:
        timer = Timer(rep_ms=QUICK_REP_MS) if quick else Timer()
    rows: list[dict] = []
    with torch.cuda.device(device):
        for dtype in MEMORY_DTYPES:
            rows += _memory_rows(device, dtype, MEMORY_ELEMENTS, timer)
            torch.cuda.empty_cache()
        rows += _matmul_rows(device, quick, timer)
        rows += _attention_rows(device, quick, timer)
        torch.cuda.empty_cache()
    return rows

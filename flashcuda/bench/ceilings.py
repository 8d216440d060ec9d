"""Ceilings measured in the same run as the kernels they judge (PERFORMANCE.md).

    matmul_<dtype>   torch.matmul of two random-normal 8192×8192 matrices: 2·M·N·K / time.
                     The tensor-core ceiling for the sweep's dtype (bf16 by default).
    matmul_fp32      4096³ in fp32 with TF32 off: the SIMT ceiling for the fp32 ladder rungs.
    copy             dst.copy_(src) of 2 GiB: bytes read + bytes written (4 GiB) / time.
"""

from __future__ import annotations

from .timing import Timer, tflops

MATMUL_N = 8192
MATMUL_FP32_N = 4096
COPY_BYTES = 2 * 1024**3


def measure_matmul(timer: Timer, dtype: str, n: int) -> dict:
    import torch

    from .sweep import torch_dtype

    dt = torch_dtype(dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(n, n, dtype=dt, device="cuda", generator=gen)
    b = torch.randn(n, n, dtype=dt, device="cuda", generator=gen)
    c = torch.empty(n, n, dtype=dt, device="cuda")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        if dt == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = False
        timing = timer(lambda: torch.matmul(a, b, out=c))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    flops = 2.0 * n * n * n
    return {"dtype": dtype, "shape": [n, n, n], "flops": flops, "timing": timing.to_dict(),
            "tflops": tflops(flops, timing.median_ms)}


def measure_copy(timer: Timer, nbytes: int = COPY_BYTES) -> dict:
    import torch

    src = torch.randn(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    timing = timer(lambda: dst.copy_(src))
    moved = 2 * src.numel() * src.element_size()
    return {"bytes_moved": moved, "timing": timing.to_dict(),
            "gbps": moved / (timing.median_ms * 1e-3) / 1e9}


def measure_ceilings(timer: Timer, dtype: str = "bf16", fp32: bool = False) -> dict:
    """{"results": {name: {"status": "ok", ...} or {"status": "failed", "error": ...}},
    "matmul_ref": name of the matmul the sweep's kernels are judged against}."""
    import torch

    mm_dtype = dtype if dtype in ("bf16", "fp16") else "bf16"
    jobs = {f"matmul_{mm_dtype}": lambda: measure_matmul(timer, mm_dtype, MATMUL_N),
            "copy": lambda: measure_copy(timer)}
    if fp32 or dtype == "fp32":
        jobs["matmul_fp32"] = lambda: measure_matmul(timer, "fp32", MATMUL_FP32_N)
    results: dict = {}
    for name, job in jobs.items():
        try:
            results[name] = {"status": "ok", **job()}
        except Exception as exc:  # noqa: BLE001
            results[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        torch.cuda.empty_cache()
    return {"results": results, "matmul_ref": f"matmul_{'fp32' if dtype == 'fp32' else mm_dtype}"}


def matmul_ceiling_tflops(ceilings: dict) -> float | None:
    """The TFLOP/s the sweep's kernels are judged against, or None when it was not measured."""
    return ceilings.get("results", {}).get(ceilings.get("matmul_ref", ""), {}).get("tflops")


def copy_ceiling_gbps(ceilings: dict) -> float | None:
    return ceilings.get("results", {}).get("copy", {}).get("gbps")


def fp32_ceiling_tflops(ceilings: dict) -> float | None:
    return ceilings.get("results", {}).get("matmul_fp32", {}).get("tflops")


# ---------------------------------------------------------------------------------------------
# Judging a ladder rung (run_ladder_bench returns plain dicts; read them generously)

_LABEL_KEYS = ("name", "rung", "kernel", "op")
_SIZE_KEYS = ("size", "shape", "n", "numel")
_GBPS_KEYS = ("gbps", "GB/s", "gb_s", "gb_per_s", "bandwidth_gbps")
_TFLOPS_KEYS = ("tflops", "TFLOP/s", "tflop_s")
_MS_KEYS = ("median_ms", "ms", "time_ms")


def _first_number(row: dict, keys) -> float | None:
    for k in keys:
        v = row.get(k)
        if isinstance(v, dict):  # a nested Timing
            v = v.get("median_ms")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def judge_rung(row: dict, ceilings: dict) -> dict:
    """{label, gbps, tflops, pct_copy, pct_matmul, matmul_ref, pct}: the rung's bandwidth as % of
    the copy ceiling and its TFLOP/s as % of the matmul ceiling of its dtype (fp32 rungs against the
    fp32 SIMT matmul, 16-bit rungs against the tensor-core one); `pct` is the one that judges it."""
    label = next((str(row[k]) for k in _LABEL_KEYS if k in row), "?")
    size = next((row[k] for k in _SIZE_KEYS if k in row), None)
    if size is not None:
        label += f" {size}"
    ms = _first_number(row, _MS_KEYS + ("timing",))
    gbps = _first_number(row, _GBPS_KEYS)
    if gbps is None and ms and isinstance(row.get("bytes"), (int, float)):
        gbps = row["bytes"] / (ms * 1e-3) / 1e9
    tf = _first_number(row, _TFLOPS_KEYS)
    if tf is None and ms and isinstance(row.get("flops"), (int, float)):
        tf = row["flops"] / (ms * 1e-3) / 1e12
    copy = copy_ceiling_gbps(ceilings)
    fp32 = str(row.get("dtype", "")).lower() in ("fp32", "float32", "torch.float32")
    mm_ref = "matmul_fp32" if fp32 else ceilings.get("matmul_ref")
    mm = ceilings.get("results", {}).get(mm_ref or "", {}).get("tflops")
    pct_copy = 100 * gbps / copy if gbps is not None and copy else None
    pct_mm = 100 * tf / mm if tf is not None and mm else None
    # A rung with a FLOP rate is compute-judged (matmul, attention); otherwise bandwidth-judged.
    pct = pct_mm if pct_mm is not None else pct_copy
    return {"label": label, "gbps": gbps, "tflops": tf, "pct_copy": pct_copy,
            "pct_matmul": pct_mm, "matmul_ref": mm_ref if pct_mm is not None else None, "pct": pct}

"""The standard sweep (PERFORMANCE.md) and the measurement of one point.

FLOPs (FlashAttention papers, Triton tutorial): forward = 4·B·H·Sq·Sk·D, halved when causal with
Sq == Sk; backward = 2.5 × forward. For causal with Sq != Sk the exact number of visible
(query, key) pairs under the bottom-right alignment is counted instead.

At each point every implementation sees the same random-normal leaves q, k, v (requires_grad, so the
forward is the training forward: everyone saves what its backward needs) and the same dout.
Correctness spot-check: flashcuda's out and dq/dk/dv against the first SDPA backend that ran;
a point whose check fails is marked wrong and never reported as a speed-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from .peers import REFERENCE_ORDER, Impl
from .timing import Timer, first_call, host_exposure, host_time_us, is_unsteady, tflops

TOKENS_PER_BATCH = 16384
MODEL_DIM = 2048
STANDARD_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
STANDARD_HEADDIMS = (64, 128)
QUICK_SEQLENS = (1024, 4096)
QUICK_HEADDIMS = (64, 128)
BWD_FLOPS_FACTOR = 2.5

DTYPES = ("bf16", "fp16", "fp32")

# Spot-check tolerances, against the first SDPA backend that ran (normally FLASH_ATTENTION).
# Output: an element fails when |a - ref| > atol + rtol·|ref| ("excess" > 1); the relative mean
# error mean|a - ref| / mean|ref| catches a small systematic error (a wrong scale) that stays inside
# the per-element band. Gradients: max|a - ref| / max|ref| and the same relative mean, per tensor.
# Measured on the H200 (2026-11-29) between correct kernels (SDPA efficient and cuDNN against SDPA
# flash; d64/d128, seqlen 1k-16k, causal and not):
#   bf16: excess <= 0.25, out rel mean <= 0.0022, grad rel max <= 0.0075, grad rel mean <= 0.0029
#   fp16: excess <= 0.15, out rel mean <= 0.00027, grad rel max <= 0.001, grad rel mean <= 0.00037
# An output scaled by 1.01 gives rel mean 0.010; a batch offset bug gives 1.4.
OUT_TOL = {"bf16": (1e-2, 2e-2), "fp16": (2e-3, 4e-3), "fp32": (1e-4, 1e-4)}
GRAD_TOL = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-3}
MEAN_TOL = {"bf16": 6e-3, "fp16": 1e-3, "fp32": 1e-4}


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> float:
    """(query, key) pairs that contribute, per (batch, head), by the FLOP convention."""
    if not causal:
        return float(seqlen_q * seqlen_k)
    if seqlen_q == seqlen_k:
        return seqlen_q * seqlen_k / 2.0
    # Bottom-right alignment: row i sees keys j <= i + seqlen_k - seqlen_q.
    shift = seqlen_k - seqlen_q
    return float(sum(min(seqlen_k, max(0, i + shift + 1)) for i in range(seqlen_q)))


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                    causal: bool, direction: str = "fwd") -> float:
    fwd = 4.0 * batch * nheads * headdim * visible_pairs(seqlen_q, seqlen_k, causal)
    if direction == "fwd":
        return fwd
    if direction == "bwd":
        return BWD_FLOPS_FACTOR * fwd
    raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    nheads: int
    seqlen: int
    headdim: int
    causal: bool
    dtype: str = "bf16"

    @property
    def key(self) -> str:
        return f"d{self.headdim}-s{self.seqlen}-{'causal' if self.causal else 'full'}"

    def flops(self, direction: str) -> float:
        return attention_flops(self.batch, self.nheads, self.seqlen, self.seqlen, self.headdim,
                               self.causal, direction)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["flops_fwd"] = self.flops("fwd")
        d["flops_bwd"] = self.flops("bwd")
        return d


def standard_points(seqlens: Iterable[int] = STANDARD_SEQLENS,
                    headdims: Iterable[int] = STANDARD_HEADDIMS,
                    causals: Iterable[bool] = (False, True), dtype: str = "bf16",
                    tokens: int = TOKENS_PER_BATCH, model_dim: int = MODEL_DIM) -> list[SweepPoint]:
    """batch = tokens // seqlen (at least 1), nheads = model_dim // headdim (a head dim that does
    not divide the model dim, e.g. 192 of 2048: the whole heads that fit, 10); ordered by head
    dim, then seqlen, then causal (the order of the PERFORMANCE.md table)."""
    points = []
    for d in headdims:
        if not 0 < d <= model_dim:
            raise ValueError(f"head dim {d}: expected 1 .. the model dim {model_dim}")
        for s in seqlens:
            for c in causals:
                points.append(SweepPoint(max(1, tokens // s), model_dim // d, s, d, bool(c), dtype))
    return points


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


# ---------------------------------------------------------------------------------------------
# Correctness


def _rel_mean(diff, ref) -> float:
    """mean |a - ref| / mean |ref|: catches a small systematic error (a wrong scale) that stays
    inside the per-element tolerance."""
    return float(diff.mean()) / (float(ref.abs().mean()) or 1.0) if diff.numel() else 0.0


def out_check(out, ref, dtype: str) -> dict:
    """Max abs diff, the worst |a - ref| / (atol + rtol·|ref|) (`excess`, ok when <= 1), the
    relative mean error (ok when <= MEAN_TOL) and no NaN/inf."""
    atol, rtol = OUT_TOL[dtype]
    a, r = out.detach().float(), ref.detach().float()
    diff = (a - r).abs()
    finite = bool(a.isfinite().all())
    excess = float((diff / (atol + rtol * r.abs())).max()) if diff.numel() else 0.0
    rel_mean = _rel_mean(diff, r)
    ok = finite and math.isfinite(excess) and excess <= 1.0 and rel_mean <= MEAN_TOL[dtype]
    return {"max_abs_diff": _finite_or_none(float(diff.max())) if diff.numel() else 0.0,
            "excess": _finite_or_none(excess), "rel_mean_err": _finite_or_none(rel_mean),
            "finite": finite, "ok": ok, "atol": atol, "rtol": rtol, "mean_tol": MEAN_TOL[dtype]}


def grad_check(grads, ref_grads, dtype: str) -> dict:
    tol, mean_tol = GRAD_TOL[dtype], MEAN_TOL[dtype]
    rel, rel_mean = {}, {}
    ok = True
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        g, r = g.float(), r.float()
        diff = (g - r).abs()
        err = float(diff.max()) / (float(r.abs().max()) or 1.0) if g.numel() else 0.0
        mean = _rel_mean(diff, r)
        finite = bool(g.isfinite().all())
        rel[name], rel_mean[name] = _finite_or_none(err), _finite_or_none(mean)
        ok = ok and finite and math.isfinite(err) and err <= tol and mean <= mean_tol
    return {"rel_max_diff": rel, "rel_mean_err": rel_mean, "tol": tol, "mean_tol": mean_tol,
            "ok": ok}


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ---------------------------------------------------------------------------------------------
# One point on the GPU


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 600 else text[:600] + " ..."


def run_point(point: SweepPoint, impls: Sequence[Impl], timer: Timer, fwd_only: bool = False,
              on_impl: Callable[[str], None] | None = None, seed: int = 0) -> dict:
    """Time every implementation at `point`; returns the point's record entry."""
    import torch

    dt = torch_dtype(point.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (point.batch, point.seqlen, point.nheads, point.headdim)

    def randn():
        return torch.randn(shape, dtype=dt, device="cuda", generator=gen)

    q, k, v = (randn().requires_grad_() for _ in range(3))
    dout = randn()
    scale = point.headdim ** -0.5
    leaves = [q, k, v]
    entry = point.to_dict()
    results: dict[str, dict] = {}
    outs: dict[str, torch.Tensor] = {}
    grads: dict[str, tuple] = {}
    keep_grads = {"flashcuda", *REFERENCE_ORDER}

    for impl in impls:
        if on_impl:
            on_impl(impl.name)
        if impl.status != "ok":
            results[impl.name] = {"fwd": {"status": "absent"}, "bwd": {"status": "absent"}}
            continue
        reason = impl.skip_reason(point.batch, point.nheads, point.seqlen, point.seqlen)
        if reason:
            results[impl.name] = {"fwd": {"status": "skipped", "error": reason},
                                  "bwd": {"status": "skipped", "error": reason}}
            continue
        res = _run_impl(impl, point, leaves, dout, scale, timer, fwd_only, outs, grads,
                        impl.name in keep_grads)
        results[impl.name] = res
        torch.cuda.empty_cache()

    entry["results"] = results
    entry["check"] = _check_point(point, results, outs, grads)
    del q, k, v, dout, leaves, outs, grads
    torch.cuda.empty_cache()
    return entry


def _run_impl(impl: Impl, point: SweepPoint, leaves, dout, scale, timer: Timer, fwd_only: bool,
              outs: dict, grads: dict, keep_grads: bool) -> dict:
    res: dict[str, dict] = {}
    flops_fwd, flops_bwd = point.flops("fwd"), point.flops("bwd")
    try:
        with impl.context():
            prepared = impl.prepare(*leaves)

            def fwd():
                return impl.forward(*prepared, point.causal, scale)

            first, out = first_call(fwd)
            outs[impl.name] = out.detach().to(leaves[0].dtype)
            timing = timer(fwd)
            res["fwd"] = {"status": "ok", "timing": timing.to_dict(), "first_call_ms": first,
                          "tflops": tflops(flops_fwd, timing.median_ms),
                          "host_us": host_time_us(fwd)}
            if is_unsteady(timing):
                res["fwd"]["exposure"] = host_exposure(fwd, timing.median_ms)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        res["fwd"] = {"status": "failed", "error": _error_text(exc)}
        res["bwd"] = {"status": "skipped", "error": "forward failed"}
        _sync_quietly()
        return res

    if fwd_only:
        res["bwd"] = {"status": "skipped", "error": "--fwd-only"}
        return res
    if not impl.backward:
        res["bwd"] = {"status": "skipped", "error": "no backward timed for this peer"}
        return res
    try:
        with impl.context():
            out = fwd()
            for t in leaves:
                t.grad = None

            def bwd():
                out.backward(dout, retain_graph=True)

            first, _ = first_call(bwd)
            if keep_grads:
                grads[impl.name] = tuple(t.grad.detach().clone() for t in leaves)
            timing = timer(bwd, grad_to_none=leaves)
            res["bwd"] = {"status": "ok", "timing": timing.to_dict(), "first_call_ms": first,
                          "tflops": tflops(flops_bwd, timing.median_ms),
                          "host_us": host_time_us(bwd, grad_to_none=leaves)}
            if is_unsteady(timing):
                res["bwd"]["exposure"] = host_exposure(bwd, timing.median_ms, grad_to_none=leaves)
    except Exception as exc:  # noqa: BLE001
        res["bwd"] = {"status": "failed", "error": _error_text(exc)}
        _sync_quietly()
    finally:
        for t in leaves:
            t.grad = None
    return res


def _sync_quietly() -> None:
    import torch

    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a sticky CUDA error shows up in every later result
        pass


def _check_point(point: SweepPoint, results: dict, outs: dict, grads: dict) -> dict:
    ref = next((n for n in REFERENCE_ORDER if n in outs), None)
    check: dict = {"reference": ref, "peers": {}}
    if ref is None:
        check["ok"] = None
        check["note"] = "no SDPA backend ran here; nothing to compare with"
        return check
    for name, out in outs.items():
        if name == ref:
            continue
        oc = out_check(out, outs[ref], point.dtype)
        if name == "flashcuda":
            check["out"] = oc
        else:
            check["peers"][name] = {k: oc[k] for k in ("max_abs_diff", "excess", "ok")}
    if "flashcuda" in grads and ref in grads:
        check["grads"] = grad_check(grads["flashcuda"], grads[ref], point.dtype)
    parts = [check[k]["ok"] for k in ("out", "grads") if k in check]
    check["ok"] = all(parts) if parts else None
    return check


# ---------------------------------------------------------------------------------------------
# Reading a recorded point (tables, plots, summary)


def point_tflops(point: dict, impl: str, direction: str) -> float | None:
    r = (point.get("results") or {}).get(impl, {}).get(direction, {})
    return r.get("tflops") if r.get("status") == "ok" else None


def best_peer(point: dict, direction: str, peers: dict) -> tuple[str | None, float | None]:
    """(name, TFLOP/s) of the fastest peer allowed to be "best" (peers: the record's peer table)."""
    best: tuple[str | None, float | None] = (None, None)
    for name in point.get("results") or {}:
        if name == "flashcuda" or not peers.get(name, {}).get("in_best", True):
            continue
        t = point_tflops(point, name, direction)
        if t is not None and (best[1] is None or t > best[1]):
            best = (name, t)
    return best


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None

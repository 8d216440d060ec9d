"""Soak: many calls of random shapes through `flashcuda.flash_attn_func` on one GPU, with a run
record (issue 8).

    FLASHCUDA_COMMIT=$(git rev-parse HEAD) python scripts/soak.py [--calls 10000] [--seed 0]
        [--check-every 10] [--sm90 mix|on|off|env] [--max-seconds 0] [--out DIR]

Each call draws (sample_shape): batch 1-4; seqlen_q, seqlen_k 1-2100 (uniform, tile edges
64m-1 / 64m / 64m+1, tiny 1-16; equal 40% of the time, otherwise ragged against each other);
nheads_kv 1, 2, 4, 8 with GQA ratios 1, 2, 4, 8 (nheads <= 16); head dim 64 / 128 (40% each),
32 / 96 (10% each); full 35%, causal 35%, sliding window 20%, causal + left window 10%; fp16 /
bf16; contiguous or (20%) BHSD views; the backward on 20% of calls (a quarter of those
deterministic); and, with --sm90 mix on an sm90 GPU, FLASHCUDA_ENABLE_SM90 on for half of them.

Rules (any break -> exit 1; the record lists each failure):
  * every call: out finite, lse never NaN or +inf, gradients finite (counted on the device with
    no synchronisation, read at each progress line);
  * every --check-every-th call and every warm-up call: the oracle rule of the GPU tests against
    flashcuda.reference.attention_ref in float64 (DESIGN.md §7): out <= 2 x torch's same-dtype
    error + FA3 rounding floor + 1e-5 (1 + max|ref|); lse <= 2 x torch's + 1e-4 + the same;
    dq, dk, dv <= 3 x torch's + rounding floor + 1e-5 + 1e-3 max|ref|; rows that see no key
    exactly 0;
  * memory flat: torch.cuda.memory_allocated() at the end equals its value at the first progress
    line at or past half of the calls (exactly: over the second half no call may leave a tensor
    behind), and exceeds its value after the warm-up by at most 64 MiB (room for a one-time
    library workspace first touched by a rare shape; a leak of even a few bytes per call fails
    the first rule); max_memory_reserved() at the end is at most 1.25 x its value after the
    warm-up + 1 GiB. The warm-up loads every kernel the soak can pick, touches the small and
    single-head paths, and runs the largest shape the sampler can draw (forward, backward and
    their oracle check), so later growth of the reserved pool can only be fragmentation
    (bounded) or a leak (the allocated rules catch it). The record keeps allocated / max reserved
    at every progress line, so a failure shows whether memory stepped once or ramped.

Cost on an H200 (estimate, not measured): ~0.3 ms per call (host overhead dominates: the mean
problem is ~6 GFLOP), ~2-3 ms per forward oracle check and ~15 ms per backward one, so 10,000
calls with every 10th checked take ~30-60 s after the warm-up (~5 s) and a parallel prebuild of
the ~50 kernels (~60 s on a cold cache, ~0 on the lane's warm one): well under 4 minutes.

Output: a progress line every ~10%, then one summary line; --out DIR gets
soak-<UTC yyyymmdd-hhmmss>-<sha8>.json (strict JSON: non-finite numbers become null).
`--device cpu` runs the same loop on the portable path (tests/cpu/test_soak.py; no memory rules).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

import flashcuda
from flashcuda import flash_attn_func
from flashcuda.ops import dispatch
from flashcuda.reference import attention_ref, max_error, rounding_floor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (64, 128, 32, 96)
HEAD_DIM_WEIGHTS = (40, 40, 10, 10)
MASKS = ("full", "causal", "window", "causal_window")
MASK_WEIGHTS = (35, 35, 20, 10)
MAX_HEADS = 16
SM90_ENV = "FLASHCUDA_ENABLE_SM90"
QUANTITIES = ("out", "lse", "dq", "dk", "dv")
GIB = 1 << 30
RESERVED_GROWTH, RESERVED_SLACK = 1.25, GIB
ALLOCATED_SLACK = 64 << 20  # one-time allocations after the warm-up (e.g. a cuBLAS workspace)
MEMORY_RULE = ("allocated(end) == allocated(first progress line >= half the calls); "
               "allocated(end) <= allocated(after warm-up) + 64 MiB; "
               f"max_reserved(end) <= {RESERVED_GROWTH} x max_reserved(after warm-up) + 1 GiB")
MAX_EXCEPTIONS = 20  # then stop: a sticky CUDA error fails every later call


# ---- the sampler (pure: CPU-tested) ---------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    b: int
    sq: int
    sk: int
    h: int
    hkv: int
    d: int
    dtype: str
    causal: bool
    window: tuple[int, int]
    backward: bool
    deterministic: bool
    layout: str  # "contig" | "bhsd"
    sm90: bool

    @property
    def mask(self) -> str:
        if self.causal:
            return "causal" if self.window[0] < 0 else "causal_window"
        return "full" if self.window == (-1, -1) else "window"

    def label(self) -> str:
        mask = self.mask if self.mask in ("full", "causal") else f"{self.mask}{self.window}"
        flags = "".join(f" {name}" for name, on in (("bwd", self.backward),
                                                    ("det", self.deterministic),
                                                    ("sm90", self.sm90)) if on)
        return (f"{self.dtype} b{self.b} q{self.sq} k{self.sk} h{self.h}/{self.hkv} d{self.d} "
                f"{mask} {self.layout}{flags}")


def sample_seqlen(rng: random.Random, max_seqlen: int) -> int:
    r = rng.random()
    if r < 0.15:
        return rng.randint(1, min(16, max_seqlen))
    if r < 0.40 and max_seqlen >= 64:
        s = 64 * rng.randint(1, max_seqlen // 64) + rng.choice((-1, 0, 1))
        return max(1, min(s, max_seqlen))
    return rng.randint(1, max_seqlen)


def sample_shape(rng: random.Random, max_seqlen: int = 2100, sm90_p: float = 0.5,
                 backward_p: float = 0.2) -> Shape:
    b = rng.randint(1, 4)
    sq = sample_seqlen(rng, max_seqlen)
    sk = sq if rng.random() < 0.4 else sample_seqlen(rng, max_seqlen)
    hkv = rng.choice((1, 2, 4, 8))
    ratio = rng.choice([r for r in (1, 2, 4, 8) if hkv * r <= MAX_HEADS])
    d = rng.choices(HEAD_DIMS, HEAD_DIM_WEIGHTS)[0]
    mask = rng.choices(MASKS, MASK_WEIGHTS)[0]
    causal = mask.startswith("causal")
    if mask == "window":
        window = (rng.randint(0, 512), rng.choice((0, rng.randint(0, 64), -1)))
    elif mask == "causal_window":
        window = (rng.randint(0, 512), -1)
    else:
        window = (-1, -1)
    backward = rng.random() < backward_p
    deterministic = backward and rng.random() < 0.25
    return Shape(b, sq, sk, hkv * ratio, hkv, d, rng.choice(tuple(DTYPES)), causal, window,
                 backward, deterministic, "bhsd" if rng.random() < 0.2 else "contig",
                 rng.random() < sm90_p)


def warmup_shapes(max_seqlen: int, sm90_modes: tuple[bool, ...]) -> list[Shape]:
    """Every kernel the sampler can reach (dtype x head dim x backward mode x sm90 gate), small;
    one head and one query row, BHSD views (other library paths of the oracle's einsums); then
    the largest shape it can draw, forward and backward (the memory high-water mark)."""
    small = min(130, max_seqlen)
    shapes = [Shape(1, small, small, 2, 1, d, dtype, True, (-1, -1), True, det, "contig", sm90)
              for dtype in DTYPES for d in HEAD_DIMS for det in (False, True)
              for sm90 in sm90_modes]
    shapes += [Shape(1, sq, small, 1, 1, 64, dtype, False, (-1, -1), True, False, layout,
                     sm90_modes[-1])
               for dtype in DTYPES for sq in (1, small) for layout in ("contig", "bhsd")]
    shapes.append(Shape(4, max_seqlen, max_seqlen, MAX_HEADS, 8, 128, "bf16",
                        False, (-1, -1), True, False, "contig", sm90_modes[0]))
    return shapes


# ---- one call and its checks ----------------------------------------------------------------------

def make_inputs(shape: Shape, device: str, g: torch.Generator):
    dtype = DTYPES[shape.dtype]

    def r(s, heads):
        if shape.layout == "bhsd":
            return torch.randn(shape.b, heads, s, shape.d, device=device, generator=g
                               ).to(dtype).transpose(1, 2)
        return torch.randn(shape.b, s, heads, shape.d, device=device, generator=g).to(dtype)

    return r(shape.sq, shape.h), r(shape.sk, shape.hkv), r(shape.sk, shape.hkv)



def _amax(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return finite.abs().max().item() if finite.numel() else 0.0


def check_call(shape: Shape, q, k, v, out, lse, dout=None, grads=None) -> dict[str, tuple]:
    """{quantity: (error, bound)} under the rule of the module docstring; raises AssertionError
    for what is wrong regardless of size (NaN, a dead row that is not 0)."""
    kw = dict(causal=shape.causal, window_size=shape.window)
    dtype = q.dtype
    ref, ref_lse = attention_ref(q, k, v, **kw)
    base, base_lse = attention_ref(q, k, v, upcast=False, **kw)
    result = {}
    berr = max_error(base, ref)
    result["out"] = (max_error(out, ref),
                     2 * berr + rounding_floor(ref, dtype) + 1e-5 * (1 + _amax(ref)))
    berr = max_error(base_lse, ref_lse)
    result["lse"] = (max_error(lse, ref_lse), 2 * berr + 1e-4 + 1e-5 * (1 + _amax(ref_lse)))
    dead = torch.isneginf(ref_lse)
    if not (out.permute(0, 2, 1, 3)[dead] == 0).all():
        raise AssertionError("a row that sees no key is not exactly 0")
    if grads is None:
        return result

    def oracle(upcast: bool):
        leaves = [(t.double() if upcast else t.clone()).requires_grad_() for t in (q, k, v)]
        o, _ = attention_ref(*leaves, upcast=upcast, **kw)
        return torch.autograd.grad(o, leaves, dout.to(o.dtype))

    ref_g, base_g = oracle(True), oracle(False)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref_g, base_g, strict=True):
        bound = 3 * max_error(b, r) + rounding_floor(r, dtype) + 1e-5 + 1e-3 * _amax(r)
        result[name] = (max_error(g, r), bound)
    return result


class Soak:
    """The loop's state: counters, worst errors, failures (a record in the making)."""

    def __init__(self, device: str, sm90_mode: str):
        self.device = device
        self.sm90_mode = sm90_mode  # "env": leave FLASHCUDA_ENABLE_SM90 alone, else per shape
        self.reset_counts()
        self.worst: dict[str, dict] = {}
        self.failures: list[dict] = []
        self.failure_count = 0
        self.exceptions = 0
        self.bad = torch.zeros(3, dtype=torch.int64, device=device)  # out, lse, grads
        self.bad_seen = torch.zeros(3, dtype=torch.int64)

    def reset_counts(self) -> None:
        self.counts: dict = {"calls": 0, "forward": 0, "backward": 0, "deterministic": 0,
                             "checked": 0, "checked_backward": 0, "by_dtype": {},
                             "by_head_dim": {}, "by_mask": {}, "by_layout": {}, "by_family": {}}

    def fail(self, index: int, shape: Shape | None, what: str) -> None:
        self.failure_count += 1
        if len(self.failures) < 50:
            self.failures.append({"call": index, "shape": shape.label() if shape else None,
                                  "what": what[:2000]})

    def _bump(self, key: str, value) -> None:
        table = self.counts[key]
        table[str(value)] = table.get(str(value), 0) + 1

    def call(self, index: int, shape: Shape, g: torch.Generator, check: bool) -> None:
        if self.sm90_mode != "env":  # dispatch keys its plans on this variable
            if shape.sm90:
                os.environ[SM90_ENV] = "1"
            else:
                os.environ.pop(SM90_ENV, None)
        q, k, v = make_inputs(shape, self.device, g)
        if shape.backward:
            for t in (q, k, v):
                t.requires_grad_()
        out, lse = flash_attn_func(q, k, v, causal=shape.causal, window_size=shape.window,
                                   deterministic=shape.deterministic, return_lse=True)
        grads = dout = None
        if shape.backward:
            dout = torch.randn(out.shape, device=self.device, generator=g).to(out.dtype)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        out = out.detach()
        self.bad[0] += (~torch.isfinite(out)).sum()
        self.bad[1] += (torch.isnan(lse) | torch.isposinf(lse)).sum()
        if grads is not None:
            for t in grads:
                self.bad[2] += (~torch.isfinite(t)).sum()
        c = self.counts
        c["calls"] += 1
        c["forward"] += 1
        c["backward"] += shape.backward
        c["deterministic"] += shape.deterministic
        self._bump("by_dtype", shape.dtype)
        self._bump("by_head_dim", shape.d)
        self._bump("by_mask", shape.mask)
        self._bump("by_layout", shape.layout)
        if not check:
            return
        c["checked"] += 1
        c["checked_backward"] += shape.backward
        qd, kd, vd = (t.detach() for t in (q, k, v))
        for name, (err, bound) in check_call(shape, qd, kd, vd, out, lse, dout, grads).items():
            ratio = err / bound if bound > 0 else (0.0 if err == 0 else math.inf)
            if ratio > self.worst.get(name, {}).get("ratio", -1.0):
                self.worst[name] = {"ratio": ratio, "error": err, "bound": bound, "call": index,
                                    "shape": shape.label()}
            if not err <= bound:
                self.fail(index, shape, f"{name}: error {err:.3e} > bound {bound:.3e}")

    def read_invariants(self, upto: int) -> None:
        """Turn the device-side counters into failures (one entry per progress interval)."""
        now = self.bad.cpu()
        new = now - self.bad_seen
        self.bad_seen = now
        for name, n in zip(("out not finite", "lse NaN or +inf", "gradient not finite"),
                           new.tolist(), strict=True):
            if n:
                self.fail(upto, None, f"{n} elements: {name} (in the calls up to {upto})")


def _memory(device: str) -> dict | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    gc.collect()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "max_allocated": torch.cuda.max_memory_allocated()}


def memory_verdict(after_warmup: dict | None, half: dict | None,
                   end: dict | None) -> tuple[bool, str]:
    """MEMORY_RULE; `half` is the snapshot at the first progress line >= half the calls (the
    warm-up's when the run stopped before)."""
    if after_warmup is None or end is None:
        return True, "not measured (no CUDA device)"
    half = half or after_warmup
    limit = RESERVED_GROWTH * after_warmup["max_reserved"] + RESERVED_SLACK
    problems = []
    if end["allocated"] != half["allocated"]:
        problems.append(f"allocated {half['allocated']} -> {end['allocated']} bytes over the "
                        "second half")
    if end["allocated"] > after_warmup["allocated"] + ALLOCATED_SLACK:
        problems.append(f"allocated {after_warmup['allocated']} -> {end['allocated']} bytes "
                        "since the warm-up (> 64 MiB)")
    if end["max_reserved"] > limit:
        problems.append(f"max reserved {end['max_reserved'] / GIB:.2f} GiB > "
                        f"{RESERVED_GROWTH} x {after_warmup['max_reserved'] / GIB:.2f} + 1 GiB")
    if problems:
        return False, "; ".join(problems)
    return True, (f"flat (allocated {end['allocated']} B; max reserved "
                  f"{after_warmup['max_reserved'] / GIB:.2f} -> {end['max_reserved'] / GIB:.2f} GiB)")


# ---- kernels up front -----------------------------------------------------------------------------

def kernel_specs(shapes: list[Shape], device_index: int) -> set:
    """The KernelSpecs the default dispatch can pick for these shapes (contiguous or BHSD views:
    every stride a multiple of 8, so fwd_sm90 / fwd_sm80 / bwd_sm80)."""
    from flashcuda.ops import bwd_sm80, fwd_sm80, fwd_sm90

    _, per_block, per_sm = fwd_sm80._device_info(device_index)
    specs = set()
    for s in shapes:
        dtype = DTYPES[s.dtype]
        specs.add(fwd_sm80.select_config(dtype, s.d, per_block, per_sm).spec())
        if s.sm90 and s.d in fwd_sm90.HEAD_DIMS:
            specs.add(fwd_sm90.select_config(dtype, s.d).spec())
        if s.backward:
            cfg = bwd_sm80.config_for(dtype, s.d)
            specs.update((cfg.pre_spec(), cfg.main_spec(not s.deterministic),
                          cfg.dq_spec() if s.deterministic else cfg.convert_spec()))
    return specs


def prebuild(specs, arch: str) -> int:
    """Compile what the disk cache lacks, in parallel processes (a compile holds the GIL)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from flashcuda.jit import build_cubin, disk_cache
    from flashcuda.jit.compiler import COMPILE_OPTIONS
    from flashcuda.jit.runtime import tool_versions

    versions = tool_versions()
    missing = [s for s in specs if disk_cache().load(
        f"{s.name}.{arch}", s.key(arch, COMPILE_OPTIONS, versions)) is None]
    if missing:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(len(missing), os.cpu_count() or 2), mp_context=ctx) as pool:
            for future in [pool.submit(build_cubin, s, arch) for s in missing]:
                future.result()
    return len(missing)


# ---- the run --------------------------------------------------------------------------------------

def _finite(x):
    """Strict JSON: non-finite floats become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_record(record: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    sha = (record.get("commit") or {}).get("sha") or "unknown"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = out_dir / f"soak-{stamp}-{sha[:8]}.json"
    path.write_text(json.dumps(_finite(record), indent=1, allow_nan=False))
    return path


def summary_line(record: dict) -> str:
    c = record["counts"]
    worst = record.get("worst") or {}
    top = max(worst.items(), key=lambda kv: kv[1]["ratio"] or 0.0, default=None)
    worst_txt = f"worst {top[0]} {top[1]['ratio']:.2f} of its bound" if top else "no check ran"
    mem = record["memory"]
    return (f"soak: {record['status'].upper()}  {c['calls']}/{record['config']['calls']} calls "
            f"(bwd {c['backward']}), checked {c['checked']} (bwd {c['checked_backward']}), "
            f"failures {record['failure_count']}, {worst_txt}, memory {mem['verdict']}, "
            f"{record['seconds']['total']:.0f}s")


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    device = args.device
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("soak: no CUDA device (torch.cuda.is_available() is False)")
    from flashcuda.bench.record import commit_info

    cc = torch.cuda.get_device_capability() if cuda else None
    sm90_gpu = cc == (9, 0)
    mode = args.sm90
    sm90_p = {"mix": 0.5 if sm90_gpu else 0.0, "on": 1.0, "off": 0.0, "env": 0.0}[mode]
    record: dict = {
        "kind": "soak", "schema_version": 1,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv[1:], "commit": commit_info(),
        "versions": {"flashcuda": flashcuda.__version__, "torch": torch.__version__,
                     "torch_cuda": torch.version.cuda, "python": platform.python_version()},
        "gpu": ({"name": torch.cuda.get_device_name(), "capability": list(cc)} if cuda
                else {"name": None, "device": device}),
        "config": {"calls": args.calls, "seed": args.seed, "check_every": args.check_every,
                   "max_seqlen": args.max_seqlen, "sm90": mode, "sm90_fraction": sm90_p,
                   "backward_fraction": args.backward_p, "max_seconds": args.max_seconds,
                   "memory_rule": MEMORY_RULE},
    }
    memory: dict = {"start": _memory(device), "half": None, "ticks": []}
    state = Soak(device, mode)
    # Count the families dispatch picks (the module's functions are looked up per call).
    real_fwd, real_bwd = dispatch.forward, dispatch.backward

    def spy(real):
        def wrapped(call):
            name = real(call)
            state._bump("by_family", name)
            return name
        return wrapped

    dispatch.forward, dispatch.backward = spy(real_fwd), spy(real_bwd)
    env_before = os.environ.get(SM90_ENV)
    seconds = {"prebuild": 0.0}
    errors: list[str] = []
    completed = 0
    try:
        modes = {"mix": (False, True), "on": (True,), "off": (False,), "env": (False,)}[mode]
        if mode == "mix" and not sm90_gpu:
            modes = (False,)
        warm = warmup_shapes(args.max_seqlen, modes)
        if cuda:
            t0 = time.perf_counter()
            from flashcuda.jit import device_arch

            index = torch.cuda.current_device()
            try:
                record["config"]["prebuilt"] = prebuild(kernel_specs(warm, index),
                                                        device_arch(index))
            except Exception as exc:  # best effort: the kernels then compile on first use
                errors.append(f"prebuild: {_describe(exc)}")
            seconds["prebuild"] = time.perf_counter() - t0
        g = torch.Generator(device=device).manual_seed(args.seed)
        t0 = time.perf_counter()
        for i, shape in enumerate(warm):
            try:
                state.call(-1 - i, shape, g, check=True)
            except Exception as exc:  # recorded; the soak goes on
                state.fail(-1 - i, shape, _describe(exc))
        state.read_invariants(0)
        state.reset_counts()  # the counts are the soak's; warm-up errors stay in worst/failures
        memory["after_warmup"] = _memory(device)
        seconds["warmup"] = time.perf_counter() - t0
        record["config"]["warmup_calls"] = len(warm)

        rng = random.Random(args.seed)
        t0 = time.perf_counter()
        tick = max(1, args.calls // 10)
        for i in range(args.calls):
            if args.max_seconds and time.perf_counter() - t_start > args.max_seconds:
                break
            shape = sample_shape(rng, args.max_seqlen, sm90_p, args.backward_p)
            try:
                state.call(i, shape, g, check=args.check_every > 0 and i % args.check_every == 0)
            except Exception as exc:  # recorded; the soak goes on
                state.exceptions += 1
                state.fail(i, shape, _describe(exc))
                if state.exceptions >= MAX_EXCEPTIONS:
                    completed = i + 1
                    break
            completed = i + 1
            if completed % tick == 0 or completed == args.calls:
                state.read_invariants(completed)
                snap = _memory(device)
                if snap is not None:
                    memory["ticks"].append({"calls": completed, "allocated": snap["allocated"],
                                            "max_reserved": snap["max_reserved"]})
                    if memory["half"] is None and 2 * completed >= args.calls:
                        memory["half"] = snap
                _progress(state, completed, args.calls, time.perf_counter() - t0, device)
        state.read_invariants(completed)
        seconds["soak"] = time.perf_counter() - t0
        memory["end"] = _memory(device)
    finally:
        dispatch.forward, dispatch.backward = real_fwd, real_bwd
        if env_before is None:
            os.environ.pop(SM90_ENV, None)
        else:
            os.environ[SM90_ENV] = env_before
    flat, verdict = memory_verdict(memory.get("after_warmup"), memory.get("half"),
                                   memory.get("end"))
    memory["flat"], memory["verdict"] = flat, verdict
    if not flat:
        state.fail(completed, None, f"memory not flat: {verdict}")
    seconds["total"] = time.perf_counter() - t_start
    if state.failure_count:
        status = "fail"
    elif completed < args.calls:
        status = "incomplete"
    else:
        status = "pass"
    record.update(status=status, counts=state.counts, failure_count=state.failure_count,
                  failures=state.failures, worst=state.worst, memory=memory, seconds=seconds,
                  errors=errors)
    return record


def _describe(exc: BaseException) -> str:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return "".join(tb[-3:]).strip()


def _progress(state: Soak, done: int, total: int, seconds: float, device: str) -> None:
    worst = " ".join(f"{k} {v['ratio']:.2f}" for k, v in state.worst.items()
                     if v["ratio"] is not None and math.isfinite(v["ratio"]))
    mem = ""
    if device == "cuda":
        mem = (f"  allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB"
               f"  max reserved {torch.cuda.max_memory_reserved() / GIB:.2f} GiB")
    print(f"[soak] {done:6d}/{total} ({100 * done // total:3d}%)  {seconds:6.1f}s  "
          f"checked {state.counts['checked']}  failures {state.failure_count}  "
          f"worst/bound: {worst or '-'}{mem}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-every", type=int, default=10,
                   help="oracle-check every Nth call (0: none; warm-up calls are always checked)")
    p.add_argument("--max-seqlen", type=int, default=2100)
    p.add_argument("--backward-p", type=float, default=0.2, help="fraction of calls with backward")
    p.add_argument("--sm90", choices=("mix", "on", "off", "env"), default="mix",
                   help="FLASHCUDA_ENABLE_SM90 per call: half on (sm90 GPUs), on, off, or as "
                        "the environment has it")
    p.add_argument("--max-seconds", type=float, default=0,
                   help="stop starting calls after this long (0: no limit); the run is then "
                        "'incomplete' (exit 3)")
    p.add_argument("--out", type=Path, default=Path("soak-out"))
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = run(args)
    path = write_record(record, args.out)
    record["path"] = str(path)
    for f in record["failures"][:10]:
        print(f"  FAILED call {f['call']}: {f['shape']}: {f['what'].splitlines()[-1]}")
    print(summary_line(record) + f"  record {path}", flush=True)
    return {"pass": 0, "fail": 1, "incomplete": 3}[record["status"]]


if __name__ == "__main__":
    sys.exit(main())

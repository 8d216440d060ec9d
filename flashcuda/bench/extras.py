"""What a run records besides the sweep (PERFORMANCE.md, "Also record"; targets 4 and 5).

    first_call    a new process times its first flashcuda forward and backward: "cold" with an
                  empty FLASHCUDA_CACHE_DIR (NVRTC compile), then "warm" with the same directory
                  (cache hit + module load). torch import, CUDA context creation and
                  `import flashcuda` are timed separately and excluded; whatever the first call
                  itself imports or initialises (cuda.core, the driver API) is included. Targets: cold ≤ 2 s
                  (compile of one kernel), warm ≤ 50 ms.
    serving       a serving-size forward (batch 1, 32 heads, seqlen 2048, d128, causal, no grad):
                  p50/p90/p99 per-call latency, wall-clock and GPU, for flashcuda and each peer;
                  and the same call replayed from a CUDA graph (graph p50/p90/p99: the kernels
                  alone, as a serving stack that captures its decode step sees them).
    memory        peak extra memory (torch.cuda.max_memory_allocated above the inputs) of
                  flashcuda against the naive O(S²) pipeline (fp32 scores, softmax, P·V in torch).
    long_context  a single-head seqlen-65536 causal call (forward + backward) runs; the naive
                  pipeline would need 16 GiB of fp32 scores for it.
    decode        one new query per sequence over a full KV cache (DECODE_SHAPE: batch 1 and 8,
                  32 query heads over 8 KV heads, d128, cache lengths 1k-64k), no grad:
                  flash_attn_with_kvcache and flash_attn_func (both through ops.decode: the
                  decode kernels), flash_attn_func with ops.decode off (one query row per head
                  in the forward kernels, one call: the control), flash_attn_with_kvcache's step
                  replayed from a CUDA graph (CUDA only: the serving pattern, no host work per
                  call), the same cache as shuffled pages of DECODE_PAGE rows read in place
                  through a block table (kvcache.SPANS_ON_DEVICE; eager and from a graph) and
                  the peers' GQA forms, as median ms and the KV cache's bytes per second (the
                  bound: every key and value read once), each output checked on batch entry 0
                  against float64.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .peers import Impl
from .timing import Timer, capture, graph_latency, latency_percentiles, tflops

FIRST_CALL_TARGET_COLD_S = 2.0
FIRST_CALL_TARGET_WARM_S = 0.050
SERVING_SHAPE = {"batch": 1, "nheads": 32, "seqlen": 2048, "headdim": 128, "causal": True}
MEMORY_SHAPE = {"batch": 1, "nheads": 4, "seqlen": 16384, "headdim": 128, "causal": False}
LONG_SHAPE = {"batch": 1, "nheads": 1, "seqlen": 65536, "headdim": 128, "causal": True}
DECODE_SHAPE = {"batches": [1, 8], "nheads": 32, "nheads_kv": 8, "headdim": 128,
                "cache_seqlens": [1024, 4096, 16384, 65536]}
DECODE_PAGE = 64  # the paged arms' page size (rows per page of the shuffled pool)

# Runs in a fresh interpreter; prints one JSON line last.
_FIRST_CALL_SCRIPT = r"""
import json, time, sys
t0 = time.perf_counter()
import torch
r = {"import_torch_s": time.perf_counter() - t0}
t = time.perf_counter()
torch.zeros(1, device="cuda").add_(1); torch.cuda.synchronize()
r["cuda_init_s"] = time.perf_counter() - t
t = time.perf_counter()
import flashcuda
r["import_flashcuda_s"] = time.perf_counter() - t
dt = getattr(torch, sys.argv[1])
shape = (1, 1024, 16, 128)
q, k, v = (torch.randn(shape, dtype=dt, device="cuda", requires_grad=True) for _ in range(3))
dout = torch.randn(shape, dtype=dt, device="cuda")
def first(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); out = fn(); torch.cuda.synchronize()
    return time.perf_counter() - t, out
def fwd():
    out = flashcuda.flash_attn_func(q, k, v, causal=True)
    return out[0] if isinstance(out, tuple) else out
r["first_fwd_s"], out = first(fwd)
r["second_fwd_s"], _ = first(fwd)
try:
    r["first_bwd_s"], _ = first(lambda: out.backward(dout, retain_graph=True))
    r["second_bwd_s"], _ = first(lambda: out.backward(dout, retain_graph=True))
except Exception as exc:
    r["bwd_error"] = f"{type(exc).__name__}: {exc}"[:400]
print(json.dumps(r))
"""


def _package_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _first_call_process(cache_dir: str, dtype_attr: str, timeout_s: float) -> dict:
    env = dict(os.environ)
    env["FLASHCUDA_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_package_root()), env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _FIRST_CALL_SCRIPT, dtype_attr], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"status": "failed", "process_s": wall, "returncode": proc.returncode,
                "error": exception_line(proc.stderr)}
    return {"status": "ok", "process_s": wall, **json.loads(lines[-1])}


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")


def exception_line(stderr: str, limit: int = 600) -> str:
    """The exception line of a child's traceback (the last line is often a compiler log's tail)."""
    lines = [x.strip() for x in stderr.replace("\x00", "").splitlines() if x.strip()]
    hits = [x for x in lines if _EXC_LINE.match(x)]
    return ((hits or lines or ["no output"])[-1])[:limit]


def measure_first_call(dtype: str = "bf16", timeout_s: float = 300.0) -> dict:
    dtype_attr = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    result: dict = {"shape": [1, 1024, 16, 128], "causal": True, "dtype": dtype,
                    "targets": {"cold_first_fwd_s": FIRST_CALL_TARGET_COLD_S,
                                "warm_first_fwd_s": FIRST_CALL_TARGET_WARM_S}}
    with tempfile.TemporaryDirectory(prefix="flashcuda-bench-cache-") as d:
        os.chmod(d, 0o700)
        for phase in ("cold", "warm"):
            try:
                result[phase] = _first_call_process(d, dtype_attr, timeout_s)
            except Exception as exc:  # noqa: BLE001 - a timeout or a crash is a result too
                result[phase] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    for phase, key in (("cold", "cold_first_fwd_s"), ("warm", "warm_first_fwd_s")):
        got = result[phase].get("first_fwd_s")
        result[phase]["meets_target"] = None if got is None else got <= result["targets"][key]
    return result


def _inputs(shape: dict, dtype: str, requires_grad: bool = False, seed: int = 2):
    import torch

    from .sweep import torch_dtype

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dims = (shape["batch"], shape["seqlen"], shape["nheads"], shape["headdim"])
    return [torch.randn(dims, dtype=torch_dtype(dtype), device="cuda", generator=gen)
            .requires_grad_(requires_grad) for _ in range(4)]


def measure_serving(impls: list[Impl], dtype: str = "bf16", n: int = 200) -> dict:
    import torch

    q, k, v, _ = _inputs(SERVING_SHAPE, dtype)
    scale = SERVING_SHAPE["headdim"] ** -0.5
    result: dict = {"shape": SERVING_SHAPE, "dtype": dtype, "mode": "forward, no grad", "impls": {}}
    for impl in impls:
        if impl.status != "ok":
            result["impls"][impl.name] = {"status": "absent"}
            continue
        try:
            with torch.no_grad(), impl.context():
                prepared = impl.prepare(q, k, v)
                stats = latency_percentiles(
                    lambda p=prepared, i=impl: i.forward(*p, SERVING_SHAPE["causal"], scale), n=n)
            entry = {"status": "ok", **stats}
        except Exception as exc:  # noqa: BLE001
            result["impls"][impl.name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:600]}
            continue
        try:  # the same call replayed from a CUDA graph: kernels alone, no host work
            with torch.no_grad(), impl.context():
                entry.update(graph_latency(
                    lambda p=prepared, i=impl: i.forward(*p, SERVING_SHAPE["causal"], scale), n=n))
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            entry["graph_error"] = f"{type(exc).__name__}: {exc}"[:600]
        result["impls"][impl.name] = entry
    return result


def naive_attention(q, k, v, causal: bool, scale: float):
    """The O(S²) pipeline: fp32 (B, H, S, S) scores, row softmax, P·V."""
    import torch

    qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(sk - sq + 1)
        s.masked_fill_(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vt).to(q.dtype).transpose(1, 2)


def _peak_extra(fn) -> int:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure_memory(flashcuda_impl: Impl, dtype: str = "bf16") -> dict:
    """Peak extra bytes, forward (no grad) and forward + backward, flashcuda against naive."""
    import torch

    sh = MEMORY_SHAPE
    scale = sh["headdim"] ** -0.5
    q, k, v, dout = _inputs(sh, dtype, requires_grad=True)
    result: dict = {"shape": sh, "dtype": dtype,
                    "scores_bytes_fp32": sh["batch"] * sh["nheads"] * sh["seqlen"] ** 2 * 4,
                    "io_bytes": q.numel() * q.element_size(), "impls": {}}
    impls = {"naive": lambda a, b, c: naive_attention(a, b, c, sh["causal"], scale)}
    if flashcuda_impl.status == "ok":
        impls["flashcuda"] = lambda a, b, c: flashcuda_impl.forward(a, b, c, sh["causal"], scale)
    else:
        result["impls"]["flashcuda"] = {"status": "absent"}
    for name, fn in impls.items():
        entry: dict = {"status": "ok"}
        try:
            with torch.no_grad():
                entry["fwd_peak_extra_bytes"] = _peak_extra(lambda f=fn: f(q, k, v))

            def fwd_bwd(f=fn):
                f(q, k, v).backward(dout)

            entry["fwd_bwd_peak_extra_bytes"] = _peak_extra(fwd_bwd)
        except Exception as exc:  # noqa: BLE001
            entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:600]}
        for t in (q, k, v):
            t.grad = None
        result["impls"][name] = entry
        torch.cuda.empty_cache()
    return result


def measure_long_context(flashcuda_impl: Impl, reference: Impl | None, timer: Timer,
                         dtype: str = "bf16") -> dict:
    import torch

    from .sweep import attention_flops, out_check

    sh = LONG_SHAPE
    s = sh["seqlen"]
    result: dict = {"shape": sh, "dtype": dtype, "naive_scores_bytes_fp32": s * s * 4}
    if flashcuda_impl.status != "ok":
        return {**result, "status": "absent"}
    scale = sh["headdim"] ** -0.5
    q, k, v, dout = _inputs(sh, dtype, requires_grad=True)
    try:
        def fwd():
            return flashcuda_impl.forward(q, k, v, sh["causal"], scale)

        with torch.no_grad():
            result["fwd_peak_extra_bytes"] = _peak_extra(fwd)
            out = fwd()
        result["finite"] = bool(out.isfinite().all())
        if reference is not None and reference.status == "ok":
            with torch.no_grad(), reference.context():
                ref = reference.forward(*reference.prepare(q, k, v), sh["causal"], scale)
            result["check"] = {"reference": reference.name, **out_check(out, ref, dtype)}
            del ref
        timing = timer(fwd)
        result["fwd_timing"] = timing.to_dict()
        result["fwd_tflops"] = tflops(
            attention_flops(1, 1, s, s, sh["headdim"], sh["causal"]), timing.median_ms)
        result["fwd_bwd_peak_extra_bytes"] = _peak_extra(lambda: fwd().backward(dout))
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {exc}"[:600]
    for t in (q, k, v):
        t.grad = None
    torch.cuda.empty_cache()
    return result


@contextlib.contextmanager
def decode_off():
    """ops.decode's kernels, packing and split off for the block (the decode extra's control)."""
    from ..ops import decode

    saved = decode.KERNEL, decode.PACK_GQA, decode.SPLIT_MIN_KEYS
    decode.KERNEL, decode.PACK_GQA, decode.SPLIT_MIN_KEYS = False, False, 2 ** 62
    try:
        yield
    finally:
        decode.KERNEL, decode.PACK_GQA, decode.SPLIT_MIN_KEYS = saved


@contextlib.contextmanager
def spans_on_device():
    """kvcache.SPANS_ON_DEVICE for the block (the paged arms: the decode kernels read the block
    table themselves)."""
    from .. import kvcache

    saved = kvcache.SPANS_ON_DEVICE
    kvcache.SPANS_ON_DEVICE = True
    try:
        yield
    finally:
        kvcache.SPANS_ON_DEVICE = saved


def paged_pool(k, v, page: int, seed: int = 1):
    """k / v (B, S, Hkv, D) as a shuffled pool of `page`-row pages and the block table that
    finds them: (pool_k, pool_v, table (B, S / page) int32); S a multiple of `page`."""
    import torch

    b, n = k.shape[:2]
    pages = b * n // page
    gen = torch.Generator(device=k.device).manual_seed(seed)
    perm = torch.randperm(pages, device=k.device, generator=gen)
    pools = []
    for t in (k, v):  # logical page j of entry e at pool[perm[e * (n / page) + j]]
        pool = torch.empty_like(t).view(pages, page, *t.shape[2:])
        pool[perm] = t.reshape(pages, page, *t.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], perm.view(b, n // page).to(torch.int32)


def graph_replay(step):
    """A no-argument call that replays `step` from a CUDA graph (timing.capture at its first
    call) and returns the graph's output."""
    state: dict = {}

    def replay():
        if "graph" not in state:
            state["graph"], state["out"] = capture(step, warmup=1)
        state["graph"].replay()
        return state["out"]

    return replay


def _decode_calls(impls: list[Impl], q, k, v, scale: float) -> dict:
    """name -> (context, no-argument forward returning (B, 1, H, D)) for the decode extra."""
    import torch.nn.functional as F

    import flashcuda

    def func():
        return flashcuda.flash_attn_func(q, k, v, softmax_scale=scale)

    calls = {"flashcuda_kvcache": (contextlib.nullcontext, lambda: flashcuda.flash_attn_with_kvcache(
                 q, k, v, softmax_scale=scale)),
             "flashcuda": (contextlib.nullcontext, func),
             "flashcuda_plain": (decode_off, func)}
    if q.is_cuda:  # the serving pattern: the step captured once, replayed (no host work per call)
        import torch

        lens = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
        calls["flashcuda_graph"] = (contextlib.nullcontext, graph_replay(
            lambda: flashcuda.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens,
                                                      softmax_scale=scale)))
        if k.shape[1] % DECODE_PAGE == 0:  # the same cache in shuffled pages, read in place
            pk, pv, table = paged_pool(k, v, DECODE_PAGE)

            def paged():
                return flashcuda.flash_attn_with_kvcache(q, pk, pv, cache_seqlens=lens,
                                                         block_table=table, softmax_scale=scale)

            calls["flashcuda_paged"] = (spans_on_device, paged)

            def paged_graph_step():  # (captured with the block table read on the device)
                with spans_on_device():
                    return paged()

            calls["flashcuda_paged_graph"] = (contextlib.nullcontext,
                                              graph_replay(paged_graph_step))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    for impl in impls:
        if impl.status != "ok" or impl.name in ("flashcuda", "sdpa_math", "triton_tutorial"):
            continue
        if impl.name.startswith("sdpa_"):
            calls[impl.name] = (impl.context, lambda: F.scaled_dot_product_attention(
                qt, kt, vt, scale=scale, enable_gqa=True).transpose(1, 2))
        else:  # fa2 / fa4 take GQA's (batch, seqlen, nheads_kv, headdim) keys as they are
            calls[impl.name] = (impl.context, lambda i=impl: i.forward(q, k, v, False, scale))
    return calls


def measure_decode(impls: list[Impl], timer: Timer, dtype: str = "bf16",
                   shape: dict | None = None, device: str = "cuda") -> dict:
    """Decoding's attention (`shape`, DECODE_SHAPE by default), flashcuda's two entry points
    against the peers."""
    import torch

    from ..reference import attention_ref
    from .sweep import out_check, torch_dtype

    sh = shape or DECODE_SHAPE
    h, hk, d = sh["nheads"], sh["nheads_kv"], sh["headdim"]
    scale = d ** -0.5
    result: dict = {"shape": sh, "dtype": dtype, "mode": "forward, no grad, seqlen_q 1",
                    "points": []}
    for b, n in ((b, n) for b in sh["batches"] for n in sh["cache_seqlens"]):
        gen = torch.Generator(device=device).manual_seed(n + b)
        q = torch.randn(b, 1, h, d, dtype=torch_dtype(dtype), device=device, generator=gen)
        k, v = (torch.randn(b, n, hk, d, dtype=q.dtype, device=device, generator=gen)
                for _ in range(2))
        kv_bytes = 2 * k.numel() * k.element_size()
        ref, _ = attention_ref(q[:1].double(), k[:1].double(), v[:1].double(), scale)
        point: dict = {"batch": b, "cache_seqlen": n, "kv_bytes": kv_bytes, "impls": {}}
        for name, (context, fn) in _decode_calls(impls, q, k, v, scale).items():
            try:
                with torch.no_grad(), context():
                    out = fn()
                    check = out_check(out[:1], ref, dtype)
                    timing = timer(fn)
                point["impls"][name] = {
                    "status": "ok", "timing": timing.to_dict(), "check": check,
                    "gbps": kv_bytes / (timing.median_ms * 1e-3) / 1e9}
            except Exception as exc:  # noqa: BLE001 - a peer without GQA decode is a result too
                point["impls"][name] = {"status": "failed",
                                        "error": f"{type(exc).__name__}: {exc}"[:600]}
        result["points"].append(point)
        del q, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    return result

"""Host-side cost of one flashcuda call (validation, dispatch, tensor maps, launch), on a GPU.

    python scripts/host_overhead.py [--shape B S H D] [--causal] [--profile]
    python scripts/host_overhead.py --decode [--shape B S H D] [--profile]

Every timing is taken while a spin kernel keeps the GPU busy, so a call only enqueues work and
never waits: what is measured is the host time that, when it exceeds the GPU time of a short
call, leaves the GPU idle (the † points of the bench summary). Prints per-call microseconds for
flashcuda and SDPA's flash backend (forward, forward with autograd, backward), then the cost of
the pieces of the forward path, then (--profile) a cProfile list of the forward and backward.
--decode: a decoding step instead (one query per entry over S cached keys, H query heads over
H / 4 KV heads, default 1 x 1024 x 32 x 128): flash_attn_func, flash_attn_with_kvcache and SDPA
flash, no grad (--profile: cProfile of the two flashcuda calls).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import time

import torch

import flashcuda
from flashcuda import validate
from flashcuda.ops import dispatch, fwd_sm90
from flashcuda.ops.call import FwdCall


def spin(ms: float = 300.0) -> None:
    rate = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 2_000_000
    torch.cuda._sleep(int(ms * rate))


def per_call_us(fn, calls: int = 200, reset=None) -> float:
    """Median host microseconds of fn() over `calls` calls, the GPU kept busy."""
    torch.cuda.synchronize()
    spin()
    samples = []
    for _ in range(calls):
        if reset is not None:
            reset()
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def profile(fn, calls: int, reset=None, top: int = 30) -> str:
    torch.cuda.synchronize()
    spin(1000.0)
    prof = cProfile.Profile()
    for _ in range(calls):
        if reset is not None:
            reset()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def _bare_launch(kernel, grid, block, args, smem):
    """A launch of `kernel` with its parameters packed once: only the driver call is timed."""
    import ctypes

    from flashcuda.jit import runtime

    packed, offsets = runtime.pack_args(kernel.name, args)
    params = ctypes.create_string_buffer(packed, len(packed))
    pointers = (ctypes.c_void_p * len(offsets))(*[ctypes.addressof(params) + o for o in offsets])
    lib, fn, stream = runtime._libcuda(), kernel.function_handle, runtime._current_stream_handle(0)
    grid = tuple(grid) + (1,) * (3 - len(grid))

    def launch():
        launch.keep = params  # the buffer lives as long as the closure
        return lib.cuLaunchKernel(fn, *grid, *block, smem, stream, pointers, None)

    return launch


def launch_costs() -> None:
    """What one launch costs by itself: the context check, the stream lookup, and a bare
    cuLaunchKernel of a 4-block kernel (prepared pointers, nothing packed per call) into the
    busy stream (behind the spin kernel) and into an idle side stream."""
    import ctypes

    import numpy as np

    from flashcuda.jit import KernelSpec, get_kernel, runtime

    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    kernel = get_kernel(KernelSpec.make("smoke_axpb", "common/smoke.cu"), x.device)
    args = (x, y, np.float32(1), np.float32(0), np.int64(1024))
    kernel.launch((4,), (256,), *args)  # loads the kernel, checks its parameter list
    packed, offsets = runtime.pack_args(kernel.name, args)
    params = ctypes.create_string_buffer(packed, len(packed))
    pointers = (ctypes.c_void_p * len(offsets))(*[ctypes.addressof(params) + o for o in offsets])
    lib, fn = runtime._libcuda(), kernel.function_handle
    side = torch.cuda.Stream()

    def bare(stream_handle):
        return lambda: lib.cuLaunchKernel(fn, 4, 1, 1, 256, 1, 1, 0, stream_handle, pointers,
                                          None)

    rows = [
        ("_make_current", lambda: runtime._make_current(0)),
        ("_current_stream_handle", lambda: runtime._current_stream_handle(0)),
        ("bare cuLaunchKernel, busy", bare(runtime._current_stream_handle(0))),
        ("bare cuLaunchKernel, idle", bare(side.cuda_stream)),
        ("kernel.launch (smoke)", lambda: kernel.launch((4,), (256,), *args)),
        ("ctypes no-op (cuCtxGetCurrent)", lambda: lib.cuCtxGetCurrent(
            ctypes.byref(ctypes.c_void_p()))),
    ]
    print("launch costs (host us per call)")
    for label, fn_ in rows:
        print(f"  {label:28s} {per_call_us(fn_, calls=300):8.1f}")
    torch.cuda.synchronize()


@contextlib.contextmanager
def _backward_fn(fn):
    """The eager autograd backward runs `fn` in place of _bwd_impl (on autograd's thread)."""
    from flashcuda.ops import attention

    orig = attention._EagerAttention.backward

    @staticmethod
    def backward(ctx, dout, dlse):
        return attention._backward(ctx, dout, dlse, backward_fn=fn)

    attention._EagerAttention.backward = backward
    try:
        yield
    finally:
        attention._EagerAttention.backward = orig


def autograd_costs(fc_out, dout, leaves, clear) -> None:
    """Where the backward's host time goes between `out.backward()` and the kernels: the engine's
    start (backward() called -> our backward body entered, on autograd's device thread), the body
    itself, and the engine's end (body returned -> backward() returns); then the same engine
    around a Function that does nothing (grads allocated, no launch), and torch.autograd.grad."""
    from flashcuda.ops import attention

    marks = {}
    inner = attention._bwd_impl

    def timed(*args):
        marks["enter"] = time.perf_counter()
        r = inner(*args)
        marks["leave"] = time.perf_counter()
        return r

    pre, body, post, total = [], [], [], []
    with _backward_fn(timed):
        torch.cuda.synchronize()
        spin()
        for _ in range(200):
            clear()
            t0 = time.perf_counter()
            fc_out.backward(dout, retain_graph=True)
            t1 = time.perf_counter()
            pre.append((marks["enter"] - t0) * 1e6)
            body.append((marks["leave"] - marks["enter"]) * 1e6)
            post.append((t1 - marks["leave"]) * 1e6)
            total.append((t1 - t0) * 1e6)
        torch.cuda.synchronize()

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, a, b, c, d):
            ctx.mark_non_differentiable(lse := torch.empty(q.shape[:3], device=q.device))
            ctx.save_for_backward(q, k, v)
            return torch.empty_like(q), lse

        @staticmethod
        def backward(ctx, dout_, dlse):
            q, k, v = ctx.saved_tensors
            return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None,
                    None, None)

    nothing_out = Nothing.apply(*leaves, 1.0, None, 0, False)[0]
    # cProfile of the body where it runs (autograd's device thread; a profiler is per thread)
    prof = cProfile.Profile()

    def profiled(*args):
        prof.enable()
        try:
            return inner(*args)
        finally:
            prof.disable()

    with _backward_fn(profiled):
        torch.cuda.synchronize()
        spin(1000.0)
        for _ in range(100):
            clear()
            fc_out.backward(dout, retain_graph=True)
        torch.cuda.synchronize()
    body_profile = io.StringIO()
    pstats.Stats(prof, stream=body_profile).sort_stats("tottime").print_stats(25)
    rows = [
        ("backward() -> body entered", statistics.median(pre)),
        ("body (_bwd_impl, engine thread)", statistics.median(body)),
        ("body returned -> backward() done", statistics.median(post)),
        ("backward() total", statistics.median(total)),
        ("no-op Function backward()", per_call_us(
            lambda: nothing_out.backward(dout, retain_graph=True), reset=clear)),
        ("torch.autograd.grad (flashcuda)", per_call_us(
            lambda: torch.autograd.grad(fc_out, leaves, dout, retain_graph=True))),
    ]
    print("autograd costs (host us per call, medians)")
    for label, v in rows:
        print(f"  {label:34s} {v:8.1f}")
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    torch.cuda.synchronize()
    spin()
    with tprofile(activities=[ProfilerActivity.CPU]) as tprof:
        for _ in range(20):
            clear()
            fc_out.backward(dout, retain_graph=True)
    torch.cuda.synchronize()
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    print("the backward body on autograd's thread, cProfile of 100 calls:")
    print(body_profile.getvalue())


def fwd_lse(q, k, v, causal: bool) -> torch.Tensor:
    return flashcuda.flash_attn_func(q, k, v, causal=causal, return_lse=True)[1]


def decode_step(b: int, s: int, h: int, d: int, with_profile: bool) -> None:
    """--decode: host time of one decoding step (module docstring)."""
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, max(1, h // 4), d, device="cuda", dtype=q.dtype) for _ in range(2))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    rows = [("flash_attn_func", lambda: flashcuda.flash_attn_func(q, k, v)),
            ("flash_attn_with_kvcache", lambda: flashcuda.flash_attn_with_kvcache(q, k, v)),
            ("sdpa flash", sdpa)]
    print(f"decode step {b} x {s} keys, {h} over {k.shape[2]} heads, d{d}, bf16, no grad: "
          "host us per call, GPU kept busy")
    with torch.no_grad():
        for label, fn in rows:
            fn()
            print(f"  {label:28s} {per_call_us(fn):8.1f}")
        if with_profile:
            for label, fn in rows[:2]:
                print(f"--- {label}")
                print(profile(fn, 500, top=22))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=None, metavar=("B", "S", "H", "D"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--decode", action="store_true",
                    help="a decoding step (one query per entry over S cached keys)")
    a = ap.parse_args()
    if a.decode:
        decode_step(*(a.shape or [1, 1024, 32, 128]), a.profile)
        return
    a.shape = a.shape or [32, 512, 16, 128]
    b, s, h, d = a.shape
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = mk(), mk(), mk()
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    leaves = (ql, kl, vl)

    def clear():
        for t in leaves:
            t.grad = None

    fc_out = flashcuda.flash_attn_func(ql, kl, vl, causal=a.causal)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        sd_out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
    fc_out.backward(dout, retain_graph=True)
    sd_out.backward(dout.transpose(1, 2), retain_graph=True)
    torch.cuda.synchronize()

    def sdpa_fwd():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2),
                                                                    k.transpose(1, 2),
                                                                    v.transpose(1, 2),
                                                                    is_causal=a.causal)

    def sdpa_clear():
        for t in (qt, kt, vt):
            t.grad = None

    rows = [
        ("flashcuda fwd (no grad)", lambda: flashcuda.flash_attn_func(q, k, v, causal=a.causal), None),
        ("flashcuda fwd (autograd)", lambda: flashcuda.flash_attn_func(ql, kl, vl, causal=a.causal), None),
        ("flashcuda bwd", lambda: fc_out.backward(dout, retain_graph=True), clear),
        ("sdpa flash fwd (no grad)", sdpa_fwd, None),
        ("sdpa flash bwd", lambda: sd_out.backward(dout.transpose(1, 2), retain_graph=True), sdpa_clear),
    ]
    print(f"shape {tuple(a.shape)} bf16 causal={a.causal}: host us per call, GPU kept busy")
    for label, fn, reset in rows:
        print(f"  {label:28s} {per_call_us(fn, reset=reset):8.1f}")

    # the forward path's pieces
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    wr = 0 if a.causal else None
    call = FwdCall(q, k, v, out, lse, d ** -0.5, None, wr)
    plan = fwd_sm90._plan(call)
    cfg = plan.cfg
    maps = fwd_sm90._maps(call, cfg)
    # the first pass's report buffer where a causal call runs two passes (fwd_sm90.two_passes)
    flags = ((torch.empty(plan.grid[0] * fwd_sm90.NAN_FLAG_BYTES, dtype=torch.uint8,
                          device="cuda"),) if plan.fixup is not None else ())
    handle = torch.cuda.current_stream().cuda_stream
    pieces = [
        ("validate.check_qkv", lambda: validate.check_qkv(q, k, v)),
        ("torch.empty out + lse", lambda: (torch.empty_like(q),
                                           torch.empty(b, h, s, device="cuda", dtype=torch.float32))),
        ("FwdCall(...)", lambda: FwdCall(q, k, v, out, lse, d ** -0.5, None, wr)),
        ("dispatch._plan_key", lambda: dispatch._plan_key(call, "fwd")),
        ("fwd_sm90._plan (hit)", lambda: fwd_sm90._plan(call)),
        ("bshd_map (memo hit)", lambda: fwd_sm90.bshd_map(q, cfg.block_m)),
        ("kernel.launch", lambda: plan.kernel.launch(plan.grid, (cfg.threads, 1, 1), *maps, out,
                                                     lse, *flags, *plan.constants,
                                                     shared_mem=cfg.smem_bytes)),
        ("plan.launch (prepared)", lambda: plan.launch(*(m.raw for m in maps), out.data_ptr(),
                                                       lse.data_ptr(),
                                                       *(f.data_ptr() for f in flags))),
        ("  same, bare cuLaunchKernel", _bare_launch(plan.kernel, plan.grid, (cfg.threads, 1, 1),
                                                     (*maps, out, lse, *flags, *plan.constants),
                                                     cfg.smem_bytes)),
        ("FwdCall(...).layouts()", lambda: FwdCall(q, k, v, out, lse, d ** -0.5, None,
                                                   wr).layouts()),
        ("flags: torch.empty per call", lambda: torch.empty(
            plan.grid[0] * fwd_sm90.NAN_FLAG_BYTES, dtype=torch.uint8, device="cuda")),
        ("flags: fwd_sm90.nan_flags", lambda: fwd_sm90.nan_flags(
            out.device, 0, handle, plan.grid[0] * fwd_sm90.NAN_FLAG_BYTES)),
        ("fwd_sm90.launch_plan", lambda: fwd_sm90.launch_plan(plan, call,
                                                              [m.raw for m in maps])),
        ("fwd_sm90.run", lambda: fwd_sm90.run(call)),
        ("dispatch.forward", lambda: dispatch.forward(call)),
        ("torch.cuda.current_stream", lambda: torch.cuda.current_stream(0)),
    ]
    print("forward pieces (host us per call)")
    for label, fn in pieces:
        print(f"  {label:28s} {per_call_us(fn, calls=300):8.1f}")
    launch_costs()

    # the backward path's pieces (the same call the autograd backward makes)
    from flashcuda.ops import bwd_sm90
    from flashcuda.ops.attention import _bwd_impl
    from flashcuda.ops.call import BwdCall

    o, lse_ = fc_out.detach(), fwd_lse(q, k, v, a.causal)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bcall = BwdCall(q, k, v, o, dout, lse_, dq, dk, dv, d ** -0.5, None, wr, False)
    bpieces = [
        ("_bwd_impl (no autograd)", lambda: _bwd_impl(dout, q, k, v, o, lse_, d ** -0.5, None, wr,
                                                      False)),
        ("dispatch.backward", lambda: dispatch.backward(bcall)),
        ("bwd_sm90.run", lambda: bwd_sm90.run(bcall)),
        ("dispatch._plan_key (bwd)", lambda: dispatch._plan_key(bcall, "bwd")),
    ]
    print("backward pieces (host us per call)")
    for label, fn in bpieces:
        print(f"  {label:28s} {per_call_us(fn, calls=200):8.1f}")
    autograd_costs(fc_out, dout, leaves, clear)
    if a.profile:
        print(profile(lambda: flashcuda.flash_attn_func(q, k, v, causal=a.causal), 200))
        print(profile(lambda: fc_out.backward(dout, retain_graph=True), 100, reset=clear))


if __name__ == "__main__":
    main()

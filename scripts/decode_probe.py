"""Where a decoding call's time goes (a diagnostic for the device): for the decode extra's
shape (32 query heads over 8 KV heads, d128, bf16, one query per entry), the median time of
flash_attn_func / flash_attn_with_kvcache / the split's parts, and the kernels one call launches
(torch.profiler), so a slow decode path shows which part is slow.

    PYTHONPATH=. python3 scripts/decode_probe.py [--batch 1] [--keys 65536] [--head-dim 128]
        [--heads 32/8] [--tune [--mma-only] [--paged PAGE]] [--ncu]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import flashcuda
from flashcuda.ops import attention as attn_mod
from flashcuda.ops import decode, fwd_decode


def ms(fn) -> float:
    with torch.no_grad():
        return do_bench(fn, warmup=25, rep=200, return_mode="median")


def kernels(fn, label: str) -> None:
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
    print(f"--- {label}: kernels of 5 calls")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12,
                                    max_name_column_width=70))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--keys", type=int, default=65536)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", default="32/8", metavar="H/HKV", help="query / KV heads")
    ap.add_argument("--tune", action="store_true",
                    help="only the decode kernels' time (per call, and as a CUDA-graph "
                         "replay: without the host's): the defaults, the lanes' STAGES x UNROLL "
                         "x WAVES, the tensor cores' MMA_STAGES x WAVES and COMBINE")
    ap.add_argument("--paged", type=int, default=0, metavar="PAGE",
                    help="with --tune: also the same keys in shuffled pages of PAGE rows (the "
                         "paged kernels, block table on the device): the lanes at stages 0 and "
                         "3, the tensor cores at 3, the defaults")
    ap.add_argument("--mma-only", action="store_true",
                    help="with --tune: the defaults and the tensor-core step's arms only")
    ap.add_argument("--ncu", action="store_true",
                    help="one call of the decode kernels and one of SDPA cuDNN between "
                         "cudaProfilerStart / Stop, after warm-up (for ncu --profile-from-start "
                         "off)")
    a = ap.parse_args()
    h, hk = map(int, a.heads.split("/"))
    d = a.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(a.batch, 1, h, d, dtype=torch.bfloat16, device="cuda", generator=g)
    k, v = (torch.randn(a.batch, a.keys, hk, d, dtype=q.dtype, device="cuda", generator=g)
            for _ in range(2))
    scale = d ** -0.5
    if a.ncu:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            calls = (lambda: fwd_decode.attention(q, k, v, scale),
                     lambda: F.scaled_dot_product_attention(qt, kt, vt, scale=scale,
                                                            enable_gqa=True))
            for fn in calls * 3:
                fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for fn in calls:
                fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        return
    if a.tune:  # each choice timed and checked against the float64 oracle (DESIGN.md §7's rule)
        print(f"# bf16 d{d}, {h} query heads over {hk} KV heads")
        from flashcuda.reference import attention_ref, max_error, rounding_floor

        ref, _ = attention_ref(q, k, v, softmax_scale=scale)
        base, _ = attention_ref(q, k, v, softmax_scale=scale, upcast=False)
        bound = 2 * max_error(base, ref) + rounding_floor(ref, q.dtype)
        kv_bytes = 2 * k.numel() * k.element_size()
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def replayed(fn) -> float:
            """fn's median time as a CUDA-graph replay: the GPU's time without the host's."""
            with torch.no_grad():
                fn()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
            return ms(graph.replay)

        for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                              ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    def sdpa():
                        return F.scaled_dot_product_attention(qt, kt, vt, scale=scale,
                                                              enable_gqa=True)
                    m = ms(sdpa)
                    replay = (f"  (graph replay {replayed(sdpa) * 1e3:.1f} us)"
                              if name == "SDPA cuDNN" else "")
                print(f"b{a.batch} {a.keys:6d} keys  {name:23s} {m * 1e3:7.1f} us  "
                      f"{kv_bytes / m / 1e6:6.0f} GB/s{replay}")
            except RuntimeError as exc:
                print(f"{name}: {exc}")

        def arm(label: str) -> None:
            """Time and check the decode kernels as the module's knobs now stand."""
            with torch.no_grad():
                err = max_error(fwd_decode.attention(q, k, v, scale)[0], ref)
            m = ms(lambda: fwd_decode.attention(q, k, v, scale))
            r = replayed(lambda: fwd_decode.attention(q, k, v, scale))  # (no host in it)
            c = fwd_decode.config_on(q.device, q.dtype, d, h // hk)
            kernel = fwd_decode.get_kernel(c.spec(), q.device)
            per_sm = kernel.resident_blocks(fwd_decode.THREADS, c.smem_bytes)
            splits = fwd_decode.plan_splits(a.batch, hk, -(-(h // hk) // c.rows), a.keys,
                                            fwd_decode.slots(kernel, c, sms), c.step)[0]
            print(f"b{a.batch} {a.keys:6d} keys  {label} ({per_sm} CTAs/SM, "
                  f"{kernel.attribute('NUM_REGS')} regs, {splits} pieces)  {m * 1e3:7.1f} us  "
                  f"(replay {r * 1e3:.1f})  {kv_bytes / m / 1e6:6.0f} GB/s  err {err:.2e} "
                  f"{'ok' if err <= bound else 'WRONG'} (bound {bound:.2e})")

        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        knobs = ("UNROLL", "STAGES", "WAVES", "MMA", "MMA_STAGES", "COMBINE", "MIN_SPLIT_KEYS",
                 "COMBINE_QUADS", "CTAS_PER_SM")
        saved = {n: getattr(fwd_decode, n) for n in knobs}

        def setting(**kw: int) -> None:
            for n in knobs:
                setattr(fwd_decode, n, kw.get(n.lower(), saved[n]))
            fwd_decode._plans.clear()  # (MIN_SPLIT_KEYS is not in the plans' key)

        arm("defaults")
        if not a.mma_only:  # the CUDA-core lanes (FLASHCUDA_DECODE_MMA=0): their pipeline shape
            for stages in (0, 2, 3, 4):
                for unroll in (2, 4):
                    for waves in (1, 2):
                        setting(mma=0, unroll=unroll, stages=stages, waves=waves)
                        arm(f"lanes stages {stages} unroll {unroll} waves {waves}")
        # the tensor-core step: its pipeline depth and waves, the combine after the split (0) or
        # as its programmatic dependent (1)
        for stages in (2, 3, 4, 5, 6):
            for waves in (1, 2):
                for combine in (1, 0) if stages == saved["MMA_STAGES"] and waves == 1 else (1,):
                    setting(mma=1, mma_stages=stages, waves=waves, combine=combine)
                    arm(f"mma stages {stages} waves {waves} combine {combine}")
        for keys in (512, 1024, 2048):  # fewer, longer pieces (the combine's work per column)
            setting(min_split_keys=keys)
            arm(f"defaults, pieces of at least {keys} keys")
        for per_sm in (1, 2):  # the split aiming at fewer CTAs per SM than it holds
            setting(ctas_per_sm=per_sm)
            arm(f"defaults, the split counting {per_sm} CTA(s) per SM")
        setting(ctas_per_sm=0, mma_stages=5)  # session 47's defaults (every CTA an SM holds)
        arm("defaults, every CTA per SM, mma stages 5")
        setting(combine_quads=1 - saved["COMBINE_QUADS"])  # the other combine (quads / columns)
        arm(f"defaults, the combine {'per column' if saved['COMBINE_QUADS'] else 'by quads'}")
        setting()
        if a.paged:
            from flashcuda.bench.extras import paged_pool

            assert a.keys % a.paged == 0, "--paged: keys must be a multiple of PAGE"
            *pools, table = paged_pool(k, v, a.paged)
            for label, kw in (("lanes stages 0", dict(mma=0, stages=0)),
                              ("lanes stages 3", dict(mma=0, stages=3)),
                              ("mma stages 3", dict(mma=1, mma_stages=3)),
                              ("defaults", {})):
                setting(**kw)
                with torch.no_grad():
                    err = max_error(fwd_decode.attention(q, *pools, scale, None, None, None,
                                                         table)[0], ref)
                m = ms(lambda: fwd_decode.attention(q, *pools, scale, None, None, None, table))
                print(f"b{a.batch} {a.keys:6d} keys  paged ({a.paged} rows) {label}  "
                      f"{m * 1e3:7.1f} us  {kv_bytes / m / 1e6:6.0f} GB/s  err {err:.2e} "
                      f"{'ok' if err <= bound else 'WRONG'} (bound {bound:.2e})")
            setting()
        return
    calls = {"split_pieces": 0, "run": 0}
    run0, split0 = attn_mod._fwd_impl, decode.split_pieces

    def run(*args):
        calls["run"] += 1
        print("  run: q", tuple(args[0].shape), "k", tuple(args[1].shape), "k strides",
              args[1].stride())
        return run0(*args)

    def split(*args):
        calls["split_pieces"] += 1
        return split0(*args)

    attn_mod._fwd_impl, decode.split_pieces = run, split
    with torch.no_grad():
        print("func call:")
        flashcuda.flash_attn_func(q, k, v, softmax_scale=scale)
        print("kvcache call:")
        flashcuda.flash_attn_with_kvcache(q, k, v, softmax_scale=scale)
    attn_mod._fwd_impl, decode.split_pieces = run0, split0
    print("calls", calls, "sms", decode._sms(q.device),
          "chunk", decode.split_chunk(a.keys, hk, decode._sms(q.device)))

    rows = decode.packed_gqa(q, hk)
    chunk = decode.split_chunk(a.keys, hk, decode._sms(q.device)) if a.batch == 1 else 0
    t = {"func": lambda: flashcuda.flash_attn_func(q, k, v, softmax_scale=scale),
         "kvcache": lambda: flashcuda.flash_attn_with_kvcache(q, k, v, softmax_scale=scale),
         "decode kernels": lambda: fwd_decode.attention(q, k, v, scale),
         "packed, one call": lambda: run0(rows, k, v, scale, None, None),
         "unpacked, one call": lambda: run0(q, k, v, scale, None, None)}
    if chunk:
        whole = a.keys // chunk
        qs = rows.expand(whole, *rows.shape[1:]).contiguous()
        kw, vw = (x[0, :whole * chunk].unflatten(0, (whole, chunk)) for x in (k, v))
        t["split: whole pieces"] = lambda: run0(qs, kw, vw, scale, None, None)
        if a.keys > whole * chunk:
            kt, vt = k[:, whole * chunk:], v[:, whole * chunk:]
            t["split: tail"] = lambda: run0(rows, kt, vt, scale, None, None)
        t["split: all"] = lambda: decode.split_pieces(rows, k, v, scale, chunk, run0)
    kv_bytes = 2 * k.numel() * k.element_size()
    for name, fn in t.items():
        m = ms(fn)
        print(f"{name:24s} {m * 1e3:9.1f} us  {kv_bytes / m / 1e6:8.0f} GB/s of the cache")
    kernels(t["func"], "func")
    kernels(t["kvcache"], "kvcache")


if __name__ == "__main__":
    main()

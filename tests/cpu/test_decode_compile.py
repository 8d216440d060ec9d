"""The decode kernels (flashcuda/ops/fwd_decode.py) on the CPU lane: every variant compiles for
sm_80 and sm_90a within 255 registers and without spills, and the host's choices (config,
split plan, which calls the kernels take) answer correctly without a GPU."""

from __future__ import annotations

import pytest
import torch

from flashcuda.jit import compile_spec
from flashcuda.ops import fwd_decode
from flashcuda.ops.call import SMEM_OPTIN


def _all_variants():
    return [(spec, arch) for spec, archs in fwd_decode.variants() for arch in archs]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "arch"), _all_variants(),
                         ids=[f"{s.name}-{a}" for s, a in _all_variants()])
def test_decode_variant_compiles_without_spills(spec, arch):
    r = compile_spec(spec, arch).resources()[spec.entry_name]
    assert not r.spills, (spec.name, arch, r)
    assert r.registers <= 255, (spec.name, arch, r)


def _pipelined():
    """The 3-stage pipe at every bucket, 1 and 8 rows, plain and paged (the registry's slow test
    compiles the rest); and the depths the GPU tests try (2 / 4 keys per slot x 2 / 4 stages)
    at their shapes."""
    cfgs = [fwd_decode.DecodeConfig(torch.bfloat16, d, r, 0, 3, p, mma=0)
            for d in fwd_decode.HEAD_DIMS for r in (1, 8) for p in (False, True)]
    cfgs += [fwd_decode.DecodeConfig(torch.bfloat16, d, r, u, st, mma=0)
             for d, r in ((64, 8), (128, 4), (256, 8)) for u in (2, 4) for st in (2, 4)]
    return cfgs


@pytest.mark.slow
@pytest.mark.parametrize("cfg", _pipelined(), ids=lambda c: c.name)
def test_pipelined_variant_compiles_without_spills(cfg):
    """The cp.async pipeline's variants the tune tries (FC_STAGES 2-4): no spills, no static
    shared memory (SplitSmem overlays the stages), and the host's dynamic size holds SplitSmem
    (sizeof of the no-pipeline variant's static SplitSmem)."""
    spec = cfg.spec()
    plain = fwd_decode.DecodeConfig(cfg.dtype, cfg.head_dim, cfg.rows, cfg.unroll, 0, cfg.paged,
                                    mma=0)
    for arch in fwd_decode.ARCHS:
        r = compile_spec(spec, arch).resources()[spec.entry_name]
        assert not r.spills and r.registers <= 255, (spec.name, arch, r)
        assert r.shared_bytes == 0, (spec.name, arch, r)
        plain_smem = compile_spec(plain.spec(), arch).resources()[plain.spec().entry_name]
        assert plain_smem.shared_bytes == cfg.split_smem_bytes <= cfg.smem_bytes


def test_pipeline_sizes():
    """Dynamic shared memory: 0 without a pipeline; else the stages' 16-byte K and V pieces of
    128 threads, or SplitSmem where that is larger; stage 1 is refused."""
    cfg = fwd_decode.DecodeConfig(torch.bfloat16, 128, 4, 4, 3, mma=0)
    assert cfg.smem_bytes == 3 * 4 * 2 * 128 * 16 and cfg.name.endswith("_u4_p3_cd")
    assert fwd_decode.DecodeConfig(torch.bfloat16, 128, 4, 4, 0).smem_bytes == 0
    wide = fwd_decode.DecodeConfig(torch.float16, 64, 8, 2, 2, mma=0)  # SplitSmem 33,856 > 16,384
    assert wide.smem_bytes == wide.split_smem_bytes == 4 * (16 * 8 * 66 + 16)
    with pytest.raises(ValueError, match="stages"):
        fwd_decode.DecodeConfig(torch.float16, 64, 8, 2, 1)


def test_decode_representative_variants_compile():
    """The fast subset: the decode extra's kernel (bf16 d128, 4 rows), the widest (d256, 8
    rows) and a combine, both targets."""
    specs = [fwd_decode.config_for(torch.bfloat16, 128, 4).spec(),
             fwd_decode.config_for(torch.float16, 256, 16).spec(),
             fwd_decode.combine_spec(torch.bfloat16)]
    for spec in specs:
        for arch in fwd_decode.ARCHS:
            r = compile_spec(spec, arch).resources()[spec.entry_name]
            assert not r.spills, (spec.name, arch, r)


def test_dependent_combine_variants_compile():
    """FLASHCUDA_DECODE_COMBINE=1 (the default; sm_90): the split kernels at the defaults and the
    widest (d256, 8 rows, paged), and the combine kernel — both targets, no spills; the names
    say it (_cd); 0 (after the split) keeps the plain names."""
    specs = [c.spec() for c in (
        fwd_decode.DecodeConfig(torch.bfloat16, 128, 4, combine=1),
        fwd_decode.DecodeConfig(torch.float16, 256, 8, 2, 2, True, combine=1),
        fwd_decode.DecodeConfig(torch.bfloat16, 64, 1, 4, 0, combine=1, mma=0))]
    specs.append(fwd_decode.combine_spec(torch.bfloat16, 1, 0))
    for spec in specs:
        assert spec.name.endswith("_cd") and dict(spec.defines).get("FC_COMBINE") == "1"
        for arch in fwd_decode.ARCHS:
            r = compile_spec(spec, arch).resources()[spec.entry_name]
            assert not r.spills and r.registers <= 255, (spec.name, arch, r)
    after = fwd_decode.DecodeConfig(torch.bfloat16, 128, 4, combine=0).spec()
    assert "FC_COMBINE" not in dict(after.defines) and not after.name.endswith("_cd")
    assert fwd_decode.combine_spec(torch.bfloat16, 0, 0).name == "flash_decode_combine_bf16"
    quads = fwd_decode.combine_spec(torch.bfloat16, 1, quads=1)
    assert quads.name == "flash_decode_combine_bf16_cd_q4"
    assert dict(quads.defines).get("FC_COMBINE_QUADS") == "1"
    assert "FC_COMBINE_QUADS" not in dict(fwd_decode.combine_spec(torch.bfloat16, 1, 0).defines)
    assert fwd_decode.combine_spec(torch.bfloat16, 1).name == quads.name  # (the default)
    for spec in (fwd_decode.combine_spec(torch.float16, 0, quads=0),  # (the A/B combine)
                 fwd_decode.combine_spec(torch.float16, 0, quads=1)):
        for arch in fwd_decode.ARCHS:
            r = compile_spec(spec, arch).resources()[spec.entry_name]
            assert not r.spills, (spec.name, arch, r)


@pytest.mark.parametrize("paged", [False, True], ids=["plain", "paged"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mma_variants_compile(head_dim, paged):
    """FLASHCUDA_DECODE_MMA=1 (the default up to d128) at 2 stages: 1 / 4 / 8 rows, both dtypes
    and targets, no spills within the launch bounds (3 CTAs per SM on sm_90a unpaged, else 2), no
    static shared memory; the stages (64 KB at d128) sized for SplitSmem too; the 256 bucket and
    a registers path keep the lanes' step."""
    for dtype in fwd_decode.DTYPES:
        for rows in (1, 4, 8):
            cfg = fwd_decode.DecodeConfig(dtype, head_dim, rows, 0, 2, paged, mma=1)
            assert cfg.name.endswith("_mma_p2" + "_pg" * paged + "_cd") and cfg.step == 64
            assert cfg.smem_bytes == max(2 * 4 * 2 * 16 * head_dim * 2, cfg.split_smem_bytes)
            spec = cfg.spec()
            for arch in fwd_decode.ARCHS:
                r = compile_spec(spec, arch).resources()[spec.entry_name]
                per_sm = 3 if arch == "sm_90a" and not paged else 2
                assert not r.spills and r.registers * 128 * per_sm <= 65536, (spec.name, arch, r)
                assert r.shared_bytes == 0, (spec.name, arch, r)
    with pytest.raises(ValueError, match="mma"):
        fwd_decode.DecodeConfig(torch.bfloat16, 256, 4, 0, 2, mma=1)
    with pytest.raises(ValueError, match="mma"):
        fwd_decode.DecodeConfig(torch.bfloat16, 128, 4, 0, 0, mma=1)


def test_stream_buffers_kept_per_key_and_thread():
    """call.StreamBuffers (the sm90 forward's NaN flags): the same buffer for one thread's calls
    with one key, grown when a call needs more; another for another key or thread. (Fresh per
    call in a capture: the GPU test
    test_nan_flag_buffers_kept_per_thread_and_stream_fresh_in_a_capture.)"""
    import threading

    from flashcuda.ops.call import StreamBuffers

    cpu = torch.device("cpu")
    bufs = StreamBuffers(torch.int32)
    first = bufs.get(cpu, (cpu, 7), 64)
    assert first.dtype == torch.int32 and first.numel() == 64
    assert bufs.get(cpu, (cpu, 7), 16) is first
    grown = bufs.get(cpu, (cpu, 7), 100)
    assert grown.numel() == 100 and bufs.get(cpu, (cpu, 7), 64) is grown
    assert bufs.get(cpu, (cpu, 8), 64) is not grown
    assert bufs.kept() == [grown, bufs.get(cpu, (cpu, 8), 1)]
    other: list = []
    t = threading.Thread(target=lambda: other.append((bufs.get(cpu, (cpu, 7), 64), bufs.kept())))
    t.start()
    t.join()
    assert other[0][0] is not grown and len(other[0][1]) == 1
    assert StreamBuffers(torch.uint8).get(cpu, (0, 0), 5).dtype == torch.uint8


def test_the_pipeline_fits_the_devices_shared_memory(launches, monkeypatch):
    """The tensor cores' and the lanes' pipelines as deep as a block's shared memory allows:
    5 stages at d128 (160 KB) on an H100 / H200 (227 KB) and an A100 (163 KB), 3 stages
    (96 KB) on an sm_86 / sm_89 (99 KB); d64 keeps 5 (80 KB); never below 2; the launch says so."""
    fit = fwd_decode.fit_smem
    d128 = fwd_decode.DecodeConfig(torch.bfloat16, 128, 4, mma=1, stages=5)
    d64 = fwd_decode.DecodeConfig(torch.bfloat16, 64, 4, mma=1, stages=5)
    assert fit(d128, SMEM_OPTIN) == d128 and fit(d128, 166912) == d128
    assert fit(d128, 101376).stages == 3 and fit(d128, 101376).smem_bytes <= 101376
    assert fit(d64, 101376) == d64
    assert fit(d128, 1).stages == 2 and fit(fwd_decode.DecodeConfig(
        torch.bfloat16, 128, 4, 8, 6, mma=0), 101376).smem_bytes <= 101376
    monkeypatch.setattr(fwd_decode, "MMA_STAGES", 5)
    monkeypatch.setattr(fwd_decode, "_smem_optin", lambda device: 101376)
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 4096, 8, 128, dtype=torch.bfloat16)
    fwd_decode.attention(q, k, k, 0.1)
    assert "_mma_p3" in launches[0][0]


def test_max_splits_fit_the_combine():
    """The combine holds one piece per thread (the .cu's kMaxSplits = kThreads)."""
    assert fwd_decode.MAX_SPLITS <= fwd_decode.THREADS
    from flashcuda.jit import KERNELS_DIR

    source = (KERNELS_DIR / fwd_decode.SOURCE).read_text()
    assert "constexpr int kMaxSplits = kThreads;" in source


def test_decode_config_buckets_and_rows():
    """The buckets, rows per CTA and keys per step: the tensor cores' 4 warps x 16 keys up to
    d128 at MMA_STAGES, the lanes' slots at 256 (and with MMA=0); the registry holds the
    defaults, with the combine after the split (sm_80) and as its dependent (sm_90a)."""
    cfg = fwd_decode.config_for(torch.bfloat16, 72, 6)
    assert (cfg.head_dim, cfg.rows, cfg.slots, cfg.step) == (128, 8, 4, 64)
    assert cfg.mma and cfg.stages == fwd_decode.MMA_STAGES
    assert fwd_decode.config_for(torch.float16, 8, 1).head_dim == 64
    wide = fwd_decode.config_for(torch.float16, 256, 32)
    assert wide.rows == 8 and not wide.mma and wide.stages == fwd_decode.STAGES  # 4 row blocks
    lanes = fwd_decode.DecodeConfig(torch.bfloat16, 128, 8, mma=0)
    assert lanes.slots == 8 and lanes.step == 8 * min(fwd_decode.UNROLL, 4)  # 8 rows: <= 4 keys
    assert fwd_decode.DecodeConfig(torch.float16, 64, 2, mma=0).slots == 16
    variants = fwd_decode.variants()
    names = [s.name for s, _ in variants]
    assert len(names) == len(set(names)) == 2 * (2 * 3 * 4 * 2 + 2)
    assert {a for _, archs in variants for a in archs} == set(fwd_decode.ARCHS)
    assert all(("_cd" in s.name) == (a == ("sm_90a",)) for s, a in variants)
    assert all(s.name.endswith("_q4") == bool(fwd_decode.COMBINE_QUADS)  # (the default combine)
               for s, _ in variants if "_combine_" in s.name)


@pytest.mark.parametrize("batch,heads_kv,keys", [(1, 8, 65536), (8, 8, 16384), (1, 8, 1000),
                                                 (64, 32, 4096), (1, 1, 1), (3, 2, 77)])
def test_split_plan_covers_every_key_once(batch, heads_kv, keys):
    """Pieces of `chunk` keys (a multiple of the CTA's step of 32 keys) cover [0, keys) with none empty,
    at most MAX_SPLITS, none shorter than MIN_SPLIT_KEYS unless there is one piece, and enough
    CTAs for the GPU where the keys allow."""
    step, slots = 32, 3 * 132
    splits, chunk = fwd_decode.plan_splits(batch, heads_kv, 1, keys, slots, step)
    assert chunk % step == 0
    assert (splits - 1) * chunk < keys <= splits * chunk
    assert 1 <= splits <= fwd_decode.MAX_SPLITS
    assert splits == 1 or chunk >= fwd_decode.MIN_SPLIT_KEYS
    ctas = batch * heads_kv * splits
    assert splits == 1 or ctas <= slots  # never a part-full last wave of its own making
    assert ctas >= min(slots, batch * heads_kv * max(1, keys // fwd_decode.MIN_SPLIT_KEYS)) * 0.5


def test_split_plan_fills_one_wave_at_batch_one():
    """Batch 1 x 64k keys over 8 KV heads with 3 CTAs per SM on 132 SMs: 49 pieces per head,
    392 of the 396 CTAs the GPU holds (session 41's 4-per-SM aim made 528: a second wave of
    132 that ran as long as the first)."""
    assert fwd_decode.plan_splits(1, 8, 1, 65536, 3 * 132, 32) == (49, 1344)


def test_can_take_needs_a_gpu_and_the_layout():
    q = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 100, 8, 128, dtype=torch.bfloat16)
    assert "CUDA" in fwd_decode.can_take(q, k, k)


class _FakeKernel:
    """What PreparedLaunch reads of a CompiledKernel before any driver call."""

    name = "fake"
    device_index = -1  # CPU tensors' get_device()
    abi_checked = True
    smem_limit = 1 << 20

    def resident_blocks(self, threads, dynamic_smem=0):
        return 4


def fake_slots(cfg) -> int:
    """The split's slots for `cfg` on the `launches` fixture's GPU (fwd_decode.slots of a fake
    kernel holding 4 CTAs per SM, 132 SMs)."""
    return fwd_decode.slots(_FakeKernel(), cfg, 132)


@pytest.fixture
def launches(monkeypatch):
    """attention() on CPU tensors with fake kernels (4 CTAs per SM, 132 SMs): each launch's
    (kernel name, grid, parameter bytes) recorded instead of run."""
    from flashcuda.jit import runtime

    launched = []

    def capture(self, *values, stream=None, handle=None):
        params, _, _ = self._buffers()
        self.head.pack_into(params, 0, *values)
        launched.append((self.kernel.name, self.grid, bytes(params)[:self.size]))

    monkeypatch.setattr(fwd_decode, "get_kernel", lambda spec, device: type(
        "K", (_FakeKernel,), {"name": spec.name})())
    monkeypatch.setattr(fwd_decode, "launch_stream", lambda index: 0)
    monkeypatch.setattr(fwd_decode, "_device_ok", lambda device: (True, 132))
    monkeypatch.setattr(fwd_decode, "COMBINE", 0)  # (the plain launches: no driver attributes)
    monkeypatch.setattr(fwd_decode, "_smem_optin", lambda device: SMEM_OPTIN)  # (an H100 / H200)
    monkeypatch.setattr(runtime.PreparedLaunch, "__call__", capture)
    fwd_decode._plans.clear()
    yield launched
    fwd_decode._plans.clear()


@pytest.mark.parametrize("keys,seqused", [(100, False), (5000, True)])
def test_launch_packs_the_kernels_parameter_lists(launches, keys, seqused):
    """attention()'s prepared launches (a plan per layout) hand the split kernel and the combine
    exactly the parameter bytes of their signatures in flash_decode.cu (pack_args of the
    arguments in the kernels' order), for one piece and for many, with and without seqused;
    a second call of the same layout reuses the plan and packs its own pointers."""
    import numpy as np

    from flashcuda.jit import runtime

    launched = launches
    q = torch.randn(2, 1, 12, 64, dtype=torch.bfloat16)
    k = torch.randn(2, keys + 3, 2, 64, dtype=torch.bfloat16)[:, :keys]
    v = torch.randn(2, keys, 2, 64, dtype=torch.bfloat16)
    used = torch.tensor([keys, 1], dtype=torch.int32) if seqused else None
    for _ in range(2):
        launched.clear()
        out, lse = fwd_decode.attention(q, k, v, 0.3, used)
        assert out.shape == q.shape and lse.shape == (2, 12, 1)
        cfg = fwd_decode.config_for(q.dtype, 64, 6)
        splits, chunk = fwd_decode.plan_splits(2, 2, 1, keys, fake_slots(cfg), cfg.step)
        i64, i32 = np.int64, np.int32
        layout = (*(i64(q.stride(d)) for d in range(3)), *(i64(t.stride(d)) for t in (k, v)
                                                              for d in range(3)),
                  i64(out.stride(1)), i64(out.stride(2)), i64(0), i32(0), i32(2), i32(1),
                  i32(0), i32(keys), i32(12), i32(2), i32(64), i32(splits), i32(chunk),
                  np.float32(0.3 * 1.4426950408889634))
        assert len(launched) == (2 if splits > 1 else 1)
        name, grid, params = launched[0]
        assert name == cfg.spec().name and grid == (splits, 2, 2)
        parts = [0, 0]
        if splits > 1:  # the partials' pointers, as the call packed them
            parts = [int.from_bytes(params[40:48], "little"), int.from_bytes(params[48:56],
                                                                              "little")]
            assert all(parts)
        want, _ = runtime.pack_args("split", (q, k, v, out, lse, *(np.uint64(p) for p in parts),
                                              used, None, None, None, *layout))
        assert params == want
        if splits > 1:
            name, grid, params = launched[1]
            assert name == fwd_decode.combine_spec(q.dtype).name and grid == (24, 1, 1)
            want, _ = runtime.pack_args("combine", (*(np.uint64(p) for p in parts), out, lse,
                                                    i64(out.stride(1)), i64(out.stride(2)),
                                                    i32(2), i32(12), i32(64), i32(splits)))
            assert params == want
    assert len(fwd_decode._plans) == 1


def test_paged_launch_packs_the_table_and_the_spans(launches):
    """A paged call with left padding: the paged kernel (FC_PAGED), split over the block table's
    positions (blocks x page_size), gets seqused / seqstart / block_table's pointers, the table's
    row stride and the page size, and k / v's page strides as their batch strides."""
    import numpy as np

    from flashcuda.jit import runtime

    launched = launches
    q = torch.randn(3, 1, 8, 128, dtype=torch.float16)
    k, v = (torch.randn(40, 16, 2, 128, dtype=torch.float16) for _ in range(2))  # 40 pages of 16
    table = torch.randint(0, 40, (3, 12), dtype=torch.int32)  # 192 positions per entry
    used = torch.tensor([190, 5, 0], dtype=torch.int32)
    start = torch.tensor([3, 0, 0], dtype=torch.int32)
    fwd_decode.attention(q, k, v, 0.5, used, start, None, table)
    cfg = fwd_decode.config_for(q.dtype, 128, 4, paged=True)
    assert cfg.name.endswith("_pg") and dict(cfg.spec().defines)["FC_PAGED"] == "1"
    splits, chunk = fwd_decode.plan_splits(3, 2, 1, 192, fake_slots(cfg), cfg.step)
    name, grid, params = launched[0]
    assert name == cfg.name and grid == (splits, 2, 3)
    parts = [int.from_bytes(params[40:48], "little"), int.from_bytes(params[48:56], "little")]
    i64, i32 = np.int64, np.int32
    layout = (*(i64(q.stride(d)) for d in range(3)), *(i64(t.stride(d)) for t in (k, v)
                                                          for d in range(3)),
              i64(8 * 128), i64(128), i64(12), i32(16), i32(3), i32(1), i32(0), i32(192),
              i32(8), i32(2), i32(128), i32(splits), i32(chunk),
              np.float32(0.5 * 1.4426950408889634))
    out_at = int.from_bytes(params[24:32], "little")
    lse_at = int.from_bytes(params[32:40], "little")
    want, _ = runtime.pack_args("split", (q, k, v, np.uint64(out_at), np.uint64(lse_at),
                                          *(np.uint64(p) for p in parts), used, start, None,
                                          table, *layout))
    assert params == want


def test_decode_knobs_from_the_environment(monkeypatch):
    """FLASHCUDA_DECODE_STAGES / _UNROLL / _WAVES (A/B runs, recorded in a bench record's
    kernel_env) set the module's defaults at import; a value outside the allowed set raises,
    naming the variable."""
    from flashcuda._env import choice

    monkeypatch.setenv("FLASHCUDA_DECODE_STAGES", "3")
    assert choice("FLASHCUDA_DECODE_STAGES", 0, (0, 2, 3)) == 3
    monkeypatch.delenv("FLASHCUDA_DECODE_STAGES")
    assert choice("FLASHCUDA_DECODE_STAGES", 0, (0, 2, 3)) == 0
    for bad in ("1", "x", "-2"):
        monkeypatch.setenv("FLASHCUDA_DECODE_STAGES", bad)
        with pytest.raises(ValueError, match="FLASHCUDA_DECODE_STAGES"):
            choice("FLASHCUDA_DECODE_STAGES", 0, (0, 2, 3))
    import os
    import subprocess
    import sys

    env = {**os.environ, "FLASHCUDA_DECODE_STAGES": "4", "FLASHCUDA_DECODE_UNROLL": "2",
           "FLASHCUDA_DECODE_WAVES": "2", "FLASHCUDA_DECODE_COMBINE": "0",
           "FLASHCUDA_DECODE_MMA": "0", "FLASHCUDA_DECODE_MMA_STAGES": "4",
           "FLASHCUDA_DECODE_COMBINE_QUADS": "0", "FLASHCUDA_DECODE_CTAS_PER_SM": "2"}
    got = subprocess.run([sys.executable, "-c", "from flashcuda.ops import fwd_decode as f; "
                          "print(f.STAGES, f.UNROLL, f.WAVES, f.COMBINE, f.MMA, f.MMA_STAGES, "
                          "f.COMBINE_QUADS, f.CTAS_PER_SM)"],
                         env=env, capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    assert got == ["4", "2", "2", "0", "0", "4", "0", "2"]
    from flashcuda.bench.command import KERNEL_ENV

    assert {"FLASHCUDA_DECODE_STAGES", "FLASHCUDA_DECODE_UNROLL", "FLASHCUDA_DECODE_WAVES",
            "FLASHCUDA_DECODE_COMBINE", "FLASHCUDA_DECODE_MMA",
            "FLASHCUDA_DECODE_MMA_STAGES", "FLASHCUDA_DECODE_COMBINE_QUADS",
            "FLASHCUDA_DECODE_CTAS_PER_SM"} <= set(KERNEL_ENV)


@pytest.mark.parametrize("resident,per_sm,waves,want", [(2, 0, 1, 264), (2, 1, 1, 132),
                                                        (3, 2, 2, 528), (1, 2, 1, 132),
                                                        (0, 0, 1, 132)])
def test_slots_count_ctas_per_sm(monkeypatch, resident, per_sm, waves, want):
    """slots(): the CTAs an SM holds (at least 1), capped by CTAS_PER_SM when set, x SMs x WAVES;
    the plan's pieces follow it."""
    kernel = type("K", (), {"resident_blocks": lambda self, threads, smem: resident})()
    monkeypatch.setattr(fwd_decode, "CTAS_PER_SM", per_sm)
    monkeypatch.setattr(fwd_decode, "WAVES", waves)
    cfg = fwd_decode.config_for(torch.bfloat16, 64, 8)
    got = fwd_decode.slots(kernel, cfg, 132)
    assert got == want
    aim = min(want // 8, 16384 // fwd_decode.MIN_SPLIT_KEYS)  # 8 entries' pieces in the slots
    assert aim * 0.8 < fwd_decode.plan_splits(8, 1, 1, 16384, got, cfg.step)[0] <= aim


def test_several_query_rows_are_entries_of_their_own(launches):
    """Sq = 3 query rows per sequence, causal: 6 entries (grid z, the partials, the combine's
    grid), q's row stride and out's row stride as the per-entry strides, seqlen_q and causal
    packed; lse comes back (B, H, Sq) contiguous; causal with one row packs 0 (no shift)."""
    import numpy as np

    from flashcuda.jit import runtime

    q = torch.randn(2, 4, 8, 64, dtype=torch.bfloat16)[:, 1:]  # (2, 3, 8, 64), a strided view
    k, v = (torch.randn(2, 5000, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    out, lse = fwd_decode.attention(q, k, v, 0.2, None, None, None, None, True)
    assert out.shape == q.shape and out.is_contiguous()
    assert lse.shape == (2, 8, 3) and lse.is_contiguous()
    cfg = fwd_decode.config_for(q.dtype, 64, 4)
    splits, chunk = fwd_decode.plan_splits(6, 2, 1, 5000, fake_slots(cfg), cfg.step)
    assert splits > 1 and len(launches) == 2
    name, grid, params = launches[0]
    assert grid == (splits, 2, 6)
    parts = [int.from_bytes(params[40:48], "little"), int.from_bytes(params[48:56], "little")]
    at = [int.from_bytes(params[o:o + 8], "little") for o in (24, 32)]  # out, lse (entry-major)
    i64, i32 = np.int64, np.int32
    layout = (*(i64(q.stride(d)) for d in range(3)), *(i64(t.stride(d)) for t in (k, v)
                                                      for d in range(3)),
              i64(8 * 64), i64(64), i64(0), i32(0), i32(6), i32(3), i32(1), i32(5000), i32(8),
              i32(2), i32(64), i32(splits), i32(chunk), np.float32(0.2 * 1.4426950408889634))
    want, _ = runtime.pack_args("split", (q, k, v, *(np.uint64(p) for p in at + parts), None,
                                          None, None, None, *layout))
    assert params == want
    name, grid, params = launches[1]
    assert grid == (6 * 8, 1, 1)
    want, _ = runtime.pack_args("combine", (*(np.uint64(p) for p in parts + at), i64(8 * 64),
                                            i64(64), i32(6), i32(8), i32(64), i32(splits)))
    assert params == want
    launches.clear()  # causal with one row: no shift to make, causal packed as 0
    one = q[:, :1]
    fwd_decode.attention(one, k, v, 0.2, None, None, None, None, True)
    params = launches[0][2]
    splits, chunk = fwd_decode.plan_splits(2, 2, 1, 5000, fake_slots(cfg), cfg.step)
    at = [int.from_bytes(params[o:o + 8], "little") for o in (24, 32, 40, 48)]
    layout = (*layout[:13], i32(2), i32(1), i32(0), *layout[16:20], i32(splits), i32(chunk),
              layout[-1])
    want, _ = runtime.pack_args("split", (one, k, v, *(np.uint64(p) for p in at), None, None,
                                          None, None, *layout))
    assert params == want

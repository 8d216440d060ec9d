"""Flash decoding (kernels/attention/flash_decode.cu): each query row over its keys, split
across CTAs with fp32 partials and one combine kernel. fp16 / bf16, head_dim a multiple of 8 up
to 256, sm >= 80.

    attention(q, k, v, scale, seqused=None, seqstart=None, cache_rows=None, block_table=None,
              causal=False) -> (out (B, Sq, H, D), lse (B, H, Sq))

q (B, Sq, H, D), Sq <= MAX_QUERY_ROWS; k, v (B_cache, Sk, Hkv, D) or, with a block table,
(pages, page_size, Hkv, D); H a multiple of Hkv. Sequence b attends to positions
[seqstart[b], seqused[b]) of its cache row (cache_rows[b], default b) or of its pages
(block_table[b]): int32 device tensors, never read on the host. Its Sq query rows are the last
positions (causal: row i ends Sq - 1 - i positions early); each is an entry of its own. A KV
head's query group runs in one CTA's rows (the keys read once per group), and the positions of
each (entry, KV head) are cut into `splits` pieces, as many CTAs as the GPU holds at once (the
driver's occupancy of the kernel, at most CTAS_PER_SM, x SMs: one full wave however small the
batch); with splits > 1 each piece writes its normalised out and lse in fp32 and the combine
rounds once. So the result has one rounding (out to q's dtype) like a single kernel call. Head
dims up to 128 take the scores and P V on tensor cores (MMA, the .cu's FC_MMA) through an
MMA_STAGES-deep cp.async pipeline; the 256 bucket (and MMA=0) the CUDA-core lanes, STAGES
picking how K / V reach their registers (straight loads, or a cp.async pipeline in shared
memory: the .cu's FC_STAGES).
COMBINE: the combine kernel as the split's programmatic dependent on sm_90 (1), or launched
after it (0, and wherever griddepcontrol does not exist). COMBINE_QUADS: the combine's threads
as column quads x groups of pieces, 16-byte loads (1), or one thread per column (0).
CTAS_PER_SM: the split counts at most this many CTAs per SM (1, the default; 0: all the SM
holds).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from .._env import choice
from ..jit import KernelSpec, PreparedLaunch, get_kernel, launch_stream, register
from .call import DTYPE_CODE, DTYPE_NAME, LOG2E, PlanCache, on_cuda

SOURCE = "attention/flash_decode.cu"
ARCHS = ("sm_80", "sm_90a")
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)  # kernel buckets: a head dim multiple of 8 runs in the next one up
ROWS = (1, 2, 4, 8)  # query rows (heads of one KV head's group) per CTA
# A/B knobs, read once at import (README's environment table)
STAGES_ENV, UNROLL_ENV, WAVES_ENV = ("FLASHCUDA_DECODE_STAGES", "FLASHCUDA_DECODE_UNROLL",
                                     "FLASHCUDA_DECODE_WAVES")
COMBINE_ENV = "FLASHCUDA_DECODE_COMBINE"
UNROLL = choice(UNROLL_ENV, 4, (1, 2, 4, 8))  # keys per slot per step
# The lanes' K / V by registers (0) or an N-stage cp.async pipeline (the .cu's FC_STAGES). The
# defaults, 2 stages x 4 keys per slot: session 44's tune on the H200 (best or within 1.5% at
# batch 1 x 64k, 8 x 16k; +2.5% at 1 x 16k against 2 keys; on an H100 2 keys won by 1-2%;
# docs/perf-notes.md)
STAGES = choice(STAGES_ENV, 2, (0, 2, 3, 4, 5, 6))
THREADS = 128
MAX_SPLITS = 128  # at most the .cu's kMaxSplits (the combine: one piece per thread)
MIN_SPLIT_KEYS = 256  # no piece shorter than this (the combine and the CTA's start cost)
# the split aims at this many full waves of the CTAs the GPU holds at once
WAVES = choice(WAVES_ENV, 1, (1, 2, 3, 4))
# ... counting at most this many CTAs per SM (0: as many as the SM holds): 1, with MMA_STAGES 3,
# since session 49 — fewer, longer pieces. The H200's tune (graph replays, docs/perf-notes.md):
# d64 8 / 1 heads 8 x 16k 22.1 -> 21.0 us, 32 / 8 heads 8 x 16k 82.9 -> 80.3, d128 8 x 16k
# 139.1 -> 137.5, 1 x 4k 17.0 -> 15.9; the other five shapes within their arms' noise
CTAS_PER_SM_ENV = "FLASHCUDA_DECODE_CTAS_PER_SM"
CTAS_PER_SM = choice(CTAS_PER_SM_ENV, 1, (0, 1, 2, 3, 4))
# the combine as the split kernel's programmatic dependent (1; sm_90, elsewhere 0), or launched
# after it (0): 1-2 us less at batch 1 on an H100 (session 45; docs/perf-notes.md)
COMBINE = choice(COMBINE_ENV, 1, (0, 1))
# how the combine's threads walk a row's pieces (the .cu's FC_COMBINE_QUADS): 1 column quads x
# groups of pieces, 16-byte loads; 0 one thread per column over every piece. Session 47's tune on
# the H200 (docs/perf-notes.md): at d64 with one KV head (128 pieces) 1 x 64k 29.1 -> 18.1 us
# (cuDNN 19.3), 8 x 16k 24.1 -> 22.0; at d128 and d64 32 / 8 heads -0.5 to +5% (the H100 alike)
COMBINE_QUADS_ENV = "FLASHCUDA_DECODE_COMBINE_QUADS"
COMBINE_QUADS = choice(COMBINE_QUADS_ENV, 1, (0, 1))
# the scores and P V on tensor cores (the .cu's FC_MMA) for head dims up to 128 (1), or the
# CUDA-core lanes (0): each warp 16 keys a step, through an MMA_STAGES-deep cp.async pipeline.
# Session 45's tunes (docs/perf-notes.md): the deeper pipe with fewer CTAs per SM (so fewer,
# longer pieces) wins — at d128 4 to 6 stages (one CTA per SM) equal within 0.5%, on the H200
# 1 x 64k 79.4 us (cuDNN 78.8), 8 x 16k 136.5 (136.4); at d64 (8 / 1 heads) 5 stages (2 CTAs
# per SM) 10% ahead of 4 at 8 x 16k. Session 47 (the GPU tests and memcheck at 5, the H200's
# tune): 5 against 4 at d128 within 0.1%, at d64 8 / 1 heads 8 x 16k 24.1 against 26.1 us, 32 / 8
# heads 1 x 64k 52.6 against 55.3; so 5. Session 49: 3 with CTAS_PER_SM 1 (above): the split's
# pieces then fill one CTA per SM, and the shallower pipe lets more of them be resident
MMA_ENV, MMA_STAGES_ENV = "FLASHCUDA_DECODE_MMA", "FLASHCUDA_DECODE_MMA_STAGES"
MMA = choice(MMA_ENV, 1, (0, 1))
MMA_STAGES = choice(MMA_STAGES_ENV, 3, (2, 3, 4, 5, 6))
MMA_KEYS = 16  # keys per warp per step with the tensor cores
MAX_GRID_YZ = 65535
MAX_QUERY_ROWS = 16  # query rows per sequence (each an entry of its own: keys read once per row)


@dataclass(frozen=True)
class DecodeConfig:
    dtype: torch.dtype
    head_dim: int  # FC_HEAD_DIM: the bucket
    rows: int  # FC_ROWS
    unroll: int = 0  # FC_UNROLL (0: UNROLL, at most 4 with 8 rows, 2 paged without a pipe)
    stages: int = -1  # FC_STAGES (-1: MMA_STAGES / STAGES): 0 loads to registers, N a pipeline
    paged: bool = False  # FC_PAGED: the cache in pages through a block table
    combine: int = -1  # FC_COMBINE (-1: COMBINE): how split pieces meet
    mma: int = -1  # FC_MMA (-1: MMA): scores and P V on tensor cores (needs a pipeline)

    def __post_init__(self) -> None:
        if self.mma < 0:  # (not for the 256 bucket, nor where the registers path is asked for)
            object.__setattr__(self, "mma", MMA if self.head_dim <= 128 and self.stages else 0)
        if self.stages < 0:
            object.__setattr__(self, "stages", MMA_STAGES if self.mma else STAGES)
        if self.combine < 0:
            object.__setattr__(self, "combine", COMBINE)
        if not self.unroll:  # (the caps keep 8 rows' accumulators, q and keys within 255 regs)
            cap = 2 if self.paged and not self.stages else 4
            object.__setattr__(self, "unroll", UNROLL if self.rows < 8 else min(UNROLL, cap))
        if self.stages == 1:
            raise ValueError("DecodeConfig: stages is 0 (no pipeline) or at least 2")
        if self.mma and (self.stages < 2 or self.head_dim > 128):
            raise ValueError("DecodeConfig: mma needs a pipeline (stages >= 2) and a head dim "
                             "bucket up to 128")

    @property
    def split_smem_bytes(self) -> int:
        """sizeof(SplitSmem) in the .cu: where the slots meet (m, l, acc per slot and row)."""
        return 4 * (self.slots * self.rows * (2 + self.head_dim) + 2 * self.rows)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: 0 without a pipeline (SplitSmem is static), else the stages'
        16-byte K and V pieces per thread, which SplitSmem overlays after the keys."""
        if not self.stages:
            return 0
        if self.mma:  # [stages][warp][K, V] 16 x head_dim tiles of 16-bit elements
            return max(self.stages * (THREADS // 32) * 2 * MMA_KEYS * self.head_dim * 2,
                       self.split_smem_bytes)
        return max(self.stages * self.unroll * 2 * THREADS * 16, self.split_smem_bytes)

    @property
    def step(self) -> int:
        """Keys one CTA reads per step: its slots, kUnroll keys each (mma: 16 per warp)."""
        return self.slots * (MMA_KEYS if self.mma else self.unroll)

    @property
    def slots(self) -> int:
        """Keys the CTA reads at once per unrolled step: 4 warps x 32 / (head_dim / 8) lanes (mma:
        the 4 warps)."""
        if self.mma:
            return THREADS // 32
        return (THREADS // 32) * (32 // (self.head_dim // 8))

    @property
    def name(self) -> str:
        pipe = f"_p{self.stages}" if self.stages else ""
        paged = "_pg" if self.paged else ""
        keys = "_mma" if self.mma else f"_u{self.unroll}"
        return (f"flash_decode_{DTYPE_NAME[self.dtype]}_d{self.head_dim}_r{self.rows}"
                f"{keys}{pipe}{paged}{COMBINE_SUFFIX[self.combine]}")

    def spec(self) -> KernelSpec:
        return KernelSpec.make(self.name, SOURCE, defines={
            "FC_STAGE": 0, "FC_DTYPE": DTYPE_CODE[self.dtype], "FC_HEAD_DIM": self.head_dim,
            "FC_ROWS": self.rows, "FC_UNROLL": self.unroll, "FC_STAGES": self.stages,
            "FC_PAGED": int(self.paged),
            **({"FC_COMBINE": 1} if self.combine else {}),
            **({"FC_MMA": 1} if self.mma else {})})


# name suffixes by COMBINE (the split kernel's and the combine kernel's)
COMBINE_SUFFIX = ("", "_cd")


def combine_spec(dtype: torch.dtype, combine: int = 0, quads: int | None = None) -> KernelSpec:
    """The combine kernel (FC_STAGE 1): 0 launched after the split; 1 waiting for the split
    grid itself (griddepcontrol.wait), launched as its programmatic dependent. quads: its
    threads as column quads x groups of pieces (1, FC_COMBINE_QUADS) or one per column (0);
    None: COMBINE_QUADS."""
    quads = COMBINE_QUADS if quads is None else quads
    return KernelSpec.make(
        f"flash_decode_combine_{DTYPE_NAME[dtype]}{COMBINE_SUFFIX[combine]}"
        f"{'_q4' if quads else ''}", SOURCE,
        defines={"FC_STAGE": 1, "FC_DTYPE": DTYPE_CODE[dtype],
                 **({"FC_COMBINE": 1} if combine else {}),
                 **({"FC_COMBINE_QUADS": 1} if quads else {})})


def config_for(dtype: torch.dtype, head_dim: int, group: int, paged: bool = False) -> DecodeConfig:
    bucket = next(d for d in HEAD_DIMS if head_dim <= d)
    rows = next((r for r in ROWS if group <= r), ROWS[-1])
    return DecodeConfig(dtype, bucket, rows, paged=paged)


def config_on(device: torch.device, dtype: torch.dtype, head_dim: int, group: int,
              paged: bool = False) -> DecodeConfig:
    """The config a call on `device` runs: config_for's, its pipeline fitted to the device's
    shared memory (fit_smem), the combine launched after the split where griddepcontrol does not
    exist (before sm_90)."""
    cfg = fit_smem(config_for(dtype, head_dim, group, paged), _smem_optin(device))
    if cfg.combine == 1 and not _programmatic(device):
        cfg = dataclasses.replace(cfg, combine=0)
    return cfg


@functools.cache
def _device_ok(device: torch.device) -> tuple[bool, int]:
    """(sm >= 80, SM count) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor) >= (8, 0), props.multi_processor_count


@functools.cache
def _smem_optin(device: torch.device) -> int:
    """Dynamic shared memory a block may opt in to on a CUDA device."""
    return int(torch.cuda.get_device_properties(device).shared_memory_per_block_optin)


def fit_smem(cfg: DecodeConfig, smem_optin: int) -> DecodeConfig:
    """`cfg` with its pipeline as deep as a block's shared memory allows: MMA_STAGES / STAGES are
    the H100 / H200's (227 KB a block; 4 stages at d128 take 128 KB, 5 160 KB), where an sm_86 /
    sm_89 holds 99 KB and an A100 163 KB. Two stages always fit (64 KB at most)."""
    while cfg.stages > 2 and cfg.smem_bytes > smem_optin:
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


@functools.cache
def _programmatic(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol) exists on this device: sm >= 90."""
    return torch.cuda.get_device_properties(device).major >= 9


def can_take(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None if the decode kernels take this call (q (B, Sq, H, D), Sq <= MAX_QUERY_ROWS; shapes
    already validated), else why not."""
    if not on_cuda(q.device):
        return "the decode kernels run on CUDA devices"
    if q.dtype not in DTYPES:
        return f"the decode kernels take float16 / bfloat16, got {q.dtype}"
    head_dim = q.shape[3]
    if head_dim % 8 or head_dim > HEAD_DIMS[-1]:
        return f"the decode kernels take head_dim a multiple of 8 up to 256, got {head_dim}"
    if not 1 <= q.shape[1] <= MAX_QUERY_ROWS:
        return f"the decode kernels take 1 to {MAX_QUERY_ROWS} query rows per entry"
    if q.shape[0] * q.shape[1] > MAX_GRID_YZ or k.shape[2] * q.shape[2] > MAX_GRID_YZ:
        return "batch or heads beyond the grid's limit"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1 or t.data_ptr() % 16 or any(
                t.stride(i) % 8 for i in range(3) if t.shape[i] > 1):
            return f"{name} is not readable in 16-byte rows (strides {tuple(t.stride())})"
    ok, _ = _device_ok(q.device)
    return None if ok else "the decode kernels need compute capability >= 8.0"


def plan_splits(batch: int, nheads_kv: int, row_blocks: int, seqlen_k: int, slots: int,
                step: int) -> tuple[int, int]:
    """(splits, chunk): the keys of each (entry, KV head, row block) cut into `splits` pieces of
    `chunk` keys (a multiple of the CTA's step), as many CTAs as fit in `slots` (the CTAs the
    GPU holds at once, times WAVES: a last wave part-full would run as long as a full one, each
    CTA being bound by its own loads' latency), none shorter than MIN_SPLIT_KEYS."""
    base = batch * nheads_kv * row_blocks
    splits = max(1, min(slots // max(base, 1), MAX_SPLITS, seqlen_k // MIN_SPLIT_KEYS))
    chunk = -(-max(seqlen_k, 1) // (splits * step)) * step
    return -(-max(seqlen_k, 1) // chunk), chunk


def slots(kernel, cfg: DecodeConfig, sms: int) -> int:
    """CTAs of `kernel` the GPU holds at once (the driver's occupancy of one SM, at most
    CTAS_PER_SM when set, x SMs), x WAVES."""
    per_sm = max(1, kernel.resident_blocks(THREADS, cfg.smem_bytes))
    return (min(per_sm, CTAS_PER_SM) if CTAS_PER_SM else per_sm) * sms * WAVES


@dataclass(frozen=True)
class _Plan:
    """A call layout's launches: the split kernel's (and, with splits > 1, the combine's), their
    layout arguments packed once; each call passes only its pointers."""

    split: PreparedLaunch
    combine: PreparedLaunch | None
    splits: int


# q, k, v, out, lse, o_part, lse_part, seqused, seqstart, cache_rows, block_table: the rest is
# the layout's
_SPLIT_POINTERS = 11
_COMBINE_POINTERS = 4  # o_part, lse_part, out, lse


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
          out: torch.Tensor, block_table: torch.Tensor | None, causal: bool) -> _Plan:
    batch, seqlen_q, nheads, head_dim = q.shape
    entries = batch * seqlen_q  # (query row i of sequence b: entry b * seqlen_q + i)
    nheads_kv = k.shape[2]
    paged = block_table is not None
    # positions per entry: the cache rows' length, or (paged) the block table's pages x page size
    seqlen_k = block_table.shape[1] * k.shape[1] if paged else k.shape[1]
    group = nheads // nheads_kv
    cfg = config_on(q.device, q.dtype, head_dim, group, paged)
    row_blocks = -(-group // cfg.rows)
    _, sms = _device_ok(q.device)
    kernel = get_kernel(cfg.spec(), q.device)
    splits, chunk = plan_splits(entries, nheads_kv, row_blocks, seqlen_k,
                                slots(kernel, cfg, sms), cfg.step)
    layout = (np.int64(q.stride(0)), np.int64(q.stride(1)), np.int64(q.stride(2)),
              np.int64(k.stride(0)), np.int64(k.stride(1)), np.int64(k.stride(2)),
              np.int64(v.stride(0)), np.int64(v.stride(1)), np.int64(v.stride(2)),
              np.int64(out.stride(1)), np.int64(out.stride(2)),
              np.int64(block_table.stride(0) if paged else 0),
              np.int32(k.shape[1] if paged else 0),
              np.int32(entries), np.int32(seqlen_q), np.int32(causal), np.int32(seqlen_k),
              np.int32(nheads), np.int32(nheads_kv), np.int32(head_dim), np.int32(splits),
              np.int32(chunk), np.float32(softmax_scale * LOG2E))
    split = PreparedLaunch(kernel, (splits, nheads_kv * row_blocks, entries), (THREADS, 1, 1),
                           cfg.smem_bytes, (None,) * _SPLIT_POINTERS + layout, fixed=len(layout))
    combine = None
    if splits > 1:
        tail = (np.int64(out.stride(1)), np.int64(out.stride(2)), np.int32(entries),
                np.int32(nheads), np.int32(head_dim), np.int32(splits))
        combine = PreparedLaunch(get_kernel(combine_spec(q.dtype, cfg.combine), q.device),
                                 (entries * nheads, 1, 1), (THREADS, 1, 1), 0,
                                 (None,) * _COMBINE_POINTERS + tail, fixed=len(tail),
                                 programmatic=cfg.combine == 1)
    return _Plan(split, combine, splits)


_plans = PlanCache(lambda args: _plan(*args))


def _at(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
              seqused: torch.Tensor | None = None, seqstart: torch.Tensor | None = None,
              cache_rows: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
              causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Sq, H, D), lse (B, H, Sq)) of a decoding call (module docstring); can_take(q,
    k, v) is None. Sequence b attends to positions [seqstart[b], seqused[b]) (defaults 0 and
    all) of cache row cache_rows[b] (default b) of k / v (B_cache, Sk, Hkv, D); or, with
    block_table (B, blocks) — k / v then (pages, page_size, Hkv, D) — position p of sequence b
    is row p % page_size of page block_table[b, p // page_size], Sk = blocks x page_size. Its
    Sq query rows are the last Sq positions: with `causal`, row i sees positions below
    seqused[b] - (Sq - 1 - i) (FlashAttention's bottom-right causal), else all of them. The
    caller has checked these: int32 tensors on q's device, (B,) contiguous, block_table with a
    unit last stride; rows, pages and positions in range (the kernel reads what they say)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((batch, seqlen_q, nheads), dtype=torch.float32)  # entry-major
    if batch == 0 or nheads == 0 or seqlen_q == 0:
        return out, lse.transpose(1, 2)
    table = None if block_table is None else (block_table.shape, block_table.stride())
    causal = bool(causal) and seqlen_q > 1  # (one row: the same keys either way)
    key = (q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.get_device(),
           softmax_scale, table, causal, UNROLL, STAGES, WAVES, COMBINE, MMA, MMA_STAGES,
           COMBINE_QUADS, CTAS_PER_SM)
    plan = _plans.plan(key, (q, k, v, softmax_scale, out, block_table, causal))
    parts = None
    if plan.splits > 1:  # (the fp32 partials: freed after the combine, stream-ordered)
        entries = batch * seqlen_q
        parts = (q.new_empty((plan.splits, entries, nheads, head_dim), dtype=torch.float32),
                 q.new_empty((plan.splits, entries, nheads), dtype=torch.float32))
    o_at, lse_at = (parts[0].data_ptr(), parts[1].data_ptr()) if parts else (0, 0)
    handle = launch_stream(q.get_device())
    plan.split(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), o_at,
               lse_at, _at(seqused), _at(seqstart), _at(cache_rows), _at(block_table),
               handle=handle)
    if plan.combine is not None:
        plan.combine(o_at, lse_at, out.data_ptr(), lse.data_ptr(), handle=handle)
    lse = lse.transpose(1, 2)  # (B, H, Sq): for one row a contiguous view, else a copy
    return out, lse if seqlen_q == 1 else lse.contiguous()


@register
def variants() -> list[tuple[KernelSpec, tuple[str, ...]]]:
    """Every specialisation attention() picks by default: 2 dtypes x 3 head dims x 4 row counts,
    plain and paged (the tensor cores up to d128, the lanes at 256), with the combine as the
    split's programmatic dependent on sm_90 and after it on sm_80; and their combine kernels."""
    specs = []
    for combine, arch in ((0, "sm_80"), (COMBINE, "sm_90a")):
        specs += [(DecodeConfig(dt, d, r, paged=p, combine=combine).spec(), (arch,))
                  for dt in DTYPES for d in HEAD_DIMS for r in ROWS for p in (False, True)]
        specs += [(combine_spec(dt, combine), (arch,)) for dt in DTYPES]
    return specs

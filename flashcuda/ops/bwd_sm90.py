"""The sm90a backward family (FlashAttention-3 design: TMA, mbarriers, wgmma, a producer
warpgroup and two consumer warpgroups with setmaxnreg), fp16/bf16, head dims 64 and 128,
non-deterministic dQ.

Status: proven on the H200 (tests/gpu/test_bwd_sm90.py against the float64 oracle; records in docs/EVIDENCE.md); dispatch prefers it on compute capability 9.0:
bwd_sm90 > bwd_sm80 > bwd_simt. FLASHCUDA_ENABLE_SM90_BWD=0 turns it off; deterministic=True
goes to bwd_sm80 (this family reduces dQ with atomics).

A backward is three launches: bwd_sm80's PRE (delta, lse2, zeroed dq_accum) and CONVERT (dq =
dq_accum * softmax_scale) kernels, unchanged, around this family's MAIN kernel
(kernels/attention/flash_bwd_sm90.cu), which writes dK and dV and reduces dQ into dq_accum.

`Sm90BwdConfig` is the single source of truth of a specialisation: tiles, stages, register split,
shared memory (the .cu static_asserts the same layout), the name, the defines.

    head dim   block_m (queries) x block_n (keys), stages   smem      producer / consumers
    64         128 x 128, 2                                 195 KB    32 / 2 x 232 (FA3's tiles)
    128        64 x 128, 2                                  194 KB    24 / 2 x 240 (FA3's tiles)
    128        80 x 128, 2 (no mask, Sq >= 2048: dq_swap)   226 KB    24 / 2 x 240 (FA3's, dQ^T)

A step's GEMMs in FA3's order: dV, dS^T to shared memory and the consumers' barrier, dQ, dK,
then the dQ tile staged in shared memory once dV and dQ are done (wgmma_wait<1>) while the
tensor cores still run dK; warp 1 of the producer warpgroup reduces it into dq_accum (FA3's
split). The staging (FLASHCUDA_SM90_BWD_DQ): tma (the default at d64 since session 10) — a tile
laid out as kHeadDim / 32 boxes of 128B-swizzled fp32 rows, kHeadDim / 32 tensor-map reductions
per step into dq_accum seen as a 2-D (head dim, B H Sq_pad) fp32 tensor (map_dq, a fifth tensor
map); or frag (the default at d128 since session 12: +0.2-6.5% over tma) — one 16 KB tile per
consumer in its registers' order, each with its own hand-off and one bulk reduce-add into a
dq_accum laid out in that order (CONVERT reads it back). Tried and removed in session 39 (perf-
notes has the measurements): the consumers' own red.v2 / red.v4 / row-wise bulk reductions, the
writer's padded and flat staging, a step's red.v4 issued a step late, the previous GEMM order, a
third Q / dO stage, and dS stored [query][key] outside dq_swap.
FLASHCUDA_SM90_BWD_WATCHDOG=1 runs the variant whose mbarrier waits give up after 2 s (NaN in
dK / dV) instead of hanging (bring-up).
The producer warpgroup keeps 24 registers per thread at d128: 128 * 24 + 256 * 240 = 64512, the
whole pool the CTA gets at launch (168 registers per thread at 384 threads: setmaxnreg.inc only
takes what a setmaxnreg.dec gave back, so a split over the pool hangs the consumers at their
inc); at d64 the dQ writer in the producer warpgroup needs 32 (24 spill): 128 * 32 + 256 * 232
= 63488. Kernel defines (FLASHCUDA_SM90_BWD_DEFINES, "FC_NAME=VALUE" joined by "," or "+")
override any of these for an A/B, e.g. FC_PRODUCER_REGS=32+FC_CONSUMER_REGS=232.
`timeline` (FC_TIMELINE; run_timeline, scripts/sm90_bwd_timeline.py) builds a profiling variant
of MAIN that writes per CTA %globaltimer at entry, K / V arrival, first and last step and exit
(+ %smid, steps, block index) into a buffer; never dispatched.
The schedule (FC_WAVE_SPLIT, session 38):The schedule (FC_WAVE_SPLIT, session 38): at d64 a call without a mask whose last-wave items
have WAVE_MIN_STEPS steps runs those items as pieces in a second launch of the same source,
MAIN's programmatic dependent, their dK / dV summed in fp32 (wave_split.py; +1.6 to +2.1% at
2k-16k); a causal call of LPT_LAUNCH_BLOCKS key blocks runs its first LPT_LAUNCH_PAIRS pairs as
a grid of (pairs, key blocks) after MAIN, longest-first (+1.9 to +2.4% at 2k-8k). Both only on a
head dim's default kernel (_schedulable).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from math import lcm

import numpy as np
import torch

from .._env import env_names, env_values, flag, switched_on
from ..jit import KernelSpec, PreparedLaunch, get_kernel, launch_stream, register
from ..jit.tensor_map import MAX_DIM, bshd_map, bshd_problem, rows_f32_map
from . import bwd_sm80, wave_split
from .call import (
    DTYPE_CODE,
    DTYPE_NAME,
    LOG2E,
    REMOVED_SM90_DEFINES,
    BwdCall,
    PlanCache,
    defines_suffix,
    kernel_windows,
    parse_defines,
    register_pool,
    vector_layout_problem,
)

SOURCE = "attention/flash_bwd_sm90.cu"
ARCHS = ("sm_90a",)
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)
ENABLE_ENV = "FLASHCUDA_ENABLE_SM90_BWD"
WATCHDOG_ENV = "FLASHCUDA_SM90_BWD_WATCHDOG"
# the dQ staging (tma / frag; A/B of the other one)
DQ_ENV = "FLASHCUDA_SM90_BWD_DQ"
# The dQ staging per head dim, by measurement (docs/perf-notes.md, "dQ reductions measured"):
# session 10, the tensor-map reduction (tma) +1.5-2.9% at every point of a same-run A/B against
# the writer warp's row reductions; session 12, at d128 the per-consumer register-order staging
# (frag), same-run A/B against tma: +0.2-6.5% at all six d128 points (+4.4-6.5% from 4k
# non-causal and at 16k causal).
DQ_DEFAULT = {64: "tma", 128: "frag"}
DQ_MODES = ("tma", "frag")
FENCE_ENV = "FLASHCUDA_SM90_BWD_FENCE"  # 0 / 1: without / with the release fence (A/B)
DEFINES_ENV = "FLASHCUDA_SM90_BWD_DEFINES"  # NAME=VALUE,... (A/B of a kernel knob, as forward)
# knobs taken out of flash_bwd_sm90.cu in sessions 39, 50-52 and 56 (its header lists them;
# perf-notes has the numbers): DEFINES_ENV refuses them
REMOVED_DEFINES = REMOVED_SM90_DEFINES + (
    "FC_DKV_TMA", "FC_SPLIT_LOADS", "FC_PDL", "FC_STAT_LANES", "FC_HEADS_FIRST", "FC_EARLY_LOADS",
    "FC_MASK_BITS", "FC_MASKED_FUSED", "FC_DQ_END_READ", "FC_LPT_SAME_ORDER", "FC_STEP_COUNTERS",
    "FC_DKV_QUAD", "FC_DQ_V4", "FC_DQ_BULK", "FC_DQ_LATE", "FC_DQ_WARP", "FC_DQ_WARP_FLAT",
    "FC_DQ_EARLY", "FC_MASK_BLOCKS", "FC_MASK_SKIP", "FC_DQ_BASES", "FC_EPI_SHUFFLE_FIRST",
    "FC_MASK_PACKED", "FC_MASK_PRE", "FC_DV_LAST", "FC_LOOP_PAD", "FC_SPLIT_STEPS")
# CONVERT of the frag layout reads whole 64-byte spans and writes dq through shared memory
# (FC_DQ_SPANS, session 15: kernel times put our CONVERT at 72 us against FA4's 49 at d128
# 512 / 1k); 0 keeps the float2 reads (A/B)
CONVERT_SPANS_ENV = "FLASHCUDA_SM90_BWD_CONVERT_SPANS"
# 80-query steps with dQ^T = K^T dS^T (FC_DQ_SWAP; FlashAttention 3 / 4's d128 backward without a
# mask) for calls without a mask at these head dims from SWAP_MIN_SEQLEN_Q query rows. Same-process
# A/B (session 23, perf-notes): +1.4 / +1.7 / +1.8 / +2.3% at 2k / 4k / 8k / 16k, -0.2% at 1k,
# -6.6% at 512 (ceil(Sq / 80) steps: 9% of the last step's rows are padding there).
# FLASHCUDA_SM90_BWD_SWAP=0 / 1 turns it off / on (on: at any length, as far as SWAP_HEAD_DIMS
# allow). By default only with the 64-query kernel's default settings (is_default_kernel): an A/B
# of them (DQ set away from the default) keeps 64 queries.
SWAP_ENV = "FLASHCUDA_SM90_BWD_SWAP"
# The last-wave split (FC_WAVE_SPLIT, the .cu; wave_split.py): the last wave's work items run as
# pieces of their steps in a second kernel, MAIN's programmatic dependent, at these head dims;
# FLASHCUDA_SM90_BWD_WAVE_SPLIT=0 / 1 off / on (A/B). FLASHCUDA_SM90_BWD_WAVE_SMS=n plans it for
# n SMs instead of the GPU's (tests: MAIN and the pieces both at small sizes).
WAVE_SPLIT_ENV = "FLASHCUDA_SM90_BWD_WAVE_SPLIT"
WAVE_SPLIT_DIMS: tuple[int, ...] = (64,)
# by default (unset) only for calls without a mask whose split items have this many steps: a
# short CTA's last wave hides in the SMs' spread (wave_split.py); =1 splits wherever it can (A/B)
WAVE_MIN_STEPS = 16
# Causal calls' first LPT_LAUNCH_PAIRS (KV head, batch) pairs as a second grid of (pairs, key
# blocks) after MAIN, its programmatic dependent (FC_WAVE_SPLIT=3): key block 0 of each first,
# FC_LPT_TAIL's longest-first order with the key block a blockIdx component. At these head dims;
# FLASHCUDA_SM90_BWD_LPT_LAUNCH=0 / 1 off / on (A/B). In place of FC_LPT_TAIL and of the split.
# By default (unset) at d64 for key blocks in LPT_LAUNCH_BLOCKS (2k-8k keys): same process,
# session 38, d64 causal +1.9 / +2.4 / +2.2% at 2k / 4k / 8k (beyond p10-p90, twice at 2k / 4k),
# +0.2 / +0.5% at 1k, -1.1% at 512, -0.3% at 16k; d128 (against its FC_LPT_TAIL) -0.9 / -0.3%.
LPT_LAUNCH_ENV = "FLASHCUDA_SM90_BWD_LPT_LAUNCH"
LPT_LAUNCH_DIMS: tuple[int, ...] = (64,)
LPT_LAUNCH_BLOCKS = (16, 64)
LPT_LAUNCH_PAIRS = 8
WAVE_SMS_ENV = "FLASHCUDA_SM90_BWD_WAVE_SMS"
# 0 (diagnostic A/B): the pieces launched in plain stream order, after MAIN has completed
WAVE_PDL_ENV = "FLASHCUDA_SM90_BWD_WAVE_PDL"
SWAP_HEAD_DIMS = (128,)  # where the kernel builds it (two consumers of 64 dQ^T rows each)
SWAP_DIMS = (128,)
SWAP_MIN_SEQLEN_Q = 2048
SWAP_BLOCK_M = 80
GATED = f"bwd_sm90 is turned off ({ENABLE_ENV}=0)"
BARRIER_BYTES = 8
BLOCK_M = {64: 128, 128: 64}  # query rows per step, per head dim (FA3's tiles)
# FC_DQ_SPREAD by default (with dq_tma): d64 only (session 11, same-run A/B: +1.4-3.3% at all six
# d64 points, -1.8 to +0.3% at d128, against a +-3% spread of the unchanged forward in that run)
SPREAD_DIMS = (64,)
# FC_LPT_TAIL for causal calls (a right edge and no left one: key block 0 has the most steps), per
# head dim: the last K (KV head, batch) pairs' CTAs longest-first. Same-run A/B (session 14,
# perf-notes): d128 +1-2.7% at causal 1k / 4k / 8k (K = 8; 0 at 2k; K = 4 a little less), d64
# -3 to -4%: not used there, nor without a mask. The d64 loss is the remap's code, not its order
# (session 37: the remapped key block held through the loop costs d64 its uniform descriptors).
LPT_TAIL = {128: 8}
# FLASHCUDA_SM90_BWD_DQ=frag builds without spills at these head dims (d64 since session 23: its
# consumers spilled 60 bytes at 232 registers in session 12, none with the kernel of session 21's
# defaults)
FRAG_DIMS = (64, 128)
# FC_PROBS_EARLY per head dim (P^T's first k column blocks of 8 queries before the dP^T wait, the
# rest beside dS^T's first blocks; the .cu): same-process A/B (session 23, perf-notes) at d64
# +1.1 to +3.7% at all eight shapes (512-16k, causal and not; GPU tests of the d64 default kernel
# with it: 35 passed), at d128 +2.3 to +5.5% at all six (k = 4), again +2.6 to +5.1% in session
# 24 (k = 2 / 3 / 6 no better; the GPU lane's 673 tests at 872ef1c ran the d128 64-query and
# 80-query kernels with it as the defaults)
PROBS_EARLY = {64: 4, 128: 4}
# FC_PROBS_EMU per head dim (that many of P^T's column blocks after the dP^T wait take their exp2
# on the FMA pipe, a cubic; the .cu): same-process A/B (session 25, perf-notes) at d64, k = 2:
# +0.0 to +1.6% at ten shapes (512-16k, causal and not; five beyond p10-p90, none below), sustained
# at the power cap +1.2 / +0.5% (4 x 4k x 32 / 16 x 1k x 32); k = 3 -5 to -10%; d128 k = 1 / 2
# noise to -2.5%. Applies with the P^T split only (select_config's default kernel).
PROBS_EMU = {64: 2}
# FC_DS_STMATRIX by default (dS^T by stmatrix.x4; the [key][query] layout in FA3's order): d64
# since session 12 (same-run A/B: +0.8-3.5% at all six d64 points, -2.4 to +0.8% at d128 then);
# d128 since session 21 (same-process A/B, session 19, on the no-fence kernel: +1.2 to +2.4% at
# all six d128 points; GPU lane at c3108c4 with it set)
STMATRIX_DIMS = (64, 128)
# Head dims whose MAIN kernel advances its wgmma descriptors by one 64-bit add (FC_DESC_ADVANCE=2,
# common/sm90.cuh; every kernel of the head dim). Same-process A/B (session 24, perf-notes): d64
# +1.8 to +3.6% at all four shapes (1k / 4k, causal and not), d128 -0.2 to +1.7% (inside the
# noise at five of six). Session 17's two-process A/B had read -1.6 to +3.0% over both.
DESC_ADD64_DIMS = (64,)
# Head dims whose kernel issues fence.proxy.async before each stage release (FC_RELEASE_FENCE, the
# .cu's release()). Same-process A/B (session 19, scripts/ab_probe.py, perf-notes): d128 without it
# +2.1 to +5.7% at 1k / 4k, causal and not (session 2's two-process A/B had read d128 within
# +-1%, d64 3-11% faster with it); d64 without it +1.8 / +2.2% at 2k / 4k, +1.0 / +1.3% causal
# (same process, session 19; off there since session 21, GPU lane at c3108c4 with it off).
# GUARANTEES §1 gives why the order holds without it.
FENCE_DIMS = ()
# FC_TIMELINE: uint64 words per CTA in the timeline buffer (kTimelineWords) and what each holds
# (the .cu's kTl* indices; scripts/sm90_bwd_timeline.py decodes them)
TIMELINE_WORDS = 16
TIMELINE_FIELDS = {"id": 0, "block": 1, "entry": 2, "first_tma": 3, "produced": 4, "kv": 5,
                   "first_step": 6, "last_step": 7, "exit0": 8, "exit1": 9, "dq_end": 10,
                   "merged": 11, "s0": 12, "bar0": 13, "end0": 14, "end1": 15}


@dataclass(frozen=True)
class Sm90BwdConfig:
    """One specialisation of flash_bwd_sm90.cu (the MAIN kernel)."""

    dtype: torch.dtype
    head_dim: int
    block_m: int = 0  # 0: BLOCK_M[head_dim]
    block_n: int = 128
    stages: int = 2
    # 0: 24 / 240 at d128, 32 / 232 at d64 (the dQ writer warp's loop needs 32 there; d128's fits
    # in 24, no spills: +1.3-3.3% bwd at d128 from the consumers' 8 more registers, same-run A/B,
    # session 11); the split is bounded by the pool at launch (register_pool)
    producer_regs: int = 0
    consumer_regs: int = 0
    watchdog: bool = False  # mbarrier waits give up after 2 s (bring-up; see the .cu)
    # fence.proxy.async before a stage's release (see the .cu); None: on at FENCE_DIMS
    release_fence: bool | None = None
    # the dQ staging, exactly one of the two (neither given: DQ_DEFAULT[head_dim]'s): dq_tma from
    # 128B-swizzled boxes through a tensor map of dq_accum (FC_DQ_TMA); dq_frag from per-consumer
    # tiles in register order, one bulk reduce-add per consumer, into dq_accum in that order
    # (FC_DQ_FRAG)
    dq_tma: bool = False
    # dq_tma's staging stores in the order whose half-warps cover 8 chunks (FC_DQ_SPREAD, see the
    # .cu); None: on at the head dims of SPREAD_DIMS
    dq_spread: bool | None = None
    dq_frag: bool = False
    # dQ^T = K^T dS^T per consumer (FC_DQ_SWAP: block_m 80 at d128, dq_frag's staging of dQ^T,
    # dS stored [query][key] by stmatrix.trans; CONVERT's FC_DQ_FRAG_T reader; see the .cu)
    dq_swap: bool = False
    # P^T's column blocks (of 8 queries) computed before the dP^T wait (FC_PROBS_EARLY); None:
    # all of them (block_m // 8, the kernel's own default); select_config sets PROBS_EARLY's for
    # the default kernel of a head dim
    probs_early: int | None = None
    # of the blocks after the wait, how many take their exp2 on the FMA pipe (FC_PROBS_EMU, the
    # .cu's exp2_fma); select_config sets PROBS_EMU's with PROBS_EARLY's
    probs_emu: int = 0
    # dS^T stored by stmatrix.x4 (FC_DS_STMATRIX; the kernel applies it with the [key][query]
    # layout only); None: on at the head dims of STMATRIX_DIMS there
    ds_stmatrix: bool | None = None
    # wgmma descriptors advanced by one 64-bit add (FC_DESC_ADVANCE=2; the default 1 adds to the
    # low word); None: on at the head dims of DESC_ADD64_DIMS (the name marks only a departure
    # from that; the spec, hence the cache key, always says it)
    desc_add64: bool | None = None
    # profiling variant: one more kernel argument (after dv), a buffer that receives per CTA the
    # times of its entry, K / V arrival, first / last step and exit (FC_TIMELINE; run_timeline,
    # scripts/sm90_bwd_timeline.py); never dispatched
    timeline: bool = False
    # FC_LPT_TAIL: the CTAs of the grid's last lpt_tail (KV head, batch) pairs run longest-first
    # (key block 0 of every such pair first); dispatch sets it for causal calls at the head dims
    # of LPT_TAIL (the .cu; _build_plan)
    lpt_tail: int = 0
    # the last-wave split (FC_WAVE_SPLIT): 1 MAIN, whose CTAs before its first_main argument exit
    # and which triggers its dependents; 2 the pieces kernel (three more pointers after dv: the
    # piece table, the fp32 dK / dV sums, the step counters); 3 the causal tail's grid of (pairs,
    # key blocks) after MAIN; _build_plan sets them (wave_split_for, wave_split.plan;
    # lpt_launch_for)
    wave_split: int = 0
    # extra compile-time defines (FLASHCUDA_SM90_BWD_DEFINES="NAME=VALUE,..."): A/B variants of a
    # kernel knob, named by a suffix
    defines: tuple = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"Sm90BwdConfig.dtype: expected fp16 or bf16, got {self.dtype}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"Sm90BwdConfig.head_dim: expected one of {HEAD_DIMS}, "
                             f"got {self.head_dim}")
        if self.block_m == 0:
            object.__setattr__(self, "block_m", BLOCK_M[self.head_dim])
        if self.probs_early is None:
            object.__setattr__(self, "probs_early", self.block_m // 8)
        if not 0 <= self.probs_early <= self.block_m // 8:
            raise ValueError(f"Sm90BwdConfig.probs_early: expected 0 .. {self.block_m // 8} "
                             f"(block_m // 8), got {self.probs_early}")
        if not 0 <= self.probs_emu <= self.block_m // 8 - self.probs_early:
            raise ValueError(f"Sm90BwdConfig.probs_emu: expected 0 .. "
                             f"{self.block_m // 8 - self.probs_early} (the column blocks after "
                             f"the dP^T wait), got {self.probs_emu}")
        if self.release_fence is None:
            object.__setattr__(self, "release_fence", self.head_dim in FENCE_DIMS)
        if self.desc_add64 is None:
            object.__setattr__(self, "desc_add64", self.head_dim in DESC_ADD64_DIMS)
        if not self.dq_tma and not self.dq_frag:
            object.__setattr__(self, f"dq_{DQ_DEFAULT[self.head_dim]}", True)
        if self.dq_tma and self.dq_frag:
            raise ValueError("Sm90BwdConfig.dq_tma / dq_frag: expected one dQ staging, got both")
        if self.dq_spread is None:
            object.__setattr__(self, "dq_spread", self.dq_tma and self.head_dim in SPREAD_DIMS)
        if self.ds_stmatrix is None:
            object.__setattr__(self, "ds_stmatrix", self.head_dim in STMATRIX_DIMS
                               and not self.dq_swap)
        if self.ds_stmatrix and self.dq_swap:
            raise ValueError("Sm90BwdConfig.ds_stmatrix: expected False with dq_swap "
                             "(stmatrix stores the [key][query] layout; dq_swap's is [query][key])")
        if self.dq_spread and not self.dq_tma:
            raise ValueError("Sm90BwdConfig.dq_spread: expected False without dq_tma (it orders "
                             "the tensor-map staging stores)")
        wide = self.head_dim == 128  # (d64's dQ writer warp needs 32 registers)
        if self.producer_regs == 0:
            object.__setattr__(self, "producer_regs", 24 if wide else 32)
        if self.consumer_regs == 0:
            object.__setattr__(self, "consumer_regs", 240 if wide else 232)
        if self.block_n != 128:
            raise ValueError(f"Sm90BwdConfig.block_n: expected 128 (two consumer warpgroups of "
                             f"64 keys), got {self.block_n}")
        if self.dq_swap:
            if not (self.dq_frag and self.head_dim in SWAP_HEAD_DIMS
                    and self.block_m == SWAP_BLOCK_M):
                raise ValueError(f"Sm90BwdConfig.dq_swap: expected dq_frag, head dim in "
                                 f"{SWAP_HEAD_DIMS} and block_m {SWAP_BLOCK_M}, got {self}")
        elif self.block_m not in (64, 128) or self.block_m * self.head_dim != 64 * 64 * 2:
            raise ValueError(f"Sm90BwdConfig.block_m: expected block_m * head_dim = 8192 (one "
                             f"64 x 64 dQ tile per consumer), got {self.block_m} at "
                             f"d{self.head_dim}")
        if self.stages < 1:
            raise ValueError(f"Sm90BwdConfig.stages: expected >= 1, got {self.stages}")
        if self.wave_split not in (0, 1, 2, 3):
            raise ValueError(f"Sm90BwdConfig.wave_split: expected 0, 1, 2 or 3, got "
                             f"{self.wave_split}")
        if self.wave_split and self.lpt_tail:
            raise ValueError("Sm90BwdConfig.wave_split: expected 0 with lpt_tail (the grid in "
                             "blockIdx order)")
        if self.producer_regs * 128 + self.consumer_regs * 128 * self.consumers > self.register_pool:
            raise ValueError(f"Sm90BwdConfig: register split {self.producer_regs} / "
                             f"{self.consumer_regs} exceeds the CTA's pool of "
                             f"{self.register_pool} registers")

    @property
    def register_pool(self) -> int:
        """Registers the CTA holds from launch: the per-thread cap of __launch_bounds__(threads, 1)
        (65536 / threads, rounded down to 8) times threads. setmaxnreg moves registers between
        warpgroups inside this pool; an inc that the decs cannot cover waits forever."""
        return register_pool(self.threads)

    @property
    def ds_k_major(self) -> bool:
        """dS stored [query][key] (FC_DS_K_MAJOR): dq_swap's layout, and only its."""
        return self.dq_swap

    @property
    def consumers(self) -> int:
        """Consumer warpgroups, 64 keys each."""
        return self.block_n // 64

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    @property
    def q_bytes(self) -> int:
        return self.block_m * self.head_dim * 2

    @property
    def kv_bytes(self) -> int:
        return self.block_n * self.head_dim * 2

    @property
    def ds_bytes(self) -> int:
        return self.block_n * self.block_m * 2

    @property
    def smem_bytes(self) -> int:
        """1024 B alignment slack + K + V + stages x (Q + dO + lse2 + delta) + 2 x dS + the step's
        fp32 dQ staging tile + the mbarriers (kv_full, full / empty per stage, dq_full / dq_empty:
        one pair per consumer with dq_frag), as the .cu lays them out."""
        barriers = 1 + 2 * self.stages + 2 * (self.consumers if self.dq_frag else 1)
        stats = 2 * self.block_m * 4
        staging = self.block_m * self.head_dim * 4
        return (1024 + 2 * self.kv_bytes + self.stages * (2 * self.q_bytes + stats)
                + 2 * self.ds_bytes + staging + BARRIER_BYTES * barriers)

    @property
    def name(self) -> str:
        return (f"flash_bwd_sm90_{DTYPE_NAME[self.dtype]}_d{self.head_dim}"
                f"_bm{self.block_m}_bn{self.block_n}_s{self.stages}"
                + ("_dsk" if self.ds_k_major else "") + ("_wd" if self.watchdog else "")
                + ("" if self.release_fence else "_nofence")
                # ("_dqw", "_early": the writer warp's staging and FA3's GEMM order, the only
                # forms since session 39; kept in the names the run records use)
                + "_dqw" + ("t" if self.dq_tma else "") + ("s" if self.dq_spread else "")
                + ("g" if self.dq_frag else "")
                + "_early" + ("_stm" if self.ds_stmatrix else "")
                + ("_swap" if self.dq_swap else "")
                + ("" if self.desc_add64 == (self.head_dim in DESC_ADD64_DIMS)
                   else f"_da{2 if self.desc_add64 else 1}")
                + (f"_pe{self.probs_early}" if self.probs_early != self.block_m // 8 else "")
                + (f"_em{self.probs_emu}" if self.probs_emu else "")
                + (f"_lpt{self.lpt_tail}" if self.lpt_tail else "")
                + (f"_ws{self.wave_split}" if self.wave_split else "")
                + ("_tl" if self.timeline else "")
                + defines_suffix(self.defines))

    def spec(self) -> KernelSpec:
        return KernelSpec.make(self.name, SOURCE, defines={
            "FC_DTYPE": DTYPE_CODE[self.dtype],
            "FC_HEAD_DIM": self.head_dim,
            "FC_BLOCK_M": self.block_m,
            "FC_BLOCK_N": self.block_n,
            "FC_STAGES": self.stages,
            "FC_PRODUCER_REGS": self.producer_regs,
            "FC_CONSUMER_REGS": self.consumer_regs,
            "FC_SMEM_BYTES": self.smem_bytes,
            "FC_DS_K_MAJOR": int(self.ds_k_major),
            "FC_WATCHDOG": int(self.watchdog),
            "FC_RELEASE_FENCE": int(self.release_fence),
            **({"FC_DQ_TMA": 1} if self.dq_tma else {"FC_DQ_FRAG": 1}),
            # only when set: the other kernels keep the specs (and cache keys) they had
            **({"FC_DQ_SPREAD": 1} if self.dq_spread else {}),
            **({"FC_DS_STMATRIX": 1} if self.ds_stmatrix else {}),
            **({"FC_DQ_SWAP": 1} if self.dq_swap else {}),
            **({"FC_DESC_ADVANCE": 2} if self.desc_add64 else {}),
            **({"FC_PROBS_EARLY": self.probs_early} if self.probs_early != self.block_m // 8
               else {}),
            **({"FC_PROBS_EMU": self.probs_emu} if self.probs_emu else {}),
            **({"FC_TIMELINE": 1} if self.timeline else {}),
            **({"FC_LPT_TAIL": self.lpt_tail} if self.lpt_tail else {}),
            **({"FC_WAVE_SPLIT": self.wave_split} if self.wave_split else {}),
            **dict(self.defines),
        })

    def aux(self) -> bwd_sm80.BwdSm80Config:
        """The bwd_sm80 configuration whose PRE and CONVERT kernels this family runs."""
        cfg = bwd_sm80.config_for(self.dtype, self.head_dim)
        if cfg is None or cfg.head_dim != self.head_dim:
            raise RuntimeError(f"{self.name}: bwd_sm80 has no d{self.head_dim} config for its "
                               f"PRE / CONVERT kernels (got {cfg})")
        return cfg

    def seqlen_pad(self, seqlen_q: int) -> int:
        """Rows of lse2 / delta / dq_accum: whole query blocks; also whole PRE blocks (aux_rows)
        where one divides the other (dq_swap's 80 rows against PRE's 64 would pad to 320: PRE's
        last block then stops at the padded length instead)."""
        aux = self.aux().aux_rows
        nested = self.block_m % aux == 0 or aux % self.block_m == 0
        step = lcm(self.block_m, aux) if nested else self.block_m
        return -(-seqlen_q // step) * step

    def grid(self, call: BwdCall) -> tuple[int, int, int]:
        """One CTA per work item: (key blocks, KV heads, batch)."""
        return (-(-call.seqlen_k // self.block_n), call.nheads_kv, call.batch)

    def timeline_shape(self, call: BwdCall) -> tuple[int, int, int, int]:
        """The timeline buffer (int64), a record per work item (CTA): [batch][nheads_kv]
        [key blocks][words]."""
        gx, gy, gz = self.grid(call)
        return (gz, gy, gx, TIMELINE_WORDS)


def _dq_mode(dq: str) -> dict[str, bool]:
    return {"dq_tma": dq == "tma", "dq_frag": dq == "frag"}


def configs() -> list[Sm90BwdConfig]:
    """Every specialisation dispatch or an A/B switch can pick (the CPU lane compiles them all):
    per dtype and head dim, the default dQ staging with and without the watchdog and with the
    release fence flipped from its head dim's default, and the other staging; the 80-query dQ^T
    forms; the P^T split defaults; the timeline variants, the causal tail, the last-wave split."""
    out = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            out += [Sm90BwdConfig(dtype, d, watchdog=w) for w in (False, True)]
            out.append(Sm90BwdConfig(dtype, d, release_fence=d not in FENCE_DIMS))
            # the staging that is not the head dim's default (A/B; frag at FRAG_DIMS only)
            out += [Sm90BwdConfig(dtype, d, **_dq_mode(dq)) for dq in DQ_MODES
                    if dq != DQ_DEFAULT[d] and (dq != "frag" or d in FRAG_DIMS)]
    # 80-query steps with dQ^T (calls without a mask, SWAP_DIMS / FLASHCUDA_SM90_BWD_SWAP), with
    # and without the watchdog
    out += [swapped(Sm90BwdConfig(dtype, d, watchdog=w)) for dtype in DTYPES
            for d in SWAP_HEAD_DIMS for w in (False, True)]
    # the defaults with the P^T split (FC_PROBS_EARLY) at PROBS_EARLY's head dims, and their
    # 80-query dQ^T forms
    for dtype in DTYPES:
        for d, k in PROBS_EARLY.items():
            split = Sm90BwdConfig(dtype, d, probs_early=k, probs_emu=PROBS_EMU.get(d, 0))
            out.append(split)
            if d in SWAP_HEAD_DIMS:
                out.append(swapped(split))
    # the timeline variants of the bf16 defaults (scripts/sm90_bwd_timeline.py)
    out += [Sm90BwdConfig(torch.bfloat16, d, timeline=True, probs_early=PROBS_EARLY.get(d),
                          probs_emu=PROBS_EMU.get(d, 0))
            for d in HEAD_DIMS]
    # causal calls' longest-first tail (LPT_TAIL; dispatched), and its timeline variant
    out += [Sm90BwdConfig(dtype, d, lpt_tail=k, probs_early=PROBS_EARLY.get(d),
                          probs_emu=PROBS_EMU.get(d, 0))
            for dtype in DTYPES for d, k in LPT_TAIL.items()]
    out += [Sm90BwdConfig(torch.bfloat16, d, timeline=True, lpt_tail=k,
                          probs_early=PROBS_EARLY.get(d), probs_emu=PROBS_EMU.get(d, 0))
            for d, k in LPT_TAIL.items()]
    # the last-wave split's pieces with the timeline (scripts/sm90_bwd_timeline.py; its MAIN's
    # timeline variant, built on first use, spills 8 bytes at d64: not listed here)
    out += [Sm90BwdConfig(torch.bfloat16, d, timeline=True, wave_split=2,
                          probs_early=PROBS_EARLY.get(d), probs_emu=PROBS_EMU.get(d, 0))
            for d in HEAD_DIMS]
    # the last-wave split's MAIN, pieces and tail-grid kernels (FC_WAVE_SPLIT; WAVE_SPLIT_DIMS /
    # LPT_LAUNCH_DIMS and their switches) of the bf16 defaults with the P^T split in blockIdx
    # order, d128's 80-query form included
    base = [c for c in out if c.dtype == torch.bfloat16 and not c.timeline and not c.watchdog
            and c.probs_early != c.block_m // 8 and not c.defines and not c.lpt_tail]
    out += [dataclasses.replace(c, wave_split=w) for c in base for w in (1, 2, 3)]
    return list(dict.fromkeys(out))  # (each once, in this order)


def select_config(dtype: torch.dtype, head_dim: int) -> Sm90BwdConfig:
    """FA3's tiles; FLASHCUDA_SM90_BWD_DQ=tma / frag (FRAG_DIMS only) the dQ staging (default
    DQ_DEFAULT); FLASHCUDA_SM90_BWD_WATCHDOG=1 the variant whose mbarrier waits give up instead
    of hanging; FLASHCUDA_SM90_BWD_FENCE=0 / 1 the release fence (default FENCE_DIMS);
    FLASHCUDA_SM90_BWD_DEFINES extra kernel defines (A/B)."""
    watchdog = os.environ.get(WATCHDOG_ENV, "").strip() == "1"
    fence = os.environ.get(FENCE_ENV, "").strip()
    if fence not in ("", "0", "1"):
        raise ValueError(f"{FENCE_ENV}: expected 0 or 1, got {fence!r}")
    dq = os.environ.get(DQ_ENV, "").strip().lower() or DQ_DEFAULT[head_dim]
    if dq not in DQ_MODES:
        raise ValueError(f"{DQ_ENV}: expected one of {', '.join(DQ_MODES)}, got {dq!r}")
    if dq == "frag" and head_dim not in FRAG_DIMS:
        raise ValueError(f"{DQ_ENV}=frag: head dim {head_dim} is not one of {FRAG_DIMS} (its "
                         f"consumers spill there); expected another {DQ_ENV} or unset")
    cfg = Sm90BwdConfig(dtype, head_dim, watchdog=watchdog,
                        release_fence=None if not fence else fence == "1",
                        defines=parse_defines(DEFINES_ENV, REMOVED_DEFINES), **_dq_mode(dq))
    # PROBS_EARLY / PROBS_EMU only in the kernel the measurements and the GPU tests ran (neither
    # the watchdog build nor a fence set by hand), however its settings were reached
    if is_default_kernel(cfg) and not watchdog and not fence:
        cfg = dataclasses.replace(cfg, probs_early=PROBS_EARLY.get(head_dim),
                                  probs_emu=PROBS_EMU.get(head_dim, 0))
    return cfg


def is_default_kernel(cfg: Sm90BwdConfig) -> bool:
    """Whether `cfg` is its head dim's default 64 / 128-query kernel — the dQ staging
    select_config gives with FLASHCUDA_SM90_BWD_DQ unset (or set to the default) — up to the
    watchdog, the release fence, extra defines, the P^T split and its exp2s on the FMA pipe, the
    causal tail, the timeline and the last-wave split. The 80-query dQ^T form and the P^T split
    are made of this kernel only."""
    plain = Sm90BwdConfig(cfg.dtype, cfg.head_dim)
    return dataclasses.replace(cfg, watchdog=False, release_fence=None, defines=(),
                               probs_early=None, probs_emu=0, lpt_tail=0, timeline=False,
                               wave_split=0) == plain


def swapped(cfg: Sm90BwdConfig) -> Sm90BwdConfig:
    """`cfg` at 80-query steps with dQ^T = K^T dS^T (FC_DQ_SWAP): the register-order dQ staging,
    dS stored [query][key]; the watchdog, fence, P^T split (FC_PROBS_EARLY) and extra defines
    kept."""
    split = cfg.probs_early if cfg.probs_early != cfg.block_m // 8 else None
    return Sm90BwdConfig(cfg.dtype, cfg.head_dim, block_m=SWAP_BLOCK_M,
                         watchdog=cfg.watchdog, release_fence=cfg.release_fence,
                         dq_swap=True, defines=cfg.defines, probs_early=split,
                         probs_emu=cfg.probs_emu, dq_frag=True)


def swap_for(call: BwdCall, cfg: Sm90BwdConfig) -> bool:
    """Whether `call`, for which select_config gave `cfg`, runs the 80-query dQ^T kernel: no
    mask, a head dim of SWAP_HEAD_DIMS, and FLASHCUDA_SM90_BWD_SWAP=1, or unset at SWAP_DIMS from
    SWAP_MIN_SEQLEN_Q query rows when `cfg` is the default kernel (is_default_kernel: an A/B of
    the 64-query kernel keeps 64 queries)."""
    raw = os.environ.get(SWAP_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{SWAP_ENV}: expected 0 or 1, got {raw!r}")
    if call.head_dim not in SWAP_HEAD_DIMS or call.window_left is not None \
            or call.window_right is not None or raw == "0":
        return False
    if raw == "1":
        return True
    return (call.head_dim in SWAP_DIMS and call.seqlen_q >= SWAP_MIN_SEQLEN_Q
            and is_default_kernel(cfg))


def config_for(call: BwdCall) -> Sm90BwdConfig:
    """The MAIN kernel `call` runs: select_config's, at 80-query steps where swap_for says so,
    with the causal tail longest-first where lpt_tail_for says so."""
    cfg = select_config(call.dtype, call.head_dim)
    if swap_for(call, cfg):
        cfg = swapped(cfg)
    if lpt_tail := lpt_tail_for(call):
        cfg = dataclasses.replace(cfg, lpt_tail=lpt_tail)
    return cfg


def lpt_tail_for(call: BwdCall, table: dict[int, int] | None = None) -> int:
    """FC_LPT_TAIL's K for `call`: `table` (LPT_TAIL; bwd_sm90_wide passes its own)[head_dim]
    when the mask has a right edge and no left one (causal: the earliest key blocks have the
    most steps), else 0 (every CTA the same work, or a sliding window's, unmeasured)."""
    if _right_edge_only(call):
        return (LPT_TAIL if table is None else table).get(call.head_dim, 0)
    return 0


def _right_edge_only(call: BwdCall) -> bool:
    """A causal mask (either alignment): a right edge and no left one, so key block 0 has the
    most steps."""
    return call.window_left is None and call.window_right is not None


def wave_split_for(call: BwdCall, cfg: Sm90BwdConfig) -> int:
    """The least steps of the items `call`'s MAIN kernel `cfg` may leave to the pieces kernel
    (FC_WAVE_SPLIT; wave_plan decides whether it does), or 0 for no split:
    FLASHCUDA_SM90_BWD_WAVE_SPLIT=1 (2, wherever it can), or unset WAVE_MIN_STEPS at
    WAVE_SPLIT_DIMS for calls without a mask; only a kernel in blockIdx order (_schedulable)."""
    if cfg.lpt_tail or not _schedulable(cfg):
        return 0
    raw = os.environ.get(WAVE_SPLIT_ENV, "").strip()
    if raw:
        return 2 if flag(WAVE_SPLIT_ENV, False) else 0
    unmasked = call.window_left is None and call.window_right is None
    return WAVE_MIN_STEPS if unmasked and call.head_dim in WAVE_SPLIT_DIMS else 0


def lpt_launch_for(call: BwdCall, cfg: Sm90BwdConfig) -> int:
    """The (KV head, batch) pairs `call`'s causal tail runs as a grid of its own after MAIN
    (FC_WAVE_SPLIT=3), or 0: a causal mask (lpt_tail_for's reading), FLASHCUDA_SM90_BWD_LPT_LAUNCH=1
    or unset at LPT_LAUNCH_DIMS with LPT_LAUNCH_BLOCKS key blocks, a kernel with the default
    in blockIdx order (a config's FC_LPT_TAIL gives way); LPT_LAUNCH_PAIRS,
    or all pairs when fewer."""
    lo, hi = LPT_LAUNCH_BLOCKS
    measured = call.head_dim in LPT_LAUNCH_DIMS and lo <= -(-call.seqlen_k // cfg.block_n) <= hi
    if not (_right_edge_only(call) and flag(LPT_LAUNCH_ENV, measured)):
        return 0
    if not _schedulable(cfg):
        return 0
    return min(LPT_LAUNCH_PAIRS, call.nheads_kv * call.batch)


def _schedulable(cfg: Sm90BwdConfig) -> bool:
    """Whether the last-wave split and the causal tail's grid (FC_WAVE_SPLIT) may take `cfg`:
    the kernels they were built and GPU-tested on — a head dim's default kernel (is_default_kernel;
    a causal tail of FC_LPT_TAIL gives way) or its 80-query dQ^T form, with none of the A/B
    builds (watchdog, a fence set by hand, extra defines)."""
    if cfg.watchdog or cfg.defines or cfg.timeline \
            or cfg.release_fence != (cfg.head_dim in FENCE_DIMS):
        return False
    return cfg.dq_swap or is_default_kernel(cfg)


def wave_sms(call: BwdCall) -> int:
    """The SMs the split plans for: the GPU's, or FLASHCUDA_SM90_BWD_WAVE_SMS (a positive
    integer; tests)."""
    raw = os.environ.get(WAVE_SMS_ENV, "").strip()
    if raw:
        if not (raw.isdigit() and int(raw) > 0):
            raise ValueError(f"{WAVE_SMS_ENV}: expected a positive integer, got {raw!r}")
        return int(raw)
    return torch.cuda.get_device_properties(_device_index(call)).multi_processor_count


def wave_plan(call: BwdCall, cfg: Sm90BwdConfig, sms: int,
              min_steps: int = 2) -> wave_split.WavePlan | None:
    """wave_split.plan of `call`'s grid under `cfg` (blockIdx order: key block fastest) on `sms`
    SMs, items of `min_steps` steps at least: each work item's steps are its key block's query
    blocks times the query heads per KV head."""
    blocks, _, _ = cfg.grid(call)
    total = blocks * call.nheads_kv * call.batch
    wl, wr = (int(w) for w in kernel_windows(call.seqlen_q, call.seqlen_k, call.window_left,
                                             call.window_right))
    group = call.nheads // call.nheads_kv
    per_block = [wave_split.query_blocks(call.seqlen_q, call.seqlen_k, wl, wr, cfg.block_m,
                                         cfg.block_n, n) * group for n in range(blocks)]
    return wave_split.plan(total, lambda item: per_block[item % blocks], sms, min_steps)


def enabled() -> bool:
    """On unless FLASHCUDA_ENABLE_SM90_BWD is 0 / false / no / off."""
    return switched_on(ENABLE_ENV)


def can_implement(call: BwdCall) -> str | None:
    """None if this family can run `call`, else the reason it cannot."""
    if not enabled():
        return GATED
    if why := call_problem(call, HEAD_DIMS):
        return why
    cfg = config_for(call)
    if why := layout_problem(call, cfg.block_m, cfg.block_n):
        return why
    b, sq, h, _ = call.q.shape
    if cfg.dq_tma and b * h * cfg.seqlen_pad(sq) >= MAX_DIM:
        return (f"dq_accum's {b * h * cfg.seqlen_pad(sq)} rows exceed the tensor map's int32 "
                f"coordinates ({DQ_ENV}=tma)")
    return smem_problem(call, cfg.name, cfg.smem_bytes)


# ---- what the sm90 backward families (bwd_sm90, bwd_sm90_wide) check and run alike -------------

def call_problem(call: BwdCall, head_dims: tuple[int, ...]) -> str | None:
    """The dtype, operand, head-dim, determinism, length and empty-dim checks of an sm90 backward
    family whose kernels exist for `head_dims`."""
    if call.dtype not in DTYPES:
        return f"dtype {call.dtype} is not fp16/bf16"
    if why := call.operand_problem():
        return why
    b, sq, h, d = call.q.shape
    sk = call.seqlen_k
    if d not in head_dims:
        return f"head_dim {d} is not one of {head_dims}"
    if call.deterministic:
        return "deterministic dQ is not implemented here (dQ is reduced with atomics)"
    if sq + sk >= bwd_sm80.MAX_SEQLEN_SUM:
        return f"seqlen_q + seqlen_k = {sq + sk} >= {bwd_sm80.MAX_SEQLEN_SUM}"
    if sq == 0 or sk == 0 or b == 0 or h == 0:
        return "an empty dim (a tensor map needs non-empty dims; bwd_sm80 handles it)"
    return None


def layout_problem(call: BwdCall, block_m: int, block_n: int) -> str | None:
    """The vector-access and TMA layout checks (boxes of block_m query / block_n key rows), then
    the device checks: CUDA tensors on the call's device, compute capability 9.0."""
    tensors = call.operands()
    for name, t in tensors.items():
        if why := vector_layout_problem(name, t):
            return why
    for name, rows in (("q", block_m), ("dout", block_m), ("k", block_n), ("v", block_n)):
        if why := bshd_problem(tensors[name], rows):
            return f"{name}: TMA: {why}"
    for name, t in {**tensors, "lse": call.lse}.items():
        if t.device != call.device or t.device.type != "cuda":
            return f"{name} is on {t.device}, not on the CUDA device {call.device}"
    cc, _ = bwd_sm80._device_info(_device_index(call))
    if cc != (9, 0):
        return f"GPU compute capability {cc[0]}.{cc[1]} is not 9.0 (sm_90a: wgmma, setmaxnreg)"
    return None


def smem_problem(call: BwdCall, name: str, smem_bytes: int) -> str | None:
    """Whether the GPU gives a block `smem_bytes` of shared memory."""
    _, per_block = bwd_sm80._device_info(_device_index(call))
    if smem_bytes > per_block:
        return f"{name} needs {smem_bytes} bytes of shared memory, the GPU has {per_block}"
    return None


def _device_index(call: BwdCall) -> int:
    return call.device.index if call.device.index is not None else torch.cuda.current_device()


def launch_args(call: BwdCall, sq_pad: int) -> tuple[tuple, tuple, tuple]:
    """The fixed (non-pointer) arguments of PRE, MAIN and CONVERT for `call` (MAIN's: dk / dv
    strides, lengths, heads, Sq_pad, scales, kernel windows)."""
    h, sq, d = call.nheads, call.seqlen_q, call.head_dim
    wl, wr = kernel_windows(sq, call.seqlen_k, call.window_left, call.window_right)
    scale = np.float32(call.softmax_scale)
    # run() copies a strided lse to a contiguous one: its strides are then (h * sq, sq, 1)
    lse_strides = call.lse.stride()[:2] if call.lse.stride(-1) == 1 else (h * sq, sq)
    pre = (*_strides(call.out), *_strides(call.dout), np.int64(lse_strides[0]),
           np.int64(lse_strides[1]), np.int32(sq), np.int32(h), np.int32(d), np.int32(sq_pad))
    main = (*_strides(call.dk), *_strides(call.dv), np.int32(sq), np.int32(call.seqlen_k),
            np.int32(h), np.int32(call.nheads_kv), np.int32(sq_pad),
            np.float32(call.softmax_scale * LOG2E), scale, wl, wr)
    convert = (*_strides(call.dq), np.int32(sq), np.int32(h), np.int32(d), np.int32(sq_pad),
               scale)
    return pre, main, convert


def scratch(call: BwdCall, sq_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse with unit last stride, lse2 [B, H, Sq_pad], delta [B, H, Sq_pad], dq_accum [B, H,
    Sq_pad, D]): the three fp32 buffers in one allocation."""
    b, h = call.batch, call.nheads
    lse = call.lse if call.lse.stride(-1) == 1 else call.lse.contiguous()
    rows = b * h * sq_pad
    buf = call.q.new_empty(rows * (2 + call.head_dim), dtype=torch.float32)
    return (lse, buf[:rows].view(b, h, sq_pad), buf[rows:2 * rows].view(b, h, sq_pad),
            buf[2 * rows:].view(b, h, sq_pad, call.head_dim))


def _strides(t: torch.Tensor) -> tuple[np.int64, np.int64, np.int64]:
    return np.int64(t.stride(0)), np.int64(t.stride(1)), np.int64(t.stride(2))


@dataclass(frozen=True)
class _Plan:
    """What a call's layout decides once: the config and the three kernels' launches, their
    grids and every argument that does not change with the data addresses fixed (a call packs
    only pointers and tensor maps)."""

    cfg: Sm90BwdConfig
    sq_pad: int
    pre: PreparedLaunch  # out, dout, lse, lse2, delta, dq_accum
    main: PreparedLaunch  # map_q, map_k, map_v, map_dout, lse2, delta, dq_accum, dk, dv
    convert: PreparedLaunch  # dq_accum, dq
    # the last-wave split (FC_WAVE_SPLIT): the plan, the pieces kernel's launch (MAIN's pointers,
    # then table, part, part_steps) and its piece table (int32 [pieces, 4] on the device)
    wave: wave_split.WavePlan | None = None
    pieces: PreparedLaunch | None = None
    table: torch.Tensor | None = None
    # the causal tail's own grid after MAIN (FC_WAVE_SPLIT=3; lpt_launch_for) and whether MAIN
    # has CTAs besides (else only the tail grid runs)
    tail: PreparedLaunch | None = None
    tail_main: bool = False


_KEY_ENV = env_names(ENABLE_ENV, WATCHDOG_ENV, DQ_ENV, FENCE_ENV, DEFINES_ENV,
                    CONVERT_SPANS_ENV, SWAP_ENV,
                    WAVE_SPLIT_ENV, WAVE_SMS_ENV, WAVE_PDL_ENV, LPT_LAUNCH_ENV)


def _plan_key(call: BwdCall) -> tuple:
    """Everything can_implement and the plan read, except the data addresses (only their
    alignment, which TMA and the vector accesses care about): a hit skips can_implement, so a
    field missing here would let a call the family refuses reach the kernel."""
    return (call.dtype, call.device, call.deterministic, call.window_left, call.window_right,
            call.softmax_scale, env_values(_KEY_ENV), *call.layouts())


def _build_plan(call: BwdCall, timeline: bool = False) -> _Plan:
    if why := can_implement(call):
        raise NotImplementedError(f"flash_bwd_sm90 cannot run this call: {why}")
    cfg = config_for(call)
    tail_pairs = 0 if timeline else lpt_launch_for(call, cfg)
    min_steps = 0 if tail_pairs else wave_split_for(call, cfg)
    wave = wave_plan(call, cfg, wave_sms(call), min_steps) if min_steps else None
    if wave is not None or tail_pairs:
        cfg = dataclasses.replace(cfg, wave_split=1, lpt_tail=0)
    if timeline:  # (with the split: MAIN's and the pieces' records, one buffer)
        cfg = dataclasses.replace(cfg, timeline=True)
    aux = cfg.aux()
    b, sq, h = call.batch, call.seqlen_q, call.nheads
    sq_pad = cfg.seqlen_pad(sq)
    dev = call.device
    pre_args, main_args, convert_args = launch_args(call, sq_pad)
    # any tensor of the call stands for a pointer argument's kind (run() passes the addresses)
    t = call.lse
    main_maps = tuple(bshd_map(x, rows) for x, rows in ((call.q, cfg.block_m),
                                                        (call.k, cfg.block_n),
                                                        (call.v, cfg.block_n),
                                                        (call.dout, cfg.block_m)))
    if cfg.dq_tma:  # any map stands for map_dq's kind (run() passes the call's own)
        main_maps += main_maps[:1]
    pieces = table = None
    if wave is not None:
        pieces = PreparedLaunch(get_kernel(dataclasses.replace(cfg, wave_split=2).spec(), dev),
                                (len(wave.pieces), 1, 1), (cfg.threads, 1, 1), cfg.smem_bytes,
                                main_maps + (t,) * (9 if cfg.timeline else 8) + main_args,
                                fixed=len(main_args),
                                programmatic=wave.main_ctas > 0 and flag(WAVE_PDL_ENV, True))
        table = torch.tensor(wave.pieces, dtype=torch.int32, device=dev)
        main_args += (np.int32(wave.first_main),)
    tail = None
    tail_main = 0 < tail_pairs < call.nheads_kv * call.batch  # (MAIN has CTAs besides the tail)
    if tail_pairs:  # the first pairs' CTAs: MAIN skips them, the tail grid runs them
        blocks = -(-call.seqlen_k // cfg.block_n)
        tail = PreparedLaunch(get_kernel(dataclasses.replace(cfg, wave_split=3).spec(), dev),
                              (tail_pairs, blocks, 1), (cfg.threads, 1, 1), cfg.smem_bytes,
                              main_maps + (t,) * 5 + main_args, fixed=len(main_args),
                              programmatic=tail_main)
        main_args += (np.int32(tail_pairs * blocks if tail_main else 0),)
    return _Plan(
        cfg, sq_pad,
        pre=PreparedLaunch(get_kernel(aux.pre_spec(), dev),
                           (-(-sq_pad // aux.aux_rows), h, b),
                           (bwd_sm80.AUX_THREADS,), 0, (t,) * 6 + pre_args,
                           fixed=len(pre_args)),
        main=PreparedLaunch(get_kernel(cfg.spec(), dev), cfg.grid(call), (cfg.threads, 1, 1),
                            cfg.smem_bytes,
                            main_maps + (t,) * (6 if cfg.timeline else 5) + main_args,
                            fixed=len(main_args)),
        convert=PreparedLaunch(get_kernel(convert_spec(cfg), dev),
                               (-(-sq // convert_rows(cfg)), h, b), (bwd_sm80.AUX_THREADS,), 0,
                               (t,) * 2 + convert_args, fixed=len(convert_args)),
        wave=wave, pieces=pieces, table=table, tail=tail, tail_main=tail_main)


def convert_spec(cfg: Sm90BwdConfig) -> KernelSpec:
    """The CONVERT that reads `cfg`'s dq_accum: FC_DQ_FRAG_T's for dq_swap, FC_DQ_FRAG_M's for
    dq_frag (span reader unless FLASHCUDA_SM90_BWD_CONVERT_SPANS=0), else the row-major one."""
    aux = cfg.aux()
    if cfg.dq_swap:
        return aux.convert_t_spec(cfg.block_m)
    return aux.convert_spec(cfg.block_m if cfg.dq_frag else 0, flag(CONVERT_SPANS_ENV, True))


def convert_rows(cfg: Sm90BwdConfig) -> int:
    """Query rows per CONVERT CTA: one dq_swap tile, else PRE's aux_rows."""
    return cfg.block_m if cfg.dq_swap else cfg.aux().aux_rows


_plans = PlanCache(_build_plan)
_timeline_plans = PlanCache(lambda call: _build_plan(call, timeline=True))


def _plan(call: BwdCall) -> _Plan:
    return _plans.plan(_plan_key(call), call)


def run(call: BwdCall, timeline: torch.Tensor | None = None) -> None:
    """Fill call.dq, call.dk, call.dv. Raises NotImplementedError when can_implement(call) says
    no. PRE and CONVERT are bwd_sm80's kernels, launched as bwd_sm80.run launches them. A repeat
    call with the same layout reuses its plan (can_implement's verdict included: the plan key
    holds everything it reads). `timeline` (run_timeline's; dispatch never passes one): MAIN is
    the profiling variant of the call's config, writing its per-CTA records into this int64
    tensor (timeline_shape, zeroed by the caller)."""
    plan = _plan(call) if timeline is None else _timeline_plans.plan(_plan_key(call), call)
    cfg = plan.cfg
    lse, lse2, delta, dq_accum = scratch(call, plan.sq_pad)
    lse2_at, delta_at, accum_at = (x.data_ptr() for x in (lse2, delta, dq_accum))
    handle = launch_stream(plan.main.kernel.device_index)  # (once for the three launches)
    plan.pre(call.out.data_ptr(), call.dout.data_ptr(), lse.data_ptr(), lse2_at, delta_at,
             accum_at, handle=handle)
    maps = (bshd_map(call.q, cfg.block_m).raw, bshd_map(call.k, cfg.block_n).raw,
            bshd_map(call.v, cfg.block_n).raw, bshd_map(call.dout, cfg.block_m).raw)
    if cfg.dq_tma:
        maps += (rows_f32_map(dq_accum, cfg.block_m).raw,)
    pointers = (lse2_at, delta_at, accum_at, call.dk.data_ptr(), call.dv.data_ptr())
    records = () if timeline is None else (timeline.data_ptr(),)
    if plan.tail is not None:  # MAIN without the first pairs, then their grid (no timeline)
        if plan.tail_main:
            plan.main(*maps, *pointers, handle=handle)
        plan.tail(*maps, *pointers, handle=handle)
    elif plan.wave is not None:  # the first items as pieces, MAIN's CTAs the rest
        grads = plan.wave.slots * 2 * cfg.block_n * cfg.head_dim  # fp32 dK / dV sums per slot
        part = torch.zeros(grads + plan.wave.slots, dtype=torch.float32, device=call.device)
        # (timeline: MAIN's records, then the pieces' from record `total` on)
        pieces_records = () if timeline is None else (
            timeline.data_ptr() + 8 * TIMELINE_WORDS * plan.wave.total,)
        if plan.wave.main_ctas:
            plan.main(*maps, *pointers, *records, handle=handle)
        plan.pieces(*maps, *pointers, *pieces_records, plan.table.data_ptr(), part.data_ptr(),
                    part.data_ptr() + 4 * grads, handle=handle)
    else:
        plan.main(*maps, *pointers, *records, handle=handle)
    plan.convert(accum_at, call.dq.data_ptr(), handle=handle)


def run_timeline(call: BwdCall) -> tuple[Sm90BwdConfig, torch.Tensor]:
    """The call's backward (as run) with MAIN's timeline variant (FC_TIMELINE; never dispatched):
    its config and the per-CTA records, an int64 tensor of timeline_shape (the .cu's kTl* words,
    TIMELINE_FIELDS; zeroed before the launch, so a word no thread wrote reads 0). Asynchronous
    like run: synchronise before reading the records. With the last-wave split (cfg.wave_split):
    [total + pieces, words], MAIN's records in blockIdx order (its skipped CTAs write none), then
    one per piece in the table's order."""
    plan = _timeline_plans.plan(_plan_key(call), call)  # (raises as run does)
    cfg = plan.cfg
    shape = cfg.timeline_shape(call) if plan.wave is None else (
        plan.wave.total + len(plan.wave.pieces), TIMELINE_WORDS)
    buf = torch.zeros(shape, dtype=torch.int64, device=call.device)
    run(call, timeline=buf)
    return cfg, buf


@register
def variants() -> Iterator[tuple[KernelSpec, tuple[str, ...]]]:
    for cfg in configs():
        yield cfg.spec(), ARCHS
        if cfg.dq_swap:  # its CONVERT reads the transposed register-order tiles
            yield convert_spec(cfg), ARCHS
        elif cfg.dq_frag:  # its CONVERT reads the register-order dq_accum (both readers: A/B)
            yield cfg.aux().convert_spec(cfg.block_m, spans=True), ARCHS
            yield cfg.aux().convert_spec(cfg.block_m, spans=False), ARCHS

"""The sm90a forward kernel family (FlashAttention-3 design: TMA, mbarriers, wgmma, a producer
warpgroup and two consumer warpgroups with setmaxnreg), fp16/bf16, head dims 64, 128, 192, 256.

Status: proven on the H200 (tests/gpu/test_fwd_sm90.py against the float64 oracle; records in
docs/EVIDENCE.md); dispatch prefers it on compute capability 9.0. FLASHCUDA_ENABLE_SM90=0 turns it
off (dispatch then runs fwd_sm80); FLASHCUDA_SM90_PERSISTENT=0 launches one CTA per work tile.
Scheduling: the consumer warpgroups take turns issuing GEMMs (ping-pong) and, with a causal or
window mask and seqlen_q >= 4k, persistent CTAs walk the work tiles in snake order;
FLASHCUDA_SM90_PINGPONG=0|1 and FLASHCUDA_SM90_SNAKE=0|1 override either for A/B runs.
Masked calls (causal, window) get the masked-V guarantee: a NaN / Inf in V reaches only the rows
that see its key (the masked-V kernel: + a clean V tile per consumer; FLASHCUDA_SM90_FWD_MASKED_V=0
for A/B), by default in two passes (two_passes: the kernel without masked V, reporting per CTA
whether any O value it computed is NaN / Inf, then the masked-V kernel for the CTAs that did;
FLASHCUDA_SM90_FWD_NAN_FIXUP=0 runs the masked-V kernel alone). d128
kernels write the softmax into both arms of the mask branch (SOFTMAX_IN_ARMS), which keeps
ptxas's P V wait after the exp2s. A work tile's boundary (session 17): every kernel decodes its
next work tile under the last P V with magic-number divisions (fast_div_args) and every masked-V
kernel scans V in its producer warpgroup; two Q buffers and O by a TMA store where they fit
(with_boundary; FLASHCUDA_SM90_FWD_Q_STAGES=1 and _O_TMA=0 turn either off for A/B runs).
FLASHCUDA_SM90_FWD_DEFINES builds A/B variants of the .cu's knobs.

`Sm90FwdConfig` is the single source of truth of a specialisation: tiles, stages, warpgroups,
register split, shared memory (the .cu static_asserts the same layout), the name, the defines.

    head dim   mask      block_m x block_n, stages   smem     consumers x registers
    64         none      192 x 128, 2                 89 KB    3 x 160  (FA3's d64 tiles)
    64         causal    192 x 128 from seqlen_q 2k, else 128 x 128 (+ a clean V tile per
                         consumer: 137 / 113 KB)
    128        none      128 x 128, 2                 161 KB   2 x 240  (FA4's d128 tiles)
    128        causal    128 x 128, 2                 226 KB   2 x 240  (161 + 2 clean V tiles)
    192        none      128 x 80, 2 (two Q buffers)  217 KB   2 x 240  (below seqlen_q 2k)
    192        any       128 x 112, 2 from seqlen_q 2k 222 KB   2 x 240  (FA4's d192 tiles; the
                         masked-V second pass: 1 stage + 2 clean V tiles)
    192        causal    128 x 64, 2 below 2k         193 KB   2 x 240  (+ 2 clean V tiles)
    256        none      128 x 80, 2                  226 KB   2 x 240  (FA3's d256 tiles)
    256        causal    128 x 64, 2 below 2k, 128 x 80 from it (the masked-V second
                         pass: 1 stage + 2 clean V tiles, 193 KB)
    A/B        none      128 x 176 at d128 (FLASHCUDA_SM90_TILES=d128=bm128_bn176, FA3's)
    A/B        any       128 x 128, 2 (FLASHCUDA_SM90_TILES=bm128_bn128)
The producer warpgroup keeps 24 registers per thread: 128 * 24 + 256 * 240 = 64512 and
128 * 24 + 384 * 160 = 64512 of the 65536-register file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .._env import env_names, env_values, flag, switched_on
from ..jit import KernelSpec, PreparedLaunch, get_kernel, launch_stream, register
from ..jit.tensor_map import bshd_map, bshd_problem
from ..reference import key_range
from .call import (
    DTYPE_CODE,
    DTYPE_NAME,
    LOG2E,
    REMOVED_SM90_DEFINES,
    SMEM_OPTIN,
    FwdCall,
    PlanCache,
    StreamBuffers,
    defines_suffix,
    parse_defines,
    register_pool,
    vector_layout_problem,
)
from .fwd_sm80 import MAX_SEQLEN_SUM, _device_index, _device_info

SOURCE = "attention/flash_fwd_sm90.cu"
ARCHS = ("sm_90a",)
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 192, 256)
ENABLE_ENV = "FLASHCUDA_ENABLE_SM90"
PERSISTENT_ENV = "FLASHCUDA_SM90_PERSISTENT"
GATED = f"fwd_sm90 is turned off ({ENABLE_ENV}=0)"
BARRIER_BYTES = 8


@dataclass(frozen=True)
class Sm90FwdConfig:
    """One specialisation of flash_fwd_sm90.cu."""

    dtype: torch.dtype
    head_dim: int
    block_m: int = 128
    block_n: int = 128
    stages: int = 2
    producer_regs: int = 24
    consumer_regs: int = 240
    pingpong: bool = False  # consumer warpgroups take turns issuing GEMMs (FC_PINGPONG)
    snake: bool = False  # snake order of work tiles over the persistent CTAs (FC_SNAKE)
    # profiling variant: two more kernel arguments (a buffer, its slots per consumer) receive
    # each work tile's start / end time (FC_TIMELINE; scripts/sm90_timeline.py); never dispatched
    timeline: bool = False
    # NaN / Inf in V reaches only the rows that see its key, also in partly seen tiles (windowed
    # calls, by default; FLASHCUDA_SM90_FWD_MASKED_V=0 is the A/B variant; + a clean V tile per
    # consumer)
    masked_v: bool = False
    # The two passes of a windowed call (NAN_FIXUP, the host's default since session 22): the
    # first, a kernel without masked V, reports per CTA whether any O value it computed is NaN /
    # Inf (FC_NAN_FLAGS: one more kernel argument, nan_flags); the second, the masked-V kernel
    # with the same grid and schedule, redoes the work tiles of the CTAs that reported one and
    # exits at once in the others (FC_NAN_FIXUP)
    nan_flags: bool = False
    nan_fixup: bool = False
    # The work-tile boundary's parts that depend on the room (session 17: on by default, each
    # where it fits; with_boundary). In every kernel, whatever these say: the next work tile
    # decoded under the last P V, by magic numbers (fast_div_args), and with masked_v the V
    # scanner in the producer warpgroup (+ 4 barrier slots per stage; scanner_regs).
    # Q buffers (FC_Q_STAGES): the next work tile's Q loads while the current one's last key
    # tiles run
    q_stages: int = 1
    # O through a shared-memory staging tile per consumer and a TMA store (FC_O_TMA): one more
    # kernel argument, map_o
    o_tma: bool = False
    # extra compile-time defines (FLASHCUDA_SM90_FWD_DEFINES="NAME=VALUE,..."): A/B variants of a
    # kernel knob the .cu documents (e.g. FC_MASK_BITS=0); never chosen by default
    defines: tuple = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"Sm90FwdConfig.dtype: expected fp16 or bf16, got {self.dtype}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"Sm90FwdConfig.head_dim: expected one of {HEAD_DIMS}, "
                             f"got {self.head_dim}")
        if self.block_m not in (128, 192):
            raise ValueError(f"Sm90FwdConfig.block_m: expected 128 or 192 (two or three consumer "
                             f"warpgroups), got {self.block_m}")
        if self.block_n not in (64, 80, 112, 128, 176):
            raise ValueError(f"Sm90FwdConfig.block_n: expected 64, 80, 112, 128 or 176, "
                             f"got {self.block_n}")
        if self.stages < 1:
            raise ValueError(f"Sm90FwdConfig.stages: expected >= 1, got {self.stages}")
        if self.nan_flags and self.masked_v:
            raise ValueError("Sm90FwdConfig.nan_flags: the first pass is a kernel without "
                             "masked_v")
        if self.nan_fixup and not self.masked_v:
            raise ValueError("Sm90FwdConfig.nan_fixup: the second pass is a masked_v kernel")
        if self.q_stages not in (1, 2):
            raise ValueError(f"Sm90FwdConfig.q_stages: expected 1 or 2, got {self.q_stages}")
        if (self.producer_regs * 128 + self.consumer_regs * 128 * self.consumers
                > register_pool(self.threads)):
            raise ValueError(f"Sm90FwdConfig: register split {self.producer_regs} / "
                             f"{self.consumer_regs} exceeds the CTA's pool of "
                             f"{register_pool(self.threads)} registers at launch")

    @property
    def consumers(self) -> int:
        """Consumer warpgroups, 64 query rows each."""
        return self.block_m // 64

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
    def smem_bytes(self) -> int:
        """1024 B alignment slack + q_stages x Q + stages x (K + V) [+ the clean V tiles] [+ the
        O staging tiles] + the mbarriers (as the .cu lays out)."""
        barriers = 2 * self.q_stages + 4 * self.stages
        barriers += 4 * self.stages if self.masked_v else 0  # the scanners' v_scanned[], ...
        clean = self.consumers * self.kv_bytes if self.masked_v else 0
        # FC_O_TMA's staging tiles (with masked V: in the clean V tiles, no bytes of their own)
        staged = self.o_tma and not self.masked_v
        staging = self.consumers * 64 * self.head_dim * 2 if staged else 0
        return (1024 + self.q_stages * self.q_bytes + 2 * self.stages * self.kv_bytes + clean
                + staging + BARRIER_BYTES * barriers)

    @property
    def name(self) -> str:
        """The kernel's name. `_ms` (the V scanner, with `_mv`) and `_fd_da` (the magic-number
        divisions and the decode ahead) name parts that every such kernel has since session 39,
        when their A/B switches went: kept, so that names match the run records before it."""
        return (f"flash_fwd_sm90_{DTYPE_NAME[self.dtype]}_d{self.head_dim}"
                f"_bm{self.block_m}_bn{self.block_n}_s{self.stages}{'_pp' if self.pingpong else ''}"
                f"{'_sn' if self.snake else ''}{'_tl' if self.timeline else ''}"
                f"{'_mv' if self.masked_v else ''}{'_nf' if self.nan_flags else ''}"
                f"{'_fx' if self.nan_fixup else ''}"
                f"{f'_q{self.q_stages}' if self.q_stages != 1 else ''}"
                f"{'_ot' if self.o_tma else ''}{'_ms' if self.masked_v else ''}_fd_da"
                + defines_suffix(self.defines))

    @property
    def windowed(self) -> bool:
        """A kernel built for windowed calls: the masked-V kernel or the first pass before it."""
        return self.masked_v or self.nan_flags

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
            "FC_PINGPONG": int(self.pingpong),
            "FC_SNAKE": int(self.snake),
            **({"FC_TIMELINE": 1} if self.timeline else {}),
            **({"FC_MASKED_V": 1} if self.masked_v else {}),
            **({"FC_NAN_FLAGS": 1} if self.nan_flags else {}),
            **({"FC_NAN_FIXUP": 1} if self.nan_fixup else {}),
            **({"FC_Q_STAGES": self.q_stages} if self.q_stages != 1 else {}),
            **({"FC_O_TMA": 1} if self.o_tma else {}),
            "FC_SOFTMAX_IN_ARMS": int(self.head_dim in SOFTMAX_IN_ARMS),
            **({"FC_MASK_BITS": 1} if MASK_BITS and self.windowed and self.block_n <= 128 else {}),
            **({"FC_EXP_SPLIT": EXP_SPLIT[self.head_dim]} if self.head_dim in EXP_SPLIT else {}),
            **({"FC_RESCALE_EARLY": 1} if self.head_dim in RESCALE_EARLY else {}),
            **({"FC_O_QUAD": 1} if self.block_m in O_QUAD.get(self.head_dim, ()) else {}),
            **dict(self.defines),
        })

    def work_tiles(self, call: FwdCall) -> int:
        """(query block, head, batch) tiles the persistent CTAs walk."""
        return math.ceil(call.seqlen_q / self.block_m) * call.nheads * call.batch

    def grid(self, call: FwdCall, sms: int) -> tuple[int, int, int]:
        """Persistent: one CTA per SM (one fits: 384 threads with 240-register consumers).
        With FLASHCUDA_SM90_PERSISTENT=0, one CTA per work tile (the same kernel runs its loop
        once), the hardware scheduler balancing: for A/B measurements."""
        tiles = self.work_tiles(call)
        if os.environ.get(PERSISTENT_ENV, "1").strip() == "0":
            return (max(1, tiles), 1, 1)
        return (max(1, min(tiles, sms)), 1, 1)


# (block_m, block_n) per head dim, mask and length, by measurement (docs/perf-notes.md, "FA3's
# tiles"): FlashAttention-3's 192 x 128 at d64 (three consumer warpgroups share each K/V tile)
# wins 12-21% without a mask and at causal 16k but loses 20% at causal 1k (fewer, longer work
# tiles for the diagonal); re-measured in session 15 (after the ping-pong, O_QUAD and the L2
# sections): at causal d64 192 rows win +5-6% at 2k and +6.5-9% at 4k, lose 7% at 512 / 1k
# (three same-run A/Bs, perf-notes "causal d64 forward tiles, again"). d128: 128 x 128
# everywhere (FA4's). 128 x 176 without a mask won 2-4% from 4k on in session 2, before the
# ping-pong and the softmax in the mask's arms; with the exp2s split around the P V wait
# (EXP_SPLIT), 128 x 128 wins +2.4-5.6% at 4k-16k (session 13,
# "d128 tiles and the exp2 split" in perf-notes).
TILES_192_FROM = 2048  # causal / windowed d64: 192-row tiles from this seqlen_q on
# d192 / d256 (session 26): two consumer warpgroups of 64 rows. A warpgroup's O takes
# kHeadDim / 2 registers per thread (128 at d256), and two stages of K / V tiles must fit beside
# a 128-row Q tile. Without a mask FA3's d256 tiles, 128 x 80 (1 KB + 64 KB + 2 x 2 x 40 KB =
# 225 KB of the 227 KB; d192: + a second Q buffer, 217 KB). Same-process A/Bs (H200, perf-notes
# "head dims 192 and 256"): 80 keys against 64 at d256 +3.8 to +5.9% at 1k-16k (4c36094), at
# d192 +5.5 to +7.3% (3ec4f06). With a causal / window mask, 80 keys from 2k since
# session 29, 64 below: the first pass is the 80-key kernel without masked V; the second
# (masked-V, run for the CTAs whose first pass saw a NaN / Inf) must share its tiles and gets one
# K / V stage (_config: at two it would not fit at d192, 229 KB). Same-process A/Bs (f59cdfa,
# perf-notes session 29), 80 keys against 64, causal: d256 +5.4 / +6.5% at 4k / 16k, +1.1% at
# 2k, -4.4 / -8.1% at 512 / 1k; d192 +6.2 / +9.3% at 4k / 16k, +3.5% at 2k, -7.2% at 512, 0 at 1k
# (the diagonal's masked share of a tile grows with its keys, and short calls have few tiles).
# FLASHCUDA_SM90_TILES=d192=bm128_bn64,d256=bm128_bn64 builds the 64-key kernels (A/B).
# d192 from WIDE_LONG_FROM: FA4's 128 x 112 (its _tile_size_fwd_sm90, causal or not), one Q
# buffer (1 KB + 48 KB + 2 x 2 x 42 KB = 222 KB; the masked-V second pass: one K / V stage and
# its clean V tiles). Same-process A/B (67c649e, perf-notes session 32), 112 keys against the
# default: without a mask +4.0 / +8.0 / +8.0 / +6.8% at 2k / 4k / 8k / 16k (+3.7% at 512, -1.0% at
# 1k: 1024 keys are 10 tiles of 112, the last with 16 keys, against 13 of 80); causal +3.2 /
# +3.4 / +6.2 / +7.9% at 2k - 16k, -11% at 512, +0.4% at 1k. FLASHCUDA_SM90_TILES=d192=bm128_bn80
# (or =bm128_bn112 at every length) for A/Bs.
WIDE_TILES = {192: (128, 80), 256: (128, 80)}  # without a window below WIDE_LONG_FROM
WIDE_LONG_TILES = {192: (128, 112), 256: (128, 80)}  # from WIDE_LONG_FROM, with a window or not
WIDE_WINDOWED_SHORT = (128, 64)  # with a window below it
WIDE_LONG_FROM = 2048
LONG = 8192  # a long call (the default seqlen_q of select_config)


def tiles_for(head_dim: int, windowed: bool, seqlen_q: int) -> tuple[int, int]:
    if head_dim == 64:
        return (192, 128) if not windowed or seqlen_q >= TILES_192_FROM else (128, 128)
    if head_dim in WIDE_TILES:
        if seqlen_q >= WIDE_LONG_FROM:
            return WIDE_LONG_TILES[head_dim]
        return WIDE_WINDOWED_SHORT if windowed else WIDE_TILES[head_dim]
    return (128, 128)


# Every (block_m, block_n) tiles_for returns, per head dim; 128 x 128 is also the A/B baseline
# (FLASHCUDA_SM90_TILES=bm128_bn128 at every head dim, or d64=bm192_bn128,d128=bm128_bn176 ...).
# Tried and removed: d128's 128 x 192 (FA4's sm90 tile without a mask; 225 KB, one Q buffer, no
# O tensor store), 3-8% behind 128 x 128 at 2k-16k on the H200 (session 47, docs/perf-notes.md).
SHAPES = {64: ((192, 128), (128, 128)), 128: ((128, 176), (128, 128)),
          192: ((128, 80), (128, 64), (128, 112)), 256: ((128, 80), (128, 64))}
WINDOWED_TILES = {64: ((192, 128), (128, 128)), 128: ((128, 128),),  # tiles_for with a window
                  192: ((128, 80), (128, 64), (128, 112)), 256: ((128, 80), (128, 64))}
TILES_ENV = "FLASHCUDA_SM90_TILES"
CONSUMER_REGS = {2: 240, 3: 160}  # per consumer thread; the producer keeps 24


# Scheduling variants, measured on the H200 (docs/perf-notes.md, "ping-pong and snake order",
# "snake order from 4k", "snake order for few rounds"): ping-pong wins almost everywhere; the snake order
# only where work per tile differs (causal / window), and there from seqlen_q 4k, or when the
# work tiles make at most SNAKE_ROUNDS rounds over the SMs (the last round's imbalance is then a
# large share of the call: -10 to -22% kernel time at 2-6 rounds, -2.5% at 11.6, +1% at 15.5).
# Both env vars override the rule either way (0 or 1) for A/B runs.
PINGPONG_ENV = "FLASHCUDA_SM90_PINGPONG"  # consumer warpgroups take turns issuing GEMMs
SNAKE_ENV = "FLASHCUDA_SM90_SNAKE"  # snake order of work tiles over the persistent CTAs
SNAKE_FROM = 4096  # seqlen_q from which a masked call walks its tiles in snake order
SNAKE_ROUNDS = 12  # ... and below it, when its work tiles are at most this many per SM
# Exceptions, by same-process A/Bs on the H200 (session 28, perf-notes "ping-pong and snake at
# the short masked calls"): d64's windowed 128-row tiles (causal / window below 2k) run without
# ping-pong (causal 1k +3.6 / +4.3%, 512 +-0.6%; its 192-row tiles keep it: -7% at causal 2k
# without), and d192 keeps the snake order only from SNAKE_FROM (few rounds with it: causal 512
# -4.3 / -5.3%, 1k -3.7 / -4.2%; 2k / 4k within +-1%).
NO_PINGPONG_WINDOWED = ((64, 128),)  # (head dim, block_m)
NO_FEW_ROUNDS_SNAKE = (192,)  # head dims
# the masked-V variant for windowed calls: on by default (session 9: 1-5% on causal calls, the
# scans of the masked tiles); 0 builds the kernel that lets 0 x NaN through (A/B; see the .cu)
MASKED_V_ENV = "FLASHCUDA_SM90_FWD_MASKED_V"
# K / V ring depth for calls without a window (A/B; default 2, FA3's and FA4's; a third stage fits
# at 128 keys: 1 KB + Q 32 KB + 3 x 64 KB at d128). Windowed calls keep 2 (their masked-V clean
# tiles would not fit with a third).
STAGES_ENV = "FLASHCUDA_SM90_FWD_STAGES"
# The work-tile boundary's parts, on by default since session 17 (perf-notes "the work-tile
# boundary, made the default": together -2.8 to +11.7% at 512-4k, gains at 15 of 16 points, and
# -1.3 to +2.2% at 8k-16k, same-run A/Bs; none gains alone: each shortens one link of a chain
# the two consumers run in lock step). The decode ahead, the magic-number divisions and masked
# V's scanner are in every kernel (their switches, FLASHCUDA_SM90_FWD_DECODE_AHEAD / _FAST_DIV /
# _MV_SCANNER, went in session 39); the two parts that need room each have a switch, set to its
# OFF_SWITCHES value for the kernel without it (A/B): Q_STAGES=1 (one Q buffer), O_TMA=0 (O by
# the consumers' own stores). See FC_Q_STAGES and FC_O_TMA in the .cu.
Q_STAGES_ENV = "FLASHCUDA_SM90_FWD_Q_STAGES"  # 1 | 2 (where the second Q tile fits: not d128 mv)
O_TMA_ENV = "FLASHCUDA_SM90_FWD_O_TMA"
OFF_SWITCHES = {Q_STAGES_ENV: "1", O_TMA_ENV: "0"}


DEFINES_ENV = "FLASHCUDA_SM90_FWD_DEFINES"  # NAME=VALUE,... (A/B of a kernel knob)
# knobs taken out of the kernels in session 39 (their headers list them; perf-notes has the
# numbers), and FC_LEAN_STEP in session 49 (+1.6 / +0.5% at d64, inside p10-p90, and -0.9% at
# d128 on the H200): DEFINES_ENV refuses them
REMOVED_DEFINES = REMOVED_SM90_DEFINES + (
    "FC_CROSS_TILE", "FC_DESC_EARLY", "FC_FIRST_HALF", "FC_SMEM_PAD", "FC_FAST_DIV",
    "FC_DECODE_AHEAD", "FC_MV_SCANNER", "FC_MV_SCAN_UNROLL", "FC_L2_SECTIONS", "FC_LEAN_STEP")
# Head dims whose kernel writes the softmax into both arms of the mask branch (FC_SOFTMAX_IN_ARMS,
# the .cu): ptxas then keeps the P V wait after the exp2s, and the softmax overlaps the P V within
# the warpgroup. Same-run A/B (session 9, docs/perf-notes.md): d128 +3-8% (16k: 567 -> 610
# TFLOP/s without a mask, 548 -> 588 causal), d64 -2-4% (its three warpgroups' ping-pong already
# hides the softmax; the duplicated code costs more than the overlap gives).
SOFTMAX_IN_ARMS = (128, 192, 256)  # (d192 / d256: FC_SOFTMAX_IN_ARMS=0 -7 to -18%, session 26)
# Column groups (of 8 keys) whose exp2s run before the previous P V's wait, per head dim; the rest
# run after it, among the O rescale and the packing (FC_EXP_SPLIT, the .cu; FlashAttention 4's
# placement). Same-run A/B (session 13, perf-notes): d128 +0-5% (with 128 x 128 tiles +2.4-5.6%
# at 4k-16k without a mask, causal -1 to +3%), d64 -1 to +2% (noise: not used). d128's k = 6 of
# 16 groups (was 8) from session 19's same-process A/B (scripts/ab_probe.py): +1.6 to +2.2% at 4k
# and 8k, causal and not, against k = 8; 4, 10, 12 slower. An
# FLASHCUDA_SM90_FWD_DEFINES=FC_EXP_SPLIT=0 run builds the unsplit kernel (A/B).
# d192 / d256: 3 of the 8 (64 keys) or 10 (80 keys) groups, about d128's share; session 26 at
# 64 keys: FC_EXP_SPLIT=0 0 to -6.7%
EXP_SPLIT = {128: 6, 192: 3, 256: 3}
# Head dims whose kernel rescales O by the previous key tile's correction while the scores GEMM
# runs, before the P V (FC_RESCALE_EARLY, the .cu; FA4's rescale_O_before_gemm above d128; inert
# in the masked-V kernels). Same-process A/B (session 33, e2ca481, with ping-pong): d256 +0.6 /
# +2.3 / +0.9 / +3.3% at 4k / 4k causal / 16k / 16k causal, all beyond p10-p90; d192 -1.0 to
# -1.8% (not used there). FLASHCUDA_SM90_FWD_DEFINES=FC_RESCALE_EARLY=0 builds the old order.
RESCALE_EARLY = (256,)
# The windowed (masked-V) kernels test a masked tile's scores against a bit mask of each lane's
# visible columns (FC_MASK_BITS, the .cu; 128-key tiles). Same-run A/B (session 18, perf-notes):
# causal forward +0.3 to +3.4% at 512-8k (the masked first tile of every causal work tile is on
# its critical path); the unwindowed kernels, which mask only ragged edge tiles, keep the compares
# (not measured with it). FLASHCUDA_SM90_FWD_DEFINES=FC_MASK_BITS=0 builds the compares (A/B).
MASK_BITS = True
# Query-block heights (block_m) whose kernel stores O in 16-byte stores after a transpose within
# each quad (FC_O_QUAD, the .cu), per head dim. Same-run A/B (session 14, perf-notes): d128
# +2-11% (512-1k +6-11%, 4k +2-3.5%, 8k causal 0), the per-work-tile epilogue 2.1 -> 0.9 us
# (forward timeline); d64 with 192-row tiles +1.4-3.4% without a mask, with 128-row tiles (the
# causal ones, then below 8k, now below 2k) -1 to -3.6%: not used there.
O_QUAD = {128: (128,), 64: (192,), 192: (128,), 256: (128,)}


def _defines() -> tuple:
    return parse_defines(DEFINES_ENV, REMOVED_DEFINES)


def _config(dtype: torch.dtype, head_dim: int, block_m: int, block_n: int,
            pingpong: bool | None = None, snake: bool | None = None,
            windowed: bool = False, seqlen_q: int = LONG,
            masked_v: bool | None = None, few_rounds: bool = False,
            boundary: dict | None = None) -> Sm90FwdConfig:
    """The config of these tiles; `boundary` (with_boundary's parts) in place of the env's."""
    if pingpong is None:
        pingpong = flag(PINGPONG_ENV,
                        not (windowed and (head_dim, block_m) in NO_PINGPONG_WINDOWED))
    if snake is None:
        few_rounds = few_rounds and head_dim not in NO_FEW_ROUNDS_SNAKE
        snake = flag(SNAKE_ENV, windowed and (seqlen_q >= SNAKE_FROM or few_rounds))
    if masked_v is None:  # without a window every key below seqlen_k is seen by every row;
        # built for the windowed tiles only (d128 x 176 with a clean tile per consumer would not fit)
        masked_v = (windowed and flag(MASKED_V_ENV, True)
                    and (block_m, block_n) in WINDOWED_TILES[head_dim])
    cfg = Sm90FwdConfig(dtype, head_dim, block_m, block_n,
                        consumer_regs=CONSUMER_REGS[block_m // 64], pingpong=pingpong,
                        snake=snake, masked_v=masked_v, defines=_defines())
    if cfg.masked_v:
        cfg = scanner_regs(cfg)
    if cfg.masked_v and cfg.smem_bytes > SMEM_OPTIN:
        # d256's masked-V kernel: its two clean V tiles fit beside one K / V stage only. It runs
        # as the second of two passes (two_passes), for the CTAs whose first pass saw a NaN / Inf
        cfg = dataclasses.replace(cfg, stages=1)
    stages = _stages()
    if stages != cfg.stages and not (windowed or cfg.masked_v):
        cfg = dataclasses.replace(cfg, stages=stages)
        if cfg.smem_bytes > SMEM_OPTIN:
            raise ValueError(f"{STAGES_ENV}={stages}: {cfg.name} would need {cfg.smem_bytes} "
                             f"bytes of shared memory (at most {SMEM_OPTIN}); expected fewer "
                             f"stages or smaller tiles ({TILES_ENV})")
    if boundary is None:
        boundary = dict(q_stages=_q_stages(), o_tma=flag(O_TMA_ENV, True))
    return with_boundary(cfg, **boundary)


BOUNDARY = dict(q_stages=2, o_tma=True)
BOUNDARY_OFF = dict(q_stages=1, o_tma=False)


def with_boundary(cfg: Sm90FwdConfig, *, q_stages: int, o_tma: bool) -> Sm90FwdConfig:
    """`cfg` (without them) with the work-tile boundary's parts that need room, each where it
    fits: the second Q buffer and O's staging tiles only within SMEM_OPTIN (in this order: d128's
    masked-V kernels keep one Q buffer and stage O in their clean V tiles)."""
    if q_stages == 2 and (two := dataclasses.replace(cfg, q_stages=2)).smem_bytes <= SMEM_OPTIN:
        cfg = two
    if o_tma and (staged := dataclasses.replace(cfg, o_tma=True)).smem_bytes <= SMEM_OPTIN:
        cfg = staged
    return cfg


def scanner_regs(cfg: Sm90FwdConfig) -> Sm90FwdConfig:
    """`cfg` (a masked-V kernel, whose producer warpgroup runs the V scanner) with its register
    split: from d128 the producer warpgroup gets 32 registers (its consumers 8 fewer than
    CONSUMER_REGS): at 24 ptxas spills one of the producer's loop invariants once the scan
    requests are computed beside the loads."""
    if cfg.head_dim < 128:
        return cfg
    return dataclasses.replace(cfg, producer_regs=32,
                               consumer_regs=CONSUMER_REGS[cfg.consumers] - 8)


def _q_stages() -> int:
    raw = os.environ.get(Q_STAGES_ENV, "").strip()
    if raw not in ("", "1", "2"):
        raise ValueError(f"{Q_STAGES_ENV}: expected 1 or 2, got {raw!r}")
    return int(raw or 2)


def _stages() -> int:
    raw = os.environ.get(STAGES_ENV, "").strip()
    if not raw:
        return 2
    if raw not in ("1", "2", "3", "4"):
        raise ValueError(f"{STAGES_ENV}: expected 1, 2, 3 or 4, got {raw!r}")
    return int(raw)


def select_config(dtype: torch.dtype, head_dim: int, windowed: bool = False,
                  seqlen_q: int = LONG, *, few_rounds: bool = False) -> Sm90FwdConfig:
    """The tiles of tiles_for, or those FLASHCUDA_SM90_TILES=bm<M>_bn<N> forces (A/B runs).
    few_rounds: the call's work tiles are at most SNAKE_ROUNDS per SM (see _plan)."""
    forced = os.environ.get(TILES_ENV, "").strip()
    if forced:
        for item in forced.split(","):
            dim, _, tiles = item.strip().rpartition("=")
            m = re.fullmatch(r"bm(\d+)_bn(\d+)", tiles)
            if not m or (dim and not re.fullmatch(r"d\d+", dim)):
                raise ValueError(f"{TILES_ENV}: expected bm<M>_bn<N> or a comma list of "
                                 f"d<D>=bm<M>_bn<N> (e.g. d64=bm128_bn128), got {forced!r}")
            if not dim or dim == f"d{head_dim}":
                return _config(dtype, head_dim, int(m.group(1)), int(m.group(2)),
                               windowed=windowed, seqlen_q=seqlen_q, few_rounds=few_rounds)
    return _config(dtype, head_dim, *tiles_for(head_dim, windowed, seqlen_q),
                   windowed=windowed, seqlen_q=seqlen_q, few_rounds=few_rounds)


# Head dims whose timeline and boundary A/B variants configs() precompiles (d192 / d256: the
# dispatched kernels and their passes only; an A/B run there compiles its variant on first use)
AB_HEAD_DIMS = (64, 128)


def configs() -> list[Sm90FwdConfig]:
    """Every specialisation dispatch or an A/B run can pick (the CPU lane compiles them all):
    the timeline variants of the ping-pong kernels (bf16: scripts/sm90_timeline.py), the
    masked-V variants of the kernels with windowed tiles, and for dispatch's kernels the A/B
    variants without one of the work-tile boundary's parts that need room (one Q buffer, O by
    the consumers' stores: OFF_SWITCHES)."""
    out = [_config(dtype, d, bm, bn, pingpong, snake, masked_v=mv) for dtype in DTYPES
           for d, shapes in SHAPES.items() for bm, bn in shapes
           for pingpong in (False, True) for snake in (False, True)
           for mv in (False, True) if not mv or (bm, bn) in WINDOWED_TILES[d]]
    out += [dataclasses.replace(c, timeline=True) for c in out
            if c.dtype == torch.bfloat16 and c.pingpong and not c.masked_v
            and c.head_dim in AB_HEAD_DIMS]
    # the A/B variants the GPU lane runs (tests/gpu/test_fwd_sm90.py, with dispatch's tiles and
    # pipeline: ping-pong, except the windowed tiles of NO_PINGPONG_WINDOWED)
    bare = [_config(c.dtype, c.head_dim, c.block_m, c.block_n, c.pingpong, c.snake,
                    masked_v=c.masked_v, boundary=BOUNDARY_OFF) for c in out
            if (c.pingpong or (c.masked_v and (c.head_dim, c.block_m) in NO_PINGPONG_WINDOWED))
            and not c.timeline and c.head_dim in AB_HEAD_DIMS
            and (c.block_m, c.block_n) in (tiles_for(c.head_dim, False, LONG),
                                           tiles_for(c.head_dim, True, 1),
                                           tiles_for(c.head_dim, True, LONG))]
    # the two passes of dispatch's windowed calls (two_passes; with ping-pong, and without it
    # where NO_PINGPONG_WINDOWED says)
    out += [p for c in out if c.masked_v and not c.timeline
            and (c.pingpong or (c.head_dim, c.block_m) in NO_PINGPONG_WINDOWED)
            for p in (first_pass(c), second_pass(c))]
    out += [with_boundary(c, **{**BOUNDARY, part: BOUNDARY_OFF[part]}) for c in bare
            for part in BOUNDARY]
    return list({c.name: c for c in out}.values())


def enabled() -> bool:
    """On unless FLASHCUDA_ENABLE_SM90 is 0 / false / no / off."""
    return switched_on(ENABLE_ENV)


def can_implement(call: FwdCall) -> str | None:
    """None if this family can run `call`, else the reason it cannot."""
    if not enabled():
        return GATED
    if call.dtype not in DTYPES:
        return f"dtype {call.dtype} is not fp16/bf16"
    for name in ("k", "v", "out"):
        if getattr(call, name).dtype != call.dtype:
            return f"{name}.dtype {getattr(call, name).dtype} differs from q.dtype {call.dtype}"
    d = call.head_dim
    if d not in HEAD_DIMS:
        return f"head_dim {d} is not one of {HEAD_DIMS}"
    if call.k.shape[3] != d or call.v.shape[3] != d:
        return f"k/v head dims {call.k.shape[3]}/{call.v.shape[3]} differ from q's {d}"
    if call.nheads_kv <= 0 or call.nheads % call.nheads_kv:
        return f"nheads {call.nheads} is not a multiple of nheads_kv {call.nheads_kv}"
    if call.seqlen_q + call.seqlen_k >= MAX_SEQLEN_SUM:
        return f"seqlen_q + seqlen_k = {call.seqlen_q + call.seqlen_k} >= {MAX_SEQLEN_SUM}"
    if call.seqlen_k == 0:
        return "seqlen_k is 0 (a tensor map needs non-empty dims; fwd_sm80 handles it)"
    if not (math.isfinite(call.softmax_scale) and call.softmax_scale > 0):
        return f"softmax_scale must be positive and finite, got {call.softmax_scale}"
    if why := vector_layout_problem("out", call.out):
        return why
    cfg = select_config(call.dtype, d, call.is_local, call.seqlen_q)
    if cfg.work_tiles(call) >= 2**31:
        return f"{cfg.work_tiles(call)} work tiles exceed the kernel's int32 tile index"
    if call.batch and call.seqlen_q and call.nheads:
        maps = (("q", cfg.block_m), ("k", cfg.block_n), ("v", cfg.block_n))
        for name, rows in maps + ((("out", 64),) if cfg.o_tma else ()):
            if why := vector_layout_problem(name, getattr(call, name)):
                return why
            if why := bshd_problem(getattr(call, name), rows):
                return f"{name}: TMA: {why}"
    lse = call.lse
    if (lse.dtype != torch.float32 or tuple(lse.shape) != (call.batch, call.nheads, call.seqlen_q)
            or not lse.is_contiguous()):
        return "lse must be a contiguous float32 (batch, nheads, seqlen_q) tensor"
    if call.device.type != "cuda":
        return f"tensors are on {call.device}, not on a CUDA device"
    cc, per_block, _ = _device_info(_device_index(call.device))
    if cc != (9, 0):
        return f"GPU compute capability {cc[0]}.{cc[1]} is not 9.0 (sm_90a: wgmma, setmaxnreg)"
    if cfg.smem_bytes > per_block:
        return f"{cfg.name} needs {cfg.smem_bytes} bytes of shared memory, the GPU has {per_block}"
    return None


def kernel_args(call: FwdCall, cfg: Sm90FwdConfig, by_block: int | None = None,
                grid_x: int | None = None, nan_flags: torch.Tensor | None = None) -> tuple:
    """map_q, map_k, map_v [, map_o with FC_O_TMA], out, lse [, nan_flags for either of the two
    passes: NAN_FLAG_BYTES uint8 per CTA], then `constant_args` and `fast_div_args`, which need
    the grid's CTA count `grid_x`."""
    if (cfg.nan_flags or cfg.nan_fixup) != (nan_flags is not None):
        raise ValueError(f"{cfg.name}: nan_flags goes with the two passes' kernels only")
    flags = () if nan_flags is None else (nan_flags,)
    return (*_maps(call, cfg), call.out, call.lse, *flags,
            *constants(call, cfg, by_block, grid_x))


def constants(call: FwdCall, cfg: Sm90FwdConfig, by_block: int | None = None,
              grid_x: int | None = None) -> tuple:
    """The trailing kernel arguments a call's layout fixes: constant_args + fast_div_args."""
    if grid_x is None:
        raise ValueError(f"{cfg.name}: the schedule's magic numbers need the grid's CTA count")
    return constant_args(call, by_block) + fast_div_args(call, cfg, by_block, grid_x)


def fast_div_magic(d: int) -> int:
    """n // d for 0 <= n < 2**31 as the kernel's fast_quo computes it, (umulhi(n, mul) + n) >>
    shift, packed as mul | shift << 32: shift = ceil(log2 d), mul = 2**32 (2**shift - d) // d + 1
    (Granlund and Montgomery's round-up method, exact for n and d below 2**31)."""
    if not 0 < d < 2**31:
        raise ValueError(f"fast_div_magic: expected 0 < d < 2**31, got {d}")
    shift = (d - 1).bit_length()
    mul = (2**32 * (2**shift - d)) // d + 1
    return mul | shift << 32


def fast_div_args(call: FwdCall, cfg: Sm90FwdConfig, by_block: int | None, grid_x: int) -> tuple:
    """The schedule's ten arguments after constant_args (Magic in the .cu): the magic numbers of
    num_m, the (batch, head) pairs (unused by the kernel since the plain by_block order went in
    session 39), a section's tiles, by_block, the last section's pairs, nheads, the query heads
    per K / V head and the grid's CTA count (np.uint64), then the section count and the last
    section's pairs (np.int32). Divisors a call does not use (by_block 0: no sections) get 1."""
    num_m = math.ceil(call.seqlen_q / cfg.block_m)
    heads = call.nheads * call.batch
    b = int(call.is_local if by_block is None else by_block)
    sections = -(-heads // b) if b > 0 else 0
    last = heads - (sections - 1) * b if b > 0 else 1
    divisors = (num_m, heads, num_m * b, b, last, call.nheads, call.nheads // call.nheads_kv,
                grid_x)
    return (*(np.uint64(fast_div_magic(max(d, 1))) for d in divisors), np.int32(sections),
            np.int32(last))


def _maps(call: FwdCall, cfg: Sm90FwdConfig) -> tuple:
    """The call's tensor maps: q, k, v, and out's (a 64 x 64 box, the store) with FC_O_TMA."""
    maps = (bshd_map(call.q, cfg.block_m), bshd_map(call.k, cfg.block_n),
            bshd_map(call.v, cfg.block_n))
    return maps + (bshd_map(call.out, 64),) if cfg.o_tma else maps


def constant_args(call: FwdCall, by_block: int | None = None) -> tuple:
    """out strides (int64: batch, row, head), seqlen_q, seqlen_k, nheads, nheads_kv (int32),
    scale_log2 (float32), window_left, window_right, batch, by_block (int32; by_block: the
    causal / window schedule, see Schedule in the .cu: 0 without a mask, else the (batch, head)
    pairs per L2 section, `by_block` when given): what a call's layout fixes."""
    wl, wr = call.kernel_windows()
    o = call.out
    return (
        np.int64(o.stride(0)), np.int64(o.stride(1)), np.int64(o.stride(2)),
        np.int32(call.seqlen_q), np.int32(call.seqlen_k), np.int32(call.nheads),
        np.int32(call.nheads_kv), np.float32(call.softmax_scale * LOG2E), wl, wr,
        np.int32(call.batch), np.int32(call.is_local if by_block is None else by_block),
    )


# Of the L2 that one section's K and V may fill, by head dim: 0.35 at d64 / d128 since session 56
# (0.75 before). While a section runs, its Q loads and O stores pass through the L2 too, and with
# K and V at 75% the lighter query blocks found them evicted: ncu on an H100 at 32 x 512 causal
# read K and V 1.5x (d128) / 1.9x (d64) from DRAM, a kernel 77% DRAM-busy (cuDNN's reads them
# once). Same-process A/B on the H100 (perf-notes, session 56): 0.35 +16 / +13% at d128 / d64
# 32 x 512 causal, +22% at d128 16 x 1k, +6% at 8 x 2k, +6% at 4 x 4k, d64 1k / 2k even; 0.15-0.35
# alike. On the H200 (session 12, 2k-8k causal, compute-bound there) 0.35 measured -0.8 to +2.0%.
# d192 / d256 keep 0.75 (session 57): a head's K / V is so large there that 0.35 leaves one or two
# heads a section at 4k-16k; on the H100 0.35 lost 6.9% at d256 4 x 4k causal, 3.1% at 2 x 8k
# (a less even static walk, and K / V re-read: scripts/l2_model.py), even at 16 x 1k.
L2_SECTION_SHARE = {64: 0.35, 128: 0.35, 192: 0.75, 256: 0.75}
L2_SHARE_ENV = "FLASHCUDA_SM90_FWD_L2_SHARE"  # another share in (0, 1] (A/B of the section size)


def l2_share(head_dim: int) -> float:
    """L2_SECTION_SHARE at `head_dim`, or FLASHCUDA_SM90_FWD_L2_SHARE's value (an A/B, every head
    dim); ValueError naming the variable unless a number in (0, 1]."""
    raw = os.environ.get(L2_SHARE_ENV, "").strip()
    if not raw:
        return L2_SECTION_SHARE[head_dim]
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise ValueError(f"{L2_SHARE_ENV}: expected a number in (0, 1], got {raw!r}")
    return share


def schedule_arg(call: FwdCall, cfg: Sm90FwdConfig, l2_bytes: int,
                 ctas: int | None = None) -> int | None:
    """The kernel's by_block argument when it is not the call's is_local: the L2 section of a
    causal / window call (Schedule in the .cu), else None. Given the grid's CTA count `ctas`, the
    section is the size whose static schedule ends evenest (balanced_section in l2_balance's
    mode)."""
    if call.is_local:
        per = l2_section(call, l2_bytes)
        mode = l2_balance() if ctas is not None else 0
        if mode:
            per = balanced_section(call, cfg, per, ctas, mode)
        return per
    return None


def l2_section(call: FwdCall, l2_bytes: int) -> int:
    """(batch, head) pairs per section of the causal / window order (L2 sections): as many whole
    groups of query heads (a group shares one K / V head) as keep their K and V within
    L2_SECTION_SHARE (l2_share, by head dim) of `l2_bytes`, at least one group, at most every
    pair. Sections start at multiples of the size, which are multiples of the group, so a
    section's pairs read size / group K / V heads."""
    group = call.nheads // call.nheads_kv
    kv_head = 2 * call.seqlen_k * call.head_dim * call.q.element_size()  # K and V of one head
    groups = max(1, int(l2_share(call.head_dim) * l2_bytes) // max(kv_head, 1))
    return min(groups * group, call.batch * call.nheads)


# balanced_section: the modelled fixed cost of a work tile, in key tiles (the forward timeline at
# 1 x 16384 x 8 d128 causal, session 21: 1.3-3.7 us fixed against 1.5 us per key tile); the
# model runs for calls of at most BALANCE_ROUNDS rounds of work tiles over the CTAs (past that
# the last section's imbalance is a small part of a CTA's work; and the model's cost stays a few
# ms at most). FLASHCUDA_SM90_FWD_L2_BALANCE (the default 3): 0 keeps the largest section, 1
# weighs the even splits only, 2 every size up to the largest (whole groups), 3 the even splits'
# choice unless a size of any whole number of groups makes the static walk EVERY_SIZE_GAIN
# evener. Session 58 (H100, ab_probe): every size (2) against the even splits (1) +9.5% at d128
# 3 x 3000 x 8 causal (modelled makespan 1.120 -> 1.035 of the mean), +1.0 / +1.6% at d64
# 4 / 16 x 1k x 32, but -0.3% at d128 8 x 1k x 16 (1.031 -> 1.008), and where the model ties,
# the larger size it keeps lost: -1.9% at d128 32 x 512 x 16 (64 -> 69 pairs), -5.7% at d256
# 16 x 1k x 16 (22 -> 33 pairs). So a size off the even splits is taken only for a clear gain.
TILE_FIXED_COST = 1.0
BALANCE_ROUNDS = 64
EVERY_SIZE_GAIN = 0.03
L2_BALANCE_ENV = "FLASHCUDA_SM90_FWD_L2_BALANCE"


def l2_balance() -> int:
    """FLASHCUDA_SM90_FWD_L2_BALANCE, balanced_section's mode: 3 (unset or empty) the even
    splits' size, or every size's where that is EVERY_SIZE_GAIN evener; 1 the even splits only,
    2 every size, 0 off; ValueError naming the variable for any other value."""
    raw = os.environ.get(L2_BALANCE_ENV, "").strip() or "3"
    if raw not in ("0", "1", "2", "3"):
        raise ValueError(f"{L2_BALANCE_ENV}: expected 0, 1, 2, 3 or unset, got {raw!r}")
    return int(raw)


def key_tiles_per_block(call: FwdCall, cfg: Sm90FwdConfig) -> np.ndarray:
    """Key tiles each query block of `cfg.block_m` rows visits (Schedule::block's n_first ..
    n_last from mask.cuh's key range, reference.key_range), by block index."""
    wl, wr = (int(w) for w in call.kernel_windows())
    sq, sk, bm, bn = call.seqlen_q, call.seqlen_k, cfg.block_m, cfg.block_n
    tiles = []
    for m0 in range(0, sq, bm):
        lo, hi = key_range(m0, min(m0 + bm, sq), sq, sk, wl, wr)
        tiles.append((hi - 1) // bn - lo // bn + 1 if hi > lo else 0)
    return np.array(tiles, dtype=np.int64)


def section_order(num_m: int, heads: int, per: int) -> tuple[np.ndarray, np.ndarray]:
    """(query block, batch * head) of each work tile in the L2 sections' order with `per` pairs
    per section (the .cu's Schedule::block, vectorised), by work tile index."""
    t = np.arange(num_m * heads, dtype=np.int64)
    s = t // (num_m * per)
    size = np.minimum(per, heads - s * per)
    sections = -(-heads // per)
    within = t - s * num_m * per
    within = np.where((sections - 1 - s) & 1, num_m * size - 1 - within, within)
    return num_m - 1 - within // size, s * per + within % size


def static_cta(total: int, ctas: int, snake: bool) -> np.ndarray:
    """The persistent CTA that takes each of `total` work tiles (the .cu's walk_next: round
    robin, every other round reversed with the snake), by work tile index."""
    t = np.arange(total, dtype=np.int64)
    rnd, col = t // ctas, t % ctas
    return np.where(snake & ((rnd & 1) == 1), ctas - 1 - col, col)


def section_makespan(key_tiles: np.ndarray, heads: int, per: int, ctas: int,
                     snake: bool) -> float:
    """The most modelled work one CTA gets (key tiles + TILE_FIXED_COST per work tile) when the
    persistent CTAs walk the L2 sections' order of `per` pairs per section statically."""
    blocks, _ = section_order(len(key_tiles), heads, per)
    cost = key_tiles[blocks] + TILE_FIXED_COST
    cta = static_cta(len(blocks), ctas, snake)
    return float(np.bincount(cta, weights=cost, minlength=ctas).max())


def balanced_section(call: FwdCall, cfg: Sm90FwdConfig, largest: int, ctas: int,
                     mode: int = 1) -> int:
    """Pairs per L2 section no larger than `largest` (l2_section's) whose static schedule ends
    evenest by section_makespan, the larger on a tie (l2_balance's `mode`). Mode 1 weighs
    `largest` and, for each section count up to twice its, the even split (whole groups); mode 2
    every whole number of groups up to `largest` as well; mode 3 takes mode 2's size only where
    its makespan is EVERY_SIZE_GAIN below mode 1's (no size ends below the mean work per CTA, so
    the wider search runs only where mode 1's is that far above it). A last section much smaller
    than the others leaves the static walk uneven (1 x 16384 x 8 d128 causal, sections of 5 and
    3 pairs: CTAs' work 948-1052 key tiles, the last CTA 43 us past the mean; of 4 and 4: even).
    Host time, once per new shape: over 864 causal shapes at most 2.8 ms in mode 1, 7.5 ms in
    mode 3 (the CPU lane's machine, session 58)."""
    heads = call.batch * call.nheads
    group = call.nheads // call.nheads_kv
    if largest >= heads or cfg.work_tiles(call) > BALANCE_ROUNDS * ctas:
        return largest
    groups, most = heads // group, largest // group
    counts = range(-(-groups // most), -(-groups // max(1, most // 2)) + 1)
    # (each even split is at most `largest`: k >= groups / most sections)
    even_sizes = {largest, *(group * -(-groups // k) for k in counts)}
    key_tiles = key_tiles_per_block(call, cfg)
    spans: dict[int, float] = {}

    def evenest(sizes: set[int]) -> int:
        best = None
        for per in sorted(sizes, reverse=True):
            if per not in spans:
                spans[per] = section_makespan(key_tiles, heads, per, ctas, cfg.snake)
            if best is None or spans[per] < spans[best] * (1 - 1e-3):
                best = per
        return best

    even = evenest(even_sizes)
    if mode == 1:
        return even
    if mode == 3:
        mean = float(key_tiles.sum() + len(key_tiles) * TILE_FIXED_COST) * heads / ctas
        if spans[even] * (1 - EVERY_SIZE_GAIN) < mean:
            return even
    every = evenest(even_sizes | {group * g for g in range(1, most + 1)})
    if mode == 2 or spans[every] <= spans[even] * (1 - EVERY_SIZE_GAIN):
        return every
    return even


# Windowed calls in two passes (FC_NAN_FLAGS, FC_NAN_FIXUP in the .cu; the default since session
# 22): the kernel without masked V, which reports per CTA whether any O value it computed is NaN /
# Inf, then the masked-V kernel on the same grid and schedule, which exits at once in every CTA
# that reported none and redoes the work tiles of the others. The same guarantee as the masked-V
# kernel alone (a NaN / Inf of V reaches only the rows that see its key): in a row that does not
# see a key, that key's NaN / Inf can only arrive as 0 * NaN or 0 * Inf, i.e. as NaN, which the
# first pass reports. Same-process A/B at a5e271e (H200): the kernel without masked V +8.3 / +6.2%
# at d64 causal 512 / 1k, +13.3 / +11.7 / +8.2 / +3.6% at d128 causal 512 / 1k / 2k / 16k.
# FLASHCUDA_SM90_FWD_NAN_FIXUP=0: the masked-V kernel alone (A/B).
NAN_FIXUP_ENV = "FLASHCUDA_SM90_FWD_NAN_FIXUP"
NAN_FLAG_BYTES = 16  # per CTA (kNanFlagBytes: one per consumer warp)
# 1: the second pass launched as the first's programmatic dependent (the first pass's CTAs
# execute griddepcontrol.launch_dependents at entry; the second's wait with griddepcontrol.wait
# before they read the report), so its launch and CTA start overlap the first pass's tail
# instead of following it (A/B; the kernels are the same either way). Measured in one process
# at 22a1942 (H200): -1.1 to +0.7% at causal 512-2k, inside p10-p90 everywhere — a miss
# (perf-notes, session 22); the default is the plain launch after the first pass.
PDL_ENV = "FLASHCUDA_SM90_FWD_PDL"


def first_pass(cfg: Sm90FwdConfig) -> Sm90FwdConfig:
    """The first of the two passes whose second is the masked-V kernel `cfg`: its tiles,
    ping-pong, order and boundary parts (the second Q buffer and O's own staging tiles where
    they fit, which the clean V tiles' room denies d128's masked-V kernel), without masked V,
    reporting non-finite O (FC_NAN_FLAGS)."""
    bare = _config(cfg.dtype, cfg.head_dim, cfg.block_m, cfg.block_n, cfg.pingpong, cfg.snake,
                   windowed=True, masked_v=False,
                   boundary=dict(q_stages=_q_stages(), o_tma=cfg.o_tma))
    return dataclasses.replace(bare, nan_flags=True)


def second_pass(cfg: Sm90FwdConfig) -> Sm90FwdConfig:
    """The masked-V kernel `cfg` as the second of the two passes (FC_NAN_FIXUP). With two
    consumer warpgroups its producer warpgroup gets 32 registers (the consumers 8 fewer, as
    `scanner_regs` gives d128): at d64's 128-row tiles ptxas spilled 12 / 28 bytes of the producer's
    at 24 once the kernel starts by reading the first pass's report."""
    out = dataclasses.replace(cfg, nan_fixup=True)
    if out.consumers == 2 and out.producer_regs < 32:
        out = dataclasses.replace(out, producer_regs=32, consumer_regs=out.consumer_regs - 8)
    return out


def two_passes(cfg: Sm90FwdConfig) -> tuple[Sm90FwdConfig, Sm90FwdConfig] | None:
    """(first pass, second pass) for a call `cfg` would run alone, or None: only masked-V kernels
    get a first pass, and FLASHCUDA_SM90_FWD_NAN_FIXUP=0 keeps them alone."""
    if not cfg.masked_v or not flag(NAN_FIXUP_ENV, True):
        return None
    return first_pass(cfg), second_pass(cfg)


# The two passes in one kernel (flash_fwd_sm90_fused.cu): every CTA walks its work tiles as the
# first pass, and a CTA whose consumers saw a NaN / Inf in O walks them again as the masked-V
# kernel, in the same launch. Saves the second launch (session 22: 2.2 µs of kernel time plus the
# gap between the kernels, the two passes' whole cost over the first pass alone).
# Same-process A/B (H200, 13 rounds, causal forward, against the two launches): session 35
# +1.6 / +1.1% at d64 512 / 1k, +2.6 / +0.9% at d128 512 / 1k, 0 at d192 512, -2.9% at d256 512
# (its fused kernel spills more than its masked-V kernel alone); session 36, with the vote on
# mbarriers, +2.0 / 0% at d64, +2.7 / +0.5% at d128. The roles vote and hand over on mbarriers
# (the .cu's Vote): the first version's __syncthreads_or, an .aligned barrier reached from two
# places, was what compute-sanitizer synccheck reported; now synccheck and memcheck report 0
# errors on the boundary cases and the NaN path (session 36). FUSED_DIMS holds the head dims
# where it is the default; FLASHCUDA_SM90_FWD_FUSED=1 / 0 turns it on / off at every head dim.
FUSED_ENV = "FLASHCUDA_SM90_FWD_FUSED"
FUSED_DIMS: tuple[int, ...] = (64, 128)
FUSED_VOTE_BYTES = 24  # the fused kernel's vote: two mbarriers and a word (flash_fwd_sm90_fused.cu)
FUSED_SOURCE = "attention/flash_fwd_sm90_fused.cu"
# the macros that may differ between the two passes: the fused kernel takes each as FC_P1_X and
# FC_P2_X (attention/fwd_sm90_pass.cuh); every other define must be the same in both
PASS_MACROS = ("FC_STAGES", "FC_Q_STAGES", "FC_O_TMA", "FC_SMEM_BYTES", "FC_MASKED_V",
               "FC_NAN_FLAGS", "FC_PRODUCER_REGS", "FC_CONSUMER_REGS")


@dataclass(frozen=True)
class Sm90FwdFused:
    """Both passes of a windowed call in one kernel: `first` (the report, FC_NAN_FLAGS) and
    `second` (the masked-V kernel, not the FC_NAN_FIXUP launch: the CTA decides by itself). The
    kernel always takes map_o (first and second differ in FC_O_TMA at d192 / d256)."""

    first: Sm90FwdConfig
    second: Sm90FwdConfig

    def __post_init__(self) -> None:
        if why := self.mismatch(self.first, self.second):
            raise ValueError(f"Sm90FwdFused: {why}")

    @staticmethod
    def mismatch(a: Sm90FwdConfig, b: Sm90FwdConfig) -> str | None:
        """Why first pass `a` and masked-V kernel `b` cannot share a kernel, or None."""
        if not a.nan_flags or not b.masked_v or b.nan_fixup:
            return "first is a first pass (nan_flags), second a masked-V kernel without nan_fixup"
        same = ("dtype", "head_dim", "block_m", "block_n", "pingpong", "snake", "defines",
                "timeline")
        if differ := [f for f in same if getattr(a, f) != getattr(b, f)]:
            return f"the passes differ in {', '.join(differ)}"
        if b.producer_regs < a.producer_regs or b.consumer_regs > a.consumer_regs:
            return ("the second pass's register split may only move registers from the "
                    "consumers to the producer")
        return None

    @property
    def block_m(self) -> int:
        return self.first.block_m

    @property
    def block_n(self) -> int:
        return self.first.block_n

    @property
    def threads(self) -> int:
        return self.first.threads

    o_tma = True  # (map_o: _maps builds it)
    nan_flags = nan_fixup = False  # (one launch, no report buffer)

    @property
    def smem_bytes(self) -> int:
        """The larger pass's (the second lays its tiles over the first's) and the vote's two
        mbarriers and word past it (FUSED_VOTE_BYTES)."""
        return max(self.first.smem_bytes, self.second.smem_bytes) + FUSED_VOTE_BYTES

    @property
    def name(self) -> str:
        b = self.second
        return (self.first.name.replace("_nf", "_fu", 1) + f"_s{b.stages}"
                + ("_ms" if b.masked_v else ""))

    def spec(self) -> KernelSpec:
        d1, d2 = dict(self.first.spec().defines), dict(self.second.spec().defines)
        shared = {k: v for k, v in d1.items() if k not in PASS_MACROS}
        for k in (set(d1) | set(d2)) - set(PASS_MACROS):
            if d1.get(k) != d2.get(k):
                raise ValueError(f"Sm90FwdFused: {k} is {d1.get(k)} in the first pass, "
                                 f"{d2.get(k)} in the second (not one of PASS_MACROS)")
        return KernelSpec.make(self.name, FUSED_SOURCE, defines={
            **shared,
            **{f"FC_P1_{k[3:]}": v for k, v in d1.items() if k in PASS_MACROS},
            **{f"FC_P2_{k[3:]}": v for k, v in d2.items() if k in PASS_MACROS},
            "FC_FUSED_SMEM_BYTES": self.smem_bytes,
            # (from the 1024-aligned base: the larger layout's end, without its alignment slack)
            "FC_FUSED_VOTE_OFFSET": self.smem_bytes - FUSED_VOTE_BYTES - 1024,
        })


def fused_passes(cfg: Sm90FwdConfig) -> Sm90FwdFused | None:
    """The fused kernel for a call `cfg` would run alone (a masked-V kernel), or None where the
    call runs one pass (FLASHCUDA_SM90_FWD_NAN_FIXUP=0, or no mask) or the passes cannot share a
    kernel (Sm90FwdFused.mismatch, or more shared memory than SMEM_OPTIN: then two launches)."""
    if not cfg.masked_v or not flag(NAN_FIXUP_ENV, True):
        return None
    first = first_pass(cfg)
    if Sm90FwdFused.mismatch(first, cfg):
        return None
    fused = Sm90FwdFused(first, cfg)
    return fused if fused.smem_bytes <= SMEM_OPTIN else None


@dataclass(frozen=True)
class _Plan:
    """What a call's layout decides once: config, kernel, grid, the constant arguments, and the
    launch with those fixed (a call packs only its three tensor maps and two pointers). With two
    passes (two_passes), `cfg` / `launch` are the first pass's and `fixup` the second's; each
    call gives both a buffer of NAN_FLAG_BYTES per CTA (the first pass writes all of it). With
    FUSED_ENV, `cfg` is the Sm90FwdFused kernel of both passes and there is no fixup."""

    cfg: Sm90FwdConfig | Sm90FwdFused
    kernel: object
    grid: tuple[int, int, int]
    constants: tuple
    launch: PreparedLaunch
    fixup_cfg: Sm90FwdConfig | None = None
    fixup: PreparedLaunch | None = None


_EMPTY = "empty"  # nothing to compute (batch, seqlen_q or nheads is 0)


_KEY_ENV = env_names(ENABLE_ENV, PERSISTENT_ENV, TILES_ENV, PINGPONG_ENV, SNAKE_ENV,
                     MASKED_V_ENV, DEFINES_ENV, L2_SHARE_ENV, STAGES_ENV, Q_STAGES_ENV, O_TMA_ENV,
                     L2_BALANCE_ENV, NAN_FIXUP_ENV, PDL_ENV, FUSED_ENV)


def _plan_key(call: FwdCall) -> tuple:
    """Everything can_implement and the plan read, except the data addresses (only their
    alignment, which TMA and the vector stores care about): a hit skips can_implement, so a
    field missing here would let a call the family refuses reach the kernel."""
    return (call.dtype, call.device, call.window_left, call.window_right, call.softmax_scale,
            env_values(_KEY_ENV), *call.layouts())


def plan_config(call: FwdCall, sms: int) -> Sm90FwdConfig:
    """select_config for the call, told whether its work tiles make few rounds over `sms` SMs
    (the tiles do not depend on it, so the first choice's count decides)."""
    args = (call.dtype, call.head_dim, call.is_local, call.seqlen_q)
    cfg = select_config(*args)
    if cfg.work_tiles(call) <= SNAKE_ROUNDS * sms:
        cfg = select_config(*args, few_rounds=True)
    return cfg


def _build_plan(call: FwdCall) -> _Plan | str:
    if why := can_implement(call):
        raise NotImplementedError(f"flash_fwd_sm90 cannot run this call: {why}")
    if call.batch == 0 or call.seqlen_q == 0 or call.nheads == 0:
        return _EMPTY
    props = torch.cuda.get_device_properties(_device_index(call.device))
    sms = props.multi_processor_count
    cfg = plan_config(call, sms)
    passes = two_passes(cfg)
    first = passes[0] if passes else cfg
    grid = first.grid(call, sms)
    by_block = schedule_arg(call, first, props.L2_cache_size, grid[0])
    fixed = constants(call, first, by_block, grid[0])
    # (any tensor stands for nan_flags' pointer kind: launch_plan passes each call's own buffer)
    flags = (call.lse,) if passes else ()

    def prepare(c: Sm90FwdConfig) -> tuple:
        kernel = get_kernel(c.spec(), call.device)
        args = (*_maps(call, c), call.out, call.lse, *flags, *fixed)
        return kernel, PreparedLaunch(kernel, grid, (c.threads, 1, 1), c.smem_bytes, args,
                                      fixed=len(fixed),
                                      programmatic=c.nan_fixup and flag(PDL_ENV, False))

    fused = fused_passes(cfg) if passes and flag(FUSED_ENV, cfg.head_dim in FUSED_DIMS) else None
    if fused is not None:
        _same_walk(call, sms, props.L2_cache_size, first, fused.second, grid, by_block, fixed)
        kernel = get_kernel(fused.spec(), call.device)
        args = (*_maps(call, fused), call.out, call.lse, *fixed)
        return _Plan(fused, kernel, grid, fixed,
                     PreparedLaunch(kernel, grid, (fused.threads, 1, 1), fused.smem_bytes, args,
                                    fixed=len(fixed)))
    kernel, launch = prepare(first)
    if not passes:
        return _Plan(cfg, kernel, grid, fixed, launch)
    second = passes[1]
    _same_walk(call, sms, props.L2_cache_size, first, second, grid, by_block, fixed)
    return _Plan(first, kernel, grid, fixed, launch, second, prepare(second)[1])


def _same_walk(call: FwdCall, sms: int, l2_bytes: int, first: Sm90FwdConfig,
               second: Sm90FwdConfig, grid: tuple, by_block: int, fixed: tuple) -> None:
    """The second pass must walk what the first walked: CTA b redoes CTA b's work tiles."""
    if (second.grid(call, sms) != grid
            or schedule_arg(call, second, l2_bytes, grid[0]) != by_block
            or constants(call, second, by_block, grid[0]) != fixed):
        raise RuntimeError(f"fwd_sm90: {first.name} and {second.name} would walk different "
                           f"work tiles")


_plans = PlanCache(_build_plan)


def _plan(call: FwdCall) -> _Plan | str:
    return _plans.plan(_plan_key(call), call)


def run(call: FwdCall) -> None:
    """Fill call.out and call.lse. Raises NotImplementedError when can_implement(call) says no.
    A repeat call with the same layout reuses its plan (can_implement's verdict included: the plan
    key holds everything it reads) and only encodes the three tensor maps."""
    plan = _plan(call)
    if plan is _EMPTY:
        return
    launch_plan(plan, call, [m.raw for m in _maps(call, plan.cfg)])


def launch_plan(plan: _Plan, call: FwdCall, maps: list) -> None:
    """Launch `plan`'s kernel (or two passes) for `call`, given its tensor maps for `plan.cfg`
    as raw bytes (run's last step; the host-overhead scripts time it alone)."""
    out_at, lse_at = call.out.data_ptr(), call.lse.data_ptr()
    if plan.fixup is None:
        plan.launch(*maps, out_at, lse_at)
        return
    index = plan.launch.kernel.device_index
    handle = launch_stream(index)  # (once for both passes)
    flags = nan_flags(call.device, index, handle, plan.grid[0] * NAN_FLAG_BYTES)
    plan.launch(*maps, out_at, lse_at, flags.data_ptr(), handle=handle)
    if plan.fixup_cfg.o_tma != plan.cfg.o_tma:
        maps = [m.raw for m in _maps(call, plan.fixup_cfg)]
    plan.fixup(*maps, out_at, lse_at, flags.data_ptr(), handle=handle)


_flag_buffers = StreamBuffers(torch.uint8)


def nan_flags(device: torch.device, index: int, handle: int, nbytes: int) -> torch.Tensor:
    """A buffer of at least `nbytes` on `device` (index `index`) for the two passes' NaN flags
    of a call on stream `handle` (the driver's handle of torch's current stream there).

    One buffer per (thread, device, stream), kept between calls (call.StreamBuffers; fresh per
    call while the stream is captured): each call's first pass writes every byte its second pass
    reads, so the next call's first pass cannot overwrite flags a second pass has still to read
    (per thread: two threads sharing a stream could interleave their launches, A's first pass,
    B's first pass, A's second)."""
    return _flag_buffers.get(device, (index, handle), nbytes)  # (legacy default stream: 0)


def fused_configs() -> list[Sm90FwdFused]:
    """The fused kernels (FUSED_ENV) of the windowed kernels dispatch picks without A/B
    variables: every dtype and head dim, at the sequence lengths where the tiles change, with
    many rounds of work tiles and few (the snake order)."""
    picked = (select_config(dtype, d, True, s, few_rounds=few) for dtype in DTYPES
              for d in HEAD_DIMS for s in (1, 2048, LONG) for few in (False, True))
    unique = {c.name: c for c in picked}
    return [Sm90FwdFused(first_pass(c), c) for c in unique.values() if c.masked_v]


@register
def variants() -> Iterator[tuple[KernelSpec, tuple[str, ...]]]:
    for cfg in configs():
        yield cfg.spec(), ARCHS
    for fused in fused_configs():
        yield fused.spec(), ARCHS

"""The sm90a backward for the wide head dims (192 and 256), fp16/bf16, non-deterministic dQ.

Status: proven on the H200 (tests/gpu/test_bwd_sm90_wide.py against the float64 oracle, 505
passed at d03bdf6, 370 at e5b8ef8 with the dQ split, 850 run / 0 failed at ca2a337 with the key
split; sanitizers clean on the boundary cases);
dispatched by default at these head dims: d256 1.04-1.18x cuDNN, d192 1.22-1.49x at every sweep
point (docs/perf-notes.md, sessions 27-28), where the SIMT backward ran at 7-8 TFLOP/s. Against
FlashAttention 4 (session 29): d256 1.02-1.12x the best peer, d192 0.83-0.89x FA4 (its d192
splits dK / dV by keys over two warpgroups) -> session 30's key split below, 0.90-0.96x; with
session 31's role split of dK / dV a further +4 to +10% (same-process A/B).

flash_bwd_sm90.cu (family bwd_sm90) keeps each consumer warpgroup's 64 keys x head dim of dK and
dV in registers, which does not fit at head dim 256; this family's MAIN kernel
(kernels/attention/flash_bwd_sm90_wide.cu) computes dK and dV transposed and splits them by
head-dim columns between its consumer warpgroups (FlashAttention 3's d192 / d256 backward shape),
with S / dP split by keys and P / dS exchanged through shared memory. Around it, bwd_sm80's PRE
(delta, lse2, zeroed dq_accum) and CONVERT (dq = dq_accum * softmax_scale) kernels, as in
bwd_sm90.

    head dim   block_m (queries) x block_n (keys), stages   smem      consumers x registers
    192        64 x 96, 2 (one P / dS tile)                 202 KB    3 x 160   (split "dims")
    192        64 x 96, Q 2 / dO 1                          218 KB    2 x 240   (split "keys")
    256        64 x 64, 2                                   226 KB    2 x 240

The split (FLASHCUDA_SM90_BWD_WIDE_SPLIT): "keys", d192's default since session 30 (+5 to +14%
over "dims"; 0.90-0.96x FA4, was 0.83-0.89x), runs kernels/attention/flash_bwd_sm90_keys.cu:
S / dP split by keys between two warpgroups (FA4's d192 shape), and since session 31 dV^T kept
by warpgroup 0 and dK^T by warpgroup 1, each over all 96 keys (each step reads dO^T / Q^T once
as wgmma operands; +4 to +10% over FA4's layout, where each warpgroup keeps both over its own
48 keys); K in 64-byte-swizzled TMA boxes of 32 columns (cfg.k_swizzle), P / dS in a 32-byte
swizzle. "dims" is the head-dim split above (d256 has only it).

dQ, in both kernels: each consumer stores its dQ tile into shared memory and one thread reduces
it into dq_accum with bulk reduce-adds (dq_accum in register order, CONVERT's FC_DQ_FRAG_M
reader); "dims" stages it in its own, then idle, Q / dO chunks of the stage, the dO half while
the tensor cores still run dK^T (+13-20% over red.global.add.v2 per thread at d256, session 27,
then +10-15% more from the split, session 28); "keys" in a staging buffer per consumer.
FLASHCUDA_SM90_BWD_WIDE_DEFINES ("FC_NAME=VALUE,...") builds A/B variants of a kernel knob
(FC_LPT_TAIL=0 below). Removed in session 39 (A/B arms measured as losses or noise, and a timing
probe; docs/perf-notes.md): FLASHCUDA_SM90_BWD_WIDE_DQ (red: red.global.add.v2 into a row-major
dq_accum) and the defines FC_DQ_V4, FC_DQ_STAGE_SPLIT=0, FC_PROBE_NO_DQ, FC_KV_ROLES=0,
FC_PDS_STMATRIX=0.

Dispatch order: bwd_sm90 (d64 / d128) > bwd_sm90_wide (d192 / d256) > bwd_sm80 > bwd_simt; the
head dims are disjoint. FLASHCUDA_ENABLE_SM90_BWD_WIDE=0 turns it off (the SIMT backward then
runs these head dims). deterministic=True goes elsewhere (dQ is reduced with atomics)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from math import lcm

import torch

from .._env import env_names, env_values, switched_on
from ..jit import KernelSpec, PreparedLaunch, get_kernel, launch_stream, register
from ..jit.tensor_map import bshd_map
from . import bwd_sm80, bwd_sm90
from .call import (
    DTYPE_CODE,
    DTYPE_NAME,
    REMOVED_SM90_DEFINES,
    SMEM_OPTIN,
    BwdCall,
    PlanCache,
    defines_suffix,
    parse_defines,
    register_pool,
)

SOURCE = "attention/flash_bwd_sm90_wide.cu"
# d192 with dK / dV split by keys over two consumers (FlashAttention 4's d192 shape)
KEYS_SOURCE = "attention/flash_bwd_sm90_keys.cu"
ARCHS = ("sm_90a",)
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (192, 256)
ENABLE_ENV = "FLASHCUDA_ENABLE_SM90_BWD_WIDE"
DEFINES_ENV = "FLASHCUDA_SM90_BWD_WIDE_DEFINES"  # NAME=VALUE,... (A/B of a kernel knob)
# knobs taken out of the kernels in session 39 (their headers list them; perf-notes has the
# numbers): DEFINES_ENV refuses them
REMOVED_DEFINES = REMOVED_SM90_DEFINES + (
    "FC_DQ_STAGE", "FC_DQ_STAGE_SPLIT", "FC_DQ_V4", "FC_PROBE_NO_DQ", "FC_KV_ROLES",
    "FC_PDS_STMATRIX")
# how the consumers split dK^T / dV^T: "dims" (head-dim rows, flash_bwd_sm90_wide.cu) or "keys"
# (their own keys, flash_bwd_sm90_keys.cu: d192 only)
SPLIT_ENV = "FLASHCUDA_SM90_BWD_WIDE_SPLIT"
SPLITS = ("dims", "keys")
SPLIT_DEFAULT = {192: "keys", 256: "dims"}  # keys at d192: +5 to +14% (session 30)
KEYS_HEAD_DIMS = (192,)
GATED = f"bwd_sm90_wide is turned off ({ENABLE_ENV}=0)"
BARRIER_BYTES = 8
# (block_m, block_n, consumers) per head dim: S / dP split by keys (block_n / consumers each),
# dK^T / dV^T / dQ by head-dim columns (head_dim / consumers each); FA3's d192 shape (64 x 96,
# three consumers), and 64 keys at d256 (FA3's 80: K / V of 80 keys beside the two-stage Q / dO
# ring leave no room for the P / dS tiles; FA3 keeps one dO stage)
TILES = {256: (64, 64, 2), 192: (64, 96, 3)}
# P / dS tiles of each kind: two (no barrier before a step's stores), or one where two do not
# fit (d192: K / V of 96 keys + the ring leave 58 KB; the 96-key tiles take 16 KB each)
P_BUFFERS = {256: 2, 192: 1}
# consumer registers: the CTA's pool over 384 / 512 threads, less the producer's 24 per thread
CONSUMER_REGS = {256: 240, 192: 160}
# the key split's shape: 64 x 96, two consumers of 240 registers; Q two stages, dO one
KEYS_TILES, KEYS_REGS = (64, 96, 2), 240
# FC_LPT_TAIL for causal calls (a right edge and no left one: key block 0 has the most steps),
# per head dim: the grid's last K (KV head, batch) pairs' CTAs longest-first (bwd_sm90's
# LPT_TAIL, session 14). Same-process A/B (97e7873, perf-notes session 32), K = 8 against
# blockIdx order: d192 causal +2.2 / +4.1 / +6.0% at 1k / 2k / 4k, +0.2% at 512, -1.1% at 16k
# (inside p10-p90); d256 causal +3.3 / +3.2% at 2k / 4k. K = 16: d192 +3.0 / +3.7 / +4.3%,
# d256 4k -11.5%. FLASHCUDA_SM90_BWD_WIDE_DEFINES=FC_LPT_TAIL=0 turns it off (A/B).
LPT_TAIL = {192: 8, 256: 8}


@dataclass(frozen=True)
class Sm90BwdWideConfig:
    """One specialisation of flash_bwd_sm90_wide.cu (the MAIN kernel)."""

    dtype: torch.dtype
    head_dim: int
    block_m: int = 0  # 0: TILES[head_dim]
    block_n: int = 0
    consumers: int = 0
    stages: int = 2
    producer_regs: int = 24
    consumer_regs: int = 0  # 0: CONSUMER_REGS[head_dim]
    split: str = "dims"  # "keys": flash_bwd_sm90_keys.cu (d192; SPLIT_ENV)
    # FC_LPT_TAIL: the grid's last lpt_tail (KV head, batch) pairs longest-first (causal calls,
    # LPT_TAIL; config_for)
    lpt_tail: int = 0
    # extra compile-time defines (FLASHCUDA_SM90_BWD_WIDE_DEFINES="NAME=VALUE,..."): A/B variants
    # of a kernel knob, named by a suffix
    defines: tuple = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be float16 or bfloat16, got {self.dtype}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.keys_split and self.head_dim not in KEYS_HEAD_DIMS:
            raise ValueError(f"split='keys' is built for head_dim {KEYS_HEAD_DIMS}, got "
                             f"{self.head_dim}")
        tiles = self.tiles
        for name, value in zip(("block_m", "block_n", "consumers"), tiles, strict=True):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, value)
        if self.consumer_regs == 0:
            object.__setattr__(self, "consumer_regs", self.default_regs)
        if (self.block_m, self.block_n, self.consumers) != tiles:
            raise ValueError(f"d{self.head_dim}: the kernel is instantiated for block_m x "
                             f"block_n x consumers = {tiles}")
        if self.keys_split and self.stages != 2:
            raise ValueError(f"split='keys' has two Q stages, got stages={self.stages}")
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        used = 128 * self.producer_regs + 128 * self.consumers * self.consumer_regs
        if used > register_pool(self.threads):
            raise ValueError(f"{self.name}: {used} registers exceed the CTA's pool "
                             f"{register_pool(self.threads)}")
        if self.smem_bytes > SMEM_OPTIN:
            raise ValueError(f"{self.name} needs {self.smem_bytes} bytes of shared memory "
                             f"(> {SMEM_OPTIN})")

    @property
    def keys_split(self) -> bool:
        return self.split == "keys"

    @property
    def tiles(self) -> tuple[int, int, int]:
        """(block_m, block_n, consumers) of the kernel's instantiation."""
        return KEYS_TILES if self.keys_split else TILES[self.head_dim]

    @property
    def default_regs(self) -> int:
        return KEYS_REGS if self.keys_split else CONSUMER_REGS[self.head_dim]

    @property
    def k_swizzle(self) -> int:
        """K's TMA swizzle in bytes: the key split reads K's dQ columns from mid-way through a
        128-byte atom, so it loads K in 64-byte-swizzled boxes of 32 columns."""
        return 64 if self.keys_split else 128

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
    def p_buffers(self) -> int:
        return P_BUFFERS[self.head_dim]

    @property
    def smem_bytes(self) -> int:
        """1024 B alignment slack + K + V + stages x (Q + dO + lse2 + delta) + p_buffers x (P +
        dS, whole 64-key chunks) + the mbarriers (as the .cu lays out and static_asserts). The key
        split: K + V + 2 x (Q + lse2 + delta) + dO + P + dS (no padding) + the consumers' fp32 dQ
        staging tiles + 7 mbarriers."""
        stats = 2 * self.block_m * 4
        if self.keys_split:
            p_bytes = self.block_m * self.block_n * 2
            dq_bytes = self.block_m * self.head_dim * 4
            return (1024 + 2 * self.kv_bytes + 2 * (self.q_bytes + stats) + self.q_bytes
                    + 2 * p_bytes + dq_bytes + BARRIER_BYTES * 7)
        p_bytes = self.block_m * 128 * -(-self.block_n // 64)
        return (1024 + 2 * self.kv_bytes + self.stages * (2 * self.q_bytes + stats)
                + 2 * self.p_buffers * p_bytes + BARRIER_BYTES * (1 + 2 * self.stages))

    @property
    def name(self) -> str:
        return (f"flash_bwd_sm90w_{DTYPE_NAME[self.dtype]}_d{self.head_dim}"
                f"_bm{self.block_m}_bn{self.block_n}_c{self.consumers}_s{self.stages}"
                + ("" if (self.producer_regs, self.consumer_regs) == (24, self.default_regs)
                   else f"_r{self.producer_regs}x{self.consumer_regs}")
                + "_dqs"  # (dQ staged: the only form since session 39, kept in the names)
                + ("_keys" if self.keys_split else "")
                + (f"_lpt{self.lpt_tail}" if self.lpt_tail else "")
                + defines_suffix(self.defines))

    def spec(self) -> KernelSpec:
        if self.keys_split:  # (its shape is fixed in the source)
            return KernelSpec.make(self.name, KEYS_SOURCE, defines={
                "FC_DTYPE": DTYPE_CODE[self.dtype],
                "FC_PRODUCER_REGS": self.producer_regs,
                "FC_CONSUMER_REGS": self.consumer_regs,
                "FC_SMEM_BYTES": self.smem_bytes,
                **({"FC_LPT_TAIL": self.lpt_tail} if self.lpt_tail else {}),
                **dict(self.defines),
            })
        return KernelSpec.make(self.name, SOURCE, defines={
            "FC_DTYPE": DTYPE_CODE[self.dtype],
            "FC_HEAD_DIM": self.head_dim,
            "FC_BLOCK_M": self.block_m,
            "FC_BLOCK_N": self.block_n,
            "FC_STAGES": self.stages,
            "FC_CONSUMERS": self.consumers,
            "FC_P_BUFFERS": self.p_buffers,
            "FC_PRODUCER_REGS": self.producer_regs,
            "FC_CONSUMER_REGS": self.consumer_regs,
            "FC_SMEM_BYTES": self.smem_bytes,
            **({"FC_LPT_TAIL": self.lpt_tail} if self.lpt_tail else {}),
            **dict(self.defines),
        })

    def aux(self) -> bwd_sm80.BwdSm80Config:
        """The bwd_sm80 configuration whose PRE and CONVERT kernels this family runs (their
        dq_accum, CONVERT's in register order: convert_spec; bwd_sm80's own MAIN has no d256
        tiles, only these two are built)."""
        return bwd_sm80.BwdSm80Config(self.dtype, self.head_dim, 64, 64, 4)

    def seqlen_pad(self, seqlen_q: int) -> int:
        """Rows of lse2 / delta / dq_accum: whole query blocks and whole PRE blocks."""
        step = lcm(self.block_m, self.aux().aux_rows)
        return -(-seqlen_q // step) * step

    def grid(self, call: BwdCall) -> tuple[int, int, int]:
        """One CTA per (key block, KV head, batch)."""
        return (-(-call.seqlen_k // self.block_n), call.nheads_kv, call.batch)



def configs() -> list[Sm90BwdWideConfig]:
    """The default kernels of causal calls per dtype and head dim (LPT_TAIL); the head-dim split
    per dtype and head dim (d256's default, d192's with SPLIT_ENV=dims); the key split per dtype
    (d192's default)."""
    causal = [dataclasses.replace(default_config(dt, d), lpt_tail=k)
              for dt in DTYPES for d, k in LPT_TAIL.items()]
    return causal + [Sm90BwdWideConfig(dt, d) for dt in DTYPES for d in HEAD_DIMS] + [
        Sm90BwdWideConfig(dt, d, split="keys") for dt in DTYPES for d in KEYS_HEAD_DIMS]


def enabled() -> bool:
    """On unless FLASHCUDA_ENABLE_SM90_BWD_WIDE is 0 / false / no / off."""
    return switched_on(ENABLE_ENV)


def can_implement(call: BwdCall) -> str | None:
    """None if this family can run `call`, else the reason it cannot (bwd_sm90's checks)."""
    if not enabled():
        return GATED
    if why := bwd_sm90.call_problem(call, HEAD_DIMS):
        return why
    split = split_for(call.head_dim)
    cfg = Sm90BwdWideConfig(call.dtype, call.head_dim, split=split)
    if why := bwd_sm90.layout_problem(call, cfg.block_m, cfg.block_n):
        return why
    return bwd_sm90.smem_problem(call, cfg.name, cfg.smem_bytes)


@dataclass(frozen=True)
class _Plan:
    """The config and the three launches of a call's layout (a call packs only pointers and
    tensor maps)."""

    cfg: Sm90BwdWideConfig
    sq_pad: int
    pre: PreparedLaunch  # out, dout, lse, lse2, delta, dq_accum
    main: PreparedLaunch  # map_q, map_k, map_v, map_dout, lse2, delta, dq_accum, dk, dv
    convert: PreparedLaunch  # dq_accum, dq


_KEY_ENV = env_names(ENABLE_ENV, DEFINES_ENV, SPLIT_ENV)


def split_for(head_dim: int) -> str:
    """FLASHCUDA_SM90_BWD_WIDE_SPLIT where it names a split built for head_dim, else the head
    dim's default ("keys" exists at KEYS_HEAD_DIMS only; a bad name is a ValueError)."""
    split = os.environ.get(SPLIT_ENV, "").strip() or SPLIT_DEFAULT[head_dim]
    if split not in SPLITS:
        raise ValueError(f"{SPLIT_ENV}: expected one of {SPLITS}, got {split!r}")
    return split if head_dim in KEYS_HEAD_DIMS else "dims"


def config_for(call: BwdCall) -> Sm90BwdWideConfig:
    """The MAIN kernel `call` runs: the head dim's split and tiles, with
    FLASHCUDA_SM90_BWD_WIDE_DEFINES."""
    return Sm90BwdWideConfig(call.dtype, call.head_dim, split=split_for(call.head_dim),
                             lpt_tail=bwd_sm90.lpt_tail_for(call, LPT_TAIL),
                             defines=parse_defines(DEFINES_ENV, REMOVED_DEFINES))


def default_config(dtype: torch.dtype, head_dim: int) -> Sm90BwdWideConfig:
    """The head dim's default MAIN kernel without the environment's A/B knobs (no mask)."""
    return Sm90BwdWideConfig(dtype, head_dim, split=SPLIT_DEFAULT[head_dim])


def _plan_key(call: BwdCall) -> tuple:
    """Everything can_implement and the plan read, except the data addresses (a hit skips
    can_implement)."""
    return (call.dtype, call.device, call.deterministic, call.window_left, call.window_right,
            call.softmax_scale, env_values(_KEY_ENV), *call.layouts())


def _build_plan(call: BwdCall) -> _Plan:
    if why := can_implement(call):
        raise NotImplementedError(f"flash_bwd_sm90_wide cannot run this call: {why}")
    cfg = config_for(call)
    aux = cfg.aux()
    b, sq, h = call.batch, call.seqlen_q, call.nheads
    sq_pad = cfg.seqlen_pad(sq)
    dev = call.device
    pre_args, main_args, convert_args = bwd_sm90.launch_args(call, sq_pad)
    t = call.lse  # stands for a pointer argument's kind (run() passes the addresses)
    main_maps = _maps(call, cfg)
    return _Plan(
        cfg, sq_pad,
        pre=PreparedLaunch(get_kernel(aux.pre_spec(), dev), (-(-sq_pad // aux.aux_rows), h, b),
                           (bwd_sm80.AUX_THREADS,), 0, (t,) * 6 + pre_args,
                           fixed=len(pre_args)),
        main=PreparedLaunch(get_kernel(cfg.spec(), dev), cfg.grid(call), (cfg.threads, 1, 1),
                            cfg.smem_bytes, main_maps + (t,) * 5 + main_args,
                            fixed=len(main_args)),
        convert=PreparedLaunch(get_kernel(convert_spec(cfg), dev),
                               (-(-sq // aux.aux_rows), h, b), (bwd_sm80.AUX_THREADS,), 0,
                               (t,) * 2 + convert_args, fixed=len(convert_args)))


def _maps(call: BwdCall, cfg: Sm90BwdWideConfig) -> tuple:
    """MAIN's tensor maps of q, k, v, dout (K in cfg.k_swizzle)."""
    return (bshd_map(call.q, cfg.block_m), bshd_map(call.k, cfg.block_n, cfg.k_swizzle),
            bshd_map(call.v, cfg.block_n), bshd_map(call.dout, cfg.block_m))


def convert_spec(cfg: Sm90BwdWideConfig) -> KernelSpec:
    """CONVERT for cfg's dq_accum: 64 x 64 blocks in the consumers' register order."""
    return cfg.aux().convert_spec(cfg.block_m, True)


_plans = PlanCache(_build_plan)


def run(call: BwdCall) -> None:
    """Fill call.dq, call.dk, call.dv (NotImplementedError when can_implement says no). A repeat
    call with the same layout reuses its plan."""
    plan = _plans.plan(_plan_key(call), call)
    cfg = plan.cfg
    lse, lse2, delta, dq_accum = bwd_sm90.scratch(call, plan.sq_pad)
    lse2_at, delta_at, accum_at = (x.data_ptr() for x in (lse2, delta, dq_accum))
    handle = launch_stream(plan.main.kernel.device_index)  # (once for the three launches)
    plan.pre(call.out.data_ptr(), call.dout.data_ptr(), lse.data_ptr(), lse2_at, delta_at,
             accum_at, handle=handle)
    maps = (m.raw for m in _maps(call, cfg))
    plan.main(*maps, lse2_at, delta_at, accum_at, call.dk.data_ptr(), call.dv.data_ptr(),
              handle=handle)
    plan.convert(accum_at, call.dq.data_ptr(), handle=handle)


@register
def variants() -> Iterator[tuple[KernelSpec, tuple[str, ...]]]:
    for cfg in configs():
        yield cfg.spec(), ARCHS
        yield cfg.aux().pre_spec(), ARCHS
        yield convert_spec(cfg), ARCHS  # (the same PRE / CONVERT twice: the registry dedups)

"""The sm80 tensor-core flash backward (FA2 algorithm), fp16 / bf16, on any sm >= 8.0.

Kernels: kernels/attention/flash_bwd_sm80.cu (one source, four parts picked by FC_PART):

    preprocess  delta = rowsum(dO * O), lse2 = lse * log2(e) (+inf: P = 0), zero the dQ accumulator
    main        per (key block, KV head, batch): dK, dV (and dQ via fp32 reductions unless
                deterministic); loops over the query heads of the KV head's group (GQA / MQA)
    dq          deterministic mode: per (query block, head, batch), dQ without atomics
    convert     dq = dq_accum * softmax_scale in the input dtype

`BwdSm80Config` is the single source of truth for tile sizes and shared-memory bytes: it renders the
constexprs the .cu sees (which static_asserts its own layout against FC_SMEM_BYTES) and names every
specialisation, e.g. ``flash_bwd_sm80_bf16_d128_bm64_bn128_w8``. Which configuration runs is data:
CONFIG_TABLE (per compile-time head dim, optionally dtype and mask) maps to a tag such as
``bm64_bn128_w8``; FLASHCUDA_BWD_SM80_CONFIG overrides it for A/B runs (``bm64_bn64_w4``, or
``d64=bm128_bn64_w4,d128=bm64_bn64_w4``), and CANDIDATES lists the tags compiled ahead for that.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from functools import cache
from math import lcm

import numpy as np
import torch

from ..jit import KernelSpec, get_kernel, register
from .call import (
    DTYPE_CODE,
    DTYPE_NAME,
    LOG2E,
    BwdCall,
    kernel_windows,
    on_cuda,
    vector_layout_problem,
)

SOURCE = "attention/flash_bwd_sm80.cu"
ARCHS = ("sm_80", "sm_90a")
DTYPES = (torch.float16, torch.bfloat16)
AUX_THREADS = 256  # preprocess and convert kernels
PART_PRE, PART_MAIN, PART_DQ, PART_CONVERT = 0, 1, 2, 3
# Windows are clamped to +-(Sq + Sk) and index sums of three such terms must fit in int32.
MAX_SEQLEN_SUM = 1 << 29


# Occupancy arithmetic (ctas_per_sm): H100 / H200 have 228 KB of shared memory per SM (227 KB per
# CTA at most), A100 164 KB (163 KB); every resident CTA also holds 1 KB reserved by the system.
H100_SMEM_PER_SM = 233472
A100_SMEM_PER_SM = 167936
RESERVED_SMEM_PER_CTA = 1024
REGISTERS_PER_SM = 65536


@dataclass(frozen=True)
class BwdSm80Config:
    """Tiles of one backward specialisation.

    head_dim:   compile-time head dim (a runtime head dim <= it, multiple of 8, is zero-padded)
    block_m:    query rows per step of the main kernel
    block_n:    keys per CTA of the main kernel; each warp owns 16 keys, so block_n = 16 * warps
    dq_warps_m: warp rows of the main kernel's dQ GEMM (block_m x head_dim); 0 = auto
    dq_passes:  column passes of that GEMM per warp (fewer live fp32 accumulators); 0 = auto.
                Auto picks the (warp grid, passes) reading the fewest shared bytes whose
                accumulators fit max_dq_acc(head_dim) floats per thread.
    dp_group:   query n-tiles (of 8) of dP^T computed at a time in the main kernel; 0 = auto (4 at
                D >= 96, 8 at D = 64, all at D <= 32). Fewer live registers; each extra group
                reloads the warp's V rows.
    min_blocks: CTAs per SM the main kernel's __launch_bounds__ asks for (caps registers at
                65536 / (min_blocks * threads)); 0 = auto, 8 / warps (8 warps per SM either way,
                which with <= 256 threads per CTA caps nothing below 255).
    dq_red:     vector width of the dQ fp32 reductions on sm_90: 2 (red.v2) or 4 (red.v4, two
                shuffles per 8 columns to gather 4 consecutive ones); sm_80 always uses 2.
    dq_block_m: query rows per CTA of the deterministic dQ kernel (16 per warp)
    dq_block_n: keys per step of the deterministic dQ kernel
    aux_rows:   rows per CTA of the preprocess and convert kernels

    `tag` spells the main-kernel knobs (block_m, block_n, warps and every knob not at its auto
    value), e.g. ``bm64_bn64_w4`` or ``bm64_bn128_w8_red4``; `from_tag` parses it back. The tag is
    what FLASHCUDA_BWD_SM80_CONFIG and CONFIG_TABLE hold.
    """

    dtype: torch.dtype
    head_dim: int
    block_m: int
    block_n: int
    warps: int
    dq_warps_m: int = 0
    dq_passes: int = 0
    dp_group: int = 0
    min_blocks: int = 0
    dq_red: int = 2
    dq_block_m: int = 64
    dq_block_n: int = 64
    aux_rows: int = 64

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be float16 or bfloat16, got {self.dtype}")
        if self.head_dim % 16 or not 16 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must be a multiple of 16 in [16, 256], got {self.head_dim}")
        if self.warps < 1 or self.block_n != 16 * self.warps:
            raise ValueError(f"block_n must be 16 * warps = {16 * self.warps}, got {self.block_n}")
        if self.block_m < 16 or self.block_m % 16 or self.block_m // 2 > 32 * self.warps:
            raise ValueError(
                f"block_m must be a multiple of 16 and <= 64 * warps, got {self.block_m}"
            )
        if self.dq_block_m % 16 or self.dq_block_n % 16:
            raise ValueError("dq_block_m and dq_block_n must be multiples of 16")
        if self.aux_rows % 8:
            raise ValueError(f"aux_rows must be a multiple of 8, got {self.aux_rows}")
        if self.dq_red not in (2, 4):
            raise ValueError(f"dq_red must be 2 or 4, got {self.dq_red}")
        if self.min_blocks < 0:
            raise ValueError(f"min_blocks must be >= 0, got {self.min_blocks}")
        if self.min_blocks == 0:
            object.__setattr__(self, "min_blocks", _auto_min_blocks(self.warps))
        if self.dp_group == 0:
            object.__setattr__(self, "dp_group", _auto_dp_group(self.head_dim, self.block_m))
        if self.dp_group % 2 or (self.block_m // 8) % self.dp_group:
            raise ValueError(
                f"dp_group must be even and divide block_m / 8 = {self.block_m // 8}, "
                f"got {self.dp_group}"
            )
        if self.dq_warps_m == 0 or self.dq_passes == 0:
            wm, passes = _best_dq_grid(
                self.head_dim, self.block_m, self.warps, self.dq_warps_m, self.dq_passes
            )
            object.__setattr__(self, "dq_warps_m", wm)
            object.__setattr__(self, "dq_passes", passes)
        if not _dq_grid_ok(
            self.head_dim, self.block_m, self.warps, self.dq_warps_m, self.dq_passes
        ):
            raise ValueError(
                f"dq_warps_m={self.dq_warps_m}, dq_passes={self.dq_passes} do not tile the "
                f"{self.block_m} x {self.head_dim} dQ block with {self.warps} warps"
            )

    # -- tags ---------------------------------------------------------------------------------
    @classmethod
    def from_tag(cls, dtype: torch.dtype, head_dim: int, tag: str) -> BwdSm80Config:
        """The configuration a tag spells (ValueError naming the problem otherwise)."""
        m = _TAG.fullmatch(tag.strip())
        if m is None:
            raise ValueError(
                f"bad sm80 backward config tag {tag!r}: expected bm<M>_bn<N>_w<W> followed by any "
                "of _dp<G> _dqm<WM> _dqp<P> _mb<B> _red<2|4>, e.g. bm64_bn64_w4 or bm64_bn128_w8_red4"
            )
        knobs: dict[str, int] = {}
        for name, value in _KNOB.findall(m.group(4) or ""):
            field = _TAG_KNOBS[name]
            if field in knobs:
                raise ValueError(f"bad sm80 backward config tag {tag!r}: {name} given twice")
            knobs[field] = int(value)
        bm, bn, w = (int(m.group(i)) for i in (1, 2, 3))
        return cls(dtype, head_dim, bm, bn, w, **knobs)

    @property
    def tag(self) -> str:
        auto = BwdSm80Config(self.dtype, self.head_dim, self.block_m, self.block_n, self.warps)
        out = f"bm{self.block_m}_bn{self.block_n}_w{self.warps}"
        if self.dp_group != auto.dp_group:
            out += f"_dp{self.dp_group}"
        if (self.dq_warps_m, self.dq_passes) != (auto.dq_warps_m, auto.dq_passes):
            out += f"_dqm{self.dq_warps_m}_dqp{self.dq_passes}"
        if self.min_blocks != auto.min_blocks:
            out += f"_mb{self.min_blocks}"
        if self.dq_red != auto.dq_red:
            out += f"_red{self.dq_red}"
        return out

    # -- derived sizes ------------------------------------------------------------------------
    @property
    def dtype_name(self) -> str:
        return DTYPE_NAME[self.dtype]

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def dq_warps(self) -> int:
        return self.dq_block_m // 16

    @property
    def row_stride(self) -> int:
        """Shared row stride (elements) of Q/K/V/dO tiles: +16 bytes so ldmatrix is conflict-free."""
        return self.head_dim + 8

    def main_smem_bytes(self, with_dq: bool) -> int:
        kv = 2 * self.block_n * self.row_stride * 2  # K, V
        qdo = 2 * 2 * self.block_m * self.row_stride * 2  # Q, dO, two stages each
        ds = self.block_n * (self.block_m + 8) * 2 if with_dq else 0
        stats = 2 * 2 * self.block_m * 4  # lse2, delta, two stages each
        return kv + qdo + ds + stats

    def dq_smem_bytes(self) -> int:
        qdo = 2 * self.dq_block_m * self.row_stride * 2  # Q, dO
        kv = 2 * 2 * self.dq_block_n * self.row_stride * 2  # K, V, two stages each
        return qdo + kv

    def smem_bytes(self, deterministic: bool) -> int:
        """Largest dynamic shared memory any kernel of the backward needs."""
        if deterministic:
            return max(self.main_smem_bytes(False), self.dq_smem_bytes())
        return self.main_smem_bytes(True)

    def ctas_per_sm(
        self,
        registers: int = 255,
        smem_per_sm: int = H100_SMEM_PER_SM,
        with_dq: bool = True,
    ) -> int:
        """Resident main-kernel CTAs per SM for a register count (ptxas' report) on an SM with
        `smem_per_sm` bytes of shared memory (each CTA also takes RESERVED_SMEM_PER_CTA), 64K
        registers (allocated per warp in units of 256) and at most 64 warps."""
        regs_per_warp = -(-registers * 32 // 256) * 256
        by_regs = REGISTERS_PER_SM // (regs_per_warp * self.warps)
        by_smem = smem_per_sm // (self.main_smem_bytes(with_dq) + RESERVED_SMEM_PER_CTA)
        return min(by_regs, by_smem, 64 // self.warps, 32)

    def seqlen_pad(self, seqlen_q: int) -> int:
        """Rows of the lse2 / delta / dQ-accumulator buffers: every kernel reads whole blocks."""
        step = lcm(self.block_m, self.dq_block_m, self.aux_rows)
        return -(-seqlen_q // step) * step

    # -- specialisations ----------------------------------------------------------------------
    @property
    def _prefix(self) -> str:
        return f"{self.dtype_name}_d{self.head_dim}"

    def _defines(self, part: int, **extra: int) -> dict[str, int]:
        return {
            "FC_PART": part,
            "FC_DTYPE": DTYPE_CODE[self.dtype],
            "FC_HEAD_DIM": self.head_dim,
            **extra,
        }

    def main_spec(self, with_dq: bool = True) -> KernelSpec:
        # Without dQ there are no reductions: the _nodq kernel of a _red4 tag is the _red2 one.
        tag = self.tag if with_dq else replace(self, dq_red=2).tag
        name = f"flash_bwd_sm80_{self._prefix}_{tag}" + ("" if with_dq else "_nodq")
        return KernelSpec.make(
            name,
            SOURCE,
            defines=self._defines(
                PART_MAIN,
                FC_BLOCK_M=self.block_m,
                FC_BLOCK_N=self.block_n,
                FC_WARPS=self.warps,
                FC_WITH_DQ=int(with_dq),
                FC_DQ_WARPS_M=self.dq_warps_m,
                FC_DQ_PASSES=self.dq_passes,
                FC_DP_GROUP=self.dp_group,
                FC_MIN_BLOCKS=self.min_blocks,
                FC_DQ_RED_V4=int(with_dq and self.dq_red == 4),
                FC_SMEM_BYTES=self.main_smem_bytes(with_dq),
            ),
        )

    def dq_spec(self) -> KernelSpec:
        name = (
            f"flash_bwd_dq_sm80_{self._prefix}_bm{self.dq_block_m}_bn{self.dq_block_n}"
            f"_w{self.dq_warps}"
        )
        return KernelSpec.make(
            name,
            SOURCE,
            defines=self._defines(
                PART_DQ,
                FC_BLOCK_M=self.dq_block_m,
                FC_BLOCK_N=self.dq_block_n,
                FC_WARPS=self.dq_warps,
                FC_SMEM_BYTES=self.dq_smem_bytes(),
            ),
        )

    def pre_spec(self) -> KernelSpec:
        """PRE."""
        return KernelSpec.make(
            f"flash_bwd_pre_sm80_{self._prefix}_r{self.aux_rows}",
            SOURCE,
            defines=self._defines(PART_PRE, FC_BLOCK_M=self.aux_rows),
        )

    def convert_spec(self, frag_m: int = 0, spans: bool = True) -> KernelSpec:
        """CONVERT; frag_m > 0 reads dq_accum in flash_bwd_sm90's FC_DQ_FRAG layout (tiles of
        frag_m query rows in its consumers' register order: frag_offset in the .cu), by default
        in whole 64-byte spans with dq written through shared memory (FC_DQ_SPANS; spans=False:
        the float2 reads, A/B)."""
        spans = bool(frag_m) and spans
        if spans and (self.aux_rows % 64 or self.head_dim % 64 or frag_m % 64):
            raise ValueError(f"convert_spec: the span reader needs 64-row / 64-column tiles, got "
                             f"aux_rows {self.aux_rows}, head dim {self.head_dim}, frag_m {frag_m}")
        extra = {"FC_DQ_FRAG_M": frag_m} if frag_m else {}
        if spans:
            extra["FC_DQ_SPANS"] = 1
        return KernelSpec.make(
            f"flash_bwd_convert_sm80_{self._prefix}_r{self.aux_rows}"
            + (f"_frag{frag_m}" if frag_m else "") + ("s" if spans else ""),
            SOURCE,
            defines=self._defines(PART_CONVERT, FC_BLOCK_M=self.aux_rows, **extra),
        )

    def convert_t_spec(self, rows: int) -> KernelSpec:
        """CONVERT of flash_bwd_sm90's FC_DQ_SWAP dq_accum (FC_DQ_FRAG_T: tiles of `rows` queries,
        each 64-column block of dQ^T in its consumer's register order; see the .cu): one CTA per
        tile, grid (ceil(Sq / rows), H, B)."""
        if rows % 8 or self.head_dim % 64:
            raise ValueError(f"convert_t_spec: expected rows % 8 == 0 and a head dim multiple of "
                             f"64, got rows {rows}, head dim {self.head_dim}")
        return KernelSpec.make(
            f"flash_bwd_convert_sm80_{self._prefix}_t{rows}", SOURCE,
            defines=self._defines(PART_CONVERT, FC_BLOCK_M=rows, FC_DQ_FRAG_T=1),
        )

    def spec(self) -> KernelSpec:
        """The main kernel (the one whose name identifies the configuration)."""
        return self.main_spec(True)

    def specs(self) -> list[KernelSpec]:
        return [
            self.pre_spec(),
            self.main_spec(True),
            self.main_spec(False),
            self.dq_spec(),
            self.convert_spec(),
        ]


_TAG = re.compile(r"bm(\d+)_bn(\d+)_w(\d+)((?:_(?:dp|dqm|dqp|mb|red)\d+)*)")
_KNOB = re.compile(r"_(dp|dqm|dqp|mb|red)(\d+)")
_TAG_KNOBS = {
    "dp": "dp_group",
    "dqm": "dq_warps_m",
    "dqp": "dq_passes",
    "mb": "min_blocks",
    "red": "dq_red",
}


def max_dq_acc(head_dim: int) -> int:
    """fp32 dQ accumulators a thread may hold next to dK and dV (head_dim floats together)."""
    return 32 if head_dim >= 96 else 64


def _auto_min_blocks(warps: int) -> int:
    return max(1, 8 // warps)


def _auto_dp_group(head_dim: int, block_m: int) -> int:
    # Register budget (255, no spills; NVRTC 13.0, the GPU image's, and 13.5): with the whole dP^T
    # alive next to P^T and dK/dV, ptxas spilled 4-36 bytes on sm_90a at D = 96 and 128, whatever
    # the dQ warp grid; dP^T in groups of 4 n-tiles (one extra reload of the warp's V rows per step,
    # ~5% more shared reads) fits. D = 64 uses groups of 8 for the same margin.
    limit = 4 if head_dim >= 96 else 8 if head_dim >= 64 else block_m // 8
    return min(limit, block_m // 8)


def _dq_grid_ok(head_dim: int, block_m: int, warps: int, wm: int, passes: int) -> bool:
    if wm < 1 or passes < 1 or warps % wm:
        return False
    wn = warps // wm
    return block_m % (16 * wm) == 0 and head_dim % (16 * wn * passes) == 0


def _best_dq_grid(
    head_dim: int, block_m: int, warps: int, wm_fixed: int = 0, passes_fixed: int = 0
) -> tuple[int, int]:
    """(dq_warps_m, dq_passes) reading the fewest shared bytes per key (dS^T rows once per pass,
    K columns once) whose accumulators fit max_dq_acc; 0 = free. Ties: fewer warp rows."""
    best: tuple[int, int, int] | None = None
    for wm in [wm_fixed] if wm_fixed else range(1, warps + 1):
        for passes in [passes_fixed] if passes_fixed else (1, 2, 4, 8):
            if not _dq_grid_ok(head_dim, block_m, warps, wm, passes):
                continue
            rows, cols = block_m // wm, head_dim // (warps // wm)
            if not passes_fixed and rows * cols // passes // 32 > max_dq_acc(head_dim):
                continue
            cost = passes * rows + cols
            if best is None or cost < best[0]:
                best = (cost, wm, passes)
    if best is None:
        raise ValueError(
            f"no warp grid of {warps} warps tiles the {block_m} x {head_dim} dQ block in "
            f"16 x 16 multiples within {max_dq_acc(head_dim)} accumulators per thread"
        )
    return best[1], best[2]


# Default tiles: (compile-time head dim, dtype or None = any, windowed or None = any) -> tag; the
# most specific matching key wins ("windowed": causal or any sliding window). block_n = 128 keys
# (8 warps x 16) keeps dK and dV of 16 keys x D per warp in registers (D / 2 fp32 per thread).
# block_m = 64 leaves room for the 16 x 64 S^T and dP^T fragments next to them at D >= 96; D <= 64
# afford block_m = 128 (fewer K/V-side operand reloads, half the dQ reductions per key). Measured
# (H200, sweep-20261130-002723-10dcd36): 0.77-0.87x FA2; the A/B candidates below await the GPU.
CONFIG_TABLE: dict[tuple[int, torch.dtype | None, bool | None], str] = {
    (32, None, None): "bm128_bn128_w8",
    (64, None, None): "bm128_bn128_w8",
    (96, None, None): "bm64_bn128_w8",
    (128, None, None): "bm64_bn128_w8",
}
HEAD_DIMS = tuple(sorted({d for d, _, _ in CONFIG_TABLE}))

# Tags compiled ahead (CPU lane, scripts/precompile.py) for A/B runs through CONFIG_ENV; any other
# valid tag also works (compiled on first use). docs/perf-notes.md (2026-11-30) has the predictions.
#   bm*_bn64_w4: two 4-warp CTAs per SM on H100/H200 (one 8-warp CTA today), same warp tile
#   _red4:       dQ reductions as red.global.add.v4.f32 on sm_90
CANDIDATES: dict[int, tuple[str, ...]] = {
    64: ("bm128_bn64_w4", "bm64_bn64_w4", "bm128_bn128_w8_red4", "bm128_bn64_w4_red4"),
    128: ("bm64_bn64_w4", "bm64_bn128_w8_red4", "bm64_bn64_w4_red4"),
}

# FLASHCUDA_BWD_SM80_CONFIG: "TAG" (every head dim) or "d64=TAG,d128=TAG" (per compile-time head
# dim; the others keep CONFIG_TABLE's). Empty or "default": the table. A tag that does not tile a
# head dim raises ValueError (an A/B run must not fall back silently).
CONFIG_ENV = "FLASHCUDA_BWD_SM80_CONFIG"


def _kernel_head_dim(head_dim: int) -> int | None:
    """The smallest compile-time head dim >= a runtime one (a multiple of 8), or None."""
    if head_dim <= 0 or head_dim % 8:
        return None
    return next((d for d in HEAD_DIMS if head_dim <= d), None)


def table_tag(head_dim: int, dtype: torch.dtype, windowed: bool) -> str:
    """CONFIG_TABLE's tag for a compile-time head dim (KeyError if the table has none)."""
    for key in ((head_dim, dtype, windowed), (head_dim, dtype, None), (head_dim, None, windowed),
                (head_dim, None, None)):
        if key in CONFIG_TABLE:
            return CONFIG_TABLE[key]
    raise KeyError(f"CONFIG_TABLE has no entry for head_dim {head_dim}")


def parse_override(raw: str) -> dict[int | None, str]:
    """CONFIG_ENV's value as {compile-time head dim or None (= every head dim): tag}."""
    raw = raw.strip()
    if not raw or raw.lower() == "default":
        return {}
    out: dict[int | None, str] = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        if "=" in part:
            key, tag = (x.strip() for x in part.split("=", 1))
            m = re.fullmatch(r"d?(\d+)", key)
            if m is None or int(m.group(1)) not in HEAD_DIMS:
                raise ValueError(
                    f"{CONFIG_ENV}={raw!r}: {key!r} is not a compile-time head dim "
                    f"(one of {', '.join(f'd{d}' for d in HEAD_DIMS)})"
                )
            out[int(m.group(1))] = tag
        else:
            out[None] = part
    return out


@cache
def _resolve(dtype: torch.dtype, d: int, windowed: bool, raw: str) -> BwdSm80Config:
    override = parse_override(raw)
    tag = override.get(d, override.get(None))
    if tag is None:
        return BwdSm80Config.from_tag(dtype, d, table_tag(d, dtype, windowed))
    try:
        return BwdSm80Config.from_tag(dtype, d, tag)
    except ValueError as exc:
        raise ValueError(f"{CONFIG_ENV}={raw!r} at head_dim {d}: {exc}") from None


def config_for(dtype: torch.dtype, head_dim: int, windowed: bool = False) -> BwdSm80Config | None:
    """The configuration for a runtime head dim (the smallest compile-time head dim >= it), or
    None if none holds it: CONFIG_ENV's tag when set, else CONFIG_TABLE's."""
    if dtype not in DTYPES:
        return None
    d = _kernel_head_dim(head_dim)
    if d is None:
        return None
    return _resolve(dtype, d, bool(windowed), os.environ.get(CONFIG_ENV, ""))


def call_config(call: BwdCall) -> BwdSm80Config | None:
    """config_for a call: its dtype, head dim and mask."""
    windowed = call.window_left is not None or call.window_right is not None
    return config_for(call.dtype, call.head_dim, windowed)


@cache
def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _device_info(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), int(props.shared_memory_per_block_optin)


def can_implement(call: BwdCall) -> str | None:
    """None if this family can run `call`, else the reason it cannot."""
    if call.dtype not in DTYPES:
        return f"dtype {call.dtype} is not supported (float16 / bfloat16 only)"
    if why := call.operand_problem():
        return why
    tensors = call.operands()
    sq, sk, d = call.seqlen_q, call.seqlen_k, call.head_dim
    cfg = call_config(call)
    if cfg is None:
        return f"head_dim {d} is not supported (multiples of 8 up to {HEAD_DIMS[-1]})"
    if sq + sk >= MAX_SEQLEN_SUM:
        return f"seqlen_q + seqlen_k = {sq + sk} is too large (< {MAX_SEQLEN_SUM})"
    for name, t in tensors.items():
        if t.numel() and (why := vector_layout_problem(name, t)):
            return why
    for name, t in {**tensors, "lse": call.lse}.items():
        if t.device != call.device or not on_cuda(t.device):
            return f"{name} is on {t.device}, expected a CUDA device ({call.device})"
    cc, smem_optin = _device_info(_device_index(call.device))
    if cc < (8, 0):
        return f"compute capability {cc[0]}.{cc[1]} < 8.0 (needs mma.sync bf16, cp.async)"
    need = cfg.smem_bytes(call.deterministic)
    if need > smem_optin:
        return f"needs {need} bytes of shared memory per block, the device allows {smem_optin}"
    return None


def _strides(t: torch.Tensor) -> tuple[np.int64, np.int64, np.int64]:
    return np.int64(t.stride(0)), np.int64(t.stride(1)), np.int64(t.stride(2))


def run(call: BwdCall) -> None:
    """Fill call.dq, call.dk, call.dv. The caller has checked can_implement(call)."""
    cfg = call_config(call)
    if cfg is None:
        raise NotImplementedError(can_implement(call) or "no sm80 backward configuration")
    b, sq, sk = call.batch, call.seqlen_q, call.seqlen_k
    h, hkv, d = call.nheads, call.nheads_kv, call.head_dim
    if b == 0 or h == 0:
        return
    dev = call.device
    sq_pad = cfg.seqlen_pad(sq)
    with_dq = not call.deterministic
    lse = call.lse if call.lse.stride(-1) == 1 else call.lse.contiguous()
    lse2 = torch.empty((b, h, sq_pad), dtype=torch.float32, device=dev)
    delta = torch.empty_like(lse2)
    dq_accum = (
        torch.empty((b, h, sq_pad, cfg.head_dim), dtype=torch.float32, device=dev)
        if with_dq and sq > 0
        else None
    )
    wl, wr = kernel_windows(sq, sk, call.window_left, call.window_right)
    scale = np.float32(call.softmax_scale)
    scale_log2 = np.float32(call.softmax_scale * LOG2E)
    shape_args = (
        np.int32(sq),
        np.int32(sk),
        np.int32(h),
        np.int32(hkv),
        np.int32(d),
        np.int32(sq_pad),
        scale_log2,
        scale,
        wl,
        wr,
    )

    if sq > 0:
        get_kernel(cfg.pre_spec(), dev).launch(
            (sq_pad // cfg.aux_rows, h, b),
            (AUX_THREADS,),
            call.out,
            call.dout,
            lse,
            lse2,
            delta,
            dq_accum,
            *_strides(call.out),
            *_strides(call.dout),
            np.int64(lse.stride(0)),
            np.int64(lse.stride(1)),
            np.int32(sq),
            np.int32(h),
            np.int32(d),
            np.int32(sq_pad),
        )
    if sk > 0:
        get_kernel(cfg.main_spec(with_dq), dev).launch(
            (-(-sk // cfg.block_n), hkv, b),
            (cfg.threads,),
            call.q,
            call.k,
            call.v,
            call.dout,
            lse2,
            delta,
            dq_accum,
            call.dk,
            call.dv,
            *_strides(call.q),
            *_strides(call.k),
            *_strides(call.v),
            *_strides(call.dout),
            *_strides(call.dk),
            *_strides(call.dv),
            *shape_args,
            shared_mem=cfg.main_smem_bytes(with_dq),
        )
    if sq == 0:
        return
    if with_dq:
        get_kernel(cfg.convert_spec(), dev).launch(
            (-(-sq // cfg.aux_rows), h, b),
            (AUX_THREADS,),
            dq_accum,
            call.dq,
            *_strides(call.dq),
            np.int32(sq),
            np.int32(h),
            np.int32(d),
            np.int32(sq_pad),
            scale,
        )
    else:
        get_kernel(cfg.dq_spec(), dev).launch(
            (-(-sq // cfg.dq_block_m), h, b),
            (32 * cfg.dq_warps,),
            call.q,
            call.k,
            call.v,
            call.dout,
            lse2,
            delta,
            call.dq,
            *_strides(call.q),
            *_strides(call.k),
            *_strides(call.v),
            *_strides(call.dout),
            *_strides(call.dq),
            *shape_args,
            shared_mem=cfg.dq_smem_bytes(),
        )


def configs() -> list[BwdSm80Config]:
    """Every configuration compiled ahead: CONFIG_TABLE's and the A/B CANDIDATES, both dtypes."""
    out: dict[BwdSm80Config, None] = {}
    for dtype in DTYPES:
        for key, tag in CONFIG_TABLE.items():
            if key[1] in (None, dtype):
                out[BwdSm80Config.from_tag(dtype, key[0], tag)] = None
        for d, tags in CANDIDATES.items():
            for tag in tags:
                out[BwdSm80Config.from_tag(dtype, d, tag)] = None
    return list(out)


def variants() -> list[tuple[KernelSpec, tuple[str, ...]]]:
    """Every specialisation this family launches by default or as an A/B candidate, once each,
    for the CPU compile lane and scripts/precompile.py."""
    seen: dict[str, tuple[KernelSpec, tuple[str, ...]]] = {}
    for cfg in configs():
        for spec in cfg.specs():
            seen.setdefault(spec.name, (spec, ARCHS))
    return list(seen.values())


register(variants)

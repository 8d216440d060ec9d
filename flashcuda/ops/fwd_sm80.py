"""The sm80 tensor-core forward kernel family (FlashAttention-2 algorithm, fp16/bf16).

`Sm80FwdConfig` is the single source of truth for a specialisation: tile sizes, warps, shared
memory, threads, the kernel name and the constants the .cu sees (which checks its own smem layout
against `smem_bytes`). Tile shapes per head dim follow FA2's measured choices for A100/H100
(csrc/flash_attn/src/flash_fwd_launch_template.h):

    kernel head dim   block_m x block_n, warps   smem      why
    32, 64            128 x 128, 4               24/48 KB  FA2: 8 warps 18% slower, 64x256 27% slower (d64)
    96, 128           128 x 64, 4                48/64 KB  FA2: 8 warps 28% slower at 2k (d128)
    192               128 x 64, 8                96 KB
    256               128 x 64, 8                128 KB    where a block may take 128 KB but an SM
                                                           cannot hold two 96 KB CTAs (A100)
    256               64 x 64, 4                 96 KB     elsewhere (H100/H200: 2 CTAs per SM;
                                                           sm86/89/120: 99 KB per block)

K and V are single-buffered: FA2's schedule overlaps the V load with Q K^T and the next K load with
softmax + P V, so a deeper pipeline would only cost shared memory (occupancy). The shapes and the
"why" column are FA2's measurements, not yet ours.

The row sums of P are carried across key tiles with round-to-nearest adds (the default since
session 7: accumulated on the tensor cores over the whole row, FLASHCUDA_SM80_FWD_ROWSUM=mma, they
leave lse ~2.4e-4 low at 65537 keys; the exact sums cost 0-2% in the same-run A/B; see the .cu).
A NaN / Inf in V reaches only the rows that see its key, also inside partly seen key tiles (the
default since session 8, once its vote rode on the loop's own barrier: 0-4% at 1k causal, 0-2% on
long rows in the same-run A/B; FLASHCUDA_SM80_FWD_MASKED_V=0 runs the variant without the scan,
for A/B runs; see the .cu).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .._env import env_names, env_values, flag
from ..jit import KernelSpec, PreparedLaunch, get_kernel, register
from .call import (
    DTYPE_CODE,
    DTYPE_NAME,
    FwdCall,
    PlanCache,
    fwd_kernel_args,
    on_cuda,
    vector_layout_problem,
)

SOURCE = "attention/flash_fwd_sm80.cu"
ARCHS = ("sm_80", "sm_90a")
DTYPES = (torch.float16, torch.bfloat16)
KERNEL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
MAX_GRID_YZ = 65535
MAX_SEQLEN_SUM = 2**30
ROWSUM_ENV = "FLASHCUDA_SM80_FWD_ROWSUM"  # exact (default) / mma (A/B): Sm80FwdConfig.exact_rowsum
MASKED_V_ENV = "FLASHCUDA_SM80_FWD_MASKED_V"  # 1 (default) / 0 (A/B): Sm80FwdConfig.masked_v

# (max dynamic smem per block with opt-in, smem per SM) by compute capability, for when torch's
# device properties lack them; also the device classes `variants()` plans for.
_SMEM_BY_CC: dict[tuple[int, int], tuple[int, int]] = {
    (8, 0): (166912, 167936),
    (8, 6): (101376, 102400),
    (8, 7): (166912, 167936),
    (8, 9): (101376, 102400),
    (9, 0): (232448, 233472),
    (10, 0): (232448, 233472),
    (12, 0): (101376, 102400),
}
_SMEM_UNKNOWN = (101376, 102400)


@dataclass(frozen=True)
class Sm80FwdConfig:
    """One specialisation of flash_fwd_sm80.cu."""

    dtype: torch.dtype
    head_dim: int  # the kernel's head dim (runtime head_dim <= this, padded with zeros)
    block_m: int
    block_n: int
    warps: int
    # the row sums of P carried across key tiles with round-to-nearest adds (lse exact on long
    # rows; False: FLASHCUDA_SM80_FWD_ROWSUM=mma, the tensor cores' sum over the row, A/B)
    exact_rowsum: bool = True
    # non-finite V in a partly seen key tile reaches only the rows that see its key (default;
    # False: FLASHCUDA_SM80_FWD_MASKED_V=0, A/B, see the .cu); + a bit table in shared memory
    masked_v: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"Sm80FwdConfig.dtype: expected fp16 or bf16, got {self.dtype}")
        if self.head_dim % 32 or not 32 <= self.head_dim <= 256:
            raise ValueError(f"Sm80FwdConfig.head_dim: expected a multiple of 32 in [32, 256], "
                             f"got {self.head_dim}")
        if self.block_m % (16 * self.warps):
            raise ValueError(f"Sm80FwdConfig: block_m={self.block_m} must be a multiple of "
                             f"16 * warps = {16 * self.warps}")
        if self.block_n % 16 or self.block_n <= 0:
            raise ValueError(f"Sm80FwdConfig.block_n: expected a positive multiple of 16, "
                             f"got {self.block_n}")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        """Q tile + one K tile + one V tile, 2-byte elements (+ with masked_v the bit table: 3 kinds
        x head_dim columns x block_n / 32 words); the .cu static_asserts the same."""
        table = 3 * self.head_dim * (self.block_n // 32) * 4 if self.masked_v else 0
        return (self.block_m + 2 * self.block_n) * self.head_dim * 2 + table

    @property
    def name(self) -> str:
        return (f"flash_fwd_sm80_{DTYPE_NAME[self.dtype]}_d{self.head_dim}"
                f"_bm{self.block_m}_bn{self.block_n}_w{self.warps}"
                + ("" if self.exact_rowsum else "_mrs") + ("" if self.masked_v else "_nomv"))

    def spec(self) -> KernelSpec:
        return KernelSpec.make(self.name, SOURCE, defines={
            "FC_DTYPE": DTYPE_CODE[self.dtype],
            "FC_HEAD_DIM": self.head_dim,
            "FC_BLOCK_M": self.block_m,
            "FC_BLOCK_N": self.block_n,
            "FC_WARPS": self.warps,
            "FC_SMEM_BYTES": self.smem_bytes,
            # only the A/B variants name their switches (the .cu defaults are the default kernel)
            **({} if self.exact_rowsum else {"FC_EXACT_ROWSUM": 0}),
            **({} if self.masked_v else {"FC_MASKED_V": 0}),
        })

    def grid(self, call: FwdCall) -> tuple[int, int, int]:
        return (math.ceil(call.seqlen_q / self.block_m), call.nheads, call.batch)


def kernel_head_dim(head_dim: int) -> int | None:
    """The smallest kernel head dim that holds `head_dim`, or None if there is none."""
    return next((d for d in KERNEL_HEAD_DIMS if d >= head_dim), None)


def select_config(dtype: torch.dtype, head_dim: int, smem_per_block: int,
                  smem_per_sm: int, masked_v: bool = True) -> Sm80FwdConfig:
    """The tile choice for a (runtime) head dim on a device with the given shared memory (FA2's,
    made without the masked-V bit table), then the masked-V treatment where its table fits next
    to those tiles: everywhere on A100 / H100-class parts; not d192 / d256 on 99 KB parts."""
    d = kernel_head_dim(head_dim)
    if d is None:
        raise ValueError(f"head_dim: expected at most {KERNEL_HEAD_DIMS[-1]}, got {head_dim}")
    if d <= 64:
        shape = (128, 128, 4)
    elif d <= 128:
        shape = (128, 64, 4)
    elif d == 192:
        shape = (128, 64, 8)
    else:  # FA2's rule for d256: the 128 KB config only where two 96 KB CTAs do not fit an SM
        big = Sm80FwdConfig(dtype, d, 128, 64, 8, masked_v=False)
        fits_big = smem_per_block >= big.smem_bytes and smem_per_sm < 2 * 98304
        shape = (128, 64, 8) if fits_big else (64, 64, 4)
    cfg = Sm80FwdConfig(dtype, d, *shape, masked_v=False)
    if cfg.smem_bytes > smem_per_block:
        cfg = Sm80FwdConfig(dtype, d, 64, 64, 4, masked_v=False)
    with_table = dataclasses.replace(cfg, masked_v=True)
    return with_table if masked_v and with_table.smem_bytes <= smem_per_block else cfg


@functools.cache
def _device_info(index: int) -> tuple[tuple[int, int], int, int]:
    """(compute capability, max dynamic smem per block, smem per SM) of a CUDA device."""
    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    per_block, per_sm = _SMEM_BY_CC.get(cc, _SMEM_UNKNOWN)
    per_block = int(getattr(props, "shared_memory_per_block_optin", per_block) or per_block)
    per_sm = int(getattr(props, "shared_memory_per_multiprocessor", per_sm) or per_sm)
    return cc, per_block, per_sm


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def exact_rowsum() -> bool:
    """FLASHCUDA_SM80_FWD_ROWSUM: exact (default, the row sums carried across key tiles with
    round-to-nearest adds) or mma (accumulated on the tensor cores across the whole row, A/B)."""
    raw = os.environ.get(ROWSUM_ENV, "").strip().lower() or "exact"
    if raw not in ("mma", "exact"):
        raise ValueError(f"{ROWSUM_ENV}: expected mma or exact, got {raw!r}")
    return raw == "exact"


def masked_v() -> bool:
    """Non-finite V in a partly seen key tile reaches only the rows that see its key (unset / 1:
    the default kernel; FLASHCUDA_SM80_FWD_MASKED_V=0: the A/B variant without the scan)."""
    return flag(MASKED_V_ENV, True)


def config_for(call: FwdCall) -> Sm80FwdConfig:
    _, per_block, per_sm = _device_info(_device_index(call.device))
    cfg = select_config(call.dtype, call.head_dim, per_block, per_sm, masked_v=masked_v())
    return dataclasses.replace(cfg, exact_rowsum=exact_rowsum())


def can_implement(call: FwdCall) -> str | None:
    """None if this family can run `call`, else the reason it cannot."""
    if call.dtype not in DTYPES:
        return f"dtype {call.dtype} is not fp16/bf16"
    for name in ("k", "v", "out"):
        if getattr(call, name).dtype != call.dtype:
            return f"{name}.dtype {getattr(call, name).dtype} differs from q.dtype {call.dtype}"
    d = call.head_dim
    if d % 8 or d > KERNEL_HEAD_DIMS[-1] or d <= 0:
        return f"head_dim {d} is not a multiple of 8 in [8, {KERNEL_HEAD_DIMS[-1]}]"
    if call.k.shape[3] != d or call.v.shape[3] != d:
        return f"k/v head dims {call.k.shape[3]}/{call.v.shape[3]} differ from q's {d}"
    if call.nheads_kv <= 0 or call.nheads % call.nheads_kv:
        return f"nheads {call.nheads} is not a multiple of nheads_kv {call.nheads_kv}"
    if call.nheads > MAX_GRID_YZ or call.batch > MAX_GRID_YZ:
        return f"nheads {call.nheads} or batch {call.batch} exceeds the grid limit {MAX_GRID_YZ}"
    if call.seqlen_q + call.seqlen_k >= MAX_SEQLEN_SUM:
        # The mask arithmetic (row + shift +- window, windows clamped to +-(Sq + Sk)) is int32.
        return f"seqlen_q + seqlen_k = {call.seqlen_q + call.seqlen_k} >= {MAX_SEQLEN_SUM}"
    if not (math.isfinite(call.softmax_scale) and call.softmax_scale > 0):
        return f"softmax_scale must be positive and finite, got {call.softmax_scale}"
    for name in ("q", "k", "v", "out"):
        if why := vector_layout_problem(name, getattr(call, name)):
            return why
    lse = call.lse
    if (lse.dtype != torch.float32 or tuple(lse.shape) != (call.batch, call.nheads, call.seqlen_q)
            or not lse.is_contiguous()):
        return "lse must be a contiguous float32 (batch, nheads, seqlen_q) tensor"
    if not on_cuda(call.device):
        return f"tensors are on {call.device}, not on a CUDA device"
    cc, per_block, per_sm = _device_info(_device_index(call.device))
    if cc < (8, 0):
        return f"GPU compute capability {cc[0]}.{cc[1]} < 8.0 (no mma.sync bf16 / cp.async)"
    cfg = select_config(call.dtype, d, per_block, per_sm)
    if cfg.smem_bytes > per_block:
        return f"{cfg.name} needs {cfg.smem_bytes} bytes of shared memory, the GPU has {per_block}"
    return None


@dataclass(frozen=True)
class _Plan:
    """What a call's layout decides once: the config and its launch, every argument but the five
    data pointers fixed."""

    cfg: Sm80FwdConfig
    launch: PreparedLaunch


_EMPTY = "empty"  # nothing to compute (batch, seqlen_q or nheads is 0)
_KEY_ENV = env_names(ROWSUM_ENV, MASKED_V_ENV)


def _plan_key(call: FwdCall) -> tuple:
    """Everything can_implement, config_for and the kernel's arguments read, except the data
    addresses (only their alignment): a hit skips can_implement, so a field missing here would
    let a call the family refuses reach the kernel."""
    return (call.dtype, call.device, call.window_left, call.window_right, call.softmax_scale,
            env_values(_KEY_ENV), *call.layouts())


def _build_plan(call: FwdCall) -> _Plan | str:
    if why := can_implement(call):
        raise NotImplementedError(f"flash_fwd_sm80 cannot run this call: {why}")
    if call.batch == 0 or call.seqlen_q == 0 or call.nheads == 0:
        return _EMPTY
    cfg = config_for(call)
    args = fwd_kernel_args(call)  # q, k, v, out, lse, then what the layout fixes
    return _Plan(cfg, PreparedLaunch(get_kernel(cfg.spec(), call.device), cfg.grid(call),
                                     (cfg.threads, 1, 1), cfg.smem_bytes, args,
                                     fixed=len(args) - 5))


_plans = PlanCache(_build_plan)


def _plan(call: FwdCall) -> _Plan | str:
    return _plans.plan(_plan_key(call), call)


def run(call: FwdCall) -> None:
    """Fill call.out and call.lse. Raises NotImplementedError when can_implement(call) says no.
    A repeat call with the same layout reuses its plan (can_implement's verdict included: the plan
    key holds everything it reads) and only packs the five data pointers."""
    plan = _plan(call)
    if plan is _EMPTY:
        return
    plan.launch(call.q.data_ptr(), call.k.data_ptr(), call.v.data_ptr(), call.out.data_ptr(),
                call.lse.data_ptr())


def configs() -> list[Sm80FwdConfig]:
    """Every config `select_config` can return on the device classes of _SMEM_BY_CC, each also
    with the tensor cores' row sums (FLASHCUDA_SM80_FWD_ROWSUM=mma) and, separately, without the
    masked-V treatment (FLASHCUDA_SM80_FWD_MASKED_V=0)."""
    seen: dict[str, Sm80FwdConfig] = {}
    for dtype in DTYPES:
        for d in KERNEL_HEAD_DIMS:
            for per_block, per_sm in _SMEM_BY_CC.values():
                cfg = select_config(dtype, d, per_block, per_sm)
                seen.setdefault(cfg.name, cfg)
                for exact, mv in ((False, True), (True, False)):
                    variant = dataclasses.replace(cfg, exact_rowsum=exact, masked_v=mv)
                    seen.setdefault(variant.name, variant)
    return list(seen.values())


@register
def variants() -> Iterator[tuple[KernelSpec, tuple[str, ...]]]:
    for cfg in configs():
        yield cfg.spec(), ARCHS

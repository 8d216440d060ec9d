"""The sm80 tensor-core flash backward (FA2 algorithm), fp16 / bf16, on any sm >= 8.0.

Kernels: kernels/attention/flash_bwd_sm80.cu (one source, four parts picked by FC_PART):

    preprocess  delta = rowsum(dO * O), lse2 = lse * log2(e) (+inf: P = 0), zero the dQ accumulator
    main        per (key block, KV head, batch): dK, dV (and dQ via fp32 reductions unless
                deterministic); loops over the query heads of the KV head's group (GQA / MQA)
    dq          deterministic mode: per (query block, head, batch), dQ without atomics
    convert     dq = dq_accum * softmax_scale in the input dtype

`BwdSm80Config` is the single source of truth for tile sizes and shared-memory bytes: it renders the
constexprs the .cu sees (which static_asserts its own layout against FC_SMEM_BYTES) and names every
specialisation, e.g. ``flash_bwd_sm80_bf16_d128_bm64_bn128_w8``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from math import lcm

import numpy as np
import torch

from ..jit import KernelSpec, get_kernel, register
from .call import DTYPE_CODE, DTYPE_NAME, LOG2E, BwdCall, kernel_windows, vector_layout_problem

SOURCE = "attention/flash_bwd_sm80.cu"
ARCHS = ("sm_80", "sm_90a")
DTYPES = (torch.float16, torch.bfloat16)
AUX_THREADS = 256  # preprocess and convert kernels
PART_PRE, PART_MAIN, PART_DQ, PART_CONVERT = 0, 1, 2, 3
# Windows are clamped to +-(Sq + Sk) and index sums of three such terms must fit in int32.
MAX_SEQLEN_SUM = 1 << 29


@dataclass(frozen=True)
class BwdSm80Config:
    """Tiles of one backward specialisation.

    head_dim:   compile-time head dim (a runtime head dim <= it, multiple of 8, is zero-padded)
    block_m:    query rows per step of the main kernel
    block_n:    keys per CTA of the main kernel; each warp owns 16 keys, so block_n = 16 * warps
    dq_warps_m: warp rows of the main kernel's dQ GEMM (block_m x head_dim); 0 picks the grid whose
                warp tile reads the fewest shared bytes
    dq_passes:  column passes of that GEMM per warp (fewer live fp32 accumulators)
    dp_group:   query n-tiles (of 8) of dP^T computed at a time in the main kernel; 0 = all
                (block_m / 8). Fewer live registers; each extra group reloads the warp's V rows.
    dq_block_m: query rows per CTA of the deterministic dQ kernel (16 per warp)
    dq_block_n: keys per step of the deterministic dQ kernel
    aux_rows:   rows per CTA of the preprocess and convert kernels
    """

    dtype: torch.dtype
    head_dim: int
    block_m: int
    block_n: int
    warps: int
    dq_warps_m: int = 0
    dq_passes: int = 1
    dp_group: int = 0
    dq_block_m: int = 64
    dq_block_n: int = 64
    aux_rows: int = 64

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be float16 or bfloat16, got {self.dtype}")
        if self.head_dim % 16 or not 16 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must be a multiple of 16 in [16, 256], got {self.head_dim}")
        if self.block_n != 16 * self.warps:
            raise ValueError(f"block_n must be 16 * warps = {16 * self.warps}, got {self.block_n}")
        if self.block_m % 16 or self.block_m // 2 > 32 * self.warps:
            raise ValueError(
                f"block_m must be a multiple of 16 and <= 64 * warps, got {self.block_m}"
            )
        if self.dq_block_m % 16 or self.dq_block_n % 16:
            raise ValueError("dq_block_m and dq_block_n must be multiples of 16")
        if self.aux_rows % 8:
            raise ValueError(f"aux_rows must be a multiple of 8, got {self.aux_rows}")
        if self.dp_group == 0:
            object.__setattr__(self, "dp_group", self.block_m // 8)
        if self.dp_group % 2 or (self.block_m // 8) % self.dp_group:
            raise ValueError(
                f"dp_group must be even and divide block_m / 8 = {self.block_m // 8}, "
                f"got {self.dp_group}"
            )
        if self.dq_warps_m == 0:
            object.__setattr__(self, "dq_warps_m", self._best_dq_warps_m())
        wm = self.dq_warps_m
        wn = self.warps // wm if wm > 0 and self.warps % wm == 0 else 0
        if (
            wn == 0
            or self.block_m % (16 * wm)
            or self.dq_passes < 1
            or self.head_dim % (16 * wn * self.dq_passes)
        ):
            raise ValueError(
                f"dq_warps_m={wm}, dq_passes={self.dq_passes} do not tile the "
                f"{self.block_m} x {self.head_dim} dQ block with {self.warps} warps"
            )

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

    def _best_dq_warps_m(self) -> int:
        best: tuple[int, int] | None = None
        for wm in range(1, self.warps + 1):
            if self.warps % wm:
                continue
            wn = self.warps // wm
            if self.block_m % (16 * wm) or self.head_dim % (16 * wn):
                continue
            cost = self.block_m // wm + self.head_dim // wn  # shared bytes per key, A + B
            if best is None or cost < best[0]:
                best = (cost, wm)
        if best is None:
            raise ValueError(
                f"no warp grid of {self.warps} warps tiles the {self.block_m} x "
                f"{self.head_dim} dQ block in 16 x 16 multiples"
            )
        return best[1]

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

    def seqlen_pad(self, seqlen_q: int) -> int:
        """Rows of the lse2 / delta / dQ-accumulator buffers: every kernel reads whole blocks."""
        step = lcm(self.block_m, self.dq_block_m, self.aux_rows)
        return -(-seqlen_q // step) * step

    # -- specialisations ----------------------------------------------------------------------
    @property
    def _tag(self) -> str:
        return f"{self.dtype_name}_d{self.head_dim}"

    def _defines(self, part: int, **extra: int) -> dict[str, int]:
        return {
            "FC_PART": part,
            "FC_DTYPE": DTYPE_CODE[self.dtype],
            "FC_HEAD_DIM": self.head_dim,
            **extra,
        }

    def main_spec(self, with_dq: bool = True) -> KernelSpec:
        name = f"flash_bwd_sm80_{self._tag}_bm{self.block_m}_bn{self.block_n}_w{self.warps}" + (
            "" if with_dq else "_nodq"
        )
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
                FC_SMEM_BYTES=self.main_smem_bytes(with_dq),
            ),
        )

    def dq_spec(self) -> KernelSpec:
        name = (
            f"flash_bwd_dq_sm80_{self._tag}_bm{self.dq_block_m}_bn{self.dq_block_n}"
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
        return KernelSpec.make(
            f"flash_bwd_pre_sm80_{self._tag}_r{self.aux_rows}",
            SOURCE,
            defines=self._defines(PART_PRE, FC_BLOCK_M=self.aux_rows),
        )

    def convert_spec(self) -> KernelSpec:
        return KernelSpec.make(
            f"flash_bwd_convert_sm80_{self._tag}_r{self.aux_rows}",
            SOURCE,
            defines=self._defines(PART_CONVERT, FC_BLOCK_M=self.aux_rows),
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


# Tiles per compile-time head dim. block_n = 128 keys (8 warps x 16) keeps dK and dV of 16 keys x D
# per warp in registers (D / 2 fp32 per thread). block_m = 64 leaves room for the 16 x 64 S^T and
# dP^T fragments next to them at D >= 96; D <= 64 afford block_m = 128 (fewer K/V-side operand
# reloads, half the dQ reductions per key). Register budget (255, no spills; NVRTC 13.0, the GPU
# image's, and 13.5): with the whole dP^T alive next to P^T and dK/dV, ptxas spilled 4-36 bytes on
# sm_90a at D = 96 and 128, whatever the dQ warp grid; dP^T in groups of 4 n-tiles (one extra
# reload of the warp's V rows per step, ~5% more shared reads) fits, D = 96 then at 241 registers.
# D = 64 uses groups of 8 for the same margin (247 instead of 255 registers on sm_80).
_TILES: dict[int, dict[str, int]] = {
    32: {"block_m": 128, "block_n": 128, "warps": 8},
    64: {"block_m": 128, "block_n": 128, "warps": 8, "dp_group": 8},
    96: {"block_m": 64, "block_n": 128, "warps": 8, "dp_group": 4},
    128: {"block_m": 64, "block_n": 128, "warps": 8, "dp_group": 4},
}
HEAD_DIMS = tuple(sorted(_TILES))


@cache
def config_for(dtype: torch.dtype, head_dim: int) -> BwdSm80Config | None:
    """The configuration for a runtime head dim (the smallest compile-time head dim >= it), or None."""
    if dtype not in DTYPES or head_dim <= 0 or head_dim % 8:
        return None
    for d in HEAD_DIMS:
        if head_dim <= d:
            return BwdSm80Config(dtype, d, **_TILES[d])
    return None


@cache
def _device_info(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), int(props.shared_memory_per_block_optin)


def can_implement(call: BwdCall) -> str | None:
    """None if this family can run `call`, else the reason it cannot."""
    if call.dtype not in DTYPES:
        return f"dtype {call.dtype} is not supported (float16 / bfloat16 only)"
    tensors = {
        "q": call.q,
        "k": call.k,
        "v": call.v,
        "out": call.out,
        "dout": call.dout,
        "dq": call.dq,
        "dk": call.dk,
        "dv": call.dv,
    }
    for name, t in tensors.items():
        if t.dtype != call.dtype:
            return f"{name} has dtype {t.dtype}, expected {call.dtype}"
    if call.lse.dtype != torch.float32:
        return f"lse must be float32, got {call.lse.dtype}"
    b, sq, h, d = call.q.shape
    sk, hkv = call.seqlen_k, call.nheads_kv
    for name, t, shape in (
        ("out", call.out, (b, sq, h, d)),
        ("dout", call.dout, (b, sq, h, d)),
        ("dq", call.dq, (b, sq, h, d)),
        ("k", call.k, (b, sk, hkv, d)),
        ("v", call.v, (b, sk, hkv, d)),
        ("dk", call.dk, (b, sk, hkv, d)),
        ("dv", call.dv, (b, sk, hkv, d)),
        ("lse", call.lse, (b, h, sq)),
    ):
        if tuple(t.shape) != shape:
            return f"{name} has shape {tuple(t.shape)}, expected {shape}"
    if hkv == 0 or h % hkv:
        return f"nheads ({h}) must be a multiple of nheads_kv ({hkv})"
    cfg = config_for(call.dtype, d)
    if cfg is None:
        return f"head_dim {d} is not supported (multiples of 8 up to {HEAD_DIMS[-1]})"
    if sq + sk >= MAX_SEQLEN_SUM:
        return f"seqlen_q + seqlen_k = {sq + sk} is too large (< {MAX_SEQLEN_SUM})"
    for name, t in tensors.items():
        if t.numel() and (why := vector_layout_problem(name, t)):
            return why
    for name, t in {**tensors, "lse": call.lse}.items():
        if t.device != call.device or t.device.type != "cuda":
            return f"{name} is on {t.device}, expected a CUDA device ({call.device})"
    cc, smem_optin = _device_info(
        call.device.index if call.device.index is not None else torch.cuda.current_device()
    )
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
    cfg = config_for(call.dtype, call.head_dim)
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


def variants() -> list[tuple[KernelSpec, tuple[str, ...]]]:
    """Every specialisation this family launches, for the CPU compile lane."""
    out: list[tuple[KernelSpec, tuple[str, ...]]] = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            cfg = config_for(dtype, d)
            if cfg is not None:
                out += [(spec, ARCHS) for spec in cfg.specs()]
    return out


register(variants)

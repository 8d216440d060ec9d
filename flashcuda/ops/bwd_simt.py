"""Flash backward, SIMT generation (kernels/attention/flash_bwd_simt.cu): any dtype, any sm >= 70.

Three kernels, launched in order on torch's current stream:

1. dot_do_o: delta = rowsum(dO o O), fp32 (B, H, Sq).
2. dkdv: per (key tile, KV head, batch), dK and dV over every query tile of every query head
   sharing the KV head (a fixed order, so dK/dV are deterministic under GQA). By default it also
   adds scale * dS K into an fp32 dQ buffer with atomics (then converted to the input dtype).
3. dq (deterministic=True only): per (query tile, head, batch), dQ over its key tiles, no atomics,
   written straight in the input dtype. Bitwise reproducible at the cost of recomputing P and dP.

`SimtBwdConfig` is the single source of truth for tile sizes, threads and shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..jit import KernelSpec, get_kernel, register
from .call import DTYPE_CODE, DTYPE_NAME, LOG2E, BwdCall
from .fwd_simt import (
    HEAD_DIM_BUCKETS,
    device_reason,
    head_dim_bucket,
    shape_reason,
    smem_tile_bytes,
)

SOURCE = "attention/flash_bwd_simt.cu"
ARCHS = ("sm_80", "sm_90a")

# FC_BWD_KERNEL values (flash_bwd_simt.cu).
DOT_DO_O, DKDV, DQ = 0, 1, 2
DOT_DO_O_ROWS_PER_CTA = 4  # one warp per row, 128 threads
DOT_DO_O_THREADS = 32 * DOT_DO_O_ROWS_PER_CTA

# Tiles per head-dim bucket: (block, lanes); block = query rows per query tile = keys per key
# tile, 128 threads. Each thread keeps 2 * head_dim / lanes fp32 accumulators (dK and dV; 16..64).
# hdim 256 halves the block to keep shared memory at 68 KB (fits sm70's 96 KB).
_TILES: dict[int, tuple[int, int]] = {32: (32, 4), 64: (32, 4), 128: (32, 4), 256: (16, 8)}


@dataclass(frozen=True)
class SimtBwdConfig:
    dtype: torch.dtype
    head_dim: int  # FC_HEAD_DIM: the bucket; the call's head_dim may be smaller
    block: int  # query rows per query tile and keys per key tile
    lanes: int  # threads per tile row

    @property
    def threads(self) -> int:
        return self.block * self.lanes

    @property
    def dkdv_smem_bytes(self) -> int:
        """K, V, Q, dO tiles + P^T, dS^T tiles + lse, delta vectors (the kernel's carve order)."""
        return (4 * smem_tile_bytes(self.block, self.head_dim)
                + 2 * smem_tile_bytes(self.block, self.block) + 2 * 4 * self.block)

    @property
    def dq_smem_bytes(self) -> int:
        """Q, dO, K, V tiles + dS tile."""
        return 4 * smem_tile_bytes(self.block, self.head_dim) + smem_tile_bytes(self.block, self.block)

    @property
    def smem_bytes(self) -> int:
        return max(self.dkdv_smem_bytes, self.dq_smem_bytes)

    def _tile_spec(self, kernel: str, code: int) -> KernelSpec:
        name = (f"flash_bwd_{kernel}_simt_{DTYPE_NAME[self.dtype]}_d{self.head_dim}"
                f"_bm{self.block}_bn{self.block}")
        return KernelSpec.make(name, SOURCE, defines={
            "FC_BWD_KERNEL": code,
            "FC_DTYPE": DTYPE_CODE[self.dtype],
            "FC_HEAD_DIM": self.head_dim,
            "FC_BLOCK": self.block,
            "FC_LANES": self.lanes,
            "FC_THREADS": self.threads,
        })

    def dkdv_spec(self) -> KernelSpec:
        return self._tile_spec("dkdv", DKDV)

    def dq_spec(self) -> KernelSpec:
        return self._tile_spec("dq", DQ)

    def dot_do_o_spec(self) -> KernelSpec:
        """Independent of the head-dim bucket: one per dtype."""
        return KernelSpec.make(f"flash_bwd_dot_do_o_simt_{DTYPE_NAME[self.dtype]}", SOURCE,
                               defines={"FC_BWD_KERNEL": DOT_DO_O, "FC_DTYPE": DTYPE_CODE[self.dtype]})

    @property
    def name(self) -> str:
        return f"flash_bwd_simt_{DTYPE_NAME[self.dtype]}_d{self.head_dim}_bm{self.block}_bn{self.block}"


def config_for(dtype: torch.dtype, head_dim: int) -> SimtBwdConfig:
    bucket = head_dim_bucket(head_dim)
    block, lanes = _TILES[bucket]
    return SimtBwdConfig(dtype, bucket, block, lanes)


def can_implement(call: BwdCall) -> str | None:
    """None if this family can run `call`, else the reason it cannot."""
    reason = shape_reason(call.q, call.k, call.v)
    if reason:
        return reason
    for name, t, like in (("out", call.out, call.q), ("dout", call.dout, call.q),
                          ("dq", call.dq, call.q), ("dk", call.dk, call.k), ("dv", call.dv, call.k)):
        if t.dtype != call.dtype or t.shape != like.shape:
            return (f"{name} must be {call.dtype} of shape {tuple(like.shape)}, "
                    f"got {t.dtype} {tuple(t.shape)}")
    for name, t in (("dq", call.dq), ("dk", call.dk), ("dv", call.dv)):
        if call.head_dim > 1 and t.stride(3) != 1:
            return f"{name} must have a unit last stride, got strides {tuple(t.stride())}"
    if call.lse.dtype != torch.float32 or tuple(call.lse.shape) != (call.batch, call.nheads, call.seqlen_q):
        return "lse must be float32 of shape (batch, nheads, seqlen_q)"
    cfg = config_for(call.dtype, call.head_dim)
    return device_reason(call.device, cfg.smem_bytes, cfg.name)


def _strides(t: torch.Tensor) -> tuple[np.int64, np.int64, np.int64]:
    """(batch, row, head) strides in elements of a (B, S, H, D) tensor."""
    return np.int64(t.stride(0)), np.int64(t.stride(1)), np.int64(t.stride(2))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[3] <= 1 or t.stride(3) == 1 else t.contiguous()


def run(call: BwdCall) -> None:
    """Fill call.dq, call.dk, call.dv on torch's current stream."""
    if call.batch == 0 or call.nheads == 0:
        return
    if call.seqlen_q == 0 or call.seqlen_k == 0:  # no score exists: every gradient is 0
        for t in (call.dq, call.dk, call.dv):
            t.zero_()
        return
    cfg = config_for(call.dtype, call.head_dim)
    device = call.device
    out, dout = _unit_last(call.out), _unit_last(call.dout)
    lse = call.lse.contiguous()
    sizes = (np.int32(call.batch), np.int32(call.seqlen_q), np.int32(call.seqlen_k),
             np.int32(call.nheads), np.int32(call.nheads_kv), np.int32(call.head_dim))
    scales = (np.float32(call.softmax_scale), np.float32(call.softmax_scale * LOG2E))
    windows = call.as_fwd().kernel_windows()

    delta = torch.empty((call.batch, call.nheads, call.seqlen_q), dtype=torch.float32, device=device)
    get_kernel(cfg.dot_do_o_spec(), device).launch(
        (-(-call.seqlen_q // DOT_DO_O_ROWS_PER_CTA), call.nheads, call.batch),
        (DOT_DO_O_THREADS, 1, 1),
        out, dout, delta, *_strides(out), *_strides(dout),
        np.int32(call.batch), np.int32(call.seqlen_q), np.int32(call.nheads), np.int32(call.head_dim),
    )

    if call.deterministic:
        dq_accum = None
    elif call.dtype == torch.float32:
        dq_accum = call.dq.zero_()  # accumulate in place
    else:
        dq_accum = torch.zeros(call.q.shape, dtype=torch.float32, device=device)
    dq_strides = _strides(dq_accum) if dq_accum is not None else (np.int64(0),) * 3
    get_kernel(cfg.dkdv_spec(), device).launch(
        (-(-call.seqlen_k // cfg.block), call.nheads_kv, call.batch), (cfg.threads, 1, 1),
        call.q, call.k, call.v, dout, lse, delta, call.dk, call.dv, dq_accum,
        *_strides(call.q), *_strides(call.k), *_strides(call.v), *_strides(dout),
        *_strides(call.dk), *_strides(call.dv), *dq_strides,
        *sizes, *scales, *windows,
        shared_mem=cfg.dkdv_smem_bytes,
    )

    if call.deterministic:
        get_kernel(cfg.dq_spec(), device).launch(
            (-(-call.seqlen_q // cfg.block), call.nheads, call.batch), (cfg.threads, 1, 1),
            call.q, call.k, call.v, dout, lse, delta, call.dq,
            *_strides(call.q), *_strides(call.k), *_strides(call.v), *_strides(dout),
            *_strides(call.dq), *sizes, *scales, *windows,
            shared_mem=cfg.dq_smem_bytes,
        )
    elif dq_accum is not call.dq:
        call.dq.copy_(dq_accum)


@register
def variants() -> list[tuple[KernelSpec, tuple[str, ...]]]:
    """Every specialisation run() can pick: per dtype one dot_do_o, and dkdv + dq per head-dim
    bucket."""
    out: list[tuple[KernelSpec, tuple[str, ...]]] = []
    for dtype in DTYPE_CODE:
        out.append((config_for(dtype, 1).dot_do_o_spec(), ARCHS))
        for bucket in HEAD_DIM_BUCKETS:
            cfg = config_for(dtype, bucket)
            out += [(cfg.dkdv_spec(), ARCHS), (cfg.dq_spec(), ARCHS)]
    return out

"""Flash forward, SIMT generation (kernels/attention/flash_fwd_simt.cu): any dtype, any sm >= 70.

The readable reference for the tile loop on the GPU, and the fp32 path. `SimtFwdConfig` is the single
source of truth for its tile sizes, thread count and shared-memory budget; the kernel reads them
as FC_* constants and traps if the launch's shared memory disagrees with its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..jit import KernelSpec, get_kernel, register
from .call import DTYPE_CODE, DTYPE_NAME, FwdCall, fwd_kernel_args

SOURCE = "attention/flash_fwd_simt.cu"
ARCHS = ("sm_80", "sm_90a")
HEAD_DIM_BUCKETS = (32, 64, 128, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
MIN_CC = (7, 0)
MAX_GRID_YZ = 65535

# Tiles per head-dim bucket: (block_m, block_n, lanes). 128 threads everywhere; a query row is
# owned by `lanes` threads, so each thread keeps head_dim / lanes fp32 accumulators (8..32) and
# block_n / lanes scores (4..8) in registers. hdim 256 halves block_m to keep shared memory at
# 84 KB (fits the 96 KB of sm70). Not tuned: this generation is the readable reference.
_TILES: dict[int, tuple[int, int, int]] = {
    32: (32, 32, 4),
    64: (32, 32, 4),
    128: (32, 32, 4),
    256: (16, 32, 8),
}

# Opt-in shared memory per block by compute capability, for torch builds whose device properties
# lack `shared_memory_per_block_optin`.
_SMEM_OPTIN_BY_CC = {(7, 0): 96 * 1024, (7, 2): 48 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024,
                     (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024}


def head_dim_bucket(head_dim: int) -> int:
    """The smallest compiled FC_HEAD_DIM that holds `head_dim` (1..256)."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM} for the SIMT kernels, got {head_dim}")


def smem_tile_bytes(rows: int, cols: int) -> int:
    """Bytes of one fp32 shared-memory tile as tile_simt.cuh lays it out (row stride cols + 1)."""
    return 4 * rows * (cols + 1)


def smem_optin_bytes(device: torch.device) -> int:
    """The most dynamic shared memory one block of `device` may opt in to."""
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if optin:
        return int(optin)
    return _SMEM_OPTIN_BY_CC.get((props.major, props.minor), 48 * 1024)


def device_reason(device: torch.device, smem_bytes: int, what: str) -> str | None:
    """Why a SIMT kernel needing `smem_bytes` cannot run on `device` (None if it can)."""
    if device.type != "cuda":
        return f"{what} runs on CUDA devices; the tensors are on {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CC:
        return f"{what} needs compute capability >= {MIN_CC[0]}.{MIN_CC[1]}, the device has {major}.{minor}"
    optin = smem_optin_bytes(device)
    if smem_bytes > optin:
        return f"{what} needs {smem_bytes} bytes of shared memory per block, the device allows {optin}"
    return None


@dataclass(frozen=True)
class SimtFwdConfig:
    dtype: torch.dtype
    head_dim: int  # FC_HEAD_DIM: the bucket; the call's head_dim may be smaller
    block_m: int
    block_n: int
    lanes: int  # threads per query row

    @property
    def threads(self) -> int:
        return self.block_m * self.lanes

    @property
    def smem_bytes(self) -> int:
        """Q tile + K tile + V tile + P tile, in the order the kernel carves them."""
        return (smem_tile_bytes(self.block_m, self.head_dim)
                + 2 * smem_tile_bytes(self.block_n, self.head_dim)
                + smem_tile_bytes(self.block_m, self.block_n))

    @property
    def name(self) -> str:
        return (f"flash_fwd_simt_{DTYPE_NAME[self.dtype]}_d{self.head_dim}"
                f"_bm{self.block_m}_bn{self.block_n}")

    def grid(self, call: FwdCall) -> tuple[int, int, int]:
        return (-(-call.seqlen_q // self.block_m), call.nheads, call.batch)

    def spec(self) -> KernelSpec:
        return KernelSpec.make(self.name, SOURCE, defines={
            "FC_DTYPE": DTYPE_CODE[self.dtype],
            "FC_HEAD_DIM": self.head_dim,
            "FC_BLOCK_M": self.block_m,
            "FC_BLOCK_N": self.block_n,
            "FC_LANES": self.lanes,
            "FC_THREADS": self.threads,
        })


def config_for(dtype: torch.dtype, head_dim: int) -> SimtFwdConfig:
    bucket = head_dim_bucket(head_dim)
    block_m, block_n, lanes = _TILES[bucket]
    return SimtFwdConfig(dtype, bucket, block_m, block_n, lanes)


def shape_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the SIMT kernels cannot take these q, k, v (None if they can); shared with bwd_simt."""
    if q.dtype not in DTYPE_CODE:
        return f"the SIMT kernels take float32, float16 or bfloat16, got {q.dtype}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    head_dim = q.shape[3]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"the SIMT kernels take head_dim 1..{MAX_HEAD_DIM}, got {head_dim}"
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        return f"q, k, v must share head_dim, got {head_dim}, {k.shape[3]}, {v.shape[3]}"
    nheads, nheads_kv = q.shape[2], k.shape[2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        return f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})"
    if nheads > MAX_GRID_YZ or q.shape[0] > MAX_GRID_YZ:
        return f"the SIMT grid takes at most {MAX_GRID_YZ} heads and batches, got {nheads}, {q.shape[0]}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[3] > 1 and t.stride(3) != 1:
            return f"{name} must have a unit last stride, got strides {tuple(t.stride())}"
    return None


def can_implement(call: FwdCall) -> str | None:
    """None if this family can run `call`, else the reason it cannot."""
    reason = shape_reason(call.q, call.k, call.v)
    if reason:
        return reason
    if call.out.dtype != call.dtype or (call.head_dim > 1 and call.out.stride(3) != 1):
        return "out must have q's dtype and a unit last stride"
    if call.lse.dtype != torch.float32 or not call.lse.is_contiguous():
        return "lse must be a contiguous float32 (batch, nheads, seqlen_q) tensor"
    cfg = config_for(call.dtype, call.head_dim)
    return device_reason(call.device, cfg.smem_bytes, cfg.name)


def run(call: FwdCall) -> None:
    """Fill call.out and call.lse on torch's current stream."""
    if call.batch == 0 or call.seqlen_q == 0 or call.nheads == 0:
        return
    cfg = config_for(call.dtype, call.head_dim)
    kernel = get_kernel(cfg.spec(), call.device)
    kernel.launch(cfg.grid(call), (cfg.threads, 1, 1), *fwd_kernel_args(call),
                  shared_mem=cfg.smem_bytes)


@register
def variants() -> list[tuple[KernelSpec, tuple[str, ...]]]:
    """Every specialisation run() can pick: 4 head-dim buckets x 3 dtypes."""
    return [(config_for(dtype, bucket).spec(), ARCHS)
            for dtype in DTYPE_CODE for bucket in HEAD_DIM_BUCKETS]

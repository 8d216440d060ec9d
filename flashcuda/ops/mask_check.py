"""Python entry for the mask test kernel (kernels/attention/mask_test.cu).

It runs `masked_visits` (the per-work-tile decision of which key tiles need the mask, mask.cuh)
against `tile_needs_mask` (the per-tile rule it replaces in the sm90 forward) on the GPU, tile by
tile, for cases the tests draw.
"""

from __future__ import annotations

import numpy as np
import torch

from ..jit import KernelSpec, get_kernel, register

SOURCE = "attention/mask_test.cu"
THREADS = 128  # mask_test.cu's kThreads
ARCHS = ("sm_80", "sm_90a")
FIELDS = ("seqlen_q", "seqlen_k", "window_left", "window_right", "row0", "rows")


def spec() -> KernelSpec:
    return KernelSpec.make("mask_test", SOURCE)


def bits_spec() -> KernelSpec:
    return KernelSpec.make("fragment_bits_test", SOURCE)


def mismatches(cases: torch.Tensor) -> torch.Tensor:
    """cases: (N, 6) int32 on a CUDA device, columns FIELDS (kernel-side windows: no -1). Returns
    (N,) int32, per case the number of key tiles (widths 64, 128, 176) where the two rules differ."""
    if not isinstance(cases, torch.Tensor):
        raise TypeError(f"cases must be a torch.Tensor, got {type(cases).__name__}")
    if cases.dtype != torch.int32 or cases.dim() != 2 or cases.shape[1] != len(FIELDS):
        raise ValueError(f"cases must be int32 of shape (N, {len(FIELDS)}), got {cases.dtype} "
                         f"{tuple(cases.shape)}")
    if cases.device.type != "cuda":
        raise ValueError(f"cases must be on a CUDA device, got {cases.device}")
    count = cases.shape[0]
    out = torch.full((count,), -1, dtype=torch.int32, device=cases.device)
    if count:
        get_kernel(spec(), cases.device).launch(
            (-(-count // THREADS), 1, 1), (THREADS, 1, 1), cases.contiguous(), out,
            np.int32(count))
    return out


def fragment_bits(bounds: torch.Tensor) -> torch.Tensor:
    """bounds: (N, 2) int32 (lo, hi) on a CUDA device. Returns (N, 2) int64: mask.cuh's
    fragment_bits(lo, hi) at 8 and at 16 column pairs per lane (bit 2j + c: column 8j + c lies in
    [lo, hi))."""
    if not isinstance(bounds, torch.Tensor):
        raise TypeError(f"bounds must be a torch.Tensor, got {type(bounds).__name__}")
    if bounds.dtype != torch.int32 or bounds.dim() != 2 or bounds.shape[1] != 2:
        raise ValueError(f"bounds must be int32 of shape (N, 2), got {bounds.dtype} "
                         f"{tuple(bounds.shape)}")
    if bounds.device.type != "cuda":
        raise ValueError(f"bounds must be on a CUDA device, got {bounds.device}")
    count = bounds.shape[0]
    out = torch.zeros((count, 2), dtype=torch.int32, device=bounds.device)
    if count:
        get_kernel(bits_spec(), bounds.device).launch(
            (-(-count // THREADS), 1, 1), (THREADS, 1, 1), bounds.contiguous(), out,
            np.int32(count))
    return out.to(torch.int64) & 0xFFFFFFFF


@register
def variants() -> list[tuple[KernelSpec, tuple[str, ...]]]:
    return [(spec(), ARCHS), (bits_spec(), ARCHS)]

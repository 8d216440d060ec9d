"""Python entry for the online-softmax test kernel (kernels/attention/online_softmax_test.cu).

It runs the CUDA `OnlineSoftmax` struct itself on the GPU, so tests can hold it against a float64
softmax: whole rows streamed tile by tile, and the same rows as two halves combined with merge().
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..jit import KernelSpec, get_kernel, register

SOURCE = "attention/online_softmax_test.cu"
THREADS = 128  # online_softmax_test.cu's kThreads
ARCHS = ("sm_80", "sm_90a")


class OnlineSoftmaxResult(NamedTuple):
    """Per row, with scores s in the log2 domain and p_j = 2^(s_j - m) / l:

    m: max_j s_j (-inf for a row of -inf scores); l: sum_j 2^(s_j - m) (0 for such a row);
    lse: natural-log log-sum-exp of the scores taken as log2-domain, i.e. ln(sum_j 2^s_j);
    out: sum_j p_j v_j (0 for an empty row); merged_lse / merged_out: the same from the two halves
    [0, n // 2) and [n // 2, n) merged with OnlineSoftmax::merge.
    """

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the name the algorithm uses)
    lse: torch.Tensor
    out: torch.Tensor
    merged_lse: torch.Tensor
    merged_out: torch.Tensor


def spec() -> KernelSpec:
    return KernelSpec.make("online_softmax_test", SOURCE)


def online_softmax_rows(scores: torch.Tensor, values: torch.Tensor, tile: int) -> OnlineSoftmaxResult:
    """Stream each row of `scores` (rows, n), float32 log2-domain scores on a CUDA device, through
    OnlineSoftmax `tile` keys at a time, weighting `values` (rows, n) float32."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be a positive int, got {tile!r}")
    for name, t in (("scores", scores), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D (rows, n), got shape {tuple(t.shape)}")
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if values.shape != scores.shape or values.device != scores.device:
        raise ValueError(f"values must match scores' shape {tuple(scores.shape)} and device "
                         f"{scores.device}, got {tuple(values.shape)} on {values.device}")
    rows, n = scores.shape
    if rows * n >= 2**31 or rows >= 2**31 // 6:
        raise ValueError(f"scores has too many elements for the test kernel: shape {(rows, n)}")
    result = torch.full((rows, 6), float("nan"), dtype=torch.float32, device=scores.device)
    if rows > 0:
        get_kernel(spec(), scores.device).launch(
            (-(-rows // THREADS), 1, 1), (THREADS, 1, 1),
            scores.contiguous(), values.contiguous(), result,
            np.int32(rows), np.int32(n), np.int32(min(tile, max(n, 1))),
        )
    return OnlineSoftmaxResult(*result.unbind(1))


@register
def variants() -> list[tuple[KernelSpec, tuple[str, ...]]]:
    return [(spec(), ARCHS)]

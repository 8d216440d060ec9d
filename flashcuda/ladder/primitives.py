"""Ladder rungs 1-5, the primitives: vector add, scale, elementwise exp, row sum.

Inputs are contiguous CUDA tensors of float32, float16 or bfloat16; arithmetic is fp32, rounded
once to the input dtype. Outputs are allocated here unless `out=` is given (same shape and dtype,
contiguous, on the same device; the elementwise rungs accept an input itself as `out`, in place).
Empty inputs return without a launch.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _checks as check
from ._kernels import (
    BLOCK,
    cdiv,
    elementwise_spec,
    full_grid,
    kernel_for,
    row_sum_spec,
    row_threads,
)


def _launch_elementwise(op: str, x: torch.Tensor, out: torch.Tensor, *args) -> None:
    kernel = kernel_for(elementwise_spec(op, x.dtype), x.device)
    vectors = cdiv(x.numel(), 16 // x.element_size())
    grid = full_grid(kernel, BLOCK, cdiv(vectors, BLOCK))
    kernel.launch((grid, 1, 1), (BLOCK, 1, 1), *args)


def _elementwise_out(out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    if out is None:
        return None
    return check.out(out, x.shape, x.dtype, "the shape and dtype of x")


def vector_add(x: torch.Tensor, y: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x + y, elementwise (any shape; x and y alike). `out` may be x or y."""
    check.tensor("x", x)
    check.tensor("y", y)
    check.same_dtype("y", y, "x", x)
    check.shape("y", y, x.shape, "the shape of x")
    out = _elementwise_out(out, x)
    check.contiguous("x", x)
    check.contiguous("y", y)
    check.cuda_devices(x=x, y=y, out=out)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    check.no_overlap(out, allow_alias=True, x=x, y=y)
    if x.numel() == 0:
        return out
    _launch_elementwise("vector_add", x, out, x, y, out, np.int64(x.numel()))
    return out


def scale(x: torch.Tensor, alpha: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = alpha * x, elementwise, with alpha rounded to float32 first (as torch does for a
    float32 tensor). `out` may be x."""
    check.tensor("x", x)
    alpha = check.real("alpha", alpha)
    out = _elementwise_out(out, x)
    check.contiguous("x", x)
    check.cuda_devices(x=x, out=out)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    check.no_overlap(out, allow_alias=True, x=x)
    if x.numel() == 0:
        return out
    _launch_elementwise("scale", x, out, x, out, np.float32(alpha), np.int64(x.numel()))
    return out


def exp(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = exp(x), elementwise (expf, within 2 ulp in fp32). `out` may be x."""
    check.tensor("x", x)
    out = _elementwise_out(out, x)
    check.contiguous("x", x)
    check.cuda_devices(x=x, out=out)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    check.no_overlap(out, allow_alias=True, x=x)
    if x.numel() == 0:
        return out
    _launch_elementwise("exp", x, out, x, out, np.int64(x.numel()))
    return out


def row_sum(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[r] = sum_j x[r, j] for a 2-D x (rows, cols) of any row length; fp32 accumulation,
    result in x.dtype, shape (rows,). Deterministic. Rows of length 0 sum to 0."""
    check.tensor("x", x, ndim=2)
    rows, cols = x.shape
    if out is not None:
        out = check.out(out, (rows,), x.dtype, "(rows,) of x, in x's dtype")
    check.contiguous("x", x)
    check.cuda_devices(x=x, out=out)
    if out is None:
        out = torch.empty(rows, dtype=x.dtype, device=x.device)
    check.no_overlap(out, x=x)
    if rows == 0:
        return out
    kernel = kernel_for(row_sum_spec(x.dtype), x.device)
    threads = row_threads(cols, x.dtype)
    grid = full_grid(kernel, threads, rows)
    kernel.launch((grid, 1, 1), (threads, 1, 1), x, out, np.int64(rows), np.int64(cols))
    return out

"""Ladder rungs 6-8, matrix operations: dot product, transpose, matmul.

Inputs are contiguous CUDA tensors of float32, float16 or bfloat16; accumulation is fp32, results
are in the input dtype. Outputs are allocated here unless `out=` is given (exact shape and dtype,
contiguous, same device, sharing no memory with an input).
"""

from __future__ import annotations

import numpy as np
import torch

from . import _checks as check
from ._kernels import (
    BLOCK,
    DOT_MAX_BLOCKS,
    DOT_UNROLL,
    HALVES,
    MAX_GRID_X,
    MMA_THREADS,
    MMA_TILE,
    SIMT_THREADS,
    SIMT_TILE,
    TRANSPOSE_BLOCK,
    cdiv,
    dot_spec,
    full_grid,
    gemm_spec,
    kernel_for,
    mma_spec,
    transpose_plan,
    transpose_spec,
)


def dot_blocks(n: int, dtype: torch.dtype) -> int:
    """Stage-1 grid of `dot`: a function of (n, dtype) only, so the order of additions — and the
    result — is the same on every GPU and every run."""
    per_block = BLOCK * DOT_UNROLL * (16 // dtype.itemsize)
    return max(1, min(DOT_MAX_BLOCKS, cdiv(n, per_block)))


def dot(x: torch.Tensor, y: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum_i x[i] * y[i] for 1-D x, y of equal length, as a 0-dim tensor in x.dtype (like
    torch.dot). Two passes, no atomics: per-block fp32 partial sums, then one block adds them in
    a fixed order, so repeated calls give bit-identical results. dot of empty vectors is 0."""
    check.tensor("x", x, ndim=1)
    check.tensor("y", y, ndim=1)
    check.same_dtype("y", y, "x", x)
    check.shape("y", y, x.shape, "the shape of x")
    if out is not None:
        out = check.out(out, (), x.dtype, "a 0-dim tensor in x's dtype")
    check.contiguous("x", x)
    check.contiguous("y", y)
    device = check.cuda_devices(x=x, y=y, out=out)
    if out is None:
        out = torch.empty((), dtype=x.dtype, device=device)
    check.no_overlap(out, x=x, y=y)
    n = x.numel()
    if n == 0:
        out.zero_()
        return out
    blocks = dot_blocks(n, x.dtype)
    partials = torch.empty(blocks, dtype=torch.float32, device=device)
    kernel_for(dot_spec(x.dtype, 1), device).launch(
        (blocks, 1, 1), (BLOCK, 1, 1), x, y, partials, np.int64(n))
    kernel_for(dot_spec(x.dtype, 2), device).launch(
        (1, 1, 1), (BLOCK, 1, 1), partials, out, np.int64(blocks))
    return out


def transpose(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x.T materialised: a 2-D (rows, cols) x gives a contiguous (cols, rows) tensor, moved
    through bank-conflict-free shared-memory tiles, with 16-byte accesses when every row of x and
    of out starts on a 16-byte boundary (_kernels.transpose_plan)."""
    check.tensor("x", x, ndim=2)
    rows, cols = x.shape
    if out is not None:
        out = check.out(out, (cols, rows), x.dtype, "(cols, rows) of x, in x's dtype")
    check.contiguous("x", x)
    check.cuda_devices(x=x, out=out)
    if out is None:
        out = torch.empty((cols, rows), dtype=x.dtype, device=x.device)
    check.no_overlap(out, x=x)
    if x.numel() == 0:
        return out
    plan = transpose_plan(rows, cols, x.dtype, x.data_ptr(), out.data_ptr())
    kernel = kernel_for(transpose_spec(x.dtype, plan.vector), x.device)
    threads = TRANSPOSE_BLOCK[0] * TRANSPOSE_BLOCK[1]
    grid = full_grid(kernel, threads, plan.tiles)
    kernel.launch((grid, 1, 1), TRANSPOSE_BLOCK, x, out, np.int64(rows), np.int64(cols))
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None,
           tensor_cores: bool | None = None) -> torch.Tensor:
    """out = a @ b for 2-D a (M, K) and b (K, N) of one dtype; (M, N) in that dtype, fp32
    accumulation. Any M, N, K (K == 0 gives zeros).

    tensor_cores: None (default) uses them for float16 / bfloat16 (mma.sync m16n8k16) and the
    shared-memory tiled SIMT kernel for float32; False forces the SIMT kernel; True requires a
    16-bit dtype.
    """
    check.tensor("a", a, ndim=2)
    check.tensor("b", b, ndim=2)
    check.same_dtype("b", b, "a", a)
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(
            f"b: expected {k} rows (the columns of a, shape {tuple(a.shape)}), got shape "
            f"{tuple(b.shape)}"
        )
    n = b.shape[1]
    if tensor_cores is None:
        tensor_cores = a.dtype in HALVES
    elif not isinstance(tensor_cores, bool):
        raise TypeError(f"tensor_cores: expected None or a bool, got {type(tensor_cores).__name__}")
    elif tensor_cores and a.dtype not in HALVES:
        raise TypeError(f"tensor_cores=True: expected dtype float16 or bfloat16, got {a.dtype}")
    if out is not None:
        out = check.out(out, (m, n), a.dtype, "(M, N) in the dtype of a")
    check.contiguous("a", a)
    check.contiguous("b", b)
    device = check.cuda_devices(a=a, b=b, out=out)
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=device)
    check.no_overlap(out, a=a, b=b)
    if m == 0 or n == 0:
        return out
    if tensor_cores:
        tiles = cdiv(m, MMA_TILE[0]) * cdiv(n, MMA_TILE[1])
        kernel_for(mma_spec(a.dtype), device).launch(
            (min(tiles, MAX_GRID_X), 1, 1), (MMA_THREADS, 1, 1), a, b, out,
            np.int64(m), np.int64(n), np.int64(k))
        return out
    launch_gemm(
        "matmul_simt", a.dtype, device, a, b, out, m, n, k,
        a_strides=(k, 1, 0, 0), b_strides=(n, 1, 0, 0), c_strides=(n, 1, 0, 0),
        batch=1, heads=1, b_group=1, alpha=1.0,
    )
    return out


def launch_gemm(role: str, dtype: torch.dtype, device: torch.device, a: torch.Tensor,
                b: torch.Tensor, c: torch.Tensor, m: int, n: int, k: int, *,
                a_strides: tuple[int, int, int, int], b_strides: tuple[int, int, int, int],
                c_strides: tuple[int, int, int, int], batch: int, heads: int, b_group: int,
                alpha: float) -> None:
    """Launch gemm.cu: c[z][m, n] = alpha * sum_k a[z][m, k] b[z][k, n] over z = (batch, head).

    Strides in elements: a (row, k, batch, head), b (k, col, batch, head), c (row, col, batch,
    head); b's head is head // b_group.
    """
    tiles = batch * heads * cdiv(m, SIMT_TILE[0]) * cdiv(n, SIMT_TILE[1])
    a_sm, a_sk, a_sb, a_sh = a_strides
    b_sk, b_sn, b_sb, b_sh = b_strides
    c_sm, c_sn, c_sb, c_sh = c_strides
    i64 = np.int64
    kernel_for(gemm_spec(role, dtype), device).launch(
        (min(tiles, MAX_GRID_X), 1, 1), (SIMT_THREADS, 1, 1), a, b, c,
        i64(m), i64(n), i64(k),
        i64(a_sm), i64(a_sk), i64(b_sk), i64(b_sn), i64(c_sm), i64(c_sn),
        i64(a_sb), i64(a_sh), i64(b_sb), i64(b_sh), i64(c_sb), i64(c_sh),
        i64(batch), i64(heads), i64(b_group), np.float32(alpha),
    )


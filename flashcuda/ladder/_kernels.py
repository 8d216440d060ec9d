"""Every ladder kernel specialisation (the single source of their names and defines), their
registration for the CPU compile lane, and the launch helpers the entry points share.

Names spell the specialisation: ``ladder_<rung>_<dtype>``, e.g. ``ladder_vector_add_bf16``,
``ladder_matmul_mma_m16n8k16_fp16``; ``ladder_attention_scores_bf16`` reads bf16 Q, K and writes
fp32 scores, ``ladder_attention_pv_bf16`` reads fp32 P and bf16 V and writes bf16.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from ..jit import KernelSpec, get_kernel, register
from ..jit.runtime import CompiledKernel

ARCHS: tuple[str, ...] = ("sm_80", "sm_90a")

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPE_NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
HALVES = (torch.float16, torch.bfloat16)

ELEMENTWISE_OPS = ("vector_add", "scale", "exp")

# Block size of the 1-D kernels (elementwise, dot, row-wise upper bound): 8 warps.
BLOCK = 256
# Stage-1 grid of the dot product: fixed from n, never from the GPU (deterministic sums).
DOT_MAX_BLOCKS = 1024
DOT_UNROLL = 4  # vectors per thread per trip in for_strided (vec.cuh)
# Vectors each thread of a row-wise block (row sum, softmax) aims for: rowwise.cuh unrolls 4
# independent 16-byte loads per trip, and softmax.cu keeps up to this many per thread in registers
# (FC_ROW_VECTORS), so a row of up to 256 x 4 vectors is read once, all of it in flight at once.
ROW_VECTORS_PER_THREAD = 4
# GEMM tiles (gemm.cu, matmul_mma.cu): restated only to size the grids.
SIMT_TILE = (64, 64)
SIMT_THREADS = 256
MMA_TILE = (64, 64)
MMA_THREADS = 128
# Transpose (transpose.cu gets the tile as FC_TILE_ROWS x FC_TILE_COLS, the block as
# FC_ROWS_PER_PASS): 256 threads. Scalar tiles: 64 x 64 elements, 16 per thread. Vector tiles:
# 64 x 64 words of shared memory (16 KB), i.e. 64 x 64 fp32 or 128 x 64 fp16/bf16 elements of x
# (rows x columns), 4 x 16-byte loads per thread; see transpose.cu.
TRANSPOSE_TILE = 64
TRANSPOSE_BLOCK = (32, 8, 1)
MAX_GRID_X = 2**31 - 1


@functools.cache
def elementwise_spec(op: str, dtype: torch.dtype) -> KernelSpec:
    return KernelSpec.make(f"ladder_{op}_{DTYPE_NAME[dtype]}", f"ladder/{op}.cu",
                           defines={"FC_DTYPE": DTYPE_CODE[dtype]})


@functools.cache
def row_sum_spec(dtype: torch.dtype) -> KernelSpec:
    return KernelSpec.make(f"ladder_row_sum_{DTYPE_NAME[dtype]}", "ladder/row_sum.cu",
                           defines={"FC_DTYPE": DTYPE_CODE[dtype]})


@functools.cache
def dot_spec(dtype: torch.dtype, stage: int) -> KernelSpec:
    role = {1: "partials", 2: "final"}[stage]
    return KernelSpec.make(f"ladder_dot_{role}_{DTYPE_NAME[dtype]}", "ladder/dot.cu",
                           defines={"FC_DTYPE": DTYPE_CODE[dtype], "FC_DOT_STAGE": stage})


@functools.cache
def transpose_spec(dtype: torch.dtype, vector: bool = False) -> KernelSpec:
    """transpose.cu's scalar tiles (`ladder_transpose_<dtype>`) or 16-byte vector tiles
    (`ladder_transpose_vec16_<dtype>`); transpose_plan says which a tensor can take."""
    rows, cols = transpose_tile(dtype, vector)
    path = "vec16_" if vector else ""
    return KernelSpec.make(f"ladder_transpose_{path}{DTYPE_NAME[dtype]}", "ladder/transpose.cu",
                           defines={"FC_DTYPE": DTYPE_CODE[dtype], "FC_VECTOR": int(vector),
                                    "FC_TILE_ROWS": rows, "FC_TILE_COLS": cols,
                                    "FC_ROWS_PER_PASS": TRANSPOSE_BLOCK[1]})


@functools.cache
def softmax_spec(dtype: torch.dtype, in_registers: bool = True) -> KernelSpec:
    """softmax.cu with the row held in registers (`ladder_softmax_<dtype>`) or streamed in two
    passes (`ladder_softmax_online_<dtype>`); softmax_plan says which a tensor needs."""
    path = "" if in_registers else "online_"
    return KernelSpec.make(f"ladder_softmax_{path}{DTYPE_NAME[dtype]}", "ladder/softmax.cu",
                           defines={"FC_DTYPE": DTYPE_CODE[dtype],
                                    "FC_ROW_VECTORS": ROW_VECTORS_PER_THREAD,
                                    "FC_IN_REGISTERS": int(in_registers)})


@functools.cache
def gemm_spec(role: str, dtype: torch.dtype) -> KernelSpec:
    """The SIMT GEMM (gemm.cu) in one of its three roles: matmul (all `dtype`), attention_scores
    (`dtype` in, fp32 out), attention_pv (fp32 P, `dtype` V and out)."""
    f32 = DTYPE_CODE[torch.float32]
    code = DTYPE_CODE[dtype]
    types = {"matmul_simt": (code, code, code), "attention_scores": (code, code, f32),
             "attention_pv": (f32, code, code)}[role]
    return KernelSpec.make(f"ladder_{role}_{DTYPE_NAME[dtype]}", "ladder/gemm.cu",
                           defines={"FC_TA": types[0], "FC_TB": types[1], "FC_TC": types[2]})


@functools.cache
def mma_spec(dtype: torch.dtype) -> KernelSpec:
    return KernelSpec.make(f"ladder_matmul_mma_m16n8k16_{DTYPE_NAME[dtype]}",
                           "ladder/matmul_mma.cu", defines={"FC_DTYPE": DTYPE_CODE[dtype]})


def all_specs() -> list[KernelSpec]:
    specs: list[KernelSpec] = []
    for dtype in FLOATS:
        specs += [elementwise_spec(op, dtype) for op in ELEMENTWISE_OPS]
        specs += [row_sum_spec(dtype), dot_spec(dtype, 1), dot_spec(dtype, 2),
                  transpose_spec(dtype, False), transpose_spec(dtype, True),
                  softmax_spec(dtype, True), softmax_spec(dtype, False)]
        specs += [gemm_spec(role, dtype)
                  for role in ("matmul_simt", "attention_scores", "attention_pv")]
    specs += [mma_spec(dtype) for dtype in HALVES]
    return specs


@register
def variants() -> list[tuple[KernelSpec, tuple[str, ...]]]:
    """Every ladder specialisation with the targets it is built for (the CPU lane compiles all)."""
    return [(spec, ARCHS) for spec in all_specs()]


# ---- launch helpers -------------------------------------------------------------------------

_occupancy: dict[tuple[int, str, int], int] = {}
_occupancy_lock = threading.Lock()


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def resident_blocks(kernel: CompiledKernel, threads: int) -> int:
    """Blocks of `threads` one SM holds at once for `kernel` (its registers and shared memory
    decide), from the driver's occupancy calculator (CompiledKernel.resident_blocks), memoised;
    2048 / threads if that is unavailable."""
    key = (kernel.device_index, kernel.name, threads)
    found = _occupancy.get(key)
    if found is None:
        try:
            found = kernel.resident_blocks(threads)
        except Exception:  # no usable driver entry point: fall back to full occupancy
            found = 0
        found = found if found > 0 else max(1, 2048 // threads)
        with _occupancy_lock:
            _occupancy[key] = found
    return found


def full_grid(kernel: CompiledKernel, threads: int, work_blocks: int) -> int:
    """Grid for a grid-stride kernel: enough blocks for the work, at most one full wave."""
    wave = sm_count(kernel.device_index) * resident_blocks(kernel, threads)
    return max(1, min(work_blocks, wave))


def row_threads(cols: int, dtype: torch.dtype) -> int:
    """Threads per row-wise block: the smallest power of two in 32 .. 256 that covers the row with
    ROW_VECTORS_PER_THREAD 16-byte vectors per thread (more per thread only past 256 threads).
    A 4096-element bf16 row (512 vectors) gets 128 threads x 4 vectors, so the unrolled loads of
    rowwise.cuh all run (with 256 threads x 2 they did not), and twice as many blocks fit on an SM."""
    vectors = -(-cols // (16 // dtype.itemsize))
    threads = 32
    while threads < BLOCK and threads * ROW_VECTORS_PER_THREAD < vectors:
        threads *= 2
    return threads


def transpose_tile(dtype: torch.dtype, vector: bool) -> tuple[int, int]:
    """(rows, columns) of x per transpose tile: 64 x 64, or for the vector path 64 words of
    4 // itemsize elements per tile row (128 x 64 for fp16/bf16)."""
    if vector:
        return (TRANSPOSE_TILE * (4 // dtype.itemsize), TRANSPOSE_TILE)
    return (TRANSPOSE_TILE, TRANSPOSE_TILE)


@dataclass(frozen=True)
class TransposePlan:
    """How transpose.cu moves a (rows, cols) matrix: vector (16-byte) or scalar tiles, and how
    many tiles there are (the grid strides over them)."""

    vector: bool
    tiles: int


def transpose_plan(rows: int, cols: int, dtype: torch.dtype, x_ptr: int, out_ptr: int) -> TransposePlan:
    """16-byte vector tiles when every row of x (cols elements) and of out (rows elements)
    starts on a 16-byte boundary: both pointers 16-byte aligned, rows and cols multiples of
    16 // itemsize. Then no 16-byte vector is cut by the matrix edge either. Else scalar tiles."""
    per_vector = 16 // dtype.itemsize
    vector = (x_ptr % 16 == 0 and out_ptr % 16 == 0
              and rows % per_vector == 0 and cols % per_vector == 0)
    tile_rows, tile_cols = transpose_tile(dtype, vector)
    return TransposePlan(vector, cdiv(rows, tile_rows) * cdiv(cols, tile_cols))


@dataclass(frozen=True)
class SoftmaxPlan:
    """How softmax.cu walks a (rows, cols) tensor: which specialisation, and the block.

    in_registers: every row's 16-byte-aligned part fits in `threads` x ROW_VECTORS_PER_THREAD
    vectors and out sits at x's offset within 16 bytes (then so does every row of out: both
    pointers move by r * cols elements), so each row is read once into registers; otherwise the
    two-pass online kernel. threads: the team walking one row (row_threads); a 32-thread team is
    a warp, and a block then holds BLOCK // 32 rows, one per warp (no block barriers)."""

    in_registers: bool
    threads: int
    rows_per_block: int

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, self.rows_per_block, 1)

    def blocks(self, rows: int) -> int:
        return cdiv(rows, self.rows_per_block)


def softmax_plan(cols: int, dtype: torch.dtype, x_ptr: int, out_ptr: int) -> SoftmaxPlan:
    """The SoftmaxPlan for rows of `cols` elements of `dtype` at x_ptr, written at out_ptr."""
    threads = row_threads(cols, dtype)
    vectors = cdiv(cols, 16 // dtype.itemsize)  # >= the aligned vectors of any row
    fits = vectors <= threads * ROW_VECTORS_PER_THREAD
    in_registers = fits and (x_ptr - out_ptr) % 16 == 0
    return SoftmaxPlan(in_registers, threads, BLOCK // threads if threads == 32 else 1)


def kernel_for(spec: KernelSpec, device: torch.device) -> CompiledKernel:
    return get_kernel(spec, device)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

"""The kernel ladder (DESIGN.md §4): the building blocks of flash attention as tested,
benchmarked CUDA kernels, each behind a validated Python entry point.

| rung | entry point | kernel (flashcuda/kernels/ladder/) |
|---|---|---|
| 1 vector add | vector_add(x, y) | vector_add.cu |
| 2 scale | scale(x, alpha) | scale.cu |
| 3 elementwise exp | exp(x) | exp.cu |
| 5 row sum | row_sum(x) | row_sum.cu (warp shuffle + block reduction, common/reduce.cuh) |
| 6 dot product | dot(x, y) | dot.cu (deterministic two-pass) |
| 8 transpose | transpose(x) | transpose.cu (16-byte vector tiles, swizzled; padded scalar tiles otherwise) |
| matmul | matmul(a, b) | gemm.cu (SIMT, fp32) / matmul_mma.cu (mma.sync, fp16/bf16) |
| 9 scores | attention_scores(q, k, scale) | gemm.cu |
| 10 softmax | softmax(x, causal=) | softmax.cu (row in registers, or two-pass online; a warp per short row) |
| 11 P·V | attention_pv(p, v) | gemm.cu |
| 12 naive attention | naive_attention(q, k, v, scale, causal) | the three above |

Every entry point takes CUDA tensors (float32, float16, bfloat16), validates before launching
(ValueError / TypeError naming the argument, the expected and the actual value), allocates its
output unless `out=` is given, and returns without a launch for empty outputs. `reference` holds
the float64 oracle of each rung; importing this package registers every kernel variant with
flashcuda.jit (the CPU lane compiles them all).
"""

from . import reference
from ._kernels import all_specs, variants
from .attention import attention_pv, attention_scores, naive_attention, softmax
from .matrix import dot, matmul, transpose
from .primitives import exp, row_sum, scale, vector_add

__all__ = [
    "all_specs", "attention_pv", "attention_scores", "dot", "exp", "matmul", "naive_attention",
    "reference", "row_sum", "scale", "softmax", "transpose", "variants", "vector_add",
]

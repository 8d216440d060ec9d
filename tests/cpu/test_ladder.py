"""CPU lane for the kernel ladder: the float64 references against torch, the input contracts
(with CPU and meta tensors: every shape / dtype error comes before the device check, and a CPU
tensor gets a clear 'expected a CUDA tensor'), and an NVRTC compile of every ladder variant for
sm_80 and sm_90a that fails on register spills."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import flashcuda.ladder as L
from flashcuda.jit import all_variants, compile_spec
from flashcuda.ladder import _kernels
from flashcuda.ladder import reference as ref
from flashcuda.ladder.matrix import dot_blocks

F64 = torch.float64


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- references vs torch float64 -------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_elementwise_references(n):
    x, y = torch.randn(n, dtype=torch.float16), torch.randn(n, dtype=torch.float16)
    _close(ref.vector_add(x, y), x.to(F64) + y.to(F64))
    _close(ref.exp(x), torch.exp(x.to(F64)))
    # alpha is rounded to float32 first, as the kernel receives it
    _close(ref.scale(x, 0.1), x.to(F64) * float(torch.tensor(0.1, dtype=torch.float32)))
    assert ref.vector_add(x, y).dtype == F64


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (1, 1), (5, 97)])
def test_reduction_and_matrix_references(shape):
    x = torch.randn(shape, dtype=torch.bfloat16)
    _close(ref.row_sum(x), x.to(F64).sum(-1))
    _close(ref.transpose(x), x.to(F64).T)
    assert ref.transpose(x).is_contiguous()
    v, w = torch.randn(shape[1]), torch.randn(shape[1])
    _close(ref.dot(v, w), torch.dot(v.to(F64), w.to(F64)))
    b = torch.randn(shape[1], 4)
    _close(ref.matmul(x, b), x.to(F64) @ b.to(F64))


def test_softmax_reference_plain_matches_torch():
    x = torch.randn(4, 7, 33)
    _close(ref.softmax(x), torch.softmax(x.to(F64), dim=-1))


@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 8), (8, 3), (1, 1)])
def test_softmax_reference_causal(sq, sk):
    x = torch.randn(2, sq, sk)
    got = ref.softmax(x, causal=True)
    visible = ref.causal_mask(sq, sk)
    # bottom-right alignment: query i sees key j iff j <= i + sk - sq
    for i in range(sq):
        for j in range(sk):
            assert bool(visible[i, j]) == (j <= i + sk - sq)
    for i in range(sq):
        if visible[i].any():
            expected = torch.softmax(x[:, i, :].to(F64).masked_fill(~visible[i], -math.inf), dim=-1)
            _close(got[:, i, :], expected)
        else:
            assert (got[:, i, :] == 0).all()
    assert not got.isnan().any()


def test_softmax_reference_all_minus_inf_row_is_zero():
    x = torch.tensor([[-math.inf, -math.inf], [0.0, -math.inf]])
    _close(ref.softmax(x), torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=F64))


@pytest.mark.parametrize(
    "b,sq,sk,h,hkv,d,causal",
    [(2, 97, 143, 4, 2, 40, False), (1, 33, 33, 2, 2, 72, True), (2, 17, 40, 4, 1, 16, True),
     (1, 1, 1, 1, 1, 8, False)],
)
def test_attention_reference_matches_sdpa(b, sq, sk, h, hkv, d, causal):
    q = torch.randn(b, sq, h, d, dtype=F64)
    k = torch.randn(b, sk, hkv, d, dtype=F64)
    v = torch.randn(b, sk, hkv, d, dtype=F64)
    got = ref.naive_attention(q, k, v, causal=causal)
    kh = k.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    mask = ref.causal_mask(sq, sk) if causal else None
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, attn_mask=mask)
    _close(got, expected.transpose(1, 2))
    # the pieces compose the same way
    p = ref.softmax(ref.attention_scores(q, k), causal=causal)
    _close(ref.attention_pv(p, v), got)


def test_attention_reference_scale_and_empty_rows():
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    _close(ref.attention_scores(q, k, 0.25), 0.25 * (q[0, :, 0].to(F64) @ k[0, :, 0].to(F64).T)[None, None])
    _close(ref.attention_scores(q, k), ref.attention_scores(q, k, 8 ** -0.5))
    # seqlen_q > seqlen_k, causal: the first two query rows see no key -> output 0, never NaN
    out = ref.naive_attention(q, k, v, causal=True)
    assert (out[:, :2] == 0).all() and not out.isnan().any()
    # seqlen_k == 0 -> zeros
    out = ref.naive_attention(q, k[:, :0], v[:, :0])
    assert out.shape == (1, 4, 1, 8) and (out == 0).all()


# ---- input contracts -------------------------------------------------------------------------

cpu = torch.randn(3, 4)
cpu16 = torch.randn(3, 4, dtype=torch.float16)


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


CUDA_MSG = "expected a CUDA tensor"

INVALID = [
    # (id, call, exception, message fragment)
    ("add-cpu", lambda: L.vector_add(cpu, cpu), ValueError, CUDA_MSG),
    ("add-meta", lambda: L.vector_add(meta(5), meta(5)), ValueError, "got a tensor on meta"),
    ("add-shape", lambda: L.vector_add(cpu, torch.randn(3, 5)), ValueError, "y: expected shape (3, 4)"),
    ("add-dtype", lambda: L.vector_add(cpu, cpu16), TypeError, "y: expected dtype torch.float32"),
    ("add-int", lambda: L.vector_add(cpu.int(), cpu.int()), TypeError, "x: expected dtype float32, float16 or bfloat16"),
    ("add-notensor", lambda: L.vector_add([1.0], cpu), TypeError, "x: expected a torch.Tensor, got list"),
    ("add-strided", lambda: L.vector_add(meta(4, 4).t(), meta(4, 4)), ValueError, "x: expected a contiguous tensor"),
    ("add-out-dtype", lambda: L.vector_add(cpu, cpu, out=cpu16), TypeError, "out: expected dtype torch.float32"),
    ("add-out-shape", lambda: L.vector_add(cpu, cpu, out=torch.empty(12)), ValueError, "out: expected shape (3, 4)"),
    ("add-out-strided", lambda: L.vector_add(meta(4, 4), meta(4, 4), out=meta(4, 4).t()), ValueError, "out: expected a contiguous"),
    ("add-mixed-device", lambda: L.vector_add(meta(3), torch.randn(3)), ValueError, "y: expected a tensor on meta"),
    ("scale-alpha", lambda: L.scale(cpu, "2"), TypeError, "alpha: expected a real number"),
    ("scale-alpha-bool", lambda: L.scale(cpu, True), TypeError, "alpha: expected a real number"),
    ("scale-alpha-tensor", lambda: L.scale(cpu, torch.tensor(2.0)), TypeError, "alpha: expected a real number"),
    ("scale-cpu", lambda: L.scale(cpu, 2.0), ValueError, CUDA_MSG),
    ("exp-cpu", lambda: L.exp(cpu16), ValueError, CUDA_MSG),
    ("exp-f64", lambda: L.exp(cpu.double()), TypeError, "got torch.float64"),
    ("rowsum-rank", lambda: L.row_sum(torch.randn(2, 3, 4)), ValueError, "x: expected a 2-D tensor, got 3-D"),
    ("rowsum-out", lambda: L.row_sum(cpu, out=torch.empty(4)), ValueError, "out: expected shape (3,)"),
    ("rowsum-cpu", lambda: L.row_sum(cpu), ValueError, CUDA_MSG),
    ("dot-rank", lambda: L.dot(cpu, cpu), ValueError, "x: expected a 1-D tensor"),
    ("dot-len", lambda: L.dot(torch.randn(3), torch.randn(4)), ValueError, "y: expected shape (3,)"),
    ("dot-out", lambda: L.dot(torch.randn(3), torch.randn(3), out=torch.empty(1)), ValueError, "out: expected shape ()"),
    ("dot-cpu", lambda: L.dot(torch.randn(3), torch.randn(3)), ValueError, CUDA_MSG),
    ("transpose-rank", lambda: L.transpose(torch.randn(3)), ValueError, "x: expected a 2-D tensor, got 1-D"),
    ("transpose-out", lambda: L.transpose(cpu, out=torch.empty(3, 4)), ValueError, "out: expected shape (4, 3)"),
    ("transpose-meta", lambda: L.transpose(meta(1 << 20, 1 << 20)), ValueError, CUDA_MSG),
    ("matmul-inner", lambda: L.matmul(meta(3, 4), meta(5, 6)), ValueError, "b: expected 4 rows"),
    ("matmul-dtype", lambda: L.matmul(cpu, cpu16.t()), TypeError, "b: expected dtype torch.float32"),
    ("matmul-tc-fp32", lambda: L.matmul(cpu, cpu.t().contiguous(), tensor_cores=True), TypeError, "tensor_cores=True"),
    ("matmul-tc-type", lambda: L.matmul(cpu, cpu.t().contiguous(), tensor_cores=1), TypeError, "tensor_cores: expected None or a bool"),
    ("matmul-strided", lambda: L.matmul(cpu, cpu.t()), ValueError, "b: expected a contiguous tensor"),
    ("matmul-out", lambda: L.matmul(meta(3, 4), meta(4, 6), out=meta(6, 3)), ValueError, "out: expected shape (3, 6)"),
    ("matmul-cpu", lambda: L.matmul(cpu, cpu.t().contiguous()), ValueError, "a: expected a CUDA tensor"),
    ("scores-rank", lambda: L.attention_scores(meta(2, 3, 4), meta(2, 3, 4, 8)), ValueError, "q: expected a 4-D tensor"),
    ("scores-headdim", lambda: L.attention_scores(meta(2, 3, 4, 8), meta(2, 5, 4, 16)), ValueError, "k: expected shape (batch=2, seqlen_k, nheads_kv, headdim=8)"),
    ("scores-gqa", lambda: L.attention_scores(meta(2, 3, 4, 8), meta(2, 5, 3, 8)), ValueError, "k: expected nheads_kv to divide nheads = 4"),
    ("scores-scale", lambda: L.attention_scores(meta(2, 3, 4, 8), meta(2, 5, 4, 8), "x"), TypeError, "softmax_scale: expected a real number"),
    ("scores-out", lambda: L.attention_scores(meta(2, 3, 4, 8), meta(2, 5, 4, 8), out=meta(2, 4, 3, 5, dtype=torch.float16)), TypeError, "out: expected dtype torch.float32"),
    ("scores-meta", lambda: L.attention_scores(meta(2, 3, 4, 8), meta(2, 5, 4, 8)), ValueError, "q: expected a CUDA tensor"),
    ("softmax-causal-rank", lambda: L.softmax(torch.randn(5), causal=True), ValueError, "x: expected at least 2 dimensions"),
    ("softmax-causal-type", lambda: L.softmax(cpu, causal=1), TypeError, "causal: expected a bool"),
    ("softmax-strided", lambda: L.softmax(cpu.t()), ValueError, "x: expected a contiguous tensor"),
    ("softmax-cpu", lambda: L.softmax(cpu), ValueError, CUDA_MSG),
    ("pv-p-dtype", lambda: L.attention_pv(meta(1, 2, 3, 4, dtype=torch.float16), meta(1, 4, 2, 8)), TypeError, "p: expected dtype float32"),
    ("pv-seqlen", lambda: L.attention_pv(meta(1, 2, 3, 4), meta(1, 5, 2, 8)), ValueError, "v: expected shape (batch=1, seqlen_k=4"),
    ("pv-out", lambda: L.attention_pv(meta(1, 2, 3, 4), meta(1, 4, 2, 8), out=meta(1, 2, 3, 8)), ValueError, "out: expected shape (1, 3, 2, 8)"),
    ("attn-v-seqlen", lambda: L.naive_attention(meta(1, 3, 2, 8), meta(1, 5, 2, 8), meta(1, 6, 2, 8)), ValueError, "v: expected seqlen_k = 5"),
    ("attn-v-heads", lambda: L.naive_attention(meta(1, 3, 4, 8), meta(1, 5, 2, 8), meta(1, 5, 1, 8)), ValueError, "v: expected nheads_kv = 2"),
    ("attn-dtype", lambda: L.naive_attention(meta(1, 3, 2, 8), meta(1, 5, 2, 8, dtype=torch.bfloat16), meta(1, 5, 2, 8)), TypeError, "k: expected dtype torch.float32"),
    ("attn-causal", lambda: L.naive_attention(meta(1, 3, 2, 8), meta(1, 5, 2, 8), meta(1, 5, 2, 8), None, "yes"), TypeError, "causal: expected a bool"),
    ("attn-cpu", lambda: L.naive_attention(torch.randn(1, 3, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)), ValueError, "q: expected a CUDA tensor"),
    ("attn-huge-meta", lambda: L.naive_attention(meta(64, 65536, 32, 128), meta(64, 65536, 8, 128), meta(64, 65536, 8, 128)), ValueError, "q: expected a CUDA tensor"),
]


@pytest.mark.parametrize("call,exc,fragment", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_inputs_raise_before_launch(call, exc, fragment):
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value)


def test_dot_grid_depends_on_n_only():
    # the order of additions (and so the result) must not depend on the GPU: no SM count here
    assert dot_blocks(1, torch.float32) == 1
    assert dot_blocks(256 * 4 * 4, torch.float32) == 1
    assert dot_blocks(256 * 4 * 4 + 1, torch.float32) == 2
    assert dot_blocks(1 << 30, torch.bfloat16) == _kernels.DOT_MAX_BLOCKS


def test_row_threads():
    assert _kernels.row_threads(0, torch.float32) == 32
    assert _kernels.row_threads(1, torch.float16) == 32
    # ROW_VECTORS_PER_THREAD = 4 vectors per thread: 33 vectors fit in 32 threads, 132 need 64
    assert _kernels.row_threads(4 * 33, torch.float32) == 32
    assert _kernels.row_threads(4 * 4 * 33, torch.float32) == 64
    assert _kernels.row_threads(4096, torch.float32) == 256  # 1024 vectors: 256 x 4
    assert _kernels.row_threads(4096, torch.bfloat16) == 128  # 512 vectors: 128 x 4
    assert _kernels.row_threads(1 << 20, torch.bfloat16) == 256


def test_softmax_plan():
    f32, bf16 = torch.float32, torch.bfloat16
    plan = _kernels.softmax_plan(4096, bf16, 0, 1 << 20)
    # 512 vectors: 128 threads x 4, in registers, one row per block
    assert plan == _kernels.SoftmaxPlan(True, 128, 1) and plan.block == (128, 1, 1)
    assert plan.blocks(65536) == 65536
    # short rows: a warp per row, 8 rows per block
    plan = _kernels.softmax_plan(33, f32, 0, 0)
    assert plan == _kernels.SoftmaxPlan(True, 32, 8) and plan.blocks(17) == 3
    assert _kernels.softmax_plan(1024, bf16, 0, 0).threads == 32  # 128 vectors = 32 x 4
    assert _kernels.softmax_plan(1025, bf16, 0, 0).threads == 64
    # the largest rows held in registers: 256 threads x 4 vectors
    assert _kernels.softmax_plan(4096, f32, 0, 0).in_registers
    assert _kernels.softmax_plan(8192, bf16, 0, 0).in_registers
    assert not _kernels.softmax_plan(4097, f32, 0, 0).in_registers
    assert not _kernels.softmax_plan(8193, bf16, 0, 0).in_registers
    # out at another offset within 16 bytes than x (e.g. a view one element in): online
    assert not _kernels.softmax_plan(100, bf16, 64, 66).in_registers
    # the same offset (both views one element in, or 16 bytes apart): registers
    assert _kernels.softmax_plan(100, bf16, 66, 2 + 4096).in_registers
    assert _kernels.softmax_plan(7, f32, 16, 48).in_registers


def test_transpose_plan():
    f32, bf16 = torch.float32, torch.bfloat16
    # 16-byte rows in x and out: vector tiles of 64 x 64 fp32 / 128 x 64 bf16 elements of x
    plan = _kernels.transpose_plan(16384, 16384, bf16, 0, 1 << 29)
    assert plan.vector and plan.tiles == (16384 // 128) * (16384 // 64)
    plan = _kernels.transpose_plan(16384, 16384, f32, 0, 1 << 30)
    assert plan.vector and plan.tiles == 256 * 256
    assert _kernels.transpose_plan(8, 8, bf16, 0, 0) == _kernels.TransposePlan(True, 1)
    assert _kernels.transpose_plan(136, 72, bf16, 0, 0) == _kernels.TransposePlan(True, 2 * 2)
    assert _kernels.transpose_plan(4, 12, f32, 0, 0) == _kernels.TransposePlan(True, 1)
    # a row of x or of out off a 16-byte boundary, or a pointer off one: scalar 64 x 64 tiles
    assert _kernels.transpose_plan(8, 12, bf16, 0, 0) == _kernels.TransposePlan(False, 1)
    assert _kernels.transpose_plan(12, 8, bf16, 0, 0) == _kernels.TransposePlan(False, 1)
    assert _kernels.transpose_plan(4, 6, f32, 0, 0) == _kernels.TransposePlan(False, 1)
    assert not _kernels.transpose_plan(64, 64, bf16, 2, 0).vector
    assert not _kernels.transpose_plan(64, 64, f32, 0, 8).vector
    assert _kernels.transpose_plan(65, 129, f32, 0, 0) == _kernels.TransposePlan(False, 2 * 3)
    assert _kernels.transpose_tile(bf16, True) == (128, 64)
    assert _kernels.transpose_tile(torch.float16, False) == (64, 64)


# ---- every variant compiles, without spills --------------------------------------------------

LADDER_VARIANTS = [(spec, arch) for spec, archs in _kernels.variants() for arch in archs]


def test_every_variant_is_registered_and_named():
    registered = {spec.name for spec, _ in all_variants()}
    names = [spec.name for spec, _ in _kernels.variants()]
    assert len(names) == len(set(names)) == 41
    for name in names:
        assert name in registered
        assert name.startswith("ladder_") and name.rsplit("_", 1)[1] in ("fp32", "fp16", "bf16")


@pytest.mark.parametrize("spec,arch", LADDER_VARIANTS,
                         ids=[f"{s.name}-{a}" for s, a in LADDER_VARIANTS])
def test_variant_compiles_without_spills(spec, arch):
    result = compile_spec(spec, arch)
    resources = result.resources()
    assert spec.entry_name in resources, f"ptxas reported no entry {spec.entry_name}: {result.log}"
    r = resources[spec.entry_name]
    assert not r.spills, f"{spec.name} on {arch} spills: {r}"
    assert r.shared_bytes <= 48 * 1024

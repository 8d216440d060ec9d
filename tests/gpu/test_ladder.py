"""GPU lane for the kernel ladder: per rung a hand-checkable case, boundary cases (empty,
singleton, ragged tails, misaligned views), an invalid case that raises, and an invariant.

Tolerance rule (DESIGN.md §7, FlashAttention's): max |ours - fp64 reference| must be at most twice
the error of the same computation done by torch in the input dtype (the "peer"), plus a small
floor for when the peer happens to be exact: a few units of the dtype's rounding (u = 2^-24 fp32,
2^-11 fp16, 2^-8 bf16) at the output's magnitude, and for fp32 sums n·u·max|term| (the bound of
an n-term fp32 sum, which rounding in a different order than torch's may reach). Where the kernel
performs exactly torch's single rounding (add, transpose), results must be bit-identical.
Outputs passed as out= are pre-filled with NaN, so an unwritten element fails; inputs are fresh
random normals every call.

Run: FLASHCUDA_TEST_SHARED_CACHE=1 python -m pytest tests/gpu/test_ladder.py -m gpu -q
"""

from __future__ import annotations

import math

import pytest
import torch

import flashcuda.ladder as L
from flashcuda.ladder import _kernels
from flashcuda.ladder import reference as ref

pytestmark = pytest.mark.gpu

DEV = "cuda"
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
HALVES = [torch.float16, torch.bfloat16]
U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # unit roundoff
U32 = 2.0**-24
NAN = float("nan")


def randn(*shape, dtype=torch.float32, device=DEV) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)


def nans(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, NAN, device=DEV, dtype=dtype)


def tensor(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, device=DEV, dtype=dtype)


def amax(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def assert_rule(ours: torch.Tensor, expected: torch.Tensor, peer: torch.Tensor, floor: float,
                what: str = "") -> None:
    """max|ours - expected| <= 2 max|peer - expected| + floor, and no NaN where expected has none."""
    assert ours.shape == expected.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(expected.shape)}"
    if ours.numel() == 0:
        return
    ours64 = ours.double()
    assert not (ours64.isnan() & ~expected.isnan()).any(), f"{what}: NaN in the output"
    err = (ours64 - expected).abs().max().item()
    peer_err = (peer.double() - expected).abs().max().item()
    assert err <= 2 * peer_err + floor, (
        f"{what}: max error {err:.3e} > 2 x torch's {peer_err:.3e} + floor {floor:.3e}"
    )


# ---- 1. vector add ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_vector_add_hand(dtype):
    out = L.vector_add(tensor([1.0, 2.0, 3.0], dtype), tensor([10.0, 20.0, 30.0], dtype))
    assert out.dtype == dtype and torch.equal(out, tensor([11.0, 22.0, 33.0], dtype))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 3, 7, 4099, (1 << 20) + 5])
def test_vector_add_sizes(dtype, n):
    x, y = randn(n, dtype=dtype), randn(n, dtype=dtype)
    out = L.vector_add(x, y, out=nans(n, dtype=dtype))
    # fp32 add of two dtype values, rounded once to dtype: exactly torch's x + y
    assert torch.equal(out, x + y)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("offsets", [(1, 1, 1), (1, 3, 0), (0, 0, 2)])
def test_vector_add_misaligned_views(dtype, offsets):
    # equal offsets take the peeled 16-byte path, unequal ones the scalar path
    n = 1001
    bx, by, bo = (randn(n + 8, dtype=dtype) for _ in range(3))
    ox, oy, oo = offsets
    x, y = bx[ox:ox + n], by[oy:oy + n]
    bo.fill_(NAN)
    out = L.vector_add(x, y, out=bo[oo:oo + n])
    assert torch.equal(out, x + y)
    assert bo[:oo].isnan().all() and bo[oo + n:].isnan().all(), "wrote outside out"


def test_vector_add_in_place_and_commutes():
    x, y = randn(12345, dtype=torch.bfloat16), randn(12345, dtype=torch.bfloat16)
    expected = x + y
    assert torch.equal(L.vector_add(x, y), L.vector_add(y, x))
    L.vector_add(x, y, out=x)
    assert torch.equal(x, expected)


def test_vector_add_invalid():
    x = randn(10)
    with pytest.raises(ValueError, match="y: expected shape"):
        L.vector_add(x, randn(11))
    with pytest.raises(ValueError, match="y: expected a tensor on cuda"):
        L.vector_add(x, torch.randn(10))
    with pytest.raises(ValueError, match="overlaps the memory of x"):
        buf = randn(20)
        L.vector_add(buf[:10], x, out=buf[5:15])


# ---- 2. scale --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_scale_hand(dtype):
    assert torch.equal(L.scale(tensor([1.0, 2.0, -3.0], dtype), 2.0), tensor([2.0, 4.0, -6.0], dtype))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 13, (1 << 20) + 3])
def test_scale_sizes(dtype, n):
    x = randn(n, dtype=dtype)
    alpha = 0.37
    out = L.scale(x, alpha, out=nans(n, dtype=dtype))
    expected = ref.scale(x, alpha)
    # one fp32 product, one rounding to dtype: floor = one unit of dtype rounding
    assert_rule(out, expected, x * alpha, U[dtype] * amax(expected), f"scale n={n}")


def test_scale_invariants():
    x = randn(100003)
    assert torch.equal(L.scale(x, 1.0), x)
    assert torch.equal(L.scale(x, 4), x * 4)  # a power of two scales exactly; ints are accepted
    y = x.clone()
    L.scale(y, 0.5, out=y)
    assert torch.equal(y, x * 0.5)


def test_scale_invalid():
    with pytest.raises(TypeError, match="alpha: expected a real number"):
        L.scale(randn(4), None)


# ---- 3. elementwise exp ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_exp_hand(dtype):
    out = L.exp(tensor([0.0, 1.0, -math.inf, 2.0], dtype))
    assert out[0].item() == 1.0 and out[2].item() == 0.0
    assert out[1].item() == pytest.approx(math.e, rel=2 * U[dtype] + 2 * U32)
    assert out[3].item() == pytest.approx(math.exp(2.0), rel=2 * U[dtype] + 2 * U32)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 5, 4097, (1 << 20) + 1])
def test_exp_sizes(dtype, n):
    x = randn(n, dtype=dtype)
    out = L.exp(x, out=nans(n, dtype=dtype))
    expected = ref.exp(x)
    # expf is within 2 ulp of fp32, then one rounding to dtype
    assert_rule(out, expected, torch.exp(x), (2 * U[dtype] + 4 * U32) * amax(expected), f"exp n={n}")


def test_exp_of_sum_is_product_of_exps():
    a = torch.rand(50001, device=DEV) * 8 - 4
    b = torch.rand(50001, device=DEV) * 8 - 4
    # fp32: a + b is rounded (relative 2^-24 * |a + b| <= 8u in the exponent), each expf is within
    # 2 ulp, the product rounds once: relative 4e-6 covers the sum with margin
    lhs = L.exp(L.vector_add(a, b))
    rhs = L.exp(a) * L.exp(b)
    torch.testing.assert_close(lhs, rhs, rtol=4e-6, atol=0)


def test_exp_invalid():
    with pytest.raises(TypeError, match="x: expected dtype"):
        L.exp(torch.zeros(3, device=DEV, dtype=torch.float64))


# ---- 5. row sum ------------------------------------------------------------------------------


def _sum_floor(dtype, x: torch.Tensor, expected: torch.Tensor) -> float:
    n = x.shape[-1] if x.dim() else 1
    return 4 * U[dtype] * amax(expected) + n * U32 * amax(x.float())


@pytest.mark.parametrize("dtype", FLOATS)
def test_row_sum_hand(dtype):
    out = L.row_sum(tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype))
    assert torch.equal(out, tensor([6.0, 15.0], dtype))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (1, 1), (3, 4097), (257, 33), (2, 100003), (1000, 7)])
def test_row_sum_shapes(dtype, shape):
    x = randn(*shape, dtype=dtype)
    out = L.row_sum(x, out=nans(shape[0], dtype=dtype))
    expected = ref.row_sum(x)
    if shape[1] == 0:
        assert (out == 0).all()
    assert_rule(out, expected, x.sum(-1), _sum_floor(dtype, x, expected), f"row_sum {shape}")


def test_row_sum_is_linear_in_scale():
    x = randn(300, 1001)
    # doubling is exact in every rounding step, so the sums double bit for bit
    assert torch.equal(L.row_sum(L.scale(x, 2.0)), L.scale(L.row_sum(x), 2.0))
    lhs, rhs = L.row_sum(L.scale(x, 0.37)), 0.37 * L.row_sum(x)
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=2 * 1001 * U32 * amax(x))


@pytest.mark.parametrize("dtype", FLOATS)
def test_row_sum_exact_on_integers(dtype):
    x = torch.randint(-2, 3, (5, 100003), device=DEV).to(dtype)  # partial sums exact in fp32
    assert torch.equal(L.row_sum(x), x.long().sum(-1).double().to(dtype))


def test_row_sum_invalid():
    with pytest.raises(ValueError, match="x: expected a 2-D tensor"):
        L.row_sum(randn(4))


# ---- 6. dot product --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_dot_hand(dtype):
    out = L.dot(tensor([1.0, 2.0, 3.0], dtype), tensor([4.0, 5.0, 6.0], dtype))
    assert out.shape == () and out.dtype == dtype and out.item() == 32.0


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 5, 4097, 3_000_001])
def test_dot_sizes(dtype, n):
    x, y = randn(n, dtype=dtype), randn(n, dtype=dtype)
    out = L.dot(x, y, out=nans(dtype=dtype))
    expected = ref.dot(x, y)
    if n == 0:
        assert out.item() == 0.0
    peer = (x.float() * y.float()).sum().to(dtype)  # torch: fp32 accumulation, rounded to dtype
    floor = 4 * U[dtype] * abs(expected.item()) + n * U32 * amax(x.float() * y.float())
    assert_rule(out, expected, peer, floor, f"dot n={n}")


@pytest.mark.parametrize("offsets", [(1, 1), (1, 2)])
def test_dot_misaligned_and_deterministic(offsets):
    n = 1_000_003
    a, b = randn(n + 4, dtype=torch.float16), randn(n + 4, dtype=torch.float16)
    x, y = a[offsets[0]:offsets[0] + n], b[offsets[1]:offsets[1] + n]
    first = L.dot(x, y)
    # two passes, fixed grid, no atomics: repeated calls and swapped operands agree bit for bit
    assert torch.equal(first, L.dot(x, y))
    assert torch.equal(first, L.dot(y, x))
    expected = ref.dot(x, y)
    peer = (x.float() * y.float()).sum().half()
    assert_rule(first, expected, peer, n * U32 * 4 + 4 * U[torch.float16] * abs(expected.item()))


def small_ints(*shape, dtype=torch.float32, low=-2, high=3) -> torch.Tensor:
    return torch.randint(low, high, shape, device=DEV).to(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_dot_exact_on_integers(dtype):
    # products of integers in [-2, 2] and all partial sums stay integers below 2^24: fp32 adds
    # them exactly, so the result is the exact sum rounded once to dtype. Losing or doubling a
    # single element would show.
    n = 1_000_003
    x, y = small_ints(n, dtype=dtype), small_ints(n, dtype=dtype)
    exact = (x.long() * y.long()).sum()
    assert L.dot(x, y).item() == exact.double().to(dtype).item()


def test_dot_invalid():
    with pytest.raises(ValueError, match="y: expected shape"):
        L.dot(randn(3), randn(4))


# ---- 8. transpose ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_transpose_hand(dtype):
    out = L.transpose(tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype))
    assert torch.equal(out, tensor([[1.0, 4.0], [2.0, 5.0], [3.0, 6.0]], dtype))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (1, 1), (33, 65), (1, 1000), (1000, 1), (257, 4099),
                                   (64, 64), (65, 129), (128, 63)])  # whole and ragged 64 x 64 tiles
def test_transpose_shapes(dtype, shape):
    x = randn(*shape, dtype=dtype)
    out = L.transpose(x, out=nans(shape[1], shape[0], dtype=dtype))
    assert out.is_contiguous() and torch.equal(out, x.t())  # a pure copy: bit-identical


@pytest.mark.parametrize("dtype", FLOATS)
def test_transpose_twice_is_identity(dtype):
    x = randn(300, 517, dtype=dtype)
    assert torch.equal(L.transpose(L.transpose(x)), x)


# Vector tiles (transpose.cu, FC_VECTOR 1) run when every row of x and of out starts on a 16-byte
# boundary; tiles are 64 x 64 fp32 / 128 x 64 fp16/bf16 elements of x, so these shapes cut tiles
# in both directions (136 x 72), fill one exactly (128 x 64), are one vector thin (8 x 4096), or
# need more tiles than the grid has blocks (4096 x 4096 bf16: 2048 tiles, grid-stride).
VECTOR_TRANSPOSE_SHAPES = [(8, 8), (136, 72), (128, 64), (64, 128), (8, 4096), (4096, 8),
                           (264, 200), (1032, 1024)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", VECTOR_TRANSPOSE_SHAPES)
def test_transpose_vector_tiles(dtype, shape):
    rows, cols = shape
    x = randn(rows, cols, dtype=dtype)
    out = nans(cols, rows, dtype=dtype)
    assert _kernels.transpose_plan(rows, cols, dtype, x.data_ptr(), out.data_ptr()).vector
    L.transpose(x, out=out)
    assert torch.equal(out, x.t())  # a pure copy: bit-identical, and no NaN left unwritten


def test_transpose_vector_tiles_grid_stride():
    x = randn(4096, 4096, dtype=torch.bfloat16)
    assert torch.equal(L.transpose(x), x.t())
    assert torch.equal(L.transpose(L.transpose(x)), x)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("offsets", [(1, 0), (0, 1), (1, 1), (2, 2), (8, 8), (8, 0)])
def test_transpose_views_at_element_offsets(dtype, offsets):
    # views starting `offsets` elements into a buffer: vector tiles only when both start on a
    # 16-byte boundary (8 elements in: always; 2 in: fp32 8 bytes, no), scalar tiles otherwise
    rows, cols = 72, 136
    ox, oo = offsets
    bx = randn(rows * cols + 16, dtype=dtype)
    bo = nans(rows * cols + 16, dtype=dtype)
    x = bx[ox:ox + rows * cols].view(rows, cols)
    out = bo[oo:oo + rows * cols].view(cols, rows)
    aligned = (ox * dtype.itemsize) % 16 == 0 and (oo * dtype.itemsize) % 16 == 0
    assert _kernels.transpose_plan(rows, cols, dtype, x.data_ptr(), out.data_ptr()).vector == aligned
    L.transpose(x, out=out)
    assert torch.equal(out, x.t())
    assert bo[:oo].isnan().all() and bo[oo + rows * cols:].isnan().all(), "wrote outside out"


def test_transpose_invalid():
    with pytest.raises(ValueError, match=r"out: expected shape \(4, 3\)"):
        L.transpose(randn(3, 4), out=randn(3, 4))


# ---- matmul ----------------------------------------------------------------------------------

MATMUL_MODES = [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False),
                (torch.float16, True), (torch.bfloat16, True)]
MODE_IDS = [f"{str(d).removeprefix('torch.')}-{'mma' if tc else 'simt'}" for d, tc in MATMUL_MODES]


def _torch_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 peer must be a true fp32 GEMM
    try:
        return a @ b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("dtype,tc", MATMUL_MODES, ids=MODE_IDS)
def test_matmul_hand(dtype, tc):
    a = tensor([[1.0, 2.0], [3.0, 4.0]], dtype)
    b = tensor([[5.0, 6.0], [7.0, 8.0]], dtype)
    assert torch.equal(L.matmul(a, b, tensor_cores=tc), tensor([[19.0, 22.0], [43.0, 50.0]], dtype))


@pytest.mark.parametrize("dtype,tc", MATMUL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("mnk", [(0, 3, 4), (3, 0, 4), (3, 4, 0), (1, 1, 1), (65, 67, 33),
                                 (100, 72, 40), (128, 64, 256), (64, 8, 8), (7, 130, 1000)])
def test_matmul_shapes(dtype, tc, mnk):
    m, n, k = mnk
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype)
    out = L.matmul(a, b, out=nans(m, n, dtype=dtype), tensor_cores=tc)
    expected = ref.matmul(a, b)
    if k == 0:
        assert (out == 0).all()
    floor = 4 * U[dtype] * amax(expected) + k * U32 * amax(a.float()) * amax(b.float())
    assert_rule(out, expected, _torch_matmul(a, b), floor, f"matmul {mnk}")


@pytest.mark.parametrize("dtype,tc", MATMUL_MODES, ids=MODE_IDS)
def test_matmul_transpose_identity(dtype, tc):
    a, b = randn(97, 45, dtype=dtype), randn(45, 70, dtype=dtype)
    lhs = L.transpose(L.matmul(a, b, tensor_cores=tc))
    rhs = L.matmul(L.transpose(b), L.transpose(a), tensor_cores=tc)
    if not tc:
        # SIMT: each output is fma(a[m,k], b[k,n], acc) over ascending k either way: bit-identical
        assert torch.equal(lhs, rhs)
    else:
        # tensor cores may add in a different order: two roundings to dtype apart at most
        torch.testing.assert_close(lhs.float(), rhs.float(), rtol=2 * U[dtype], atol=1e-3)


@pytest.mark.parametrize("dtype,tc", MATMUL_MODES, ids=MODE_IDS)
def test_matmul_exact_on_integers(dtype, tc):
    # integer operands in [-2, 2], K = 1000: every product and partial sum is exact in fp32, so
    # any tile, fragment or boundary mistake shows as an exact mismatch
    a = torch.randint(-2, 3, (130, 1000), device=DEV).to(dtype)
    b = torch.randint(-2, 3, (1000, 72), device=DEV).to(dtype)
    exact = (a.double() @ b.double()).to(dtype)
    assert torch.equal(L.matmul(a, b, tensor_cores=tc), exact)


def test_matmul_invalid():
    with pytest.raises(ValueError, match="b: expected 4 rows"):
        L.matmul(randn(3, 4), randn(5, 6))


# ---- 9. QK^T scores --------------------------------------------------------------------------


def _peer_scores(q, k, scale):
    """torch in the input dtype: (B, H, Sq, D) @ (B, H, D, Sk), then the scale, then float32."""
    h = q.shape[2]
    kh = k.transpose(1, 2).repeat_interleave(h // k.shape[2], dim=1)
    return (_torch_matmul(q.transpose(1, 2), kh.transpose(-1, -2)) * scale).float()


@pytest.mark.parametrize("dtype", FLOATS)
def test_scores_hand(dtype):
    q = tensor([[[[1.0, 0.0]]]], dtype)  # (1, 1, 1, 2)
    k = tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]], dtype)  # (1, 2, 1, 2)
    out = L.attention_scores(q, k, 0.5)
    assert out.dtype == torch.float32 and torch.equal(out, tensor([[[[0.5, 0.0]]]]))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(2, 97, 143, 4, 2, 40), (1, 1, 1, 1, 1, 1), (1, 65, 64, 2, 1, 128),
                                   (2, 3, 0, 2, 2, 8), (1, 5, 7, 2, 2, 0)])
def test_scores_shapes(dtype, shape):
    b, sq, sk, h, hkv, d = shape
    q, k = randn(b, sq, h, d, dtype=dtype), randn(b, sk, hkv, d, dtype=dtype)
    out = L.attention_scores(q, k, out=nans(b, h, sq, sk))
    scale = d ** -0.5 if d else 1.0
    expected = ref.attention_scores(q, k)
    if d == 0:
        assert (out == 0).all()
    floor = 4 * U32 * amax(expected) + d * U32 * amax(q.float()) * amax(k.float())
    assert_rule(out, expected, _peer_scores(q, k, scale), floor, f"scores {shape}")


def test_scores_of_packed_qkv_views():
    # q, k as strided views of one (B, S, 3, H, D) tensor: no copies needed
    qkv = randn(2, 50, 3, 4, 24, dtype=torch.bfloat16)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    assert not q.is_contiguous()
    out = L.attention_scores(q, k, 0.2)
    assert_rule(out, ref.attention_scores(q, k, 0.2), _peer_scores(q, k, 0.2),
                4 * U32 * 24 * amax(q.float()) ** 2)


def test_scores_scale_is_linear():
    q, k = randn(1, 33, 2, 16), randn(1, 41, 2, 16)
    # scaling by a power of two is exact: twice the scale gives exactly twice the scores
    assert torch.equal(L.attention_scores(q, k, 0.5), 2 * L.attention_scores(q, k, 0.25))


@pytest.mark.parametrize("dtype", FLOATS)
def test_scores_exact_on_integers(dtype):
    q = torch.randint(-2, 3, (2, 37, 4, 72), device=DEV).to(dtype)
    k = torch.randint(-2, 3, (2, 70, 2, 72), device=DEV).to(dtype)
    assert torch.equal(L.attention_scores(q, k, 0.5), ref.attention_scores(q, k, 0.5).float())


def test_scores_invalid():
    with pytest.raises(ValueError, match="k: expected nheads_kv to divide"):
        L.attention_scores(randn(1, 2, 4, 8), randn(1, 2, 3, 8))


# ---- 10. row softmax -------------------------------------------------------------------------


def test_softmax_hand():
    out = L.softmax(tensor([[0.0, 0.0], [0.0, math.log(3.0)], [-math.inf, -math.inf], [-math.inf, 0.0]]))
    # log(3) rounded to fp32, expf (2 ulp), the reciprocal and the product: a few ulp in all
    torch.testing.assert_close(out, tensor([[0.5, 0.5], [0.25, 0.75], [0.0, 0.0], [0.0, 1.0]]),
                               rtol=1e-6, atol=0)
    # causal, bottom-right aligned: with 3 queries and 2 keys, query 0 sees no key
    out = L.softmax(torch.zeros(3, 2, device=DEV), causal=True)
    assert torch.equal(out, tensor([[0.0, 0.0], [1.0, 0.0], [0.5, 0.5]]))
    out = L.softmax(torch.zeros(2, 2, device=DEV), causal=True)
    assert torch.equal(out, tensor([[1.0, 0.0], [0.5, 0.5]]))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (1, 1), (7, 2), (300, 33), (5, 4099), (2, 20000), (2, 3, 5, 1000)])
def test_softmax_shapes(dtype, shape):
    x = randn(*shape, dtype=dtype) * 3
    out = L.softmax(x, out=nans(*shape, dtype=dtype))
    expected = ref.softmax(x)
    # per element: expf (2 ulp) times a reciprocal sum (n-term fp32 sum), one rounding to dtype
    floor = 4 * U[dtype] * amax(expected) + shape[-1] * U32 * amax(expected)
    assert_rule(out, expected, torch.softmax(x, dim=-1), floor, f"softmax {shape}")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 40), (40, 3), (97, 143), (1, 1)])
def test_softmax_causal(dtype, sq, sk):
    x = randn(2, sq, sk, dtype=dtype)
    visible = ref.causal_mask(sq, sk, DEV)
    x = x.masked_fill(~visible, NAN)  # masked entries are never read: NaN there must not leak
    out = L.softmax(x, causal=True, out=nans(2, sq, sk, dtype=dtype))
    expected = ref.softmax(x, causal=True)
    assert not out.isnan().any() and (out[:, ~visible] == 0).all()
    peer = torch.softmax(x.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)
    floor = 4 * U[dtype] * amax(expected) + sk * U32
    assert_rule(out, expected, peer, floor, f"causal softmax {sq}x{sk}")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(6, 4096), (6, 4095), (3, 8193)])
def test_softmax_register_and_pass_paths(dtype, shape):
    # rows of <= 4 vectors per thread are held in registers, unless out sits at another offset
    # within 16 bytes than x (out below starts one element past a 16-byte boundary): then the
    # three-pass path runs; so do rows of 8193 (1025 or 2049 vectors > 256 threads x 4)
    x = randn(*shape, dtype=dtype) * 3
    expected = ref.softmax(x)
    peer = torch.softmax(x, dim=-1)
    floor = 4 * U[dtype] * amax(expected) + shape[-1] * U32 * amax(expected)
    out = L.softmax(x, out=nans(*shape, dtype=dtype))
    assert_rule(out, expected, peer, floor, f"softmax {shape}")
    shifted = nans(x.numel() + 1, dtype=dtype)[1:].view(shape)
    out = L.softmax(x, out=shifted)
    assert_rule(out, expected, peer, floor, f"softmax {shape}, out misaligned")


# Row lengths around every boundary of softmax_plan: a warp per row (<= 32 x 4 vectors: 512 fp32,
# 1024 fp16/bf16), the block per row in registers (<= 256 x 4 vectors: 4096 / 8192), the online
# kernel beyond; odd lengths give each row its own offset within 16 bytes (scalar heads and tails).
SOFTMAX_PATH_COLS = [1, 2, 7, 9, 33, 512, 513, 1023, 1025, 4095, 4097, 8191, 8193, 20001]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("cols", SOFTMAX_PATH_COLS)
@pytest.mark.parametrize("offsets", [(0, 0), (1, 1), (1, 0), (0, 3)])
def test_softmax_paths_ragged_and_misaligned(dtype, cols, offsets):
    # x and out are views `offsets` elements into their buffers: equal offsets keep the register
    # path (with heads), unequal ones take the online kernel. Row 1 is all -inf (zeros, no NaN),
    # row 2 has one -inf, row 3 is constant.
    rows = 6
    ox, oo = offsets
    bx = randn(rows * cols + 8, dtype=dtype) * 3
    bo = nans(rows * cols + 8, dtype=dtype)
    x = bx[ox:ox + rows * cols].view(rows, cols)
    out = bo[oo:oo + rows * cols].view(rows, cols)
    x[1] = -math.inf
    x[2, cols // 2] = -math.inf
    x[3] = 0.5
    plan = _kernels.softmax_plan(cols, dtype, x.data_ptr(), out.data_ptr())
    vectors = -(-cols // (16 // dtype.itemsize))
    assert plan.in_registers == (ox == oo and vectors <= 256 * 4)
    L.softmax(x, out=out)
    expected = ref.softmax(x)
    assert (out[1] == 0).all(), "an all -inf row is zeros"
    assert bo[:oo].isnan().all() and bo[oo + rows * cols:].isnan().all(), "wrote outside out"
    # per element: fp32 exp (fp32: expf, 2 ulp; fp16/bf16: ex2.approx of (x - m) log2 e, under
    # 2^-17 relative for these |x - m| < 40), an fp32 sum of `cols` terms, one rounding to dtype
    floor = 4 * U[dtype] * amax(expected) + cols * U32 * amax(expected)
    peer = torch.softmax(x, dim=-1).nan_to_num(0.0)  # torch: NaN for the -inf row
    assert_rule(out, expected, peer, floor, f"softmax {dtype} cols={cols} offsets={offsets}")
    if cols > 1:  # exp(0) = 1 exactly, an exact integer sum: 1 / cols rounded to fp32, then to dtype
        torch.testing.assert_close(out[3].double(), torch.full((cols,), 1 / cols, device=DEV, dtype=torch.float64),
                                   rtol=U[dtype] + 2 * U32, atol=0)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("cols", [300, 3000, 9000])
def test_softmax_in_place_and_nan_on_each_path(dtype, cols):
    x = randn(5, cols, dtype=dtype) * 3
    x[2, cols - 1] = NAN
    x[4] = -math.inf
    x[4, 0] = NAN  # NaN among -inf only: the max is -inf, so the row is zeros (softmax.cu)
    out = L.softmax(x)
    assert out[2].isnan().all(), "a NaN among the visible scores makes the row NaN"
    assert (out[4] == 0).all()
    assert not out[[0, 1, 3]].isnan().any()
    y = x.clone()
    L.softmax(y, out=y)
    assert torch.equal(y.nan_to_num(7.0), out.nan_to_num(7.0)), "in place == out of place"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("sq,sk", [(64, 2000), (3, 9000)])
def test_softmax_causal_block_and_online(dtype, sq, sk):
    # test_softmax_causal's rows fit a warp; these take a block (2000) and the online kernel (9000)
    x = randn(2, sq, sk, dtype=dtype) * 3
    visible = ref.causal_mask(sq, sk, DEV)
    x = x.masked_fill(~visible, NAN)
    out = L.softmax(x, causal=True, out=nans(2, sq, sk, dtype=dtype))
    expected = ref.softmax(x, causal=True)
    assert not out.isnan().any() and (out[:, ~visible] == 0).all()
    peer = torch.softmax(x.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)
    floor = 4 * U[dtype] * amax(expected) + sk * U32
    assert_rule(out, expected, peer, floor, f"causal softmax {sq}x{sk}")


def test_softmax_rows_sum_to_one_and_shift_invariance():
    x = randn(64, 4099) * 5
    out = L.softmax(x)
    # each row: <= 4099 terms, each within a few ulp: the sum is 1 within n * 2^-24 * 2
    torch.testing.assert_close(out.double().sum(-1), torch.ones(64, device=DEV, dtype=torch.float64),
                               rtol=0, atol=2 * 4099 * U32)
    torch.testing.assert_close(L.softmax(x + 7.0), out, rtol=1e-5, atol=1e-9)
    y = x.clone()
    L.softmax(y, out=y)  # in place
    assert torch.equal(y, out)


def test_softmax_minus_inf_rows_and_nan():
    x = randn(4, 300)
    x[1] = -math.inf
    x[2, 7] = NAN
    out = L.softmax(x)
    assert (out[1] == 0).all(), "an all -inf row is zeros, not NaN"
    assert out[2].isnan().all(), "a NaN among the visible scores makes the row NaN, as in torch"
    assert not out[[0, 3]].isnan().any()


def test_softmax_invalid():
    with pytest.raises(ValueError, match="x: expected a contiguous tensor"):
        L.softmax(randn(4, 6).t())


# ---- 11. P·V ---------------------------------------------------------------------------------


def _peer_pv(p, v):
    h = p.shape[1]
    vh = v.transpose(1, 2).repeat_interleave(h // v.shape[2], dim=1)
    return _torch_matmul(p.to(v.dtype), vh).transpose(1, 2)


@pytest.mark.parametrize("dtype", FLOATS)
def test_pv_hand(dtype):
    p = tensor([[[[0.25, 0.75]]]])  # (1, 1, 1, 2)
    v = tensor([[[[1.0, 2.0]], [[3.0, 4.0]]]], dtype)  # (1, 2, 1, 2)
    out = L.attention_pv(p, v)
    assert out.dtype == dtype and torch.equal(out, tensor([[[[2.5, 3.5]]]], dtype))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(2, 97, 143, 4, 2, 40), (1, 1, 1, 1, 1, 1), (1, 64, 65, 2, 1, 128),
                                   (2, 3, 0, 2, 2, 8), (0, 3, 4, 2, 2, 8)])
def test_pv_shapes(dtype, shape):
    b, sq, sk, h, hkv, d = shape
    p = torch.softmax(randn(b, h, sq, sk), dim=-1)
    v = randn(b, sk, hkv, d, dtype=dtype)
    out = L.attention_pv(p, v, out=nans(b, sq, h, d, dtype=dtype))
    expected = ref.attention_pv(p, v)
    if sk == 0:
        assert (out == 0).all()
    floor = 4 * U[dtype] * amax(expected) + sk * U32 * amax(v.float())
    assert_rule(out, expected, _peer_pv(p, v), floor, f"pv {shape}")


def test_pv_one_hot_selects_rows():
    v = randn(1, 50, 2, 24, dtype=torch.bfloat16)
    idx = torch.randint(0, 50, (1, 2, 30), device=DEV)
    p = torch.nn.functional.one_hot(idx, 50).float()  # (1, 2, 30, 50)
    out = L.attention_pv(p, v)  # out[0, i, h] = v[0, idx[0, h, i], h] exactly
    expected = torch.stack([v[0, idx[0, h], h] for h in range(2)], dim=1)[None]
    assert torch.equal(out, expected)


def test_pv_invalid():
    with pytest.raises(TypeError, match="p: expected dtype float32"):
        L.attention_pv(randn(1, 2, 3, 4, dtype=torch.float16), randn(1, 4, 2, 8))


# ---- 12. naive attention ---------------------------------------------------------------------


def _peer_attention(q, k, v, causal):
    """FlashAttention's attention_ref without upcast: every step in the input dtype."""
    scale = q.shape[-1] ** -0.5
    h = q.shape[2]
    kh = k.transpose(1, 2).repeat_interleave(h // k.shape[2], dim=1)
    vh = v.transpose(1, 2).repeat_interleave(h // v.shape[2], dim=1)
    s = _torch_matmul(q.transpose(1, 2), kh.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~ref.causal_mask(q.shape[1], k.shape[1], DEV), -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return _torch_matmul(p, vh).transpose(1, 2)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 97, 143, 4, 2, 40), (1, 1, 1, 1, 1, 8), (2, 143, 97, 2, 1, 72),
                                   (1, 1023, 1023, 2, 2, 64), (1, 4, 0, 2, 2, 16), (1, 0, 5, 2, 2, 16)])
def test_naive_attention_shapes(dtype, causal, shape):
    b, sq, sk, h, hkv, d = shape
    q = randn(b, sq, h, d, dtype=dtype)
    k, v = randn(b, sk, hkv, d, dtype=dtype), randn(b, sk, hkv, d, dtype=dtype)
    out = L.naive_attention(q, k, v, causal=causal, out=nans(b, sq, h, d, dtype=dtype))
    expected = ref.naive_attention(q, k, v, causal=causal)
    if sk == 0:
        assert (out == 0).all()
    floor = 8 * U[dtype] * amax(expected) + sk * U32 * amax(v.float())
    assert_rule(out, expected, _peer_attention(q, k, v, causal), floor,
                f"naive attention {shape} causal={causal}")


@pytest.mark.parametrize("dtype", FLOATS)
def test_naive_attention_hand(dtype):
    q, k, v = (randn(1, 9, 2, 16, dtype=dtype) for _ in range(3))
    out = L.naive_attention(q, k, v, causal=True)
    # causal, seqlen_q == seqlen_k: query 0 sees key 0 only, so its output is v[0] exactly
    assert torch.equal(out[:, 0], v[:, 0])
    # identical keys give uniform weights: the output is the mean of v
    k_same = k[:, :1].expand_as(k).contiguous()
    out = L.naive_attention(q, k_same, v)
    mean = v.double().mean(dim=1, keepdim=True).expand(1, 9, 2, 16)
    # p = fl(1/9) exactly for every key, 9 fp32 accumulations (|partial| < 4), one rounding to dtype
    torch.testing.assert_close(out.double(), mean, rtol=0, atol=4 * U[dtype] * 4 + 9 * U32 * 4)


def test_naive_attention_matches_sdpa_causal():
    q, k, v = (randn(2, 257, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    out = L.naive_attention(q, k, v, causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    expected = ref.naive_attention(q, k, v, causal=True)
    assert_rule(out, expected, sdpa, 8 * U[torch.bfloat16] * amax(expected))


def test_naive_attention_invalid():
    with pytest.raises(ValueError, match="v: expected seqlen_k"):
        L.naive_attention(randn(1, 3, 2, 8), randn(1, 5, 2, 8), randn(1, 6, 2, 8))
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        L.naive_attention(torch.randn(1, 3, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8))

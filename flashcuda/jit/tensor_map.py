"""TMA tensor maps (CUtensorMap) for the sm90 kernels, encoded on the host per call.

    m = bshd_map(q, box_rows=128)                 # (B, S, H, D) fp16/bf16 tensor, 128B swizzle
    kernel.launch(grid, block, m, ..., shared_mem=...)   # a `const __grid_constant__ TmaMap`

A map describes a 4-D box walk over a (B, S, H, D) tensor with dims listed innermost first,
(D, S, H, B), byte strides (row, head, batch), and a box of (64 elements = one 128-byte swizzled
row, box_rows, 1, 1): what flashcuda/kernels/common/sm90.cuh calls one chunk of a tile
(`swizzle_bytes=64` or 32: boxes of 32 or 16 elements in the 64- or 32-byte swizzle). Elements
outside the dims are zero-filled by the copy engine (and still count as transaction bytes).

`tiled_problem` checks the driver's rules without a GPU (can_implement uses it); `encode_tiled`
calls cuTensorMapEncodeTiled; `bshd_map` memoises maps by (address, dtype, shape, strides, box):
a map holds nothing but those, so a reused address with the same geometry gets the same map
(tested: tests/cpu/test_jit_tensor_map.py).
"""

from __future__ import annotations

import ctypes
import functools

SWIZZLE_BYTES = 128
BOX_COLS = SWIZZLE_BYTES // 2  # 16-bit elements per swizzled row
# cuTensorMapEncodeTiled's CUtensorMapSwizzle by swizzle width in bytes (cuda.h)
_SWIZZLE_CODES = {32: 1, 64: 2, 128: 3}
MAX_BOX = 256
MAX_STRIDE = 1 << 40
MAX_DIM = 1 << 31  # kernel coordinates are int32


class TensorMap:
    """128 opaque bytes of an encoded CUtensorMap; runtime.pack_args packs them 64-aligned."""

    __slots__ = ("raw",)
    SIZE = 128

    def __init__(self, raw: bytes) -> None:
        if len(raw) != self.SIZE:
            raise ValueError(f"TensorMap: expected {self.SIZE} bytes, got {len(raw)}")
        self.raw = bytes(raw)

    def __cuda_tensor_map__(self) -> bytes:
        return self.raw

    def __repr__(self) -> str:
        return f"TensorMap({self.raw[:16].hex()}...)"


def bshd_geometry(shape: tuple[int, ...], strides: tuple[int, ...],
                  elem_bytes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dims innermost first, byte strides of dims 1..3) of a (B, S, H, D) tensor: dims
    (D, S, H, B), strides (row, head, batch) in bytes. A size-1 dim's stride is never used (its
    only coordinate is 0) and may be anything in torch, so it becomes 16, a legal TMA stride."""
    b, s, h, d = shape
    dims = (d, s, h, b)
    byte_strides = []
    for size, stride in ((s, strides[1]), (h, strides[2]), (b, strides[0])):
        byte_strides.append(stride * elem_bytes if size > 1 else 16)
    return dims, tuple(byte_strides)


def tiled_problem(address: int, dims: tuple[int, ...], byte_strides: tuple[int, ...],
                  box: tuple[int, ...], elem_bytes: int, last_stride: int = 1,
                  swizzle_bytes: int = SWIZZLE_BYTES) -> str | None:
    """Why cuTensorMapEncodeTiled (no interleave, a `swizzle_bytes` swizzle) would refuse this,
    or None."""
    if last_stride != 1 and dims[0] > 1:
        return f"innermost stride must be 1 element, got {last_stride}"
    if address % 16:
        return f"address {address:#x} is not 16-byte aligned"
    for i, n in enumerate(dims):
        if not 0 < n < MAX_DIM:
            return f"dim {i} = {n} must be in [1, 2^31)"
    for i, st in enumerate(byte_strides):
        if st <= 0 or st % 16 or st >= MAX_STRIDE:
            return f"byte stride of dim {i + 1} = {st} must be a positive multiple of 16 below 2^40"
    for i, n in enumerate(box):
        if not 0 < n <= MAX_BOX:
            return f"box dim {i} = {n} must be in [1, {MAX_BOX}]"
    if box[0] * elem_bytes > swizzle_bytes or (box[0] * elem_bytes) % 16:
        return (f"box inner extent {box[0] * elem_bytes} B must be a multiple of 16, "
                f"<= {swizzle_bytes}")
    return None


def bshd_problem(t, box_rows: int, swizzle_bytes: int = SWIZZLE_BYTES) -> str | None:
    """tiled_problem for the map bshd_map(t, box_rows, swizzle_bytes) would encode (no GPU
    needed)."""
    if t.dim() != 4:
        return f"expected a 4-D (B, S, H, D) tensor, got {t.dim()} dims"
    elem = t.element_size()
    dims, strides = bshd_geometry(tuple(t.shape), tuple(t.stride()), elem)
    return tiled_problem(t.data_ptr(), dims, strides, (swizzle_bytes // 2, box_rows, 1, 1), elem,
                         t.stride(3), swizzle_bytes)


# cuTensorMapEncodeTiled's enum values (cuda.h; checked against cuda.bindings in the CPU lane).
_DTYPE_CODES = {"torch.float16": 6, "torch.bfloat16": 9, "torch.float32": 7}
_INTERLEAVE_NONE, _L2_PROMOTION_256B, _OOB_FILL_NONE = 0, 3, 0


@functools.cache
def _libcuda_encode():
    """libcuda's cuTensorMapEncodeTiled through ctypes (~1 us a call; the cuda.bindings wrapper
    builds a Python object per dim and costs tens of us). libcuda.so.1 is the driver library
    cuda.bindings itself loads, so wherever a kernel can launch it is there."""
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                   u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode_tiled(dtype, address: int, dims: tuple[int, ...], byte_strides: tuple[int, ...],
                 box: tuple[int, ...], swizzle_bytes: int = SWIZZLE_BYTES) -> TensorMap:
    """cuTensorMapEncodeTiled for an fp16 / bf16 / fp32 tensor, a 128B (64B, 32B) swizzle, zero
    fill, L2 256B promotion."""
    code = _DTYPE_CODES.get(str(dtype))
    if code is None:
        raise ValueError(f"encode_tiled: dtype must be fp16, bf16 or fp32, got {dtype}")
    rank = len(dims)
    out = ctypes.create_string_buffer(TensorMap.SIZE + 64)
    aligned = (ctypes.addressof(out) + 63) & ~63  # CUtensorMap is 64-byte aligned
    err = _libcuda_encode()(
        aligned, code, rank, address, (ctypes.c_uint64 * rank)(*dims),
        (ctypes.c_uint64 * (rank - 1))(*byte_strides), (ctypes.c_uint32 * rank)(*box),
        (ctypes.c_uint32 * rank)(*([1] * rank)), _INTERLEAVE_NONE,
        _SWIZZLE_CODES[swizzle_bytes], _L2_PROMOTION_256B, _OOB_FILL_NONE)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled(dims={dims}, strides={byte_strides}, "
                           f"box={box}) failed: CUresult {err}")
    return TensorMap(ctypes.string_at(aligned, TensorMap.SIZE))


_MEMO_SIZE = 256
_memo: dict[tuple, TensorMap] = {}


def _encode_new(key: tuple, t, dims: tuple[int, ...], byte_strides: tuple[int, ...],
                box: tuple[int, ...], swizzle_bytes: int = SWIZZLE_BYTES) -> TensorMap:
    """A memo miss whose layout was checked: encode the map on t's device, keep it under `key`."""
    from .runtime import _make_current

    _make_current(t.get_device())  # a CUDA tensor's device index
    m = encode_tiled(t.dtype, t.data_ptr(), dims, byte_strides, box, swizzle_bytes)
    if len(_memo) >= _MEMO_SIZE:
        _memo.clear()  # training brings new activations each step: keep the newest only
    _memo[key] = m
    return m


def bshd_map(t, box_rows: int, swizzle_bytes: int = SWIZZLE_BYTES) -> TensorMap:
    """The map of a CUDA (B, S, H, D) fp16/bf16 tensor, box (64 cols, box_rows rows, 1, 1) in
    the 128-byte swizzle, or (32 / 16 cols, ...) in the 64- / 32-byte one.

    Memoised by (dtype, address, shape, strides, box, swizzle): a map holds nothing else, so a
    hit is exactly the map an encode would give (the hot path of a repeated call: one dict
    lookup). A miss checks the layout (ValueError naming the rule) and encodes."""
    key = (t.dtype, t.data_ptr(), t.shape, t.stride(), box_rows, swizzle_bytes)
    m = _memo.get(key)
    if m is not None:
        return m
    if why := bshd_problem(t, box_rows, swizzle_bytes):
        raise ValueError(f"bshd_map: {why}")
    dims, byte_strides = bshd_geometry(tuple(t.shape), tuple(t.stride()), t.element_size())
    return _encode_new(key, t, dims, byte_strides, (swizzle_bytes // 2, box_rows, 1, 1),
                       swizzle_bytes)


def _rows_f32_geometry(t, box_rows: int) -> tuple[tuple[int, ...], ...]:
    """(dims, byte strides, box) of a contiguous fp32 tensor seen as 2-D rows of its last dim."""
    cols = t.shape[-1]
    return (cols, t.numel() // cols), (cols * 4,), (SWIZZLE_BYTES // 4, box_rows)


def rows_f32_problem(t, box_rows: int) -> str | None:
    """tiled_problem for rows_f32_map(t, box_rows): a contiguous fp32 tensor seen as 2-D
    (rows = every dim but the last, cols = the last), box (32 fp32 = 128 bytes, box_rows)."""
    if str(t.dtype) != "torch.float32":
        return f"expected fp32, got {t.dtype}"
    if not t.is_contiguous() or t.dim() < 2:
        return "expected a contiguous tensor of at least 2 dims"
    return tiled_problem(t.data_ptr(), *_rows_f32_geometry(t, box_rows), 4)


def rows_f32_map(t, box_rows: int) -> TensorMap:
    """The map of a contiguous CUDA fp32 tensor as 2-D (last dim, the rows of all others), box
    (32 cols, box_rows rows), 128B swizzle: the target of bwd_sm90's tensor-map dQ reduction
    (FLASHCUDA_SM90_BWD_DQ=tma). Memoised as bshd_map."""
    key = ("rows_f32", t.dtype, t.data_ptr(), t.shape, t.stride(), box_rows)
    m = _memo.get(key)
    if m is not None:
        return m
    if why := rows_f32_problem(t, box_rows):
        raise ValueError(f"rows_f32_map: {why}")
    return _encode_new(key, t, *_rows_f32_geometry(t, box_rows))

"""Tensor maps on the CPU lane: 128-byte CUtensorMap arguments are packed at 64-byte aligned
offsets (the C rule for `const __grid_constant__` alignas(64) parameters), and the (B, S, H, D)
map geometry / driver rules are checked without a GPU (encoding itself needs the driver)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from flashcuda.jit.runtime import _layout, pack_args, pack_code, pack_size
from flashcuda.jit.tensor_map import (
    BOX_COLS,
    TensorMap,
    bshd_geometry,
    bshd_problem,
    tiled_problem,
)


def _map(fill: int) -> TensorMap:
    return TensorMap(bytes([fill]) * 128)


def test_tensor_maps_are_packed_as_128_bytes_at_64_byte_alignment():
    a, b = _map(0xA1), _map(0xB2)
    buf, offsets = pack_args("k", (np.int32(7), a, None, b, np.float32(2.0)))
    # int @0, (pad to 64) map @64, void* @192, (pad to 256) map @256, float @384
    assert list(offsets) == [0, 64, 192, 256, 384]
    assert struct.unpack_from("<i", buf, 0)[0] == 7
    assert buf[64:192] == a.raw
    assert struct.unpack_from("<Q", buf, 192)[0] == 0
    assert buf[256:384] == b.raw
    assert struct.unpack_from("<f", buf, 384)[0] == 2.0
    assert pack_code(a) == "M" and pack_size("M") == 128


def test_sm90_forward_argument_layout():
    """The order fwd_sm90.kernel_args uses: three maps first, so no padding anywhere."""
    args = (_map(1), _map(2), _map(3), None, None, np.int64(1), np.int64(2), np.int64(3),
            np.int32(4), np.int32(5), np.int32(6), np.int32(7), np.float32(0.5), np.int32(8),
            np.int32(9))
    _, offsets = pack_args("k", args)
    assert list(offsets) == [0, 128, 256, 384, 392, 400, 408, 416, 424, 428, 432, 436, 440, 444,
                             448]


def test_layout_without_maps_is_the_native_c_layout():
    for codes in ("QiqfiQi", "iQ", "fffq", "IQ", "Q"):
        layout, offsets = _layout(codes)
        expected = []
        for i, c in enumerate(codes):
            prefix = struct.calcsize("@" + codes[:i]) if i else 0
            size = struct.calcsize(c)
            expected.append(prefix + (-prefix % size))
        assert list(offsets) == expected, codes
        assert layout.size >= expected[-1] + struct.calcsize(codes[-1])


def test_wrong_size_tensor_map_is_refused():
    class Bad:
        def __cuda_tensor_map__(self) -> bytes:
            return b"\0" * 64

    with pytest.raises(TypeError, match="64-byte tensor map"):
        pack_args("k", (Bad(),))
    with pytest.raises(ValueError):
        TensorMap(b"\0" * 127)


def test_bshd_geometry():
    t = torch.empty(3, 17, 4, 128, dtype=torch.bfloat16)
    dims, strides = bshd_geometry(tuple(t.shape), tuple(t.stride()), 2)
    assert dims == (128, 17, 4, 3)
    assert strides == (4 * 128 * 2, 128 * 2, 17 * 4 * 128 * 2)  # row, head, batch
    # size-1 dims: any torch stride becomes a legal 16
    one = torch.empty(1, 5, 1, 64, dtype=torch.float16)
    assert bshd_geometry(tuple(one.shape), (7, 64, 3, 1), 2) == ((64, 5, 1, 1), (128, 16, 16))
    # a (B, H, S, D) tensor seen as (B, S, H, D): strides need not grow with the dim
    bhsd = torch.empty(2, 4, 33, 64, dtype=torch.float16).transpose(1, 2)
    dims, strides = bshd_geometry(tuple(bhsd.shape), tuple(bhsd.stride()), 2)
    assert dims == (64, 33, 4, 2) and strides == (128, 33 * 128, 4 * 33 * 128)
    assert bshd_problem(bhsd, 128) is None


def test_tiled_problem_rules():
    ok = ((64, 100, 2, 1), (256, 128, 25600), (BOX_COLS, 128, 1, 1), 2)
    assert tiled_problem(0x1000, *ok) is None
    assert "16-byte" in tiled_problem(0x1002, *ok)
    assert "multiple of 16" in tiled_problem(0x1000, ok[0], (264, 128, 25600), *ok[2:])
    assert "box dim" in tiled_problem(0x1000, ok[0], ok[1], (64, 512, 1, 1), 2)
    assert "inner extent" in tiled_problem(0x1000, ok[0], ok[1], (128, 128, 1, 1), 2)
    assert "dim 1" in tiled_problem(0x1000, (64, 0, 2, 1), *ok[1:])
    assert "innermost" in tiled_problem(0x1000, *ok, last_stride=2)


def test_bshd_problem_on_views():
    big = torch.empty(2, 33, 4, 72, dtype=torch.bfloat16)
    assert "16-byte" in bshd_problem(big[..., 1:65], 128)           # misaligned base
    odd = torch.empty(2, 33, 4, 68, dtype=torch.bfloat16)[..., :64]  # row stride 272 B: ok,
    assert "multiple of 16" in bshd_problem(odd, 128)                # head stride 136 B: not
    assert bshd_problem(torch.empty(2, 33, 4, 64, dtype=torch.float16), 128) is None
    assert "4-D" in bshd_problem(torch.empty(33, 64), 128)


@pytest.fixture
def encoded(monkeypatch):
    """tensor_map with encode_tiled recorded instead of called (no driver), an empty memo: the
    list of (dtype, address, dims, byte strides, box) it was asked to encode."""
    from flashcuda.jit import runtime, tensor_map

    calls = []

    def fake_encode(dtype, address, dims, byte_strides, box, swizzle_bytes=128):
        calls.append((dtype, address, dims, byte_strides, box) + (
            () if swizzle_bytes == 128 else (swizzle_bytes,)))
        return TensorMap(bytes([len(calls)]) * 128)

    monkeypatch.setattr(tensor_map, "encode_tiled", fake_encode)
    monkeypatch.setattr(runtime, "_make_current", lambda index: None)
    monkeypatch.setattr(tensor_map, "_memo", {})
    return calls


def test_bshd_map_memo_hits_only_the_same_geometry(monkeypatch, encoded):
    """A repeated call reuses its map (no encode, no layout check); any change of address,
    shape, strides, dtype or box encodes again; a bad layout is refused before encoding."""
    from flashcuda.jit import tensor_map

    base = torch.zeros(2, 40, 3, 64, dtype=torch.bfloat16)
    m1 = tensor_map.bshd_map(base, 64)
    assert tensor_map.bshd_map(base, 64) is m1 and len(encoded) == 1
    assert encoded[0][2:] == ((64, 40, 3, 2), (384, 128, 15360), (BOX_COLS, 64, 1, 1))
    assert tensor_map.bshd_map(base, 128) is not m1                      # box
    assert tensor_map.bshd_map(base[:, :39], 64) is not m1               # shape
    assert tensor_map.bshd_map(base.transpose(0, 1).contiguous().transpose(0, 1), 64) is not m1
    assert tensor_map.bshd_map(base.to(torch.float16), 64) is not m1     # dtype and address
    m64 = tensor_map.bshd_map(base, 64, swizzle_bytes=64)                 # swizzle: its box
    assert m64 is not m1 and encoded[-1][4:] == ((32, 64, 1, 1), 64)
    assert len(encoded) == 6
    misaligned = torch.zeros(2 * 40 * 3 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 40, 3, 64)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        tensor_map.bshd_map(misaligned, 64)
    assert len(encoded) == 6
    monkeypatch.setattr(tensor_map, "_MEMO_SIZE", 2)
    tensor_map._memo.clear()
    for rows in (16, 32, 48):
        tensor_map.bshd_map(base, rows)
    assert len(tensor_map._memo) <= 2



def test_rows_f32_map_geometry_and_memo(encoded):
    """dq_accum (B, H, Sq_pad, D) fp32 as the 2-D map bwd_sm90's tma dQ reduction adds into:
    dims (D, B H Sq_pad), row stride 4 D bytes, box (32 fp32 = one 128-byte swizzled row,
    box_rows); memoised by address, shape and box; a non-fp32 or non-contiguous tensor is refused
    before encoding."""
    from flashcuda.jit import tensor_map

    acc = torch.zeros(2, 3, 192, 128, dtype=torch.float32)
    m = tensor_map.rows_f32_map(acc, 64)
    assert tensor_map.rows_f32_map(acc, 64) is m and len(encoded) == 1
    assert encoded[0][0] == torch.float32
    assert encoded[0][2:] == ((128, 2 * 3 * 192), (512,), (32, 64))
    assert tensor_map.rows_f32_map(acc, 128) is not m and len(encoded) == 2
    assert tensor_map.rows_f32_problem(acc, 64) is None
    assert "fp32" in tensor_map.rows_f32_problem(acc.to(torch.float16), 64)
    assert "contiguous" in tensor_map.rows_f32_problem(acc.transpose(1, 2), 64)
    with pytest.raises(ValueError, match="rows_f32_map"):
        tensor_map.rows_f32_map(acc[..., :64], 64)
    assert len(encoded) == 2

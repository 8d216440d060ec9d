"""Issue 8 on the CPU lane: property-based input contracts (docs/GUARANTEES.md §3) and the
portable path against the float64 oracle (§4), over shapes, strides, dtypes and devices.

Hypothesis runs derandomised (the same examples on every run) and bounded (max_examples), with no
deadline: the whole file takes well under a minute. Three properties:

  * an accepted call on CPU tensors runs the portable path and matches the oracle (the 2x rule of
    DESIGN.md §7 plus a rounding floor), rows that see no key give exactly 0 and -inf;
  * a call with exactly one thing wrong raises ValueError / TypeError / NotImplementedError whose
    message starts with the argument's name and says what was expected and what was got, and
    never reaches dispatch (so on a GPU, never a launch);
  * the same on fake CUDA tensors (torch's FakeTensorMode: CUDA devices without a GPU), where
    tensors on two GPUs or on a GPU and the CPU are refused, and huge meta tensors, where shapes
    past the kernels' int32 / int64 index limits are refused and the largest legal ones accepted.
"""

from __future__ import annotations

import contextlib
import math
import re
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from flashcuda import flash_attn_func, scaled_dot_product_attention, validate
from flashcuda.ops import dispatch
from flashcuda.reference import attention_ref, max_error

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (1, 3, 8, 16, 24, 40, 64, 72, 128, 256)
LAYOUTS = ("contiguous", "bhsd", "offset", "padded", "strided_last")
NEG_INF = float("-inf")


def bounded(n: int):
    return settings(derandomize=True, deadline=None, max_examples=n, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def no_dispatch():
    """Fail if a call gets past validation (on a GPU, the next step would be a launch)."""
    def refuse(call):
        raise AssertionError(f"validation let a bad call reach dispatch: {call!r:.200}")

    with mock.patch.object(dispatch, "forward", refuse), \
            mock.patch.object(dispatch, "backward", refuse):
        yield


@contextlib.contextmanager
def recording_dispatch(calls: list):
    """Record what dispatch would run, without running it (fake and huge meta tensors)."""
    with mock.patch.object(dispatch, "forward", calls.append), \
            mock.patch.object(dispatch, "backward", calls.append):
        yield


def layout_tensor(shape, dtype, layout: str, gen: torch.Generator) -> torch.Tensor:
    """A (B, S, H, D) tensor of random values in one of the strided layouts users pass (the
    buffer is made in `dtype`, then viewed, so the strides survive)."""
    b, s, h, d = shape

    def rand(*size):
        return torch.randn(*size, generator=gen).to(dtype)

    if layout == "contiguous":
        return rand(b, s, h, d)
    if layout == "bhsd":  # an SDPA-layout tensor seen as BSHD
        return rand(b, h, s, d).transpose(1, 2)
    if layout == "offset":  # odd storage offset: not 16-byte aligned
        return rand(b * s * h * d + 5)[5:].view(b, s, h, d)
    if layout == "padded":  # strides that are not multiples of 8
        return rand(b, s + 3, h + 1, d + 3)[:, :s, :h, :d]
    if layout == "strided_last":  # copied by the API, as FlashAttention does
        return rand(b, s, h, 2 * d)[..., ::2]
    raise ValueError(layout)


@st.composite
def problems(draw):
    """A valid flash_attn_func call: shapes, per-tensor layouts, dtype, mask, scale."""
    b = draw(st.integers(0, 3))
    sq = draw(st.integers(0, 130))
    sk = draw(st.integers(0, 130))
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.integers(1, 3))
    d = draw(st.sampled_from(HEAD_DIMS))
    dtype = draw(st.sampled_from(DTYPES))
    packed = sq == sk and h == hkv and draw(st.booleans())
    layouts = tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(3))
    causal = draw(st.booleans())
    window = (draw(st.sampled_from((-1, 0, 1, 5, 17))), draw(st.sampled_from((-1, 0, 1, 5, 17))))
    scale = draw(st.one_of(st.none(), st.floats(-2.0, 2.0, allow_nan=False)))
    seed = draw(st.integers(0, 2**16))
    return dict(b=b, sq=sq, sk=sk, h=h, hkv=hkv, d=d, dtype=dtype, packed=packed,
                layouts=layouts, causal=causal, window=window, scale=scale, seed=seed)


def build(p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(p["seed"])
    b, sq, sk, h, hkv, d, dtype = (p[n] for n in ("b", "sq", "sk", "h", "hkv", "d", "dtype"))
    if p["packed"]:
        return torch.randn(b, sq, 3, h, d, generator=gen).to(dtype).unbind(2)
    shapes = ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d))
    return tuple(layout_tensor(shape, dtype, layout, gen)
                 for shape, layout in zip(shapes, p["layouts"], strict=True))


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the error of merely rounding the oracle's values to `dtype` (as in tests/gpu)."""
    finite = ref[torch.isfinite(ref)]
    if finite.numel() == 0:
        return 0.0
    return 2 * (finite.to(dtype).double() - finite).abs().max().item()


@bounded(200)
@given(problems())
def test_accepted_cpu_calls_match_the_oracle(p):
    q, k, v = build(p)
    out, lse = flash_attn_func(q, k, v, softmax_scale=p["scale"], causal=p["causal"],
                               window_size=p["window"], return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    ref, ref_lse = attention_ref(q, k, v, p["scale"], p["causal"], p["window"])
    base, _ = attention_ref(q, k, v, p["scale"], p["causal"], p["window"], upcast=False)
    assert not out.isnan().any() and not lse.isnan().any()
    err, base_err = max_error(out, ref), max_error(base, ref)
    assert err <= 2 * base_err + rounding_floor(ref, q.dtype) + 1e-6, (err, base_err)
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead)
    assert (out.permute(0, 2, 1, 3)[dead] == 0).all()  # rows that see no key: exactly 0
    if (~dead).any():
        diff = (lse.double() - ref_lse)[~dead].abs()
        assert (diff <= 1e-4 * (1 + ref_lse[~dead].abs())).all(), diff.max().item()


# ---- one thing wrong -------------------------------------------------------------------------

def _other_dtype(dtype):
    return torch.bfloat16 if dtype != torch.bfloat16 else torch.float16


def resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A tensor like `t` (dtype, device) with shape[dim] = size (shape-based, so empty inputs
    get the fault too)."""
    shape = list(t.shape)
    shape[dim] = size
    return torch.randn(shape).to(dtype=t.dtype, device=t.device)


def grown(t: torch.Tensor, dim: int) -> torch.Tensor:
    return resized(t, dim, t.shape[dim] + 1)


# name -> (mutate(q, k, v, kwargs) -> (q, k, v, kwargs), exception, argument named first)
FAULTS = {
    "float64": (lambda q, k, v, kw: (q.double(), k.double(), v.double(), kw), TypeError, "q"),
    "int_q": (lambda q, k, v, kw: (q.to(torch.int32), k, v, kw), TypeError, "q"),
    "mixed_dtype_v": (lambda q, k, v, kw: (q, k, v.to(_other_dtype(v.dtype)), kw), TypeError, "v"),
    "rank_q": (lambda q, k, v, kw: (q.flatten(2), k, v, kw), ValueError, "q"),
    "rank_k": (lambda q, k, v, kw: (q, k[None], v, kw), ValueError, "k"),
    "batch": (lambda q, k, v, kw: (q, grown(k, 0), grown(v, 0), kw), ValueError, "k"),
    "kv_shape": (lambda q, k, v, kw: (q, k, grown(v, 1), kw), ValueError, "v"),
    "headdim_kv": (lambda q, k, v, kw: (q, grown(k, 3), grown(v, 3), kw), ValueError, "k"),
    # nheads + 1 never divides nheads (>= 1)
    "gqa": (lambda q, k, v, kw: (q, resized(k, 2, q.shape[2] + 1), resized(v, 2, q.shape[2] + 1),
                                 kw), ValueError, "k"),
    "headdim_257": (lambda q, k, v, kw: (*(resized(t, 3, 257) for t in (q, k, v)), kw),
                    ValueError, "q"),
    "headdim_0": (lambda q, k, v, kw: (q[..., :0], k[..., :0], v[..., :0], kw), ValueError, "q"),
    "device_k": (lambda q, k, v, kw: (q, k.to("meta"), v, kw), ValueError, "k"),
    "not_a_tensor_v": (lambda q, k, v, kw: (q, k, v.tolist(), kw), TypeError, "v"),
    "scale_nan": (lambda q, k, v, kw: (q, k, v, {**kw, "softmax_scale": math.nan}), ValueError,
                  "softmax_scale"),
    "scale_inf": (lambda q, k, v, kw: (q, k, v, {**kw, "softmax_scale": -math.inf}), ValueError,
                  "softmax_scale"),
    "scale_past_float32": (lambda q, k, v, kw: (q, k, v, {**kw, "softmax_scale": 3e38}),
                           ValueError, "softmax_scale"),
    "scale_str": (lambda q, k, v, kw: (q, k, v, {**kw, "softmax_scale": "0.1"}), TypeError,
                  "softmax_scale"),
    "window_neg": (lambda q, k, v, kw: (q, k, v, {**kw, "window_size": (-2, 0)}), ValueError,
                   "window_size"),
    "window_float": (lambda q, k, v, kw: (q, k, v, {**kw, "window_size": (1.5, 0)}), TypeError,
                     "window_size"),
    "window_triple": (lambda q, k, v, kw: (q, k, v, {**kw, "window_size": (1, 2, 3)}), TypeError,
                      "window_size"),
    "causal_int": (lambda q, k, v, kw: (q, k, v, {**kw, "causal": 1}), TypeError, "causal"),
    "deterministic_str": (lambda q, k, v, kw: (q, k, v, {**kw, "deterministic": "yes"}),
                          TypeError, "deterministic"),
    "dropout": (lambda q, k, v, kw: (q, k, v, {**kw, "dropout_p": 0.1}), NotImplementedError,
                "dropout_p"),
    "dropout_range": (lambda q, k, v, kw: (q, k, v, {**kw, "dropout_p": 1.5}), ValueError,
                      "dropout_p"),
    "softcap": (lambda q, k, v, kw: (q, k, v, {**kw, "softcap": 30.0}), NotImplementedError,
                "softcap"),
    "alibi": (lambda q, k, v, kw: (q, k, v, {**kw, "alibi_slopes": torch.ones(q.shape[2])}),
              NotImplementedError, "alibi_slopes"),
}


def assert_names(exc: BaseException, name: str) -> None:
    msg = str(exc)
    assert re.match(rf"{re.escape(name)}\b", msg), f"message does not start with {name!r}: {msg}"
    assert "expected" in msg and "got" in msg, f"message lacks expected/got: {msg}"


@bounded(300)
@given(problems(), st.sampled_from(sorted(FAULTS)))
def test_one_wrong_thing_raises_naming_it_before_dispatch(p, fault):
    mutate, exc_type, name = FAULTS[fault]
    q, k, v = build(p)
    kwargs = dict(softmax_scale=p["scale"], causal=p["causal"], window_size=p["window"])
    q, k, v, kwargs = mutate(q, k, v, kwargs)
    with no_dispatch(), pytest.raises(exc_type) as info:
        flash_attn_func(q, k, v, **kwargs)
    assert_names(info.value, name)


@bounded(40)
@given(problems(), st.sampled_from(("float64", "rank_q", "kv_shape", "gqa", "device_k",
                                    "mixed_dtype_v", "headdim_257")))
def test_sdpa_shim_rejects_before_dispatch(p, fault):
    mutate, exc_type, name = FAULTS[fault]
    q, k, v = build(p)
    q, k, v, _ = mutate(q, k, v, {})
    sdpa_name = {"q": "query", "k": "key", "v": "value"}[name]
    tensors = [t.transpose(1, 2) if isinstance(t, torch.Tensor) and t.dim() == 4 else t
               for t in (q, k, v)]
    if fault == "rank_q":
        tensors[0] = q
    with no_dispatch(), pytest.raises(exc_type) as info:
        scaled_dot_product_attention(*tensors, enable_gqa=True)
    assert_names(info.value, sdpa_name)


# ---- fake CUDA devices (no GPU needed) -------------------------------------------------------

@st.composite
def device_sets(draw):
    """q, k, v devices: all on one GPU (accepted) or spread over two GPUs / a GPU and the CPU."""
    home = draw(st.sampled_from(("cuda:0", "cuda:1")))
    other = draw(st.sampled_from(("cpu", "cuda:0", "cuda:1", "cuda:3")))
    which = draw(st.sampled_from((None, 1, 2, 0)))
    devices = [home] * 3
    if which is not None:
        devices[which] = other
    return devices


@bounded(40)
@given(device_sets(), st.sampled_from(DTYPES), st.integers(0, 2), st.integers(0, 300),
       st.integers(0, 300))
def test_fake_cuda_devices_one_gpu_accepted_mixes_refused(devices, dtype, b, sq, sk):
    calls: list = []
    with FakeTensorMode(), recording_dispatch(calls):
        q = torch.empty(b, sq, 4, 64, dtype=dtype, device=devices[0])
        k = torch.empty(b, sk, 2, 64, dtype=dtype, device=devices[1])
        v = torch.empty(b, sk, 2, 64, dtype=dtype, device=devices[2])
        if len(set(devices)) == 1:
            out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
            assert out.device == q.device and out.shape == q.shape
            assert lse.device == q.device and lse.shape == (b, 4, sq)
            launched = b > 0 and sq > 0 and sk > 0
            assert len(calls) == int(launched)
            if launched and sq == 1:  # decoding: ops.decode's view of q, 2 query rows per KV head
                assert calls[0].q.shape == (b, 2, 2, 64) and calls[0].q.stride() == (256, 64, 128, 1)
                assert calls[0].k is k and calls[0].out.shape == (b, 2, 2, 64)
            elif launched:
                assert calls[0].q is q and calls[0].out.shape == q.shape
            return
        bad = next(i for i in (1, 2) if devices[i] != devices[0])
        name = "kv"[bad - 1]
        with pytest.raises(ValueError) as info:
            flash_attn_func(q, k, v, causal=True)
    assert not calls
    assert_names(info.value, name)
    assert f"expected device {devices[0]}" in str(info.value)
    assert f"got {devices[bad]}" in str(info.value)


# ---- index limits, on meta tensors of any size -----------------------------------------------

def _meta(shape, dtype=torch.bfloat16) -> torch.Tensor:
    """A (B, S, H, D) meta tensor of that size: expanded from one row, no memory."""
    return torch.empty(1, 1, 1, shape[3], device="meta", dtype=dtype).expand(*shape)


LIMIT_CASES = [
    # (q shape, k shape, argument named, accepted)
    ((1, 2**31, 1, 8), (1, 4, 1, 8), "q seqlen_q", False),
    ((1, 4, 1, 8), (1, 2**31, 1, 8), "k seqlen_k", False),
    ((2**31, 4, 1, 8), (2**31, 4, 1, 8), "batch", False),
    ((1, 4, 2**31, 8), (1, 4, 1, 8), "q nheads", False),
    ((1, 2**29, 1, 8), (1, 2**29, 1, 8), "seqlen_q + seqlen_k", False),
    ((1, 2**29, 1, 8), (1, 2**29 - 1, 1, 8), None, True),  # the largest legal sum
    ((1, 2**30 - 5, 1, 8), (1, 4, 1, 8), None, True),
    ((2**31 - 1, 4, 1, 8), (2**31 - 1, 4, 1, 8), None, True),  # batch past the grid: dispatch says
    ((3, 2**28, 64, 128), (3, 2**28, 8, 128), None, True),  # 2^43 elements: int64 offsets
]


@pytest.mark.parametrize("q_shape,k_shape,name,accepted", LIMIT_CASES, ids=str)
def test_index_limits_on_meta_tensors(q_shape, k_shape, name, accepted):
    q, k = _meta(q_shape), _meta(k_shape)
    calls: list = []
    if not accepted:
        with no_dispatch(), pytest.raises(ValueError) as info:
            flash_attn_func(q, k, k)
        assert_names(info.value, name)
        assert "2**3" in str(info.value)  # the limit is stated
        return
    with recording_dispatch(calls):
        out = flash_attn_func(q, k, k, causal=True)
    assert out.shape == q.shape and out.device.type == "meta"
    assert len(calls) == 1 and calls[0].seqlen_k == k_shape[1]


@bounded(40)
@given(st.integers(1, 4), st.integers(0, 2**63 - 1))
def test_int64_offset_limit(rows, stride):
    """check_offsets: a view whose largest element offset reaches 2**63 is refused, else not."""
    shape, strides = (rows, 1, 1, 8), (stride, 8, 8, 1)
    last = (rows - 1) * stride + 7
    if last >= 2**63:
        with pytest.raises(ValueError) as info:
            validate.check_offsets("q", shape, strides)
        assert_names(info.value, "q")
    else:
        validate.check_offsets("q", shape, strides)


def test_return_flags_are_checked_before_the_call():
    """A bad return_lse must raise before anything runs (DESIGN: validate -> allocate -> launch)."""
    q = torch.randn(1, 4, 1, 8)
    with no_dispatch(), pytest.raises(TypeError) as info:
        flash_attn_func(q, q, q, return_lse="yes")
    assert_names(info.value, "return_lse")

"""Input contracts: each wrong input raises the right exception naming the argument, the expected
and the actual value."""

from __future__ import annotations

import math
import re

import pytest
import torch

from flashcuda import validate


def qkv(b=2, sq=5, sk=7, h=4, hkv=2, d=16, dtype=torch.float16):
    return (torch.randn(b, sq, h, d).to(dtype), torch.randn(b, sk, hkv, d).to(dtype),
            torch.randn(b, sk, hkv, d).to(dtype))


def test_valid_inputs_pass():
    validate.check_qkv(*qkv())
    validate.check_qkv(*qkv(dtype=torch.bfloat16, h=8, hkv=1, d=256))
    validate.check_qkv(*qkv(b=0, sq=0, sk=0, dtype=torch.float32, d=1))


def test_a_pass_is_remembered_by_layout_and_a_failure_never(monkeypatch):
    """check_qkv remembers passes by the tensors' layouts (dtype, device, shape, strides, storage
    offset) and options: a repeat with new data but the same layouts skips the checks; another
    layout, other names or another option runs them; an input that fails raises every time."""
    ran = []
    inner = validate._check_qkv
    monkeypatch.setattr(validate, "_check_qkv", lambda *a: (ran.append(a[3:]), inner(*a)))
    monkeypatch.setattr(validate, "_passed", {})
    validate.check_qkv(*qkv(sq=11))
    validate.check_qkv(*qkv(sq=11))  # new tensors, same layouts
    assert len(ran) == 1
    validate.check_qkv(*qkv(sq=11), names=("query", "key", "value"))
    validate.check_qkv(*qkv(sq=11), strided_last_ok=True)
    validate.check_qkv(*qkv(sq=12))
    q, k, v = qkv(sq=11)
    validate.check_qkv(q[:, 1:], k, v)  # another storage offset and shape
    assert len(ran) == 5
    bad = qkv(sq=11, hkv=3)  # nheads 4 not a multiple of 3
    for _ in range(2):
        with pytest.raises(ValueError, match="nheads_kv"):
            validate.check_qkv(*bad)
    assert len(ran) == 7


def test_packed_qkv_views_pass():
    packed = torch.randn(2, 9, 3, 4, 32, dtype=torch.float16)
    q, k, v = packed.unbind(dim=2)
    assert not q.is_contiguous()
    validate.check_qkv(q, k, v)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_not_a_tensor(which):
    args = list(qkv())
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=f"{'qkv'[which]}: expected a torch.Tensor, got list"):
        validate.check_qkv(*args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_unsupported_dtype(dtype):
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match=r"q: expected dtype in \(float16, bfloat16, float32\), "
                                        rf"got {str(dtype).removeprefix('torch.')}"):
        validate.check_qkv(q.to(dtype), k.to(dtype), v.to(dtype))


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="v: expected dtype float16 .the dtype of q., got bfloat16"):
        validate.check_qkv(q, k, v.bfloat16())


def test_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q: expected a 4-D tensor \(batch, seqlen_q, nheads, "
                                         r"headdim\), got a 3-D tensor of shape \(2, 5, 64\)"):
        validate.check_qkv(q.flatten(2), k, v)
    with pytest.raises(ValueError, match="k: expected a 4-D tensor"):
        validate.check_qkv(q, k[None], v)


def test_shape_mismatches():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"v: expected the shape of k \(2, 7, 2, 16\), got "
                                         r"\(2, 6, 2, 16\)"):
        validate.check_qkv(q, k, v[:, :6])
    with pytest.raises(ValueError, match="k: expected batch 2 .the batch of q., got 1"):
        validate.check_qkv(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="k: expected headdim 16 .the headdim of q., got 8"):
        validate.check_qkv(q, k[..., :8], v[..., :8])


def test_gqa_divisibility_and_heads():
    q, k, v = qkv(h=4, hkv=3)
    with pytest.raises(ValueError, match="k: expected nheads_kv dividing nheads=4 .GQA/MQA., "
                                         "got nheads_kv=3"):
        validate.check_qkv(q, k, v)
    q, k, v = qkv(h=4, hkv=2)
    with pytest.raises(ValueError, match="k nheads_kv: expected at least 1 head, got 0"):
        validate.check_qkv(q, k[:, :, :0], v[:, :, :0])


@pytest.mark.parametrize("d", [0, 257, 512])
def test_head_dim_limits(d):
    q, k, v = qkv(d=d)
    with pytest.raises(ValueError, match=rf"q: expected headdim in \[1, 256\], got {d}"):
        validate.check_qkv(q, k, v)


def test_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k: expected device cpu .the device of q., got meta"):
        validate.check_qkv(q, k.to("meta"), v)
    # meta tensors (shape inference) are accepted; other device types are not implemented.
    validate.check_qkv(*(t.to("meta") for t in (q, k, v)))


def test_strided_last_dim():
    q, k, v = qkv()
    q2 = torch.randn(2, 5, 4, 32, dtype=torch.float16)[..., ::2]
    with pytest.raises(ValueError, match=r"q: expected a contiguous last dimension \(stride\(-1\) "
                                         r"== 1\), got strides \(640, 128, 32, 2\)"):
        validate.check_qkv(q2, k, v)
    # A head_dim of 1 has no stride to speak of.
    q1, k1, v1 = qkv(d=1)
    validate.check_qkv(q1.transpose(-1, -2).transpose(-1, -2), k1, v1)


def test_int32_limits_with_expanded_tensors():
    # Expanded (stride-0) tensors have huge sizes without memory.
    base = torch.zeros(1, 1, 1, 8, dtype=torch.float16)
    small = base.expand(1, 4, 1, 8)
    with pytest.raises(ValueError, match=r"q seqlen_q: expected below 2\*\*31 .int32 kernel "
                                         r"indexing., got 2147483648"):
        validate.check_qkv(base.expand(1, 2**31, 1, 8), small, small)
    with pytest.raises(ValueError, match=r"batch: expected below 2\*\*31"):
        big = base.expand(2**31, 4, 1, 8)
        validate.check_qkv(big, big, big)
    with pytest.raises(ValueError, match=r"seqlen_q \+ seqlen_k: expected below 2\*\*30 .int32 "
                                         r"window arithmetic., got 1073741823 \+ 4 = 1073741827"):
        validate.check_qkv(base.expand(1, 2**30 - 1, 1, 8), small, small)
    with pytest.raises(ValueError, match=r"q nheads: expected below 2\*\*31"):
        validate.check_qkv(base.expand(1, 4, 2**31, 8), small, small)


def test_int64_offsets():
    validate.check_offsets("q", (2, 3), (3, 1), 0)
    validate.check_offsets("q", (0, 2**62), (2**62, 4), 0)  # empty: no offset is formed
    with pytest.raises(ValueError, match=r"q: expected every element offset below 2\*\*63 "
                                         r"\(int64 indexing\), got a largest offset of"):
        validate.check_offsets("q", (3, 2), (2**62, 1), 5)


def test_bhsd_messages_quote_the_callers_layout():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"value: expected the shape of key \(2, 2, 7, 16\), got "
                                         r"\(2, 2, 6, 16\)"):
        validate.check_qkv(q, k, v[:, :6], names=("query", "key", "value"), bhsd=True)


def test_softmax_scale():
    assert validate.softmax_scale(None, 64) == 0.125
    assert validate.softmax_scale(2, 64) == 2.0
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match=f"softmax_scale: expected a finite number, got {bad}"):
            validate.softmax_scale(bad, 64)
    with pytest.raises(TypeError, match="scale: expected a float or None, got str '1'"):
        validate.softmax_scale("1", 64, name="scale")
    with pytest.raises(TypeError, match="softmax_scale: expected a float or None, got bool"):
        validate.softmax_scale(True, 64)


def test_window_forms():
    assert validate.fa_window((-1, -1), False) == (None, None)
    assert validate.fa_window((-1, -1), True) == (None, 0)
    assert validate.fa_window([4, 0], False) == (4, 0)
    assert validate.fa_window((4, 9), True) == (4, 0)
    assert validate.fa_window((0, 0), False) == (0, 0)
    with pytest.raises(ValueError, match=r"window_size \(left\): expected -1 \(unbounded\) or >= "
                                         r"0, got -2"):
        validate.fa_window((-2, 0), False)
    with pytest.raises(TypeError, match=r"window_size: expected a pair \(left, right\) of ints"):
        validate.fa_window((1, 2, 3), False)
    with pytest.raises(TypeError, match=r"window_size: expected a pair"):
        validate.fa_window(5, False)
    with pytest.raises(TypeError, match=r"window_size \(right\): expected an int, got float 1.5"):
        validate.fa_window((1, 1.5), False)
    with pytest.raises(TypeError, match="causal: expected a bool, got str 'yes'"):
        validate.fa_window((-1, -1), "yes")


def test_unsupported_features_are_rejected_not_ignored():
    validate.check_fa_unsupported()
    validate.check_fa_unsupported(dropout_p=0, softcap=0)
    with pytest.raises(NotImplementedError, match="dropout_p: .* expected 0.0, got 0.1"):
        validate.check_fa_unsupported(dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p: expected a probability in \[0, 1\), got 1.5"):
        validate.check_fa_unsupported(dropout_p=1.5)
    with pytest.raises(NotImplementedError, match="softcap: .* expected 0.0, got 30.0"):
        validate.check_fa_unsupported(softcap=30.0)
    with pytest.raises(ValueError, match="softcap: expected a finite value >= 0, got -1.0"):
        validate.check_fa_unsupported(softcap=-1.0)
    with pytest.raises(NotImplementedError, match="alibi_slopes: .* expected None, got a Tensor"):
        validate.check_fa_unsupported(alibi_slopes=torch.ones(4))
    with pytest.raises(NotImplementedError, match="attn_mask: .* expected None, got a Tensor"):
        validate.check_sdpa_unsupported(attn_mask=torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="dropout_p: expected a float, got NoneType"):
        validate.check_sdpa_unsupported(dropout_p=None)


def test_backward_inputs():
    q, k, v = qkv()
    out = torch.empty_like(q)
    lse = torch.empty(2, 4, 5)
    validate.check_bwd(torch.randn_like(q), q, out, lse)
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 5, 4, 16\), got \(2, 5, 4, 8\)"):
        validate.check_bwd(q[..., :8], q, out, lse)
    with pytest.raises(TypeError, match="lse: expected dtype float32, got float16"):
        validate.check_bwd(q, q, out, lse.half())
    with pytest.raises(TypeError, match="dout: expected a torch.Tensor, got NoneType"):
        validate.check_bwd(None, q, out, lse)


def test_shape_dtype_device_helper():
    t = torch.zeros(2, 3)
    validate.check_shape_dtype_device(t, "x", shape=(2, 3), dtype=torch.float32, device=t.device)
    with pytest.raises(ValueError, match="x: expected device meta, got cpu"):
        validate.check_shape_dtype_device(t, "x", device=torch.device("meta"))


def test_softmax_scale_must_fit_float32():
    # The kernels take softmax_scale * log2(e) as a float32: a finite double past that would
    # become inf on the way in.
    assert validate.softmax_scale(1e38, 64) == 1e38
    assert validate.softmax_scale(-validate.MAX_SOFTMAX_SCALE, 64) == -validate.MAX_SOFTMAX_SCALE
    for bad in (3e38, -1e300):
        with pytest.raises(ValueError, match=r"softmax_scale: expected a magnitude at most "
                                             rf"2.359e\+38 .*, got {re.escape(str(bad))}"):
            validate.softmax_scale(bad, 64)


def test_empty_tensors_with_a_strided_last_dim_pass():
    # .contiguous() keeps an empty tensor's strides, and an empty input launches nothing.
    q, k, v = qkv(b=0)
    q = torch.empty(0, 5, 4, 32, dtype=torch.float16)[..., ::2]
    assert q.stride(-1) == 2
    validate.check_qkv(q, k, v)
    k2 = torch.empty(2, 0, 2, 32, dtype=torch.float16)[..., ::2]
    validate.check_qkv(qkv()[0], k2, k2)

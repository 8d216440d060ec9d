"""Input contracts of the attention entry points (DESIGN.md §3).

Every check raises with the argument's name, what was expected and what was given:
TypeError (not a tensor, wrong dtype), ValueError (shape, device, value out of range),
NotImplementedError (a FlashAttention / SDPA feature flashcuda does not implement yet).
Never `assert`: these run on user input, also under `python -O`.

Layout vocabulary: q (batch, seqlen_q, nheads, headdim); k, v (batch, seqlen_k, nheads_kv, headdim)
("BSHD"). The SDPA shim checks the same tensors as (batch, nheads, seqlen, headdim) views ("BHSD")
and asks for messages in that layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
INT32_LIMIT = 2**31  # batch, seqlen, heads: kernels index them with int32
SEQ_SUM_LIMIT = 2**30  # seqlen_q + seqlen_k: window arithmetic (i + shift +- window) in int32
INT64_LIMIT = 2**63  # element offsets: kernels index memory with int64
FLOAT32_MAX = 3.4028234663852886e38
LOG2E = 1.4426950408889634
# The kernels take softmax_scale * log2(e) as a float32: beyond this it would round to inf.
MAX_SOFTMAX_SCALE = FLOAT32_MAX / LOG2E / (1 + 2**-20)
_DEVICE_TYPES = ("cuda", "cpu", "meta")

_DIMS_BSHD = {"q": ("batch", "seqlen_q", "nheads", "headdim"),
              "kv": ("batch", "seqlen_k", "nheads_kv", "headdim")}
_DIMS_BHSD = {"q": ("batch", "nheads", "seqlen_q", "headdim"),
              "kv": ("batch", "nheads_kv", "seqlen_k", "headdim")}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _supported_dtypes() -> str:
    return ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES)


def check_tensor(t: object, name: str) -> torch.Tensor:
    """`t` must be a torch.Tensor (TypeError otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def check_shape_dtype_device(t: object, name: str, *, shape: Sequence[int] | None = None,
                             dtype: torch.dtype | None = None,
                             device: torch.device | None = None) -> torch.Tensor:
    """One tensor against an expected shape / dtype / device (each optional)."""
    t = check_tensor(t, name)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {_dtype_name(dtype)}, got {_dtype_name(t.dtype)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t


def check_offsets(name: str, shape: Sequence[int], stride: Sequence[int],
                  storage_offset: int = 0) -> None:
    """The largest element offset of a strided view must fit the kernels' int64 indexing."""
    if any(s == 0 for s in shape):
        return
    last = storage_offset + sum((s - 1) * abs(st) for s, st in zip(shape, stride, strict=True))
    if last >= INT64_LIMIT:
        raise ValueError(
            f"{name}: expected every element offset below 2**63 (int64 indexing), got a largest "
            f"offset of {last} for shape {tuple(shape)} and strides {tuple(stride)}"
        )


def _layout_signature(t: object) -> tuple | None:
    """Everything check_qkv reads of a tensor (dtype, device, shape, strides, storage offset),
    or None for what the memo leaves alone (not exactly a torch.Tensor: subclasses, fakes)."""
    if type(t) is not torch.Tensor:
        return None
    return (t.dtype, t.device, t.shape, t.stride(), t.storage_offset())


# check_qkv's passes: (options, signatures of q, k, v) -> True. A repeat call with the same
# layouts passes again without the checks (a serving loop's host time is mostly Python); a
# failure is never stored, so a bad input raises every time.
_passed: dict[tuple, bool] = {}
_PASSED_SIZE = 1024


def check_qkv(q: object, k: object, v: object, *, names: tuple[str, str, str] = ("q", "k", "v"),
              bhsd: bool = False, strided_last_ok: bool = False) -> None:
    """The three attention inputs, given as (B, S, H, D) tensors (or views).

    bhsd=True: the caller's tensors were (B, H, S, D) and q/k/v are their transposed views, so
    messages quote shapes and dimension names in the caller's layout.
    strided_last_ok=True: everything but the unit last stride (the public API checks first, then
    copies a strided last dimension, then checks again).
    """
    key = None
    if not torch.compiler.is_compiling():
        sq, sk, sv = _layout_signature(q), _layout_signature(k), _layout_signature(v)
        if sq is not None and sk is not None and sv is not None:
            key = (names, bhsd, strided_last_ok, sq, sk, sv)
            if key in _passed:
                return
    _check_qkv(q, k, v, names, bhsd, strided_last_ok)
    if key is not None:
        if len(_passed) >= _PASSED_SIZE:
            _passed.clear()
        _passed[key] = True


def _check_qkv(q: object, k: object, v: object, names: tuple[str, str, str], bhsd: bool,
               strided_last_ok: bool) -> None:
    qn, kn, vn = names
    q, k, v = check_tensor(q, qn), check_tensor(k, kn), check_tensor(v, vn)
    dims = _DIMS_BHSD if bhsd else _DIMS_BSHD

    def user_shape(t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.transpose(1, 2).shape) if bhsd and t.dim() == 4 else tuple(t.shape)

    for t, n, role in ((q, qn, "q"), (k, kn, "kv"), (v, vn, "kv")):
        if t.dim() != 4:
            raise ValueError(f"{n}: expected a 4-D tensor ({', '.join(dims[role])}), "
                             f"got a {t.dim()}-D tensor of shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{n}: expected dtype in ({_supported_dtypes()}), "
                            f"got {_dtype_name(t.dtype)}")
        if t.device.type not in _DEVICE_TYPES:
            raise NotImplementedError(
                f"{n}: flashcuda runs on CUDA GPUs (and a portable PyTorch path on CPU); "
                f"got a tensor on {t.device}")

    for t, n in ((k, kn), (v, vn)):
        if t.dtype != q.dtype:
            raise TypeError(f"{n}: expected dtype {_dtype_name(q.dtype)} (the dtype of {qn}), "
                            f"got {_dtype_name(t.dtype)}")
        if t.device != q.device:
            raise ValueError(f"{n}: expected device {q.device} (the device of {qn}), "
                             f"got {t.device}")

    if k.shape != v.shape:
        raise ValueError(f"{vn}: expected the shape of {kn} {user_shape(k)}, got {user_shape(v)}")

    batch, seqlen_q, nheads, head_dim = q.shape
    batch_k, seqlen_k, nheads_kv, head_dim_k = k.shape
    if batch_k != batch:
        raise ValueError(f"{kn}: expected batch {batch} (the batch of {qn}), got {batch_k} "
                         f"(shapes {qn} {user_shape(q)}, {kn} {user_shape(k)})")
    if head_dim_k != head_dim:
        raise ValueError(f"{kn}: expected headdim {head_dim} (the headdim of {qn}), "
                         f"got {head_dim_k}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{qn}: expected headdim in [1, {MAX_HEAD_DIM}], got {head_dim}")
    for n, val in ((f"{qn} nheads", nheads), (f"{kn} nheads_kv", nheads_kv)):
        if val < 1:
            raise ValueError(f"{n}: expected at least 1 head, got {val}")
    if nheads % nheads_kv != 0:
        raise ValueError(f"{kn}: expected nheads_kv dividing nheads={nheads} (GQA/MQA), "
                         f"got nheads_kv={nheads_kv}")

    for n, val in (("batch", batch), (f"{qn} seqlen_q", seqlen_q), (f"{kn} seqlen_k", seqlen_k),
                   (f"{qn} nheads", nheads)):
        if val >= INT32_LIMIT:
            raise ValueError(f"{n}: expected below 2**31 (int32 kernel indexing), got {val}")
    if seqlen_q + seqlen_k >= SEQ_SUM_LIMIT:
        raise ValueError(f"seqlen_q + seqlen_k: expected below 2**30 (int32 window arithmetic), "
                         f"got {seqlen_q} + {seqlen_k} = {seqlen_q + seqlen_k}")

    for t, n in ((q, qn), (k, kn), (v, vn)):
        # An empty tensor has no element to read (and .contiguous() leaves its strides as they
        # are): any call with one launches nothing.
        if not strided_last_ok and t.stride(-1) != 1 and t.shape[-1] != 1 and t.numel() > 0:
            raise ValueError(f"{n}: expected a contiguous last dimension (stride(-1) == 1), got "
                             f"strides {tuple(t.stride())}; pass {n}.contiguous()")
        if not torch.compiler.is_compiling():  # storage_offset() is opaque to dynamo; the op
            check_offsets(n, t.shape, t.stride(), t.storage_offset())  # re-checks at run time


def check_flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def softmax_scale(scale: object, head_dim: int, name: str = "softmax_scale") -> float:
    """The scale applied to q·k: `head_dim ** -0.5` when None, else a finite real number."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name}: expected a float or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"{name}: expected a finite number, got {scale}")
    if abs(scale) > MAX_SOFTMAX_SCALE:
        raise ValueError(f"{name}: expected a magnitude at most {MAX_SOFTMAX_SCALE:.4g} (the "
                         f"kernels take {name} * log2(e) as a float32), got {scale}")
    return float(scale)


def fa_window(window_size: object, causal: bool) -> tuple[int | None, int | None]:
    """FlashAttention's (left, right) window, -1 meaning unbounded, plus `causal`, as the
    kernel-side pair (window_left, window_right) with None meaning unbounded. causal sets
    window_right = 0 (bottom-right aligned diagonal), as FlashAttention does."""
    causal = check_flag(causal, "causal")
    if type(window_size) is tuple and len(window_size) == 2:  # the common form, checked cheaply
        left, right = window_size
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return (None if left == -1 else left), (0 if causal else None if right == -1 else right)
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence) \
            or len(window_size) != 2:
        raise TypeError(f"window_size: expected a pair (left, right) of ints, -1 meaning "
                        f"unbounded, got {window_size!r}")
    out: list[int | None] = []
    for side, w in zip(("left", "right"), window_size, strict=True):
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"window_size ({side}): expected an int, got {type(w).__name__} {w!r}")
        if w < -1:
            raise ValueError(f"window_size ({side}): expected -1 (unbounded) or >= 0, got {w}")
        out.append(None if w == -1 else w)
    left, right = out
    if causal:
        right = 0
    return left, right


def _check_number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    return float(value)


def check_dropout(dropout_p: object) -> None:
    p = _check_number(dropout_p, "dropout_p")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {p}")
    if p != 0.0:
        raise NotImplementedError(f"dropout_p: flashcuda has no attention dropout yet; expected "
                                  f"0.0, got {p}")


def check_fa_unsupported(*, dropout_p: object = 0.0, softcap: object = 0.0,
                         alibi_slopes: object = None) -> None:
    """Arguments FlashAttention accepts that flashcuda does not implement: rejected, never ignored."""
    check_dropout(dropout_p)
    cap = _check_number(softcap, "softcap")
    if cap < 0 or not math.isfinite(cap):
        raise ValueError(f"softcap: expected a finite value >= 0, got {cap}")
    if cap != 0.0:
        raise NotImplementedError(f"softcap: flashcuda has no logit soft-capping yet; expected "
                                  f"0.0, got {cap}")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: flashcuda has no ALiBi bias yet; expected None, "
                                  f"got a {type(alibi_slopes).__name__}")


def check_sdpa_unsupported(*, attn_mask: object = None, dropout_p: object = 0.0) -> None:
    if attn_mask is not None:
        raise NotImplementedError("attn_mask: flashcuda supports is_causal but no explicit mask "
                                  f"yet; expected None, got a {type(attn_mask).__name__}")
    check_dropout(dropout_p)


def check_bwd(dout: object, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """The backward's extra inputs: dout and out like q's (B, Sq, H, D); lse (B, H, Sq) float32."""
    b, sq, h, _ = q.shape
    check_shape_dtype_device(dout, "dout", shape=q.shape, dtype=q.dtype, device=q.device)
    check_shape_dtype_device(out, "out", shape=q.shape, dtype=q.dtype, device=q.device)
    check_shape_dtype_device(lse, "lse", shape=(b, h, sq), dtype=torch.float32, device=q.device)


def check_varlen_rank(t: object, name: str, role: str) -> torch.Tensor:
    """A packed varlen input: 3-D (total_q, nheads, headdim) or (total_k, nheads_kv, headdim)."""
    t = check_tensor(t, name)
    dims = "total_q, nheads, headdim" if role == "q" else "total_k, nheads_kv, headdim"
    if t.dim() != 3:
        raise ValueError(f"{name}: expected a 3-D tensor ({dims}), got a {t.dim()}-D tensor of "
                         f"shape {tuple(t.shape)}")
    return t


def host_ints(t: object, name: str, batch: int, device: torch.device) -> list[int]:
    """A (batch,) int32 / int64 tensor on `device` (one value per batch entry: a KV cache's
    lengths or rows), read on the host (one device-to-host copy)."""
    return [int(x) for x in batch_ints(t, name, batch, device).tolist()]


def batch_ints(t: object, name: str, batch: int, device: torch.device) -> torch.Tensor:
    """host_ints' checks without reading the values: the tensor, where they must stay on the
    device (a CUDA graph's capture)."""
    t = check_tensor(t, name)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32 or int64, got {_dtype_name(t.dtype)}")
    if t.dim() != 1 or t.numel() != batch:
        raise ValueError(f"{name}: expected shape ({batch},) (batch = q.shape[0]), got "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {t.device}")
    return t


def page_table(block_table: object, batch: int, device: torch.device) -> torch.Tensor:
    """A paged KV cache's block table: (batch, max_blocks_per_seq) int32 / int64 on q's device,
    read on the host (an int64 CPU tensor; one device-to-host copy)."""
    return device_page_table(block_table, batch, device).to("cpu", torch.long)


def device_page_table(block_table: object, batch: int, device: torch.device) -> torch.Tensor:
    """page_table's checks without reading the values: the tensor, where they must stay on the
    device (a CUDA graph's capture)."""
    table = check_tensor(block_table, "block_table")
    if table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_table: expected dtype int32 or int64, got "
                        f"{_dtype_name(table.dtype)}")
    if table.dim() != 2 or table.shape[0] != batch:
        raise ValueError(f"block_table: expected shape (batch = {batch}, max_blocks_per_seq), "
                         f"got {tuple(table.shape)}")
    if table.device != device:
        raise ValueError(f"block_table: expected device {device} (the device of q), got "
                         f"{table.device}")
    return table


def pages_in_pool(pages: torch.Tensor, ends: Sequence[int], page_size: int,
                  num_blocks: int) -> None:
    """The blocks each entry b reads (those holding its first ends[b] positions) lie in
    [0, num_blocks): checked on the host, since an index past the pool would fail a
    device-side check that kills the process."""
    if not len(ends):
        return
    used = torch.arange(pages.shape[1]) < torch.tensor([-(-n // page_size) for n in ends])[:, None]
    bad = used & ((pages < 0) | (pages >= num_blocks))
    if bad.any():
        b = int(bad.any(1).nonzero()[0])
        raise ValueError(f"block_table: expected the blocks of entry {b}'s first {ends[b]} "
                         f"positions in [0, {num_blocks}) (the cache's num_blocks), got "
                         f"{pages[b, used[b]].tolist()}")


def cu_seqlens(cu: object, name: str, *, total: int | None, total_name: str,
               device: torch.device, max_seqlen: object, max_name: str,
               batch: int | None = None) -> list[int]:
    """FlashAttention's cumulative sequence lengths: a 1-D int32 tensor on the inputs' device,
    [0, l_0, l_0 + l_1, ..., total] (non-decreasing, batch + 1 entries, the last one the packed
    length unless total is None: a paged cache's keys are not packed), and `max_seqlen` an int
    at least the longest l_i. Returns the offsets as host ints (one device-to-host copy)."""
    cu = check_tensor(cu, name)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype int32, got {_dtype_name(cu.dtype)}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name}: expected a 1-D tensor of batch + 1 >= 1 offsets, got shape "
                         f"{tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {cu.device}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name}: expected {batch + 1} entries (batch + 1, as cu_seqlens_q), "
                         f"got {cu.numel()}")
    offsets = [int(x) for x in cu.tolist()]
    if offsets[0] != 0:
        raise ValueError(f"{name}: expected the first entry 0, got {offsets[0]}")
    for i in range(len(offsets) - 1):
        if offsets[i + 1] < offsets[i]:
            raise ValueError(f"{name}: expected non-decreasing offsets, got {offsets[i]} then "
                             f"{offsets[i + 1]} at entries {i}, {i + 1}")
    if total is not None and offsets[-1] != total:
        raise ValueError(f"{name}: expected the last entry to equal {total_name} = {total}, got "
                         f"{offsets[-1]}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{max_name}: expected an int, got {type(max_seqlen).__name__} "
                        f"{max_seqlen!r}")
    longest = max((b - a for a, b in zip(offsets, offsets[1:], strict=False)), default=0)
    if max_seqlen < longest:
        raise ValueError(f"{max_name}: expected at least the longest sequence of {name} "
                         f"({longest}), got {max_seqlen}")
    return offsets

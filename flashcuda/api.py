"""Public entry points: FlashAttention's `flash_attn_func` and a PyTorch-SDPA-style shim.

Both validate their arguments (flashcuda.validate), then call the `flashcuda::fwd` custom op,
which is differentiable (autograd), traceable by torch.compile(fullgraph=True) and runs the best
CUDA kernel for the call (flashcuda.ops.dispatch) — or, for CPU tensors, the portable tiled
PyTorch path.
"""

from __future__ import annotations

import torch

from . import validate
from .ops.attention import attention


def _last_dim_contiguous(t: object, name: str) -> torch.Tensor:
    """As FlashAttention does: a tensor whose last dimension is strided is copied."""
    t = validate.check_tensor(t, name)
    if t.dim() >= 1 and t.stride(-1) != 1 and t.shape[-1] != 1:
        return t.contiguous()
    return t


def _checked_qkv(q: object, k: object, v: object, names: tuple[str, str, str] = ("q", "k", "v"),
                 bhsd: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """validate.check_qkv before any copy (a bad input never allocates), then a strided last
    dimension copied, and a copy checked again (its strides and offsets are new)."""
    validate.check_qkv(q, k, v, names=names, bhsd=bhsd, strided_last_ok=True)
    if q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:  # the common case
        return q, k, v
    qc, kc, vc = (_last_dim_contiguous(t, n) for t, n in zip((q, k, v), names, strict=True))
    if qc is not q or kc is not k or vc is not v:
        validate.check_qkv(qc, kc, vc, names=names, bhsd=bhsd)
    return qc, kc, vc


def _returned(out: torch.Tensor, lse: torch.Tensor, return_attn_probs: bool, return_lse: bool):
    """FlashAttention's return forms: (out, lse, None) with return_attn_probs (the probabilities
    are never materialised), (out, lse) with return_lse, else out."""
    if return_attn_probs:
        return out, lse, None
    if return_lse:
        return out, lse
    return out


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False, return_lse: bool = False):
    """Exact attention softmax(q kᵀ · softmax_scale) v, FlashAttention-compatible.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32.
        k, v: (batch, seqlen_k, nheads_kv, headdim), same dtype and device; nheads % nheads_kv
            == 0 (GQA / MQA: query head h uses kv head h // (nheads // nheads_kv)).
            Any strides with a contiguous last dimension (views of a packed qkv tensor work
            without a copy); a strided last dimension is copied. headdim in [1, 256].
        dropout_p: must be 0.0 (NotImplementedError otherwise).
        softmax_scale: defaults to headdim ** -0.5.
        causal: mask aligned to the bottom-right corner of the score matrix: query row i sees
            key j iff j <= i + seqlen_k - seqlen_q. Sets the right window to 0.
        window_size: (left, right), -1 meaning unbounded: row i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right.
        softcap, alibi_slopes: not implemented (must be 0.0 / None).
        deterministic: deterministic backward (also on when
            torch.are_deterministic_algorithms_enabled()).
        return_attn_probs: return (out, lse, None), as FlashAttention 2 does without dropout
            (the probabilities are never materialised).
        return_lse: return (out, lse).

    Returns:
        out (batch, seqlen_q, nheads, headdim) contiguous in q's dtype; with return_lse,
        also lse (batch, nheads, seqlen_q) float32, the natural-log log-sum-exp of the scaled
        scores of each row (not differentiable). A row that sees no key gets out 0 and lse -inf.
    """
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, return_lse)


def _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, return_lse, names=("q", "k", "v")):
    """flash_attn_func's checks and call; `names`: what its errors call q, k, v (the packed
    forms name the slices of their packed argument)."""
    validate.check_fa_unsupported(dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes)
    q, k, v = _checked_qkv(q, k, v, names=names)
    window_left, window_right = validate.fa_window(window_size, causal)
    scale = validate.softmax_scale(softmax_scale, q.shape[-1])
    deterministic = validate.check_flag(deterministic, "deterministic")
    return_attn_probs = validate.check_flag(return_attn_probs, "return_attn_probs")
    return_lse = validate.check_flag(return_lse, "return_lse")
    out, lse = attention(q, k, v, scale, window_left, window_right, deterministic)
    return _returned(out, lse, return_attn_probs, return_lse)


def _unpacked(t: object, name: str, parts: int, layout: str) -> tuple[torch.Tensor, ...]:
    """The `parts` views of a packed tensor along its third-last dimension (no copy: autograd
    sums their gradients back into it), after checking it is a tensor of that layout."""
    t = validate.check_tensor(t, name)
    rank = len(layout.split(","))
    if t.dim() != rank or t.shape[-3] != parts:
        raise ValueError(f"{name}: expected shape {layout} with {parts} at dim {rank - 3}, got "
                         f"{tuple(t.shape)}")
    return t.unbind(dim=rank - 3)


def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0,
                              softmax_scale: float | None = None, causal: bool = False,
                              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: torch.Tensor | None = None,
                              deterministic: bool = False, return_attn_probs: bool = False,
                              return_lse: bool = False):
    """flash_attn_func on q, k, v packed in one tensor, as FlashAttention's.

    Args:
        qkv: (batch, seqlen, 3, nheads, headdim): q, k, v = qkv.unbind(dim=2) (views; no copy,
            and qkv.grad receives all three gradients).
        Every other argument: as flash_attn_func.

    Returns: as flash_attn_func; out (batch, seqlen, nheads, headdim).
    """
    q, k, v = _unpacked(qkv, "qkv", 3, "(batch, seqlen, 3, nheads, headdim)")
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, return_lse,
                       names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"))


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                             softmax_scale: float | None = None, causal: bool = False,
                             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                             return_attn_probs: bool = False, return_lse: bool = False):
    """flash_attn_func with k, v packed in one tensor, as FlashAttention's.

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        kv: (batch, seqlen_k, 2, nheads_kv, headdim): k, v = kv.unbind(dim=2) (views).
        Every other argument: as flash_attn_func (GQA / MQA: nheads % nheads_kv == 0).

    Returns: as flash_attn_func.
    """
    k, v = _unpacked(kv, "kv", 2, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, return_lse,
                       names=("q", "kv[:, :, 0]", "kv[:, :, 1]"))


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: torch.Tensor | None = None,
                           return_lse: bool = False):
    """flash_attn_func on a batch of sequences of different lengths, packed without padding.

    Args:
        q: (total_q, nheads, headdim): the query tokens of every sequence, one after another.
        k, v: (total_k, nheads_kv, headdim), likewise.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 on q's device, cumulative lengths:
            sequence i is rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1 of q and rows
            cu_seqlens_k[i] .. cu_seqlens_k[i + 1] - 1 of k and v. Non-decreasing from 0 to
            total_q / total_k; a sequence may be empty.
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence.
        causal, window_size: as flash_attn_func, per sequence (causal aligned to the
            bottom-right corner of each sequence's own score matrix).
        block_table: optional (batch, max_blocks_per_seq) int tensor: k, v are then paged
            caches (num_blocks, page_size, nheads_kv, headdim) and sequence i's keys are its
            first cu_seqlens_k[i + 1] - cu_seqlens_k[i] positions, position p in block
            block_table[i, p // page_size] (cu_seqlens_k's last entry is then any total).
            The blocks a sequence reads must lie in [0, num_blocks).
        Every other argument: as flash_attn_func.

    Returns:
        out (total_q, nheads, headdim) in q's dtype; with return_lse also lse (nheads, total_q)
        float32 (FlashAttention's varlen layout); return_attn_probs gives (out, lse, None).

    This first version runs one flash_attn_func call per run of consecutive sequences of equal
    (query, key) lengths, on views of q, k, v as a batch (no input is copied; forward and
    backward are exact, every kernel family applies): sequences of one length cost one call,
    but each run costs a call's host time, so it suits a few long sequences, or many of a
    length, better than many short ones of different lengths. It reads cu_seqlens on the host
    (one device-to-host copy, which waits for the GPU), so it is neither traceable by
    torch.compile(fullgraph=True) nor capturable in a CUDA graph. Paged (block_table), every
    sequence's keys are first gathered from the pages into one packed copy (one indexed read,
    differentiable into the caches; correct, not fast: the kernels read no block table).
    """
    validate.check_fa_unsupported(dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes)
    q = validate.check_varlen_rank(q, "q", "q")
    paged = block_table is not None
    if paged:
        k, v = (_paged_cache(t, n) for t, n in ((k, "k"), (v, "v")))
        validate.check_shape_dtype_device(v, "v", shape=k.shape)
        # the checks below see a key of the caches' kind where the gathered copy will stand
        kq, vq = (t.new_empty((1, *t.shape[2:])) for t in (k, v))
    else:
        kq = k = validate.check_varlen_rank(k, "k", "kv")
        vq = v = validate.check_varlen_rank(v, "v", "kv")
    q4, k4, v4 = _checked_qkv(q.unsqueeze(0), kq.unsqueeze(0), vq.unsqueeze(0))
    q = q4[0]
    if not paged:
        k, v = k4[0], v4[0]
    cu_q = validate.cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total=q.shape[0],
                               total_name="q.shape[0]", device=q.device,
                               max_seqlen=max_seqlen_q, max_name="max_seqlen_q")
    cu_k = validate.cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total=None if paged else k.shape[0],
                               total_name="k.shape[0]", device=q.device,
                               max_seqlen=max_seqlen_k, max_name="max_seqlen_k",
                               batch=len(cu_q) - 1)
    if paged:  # packed like unpaged keys: cu_seqlens_k's offsets index the copy
        k, v = _gathered(k, v, block_table, cu_k, q.device)
    window_left, window_right = validate.fa_window(window_size, causal)
    scale = validate.softmax_scale(softmax_scale, q.shape[-1])
    deterministic = validate.check_flag(deterministic, "deterministic")
    return_attn_probs = validate.check_flag(return_attn_probs, "return_attn_probs")
    return_lse = validate.check_flag(return_lse, "return_lse")
    outs, lses = [q[:0]], [torch.empty((q.shape[1], 0), dtype=torch.float32, device=q.device)]
    i = 0
    while i < len(cu_q) - 1:  # runs [i, j) of consecutive sequences of equal lengths
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        j = i + 1
        while j < len(cu_q) - 1 and (cu_q[j + 1] - cu_q[j], cu_k[j + 1] - cu_k[j]) == (lq, lk):
            j += 1
        qi = q[cu_q[i]:cu_q[j]].unflatten(0, (j - i, lq))  # (sequences, lq, H, D): a view
        ki, vi = (t[cu_k[i]:cu_k[j]].unflatten(0, (j - i, lk)) for t in (k, v))
        out_i, lse_i = attention(qi, ki, vi, scale, window_left, window_right, deterministic)
        outs.append(out_i.flatten(0, 1))
        lses.append(lse_i.transpose(0, 1).flatten(1, 2))  # (H, sequences x lq)
        i = j
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    return _returned(out, lse, return_attn_probs, return_lse)


def _paged_cache(t: object, name: str) -> torch.Tensor:
    """A paged cache given to flash_attn_varlen_func: (num_blocks, page_size, nheads_kv,
    headdim)."""
    t = validate.check_tensor(t, name)
    if t.dim() != 4:
        raise ValueError(f"{name}: expected a 4-D paged cache (num_blocks, page_size, nheads_kv, "
                         f"headdim) with block_table, got shape {tuple(t.shape)}")
    return t


def _gathered(k: torch.Tensor, v: torch.Tensor, block_table: object, cu_k: list[int],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's keys and values read from the pages of its block_table row into one
    packed (total_k, nheads_kv, headdim) copy each, after the table is checked."""
    lengths = [b - a for a, b in zip(cu_k, cu_k[1:], strict=False)]
    pages = validate.page_table(block_table, len(lengths), device)
    page_size, num_blocks = k.shape[1], k.shape[0]
    if lengths and max(lengths) > pages.shape[1] * page_size:
        raise ValueError(f"cu_seqlens_k: expected every sequence within max_blocks_per_seq * "
                         f"page_size = {pages.shape[1] * page_size} keys, got {max(lengths)}")
    validate.pages_in_pool(pages, lengths, page_size, num_blocks)
    pos = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    blocks, offsets = pages[seq, pos // page_size], pos % page_size
    blocks, offsets = blocks.to(k.device), offsets.to(k.device)
    return k[blocks, offsets], v[blocks, offsets]


def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                     dropout_p: float = 0.0, softmax_scale: float | None = None,
                                     causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                                     softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                                     deterministic: bool = False, return_attn_probs: bool = False,
                                     return_lse: bool = False):
    """flash_attn_varlen_func on q, k, v packed in one tensor, as FlashAttention's.

    Args:
        qkv: (total, 3, nheads, headdim): q, k, v = qkv.unbind(dim=1) (views).
        cu_seqlens: (batch + 1,) int32, the sequences' bounds for q and for k / v alike;
            max_seqlen: the longest sequence.
        Every other argument: as flash_attn_varlen_func.

    Returns: as flash_attn_varlen_func; out (total, nheads, headdim).
    """
    q, k, v = _unpacked(qkv, "qkv", 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs,
                                  return_lse=return_lse)


def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                                    max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: float | None = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: torch.Tensor | None = None,
                                    deterministic: bool = False, return_attn_probs: bool = False,
                                    return_lse: bool = False):
    """flash_attn_varlen_func with k, v packed in one tensor, as FlashAttention's.

    Args:
        q: (total_q, nheads, headdim).
        kv: (total_k, 2, nheads_kv, headdim): k, v = kv.unbind(dim=1) (views).
        Every other argument: as flash_attn_varlen_func.

    Returns: as flash_attn_varlen_func.
    """
    k, v = _unpacked(kv, "kv", 2, "(total_k, 2, nheads_kv, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs,
                                  return_lse=return_lse)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, *, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention's semantics on flashcuda kernels.

    Args:
        query: (batch, nheads, seqlen_q, headdim); key, value: (batch, nheads_kv, seqlen_k,
            headdim); float16 / bfloat16 / float32, a contiguous last dimension.
        attn_mask, dropout_p: not implemented (must be None / 0.0).
        is_causal: PyTorch's causal mask, aligned to the top-left corner: query row i sees key
            j iff j <= i (unlike flash_attn_func's bottom-right alignment when seqlen_q !=
            seqlen_k).
        scale: defaults to headdim ** -0.5.
        enable_gqa: allow nheads_kv < nheads (nheads % nheads_kv == 0); otherwise the head
            counts must match, as in PyTorch.

    Returns:
        (batch, nheads, seqlen_q, headdim) in query's dtype (a transposed view of a contiguous
        (batch, seqlen_q, nheads, headdim) buffer; no input is copied). A row that sees no key
        (seqlen_k == 0) is 0.
    """
    validate.check_sdpa_unsupported(attn_mask=attn_mask, dropout_p=dropout_p)
    names = ("query", "key", "value")
    tensors = [validate.check_tensor(t, n) for t, n in zip((query, key, value), names, strict=True)]
    for t, n in zip(tensors, names, strict=True):
        if t.dim() != 4:
            raise ValueError(f"{n}: expected a 4-D tensor (batch, nheads, seqlen, headdim), got "
                             f"a {t.dim()}-D tensor of shape {tuple(t.shape)}")
    query, key, value = tensors
    if not validate.check_flag(enable_gqa, "enable_gqa") and query.shape[1] != key.shape[1]:
        raise ValueError(f"key: expected nheads_kv == nheads={query.shape[1]} (pass "
                         f"enable_gqa=True for grouped-query attention), got {key.shape[1]}")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v = _checked_qkv(q, k, v, names=names, bhsd=True)
    is_causal = validate.check_flag(is_causal, "is_causal")
    window_right = q.shape[1] - k.shape[1] if is_causal else None
    softmax_scale = validate.softmax_scale(scale, q.shape[-1], name="scale")
    out, _ = attention(q, k, v, softmax_scale, None, window_right, False)
    return out.transpose(1, 2)

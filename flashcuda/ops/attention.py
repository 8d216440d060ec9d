"""The attention custom ops: validate -> allocate -> dispatch, plus fake (meta) shapes and autograd.

    flashcuda::fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, SymInt? window_left,
                   SymInt? window_right, bool deterministic) -> (Tensor out, Tensor lse)
    flashcuda::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                   float softmax_scale, SymInt? window_left, SymInt? window_right,
                   bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)

q (B, Sq, H, D); k, v (B, Sk, Hkv, D), any strides with a unit last stride. out (B, Sq, H, D)
contiguous in q's dtype; lse (B, H, Sq) float32, natural log. Windows are in key positions
around the bottom-right aligned diagonal (mask.cuh), None = unbounded: a query row i sees key j
iff i + shift - window_left <= j <= i + shift + window_right, shift = Sk - Sq. FlashAttention's
causal is (None, 0); SDPA's top-left causal is (None, Sq - Sk), which may be negative — hence
`SymInt?` with None, not a -1 sentinel. `deterministic` is used only by the backward (it is a
forward argument so that autograd can hand it on); the backward is also deterministic whenever
torch.are_deterministic_algorithms_enabled().

lse is not differentiable: gradients flow through `out` only (as in FlashAttention).
Edge cases (no launch): batch == 0 or Sq == 0 gives empty outputs; Sk == 0 gives out 0 and
lse -inf; the backward then gives zero gradients.
"""

from __future__ import annotations

import torch

from .. import validate
from . import decode, dispatch
from .call import BwdCall, FwdCall

_NEG_INF = float("-inf")


def _empty_fwd(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, nheads, head_dim = q.shape
    # new_empty takes q's dtype and device without parsing them (the host path of every call)
    out = q.new_empty((batch, seqlen_q, nheads, head_dim))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, lse


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
              window_left: int | None, window_right: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """allocate -> dispatch; q, k, v already validated."""
    out, lse = _empty_fwd(q)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:
        out.zero_()
        lse.fill_(_NEG_INF)
        return out, lse
    dispatch.forward(FwdCall(q, k, v, out, lse, softmax_scale, window_left, window_right))
    return out, lse


@torch.library.custom_op("flashcuda::fwd", mutates_args=())
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
        window_left: int | None, window_right: int | None,
        deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    validate.check_qkv(q, k, v)
    return _fwd_impl(q, k, v, softmax_scale, window_left, window_right)


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, window_left, window_right, deterministic):
    return _empty_fwd(q)


def _bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, softmax_scale: float, window_left: int | None,
              window_right: int | None,
              deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """allocate -> dispatch; inputs already validated."""
    dq, dk, dv = _empty_bwd(q, k, v)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dout = dout.contiguous()
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    dispatch.backward(BwdCall(q, k, v, out, dout, lse, dq, dk, dv, softmax_scale, window_left,
                              window_right, deterministic))
    return dq, dk, dv


@torch.library.custom_op("flashcuda::bwd", mutates_args=())
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, softmax_scale: float, window_left: int | None,
        window_right: int | None,
        deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    validate.check_qkv(q, k, v)
    validate.check_bwd(dout, q, out, lse)
    return _bwd_impl(dout, q, k, v, out, lse, softmax_scale, window_left, window_right,
                     deterministic)


def _empty_bwd(q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, deterministic):
    return _empty_bwd(q, k, v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, softmax_scale, window_left, window_right, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.window = (window_left, window_right)
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)
    # lse's gradient is never used: without this, autograd fills a zero (B, H, Sq) tensor for it
    # on every backward (an allocation and a launch before ours, on the backward's critical path)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse, backward_fn=bwd):
    if dout is None:  # no gradient reached out (grads are not materialised): none for q, k, v
        return None, None, None, None, None, None, None
    q, k, v, out, lse = ctx.saved_tensors
    deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
    dq, dk, dv = backward_fn(dout, q, k, v, out, lse, ctx.softmax_scale, *ctx.window,
                             deterministic)
    return dq, dk, dv, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager-mode autograd with the custom ops' own bodies, context setup and backward.

    The custom-op dispatch costs ~150 us of host time per call in torch 2.11-2.13 (more than a
    short kernel takes), so eager calls go through this thin Function; torch.compile traces the
    flashcuda::fwd / flashcuda::bwd ops and their register_autograd formula instead.
    """

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, window_left, window_right, deterministic):
        out, lse = _fwd_impl(q, k, v, softmax_scale, window_left, window_right)
        _setup_context(ctx, (q, k, v, softmax_scale, window_left, window_right, deterministic),
                       (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse, backward_fn=_bwd_impl)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
              window_left: int | None = None, window_right: int | None = None,
              deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) = flashcuda::fwd, differentiable in q, k, v through out. q, k, v validated.

    Eager calls skip the custom-op wrapper and run the same bodies (directly, or through
    _EagerAttention when autograd must record the call): the wrapper costs more host time than
    a short kernel takes, and its first call imports torch._dynamo (seconds). Under
    torch.compile the op itself is traced. Eager calls without autograd that decode (one query
    row seeing all of its keys) run through ops.decode (the decode kernels where they take the
    call; else GQA packed, one entry's long keys split).
    """
    if torch.compiler.is_compiling():
        return fwd(q, k, v, softmax_scale, window_left, window_right, deterministic)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(q, k, v, softmax_scale, window_left, window_right,
                                     deterministic)
    # inference: a decoding call (one query row that sees all its keys): ops.decode
    decoded = decode.forward(q, k, v, softmax_scale, window_left, window_right, _fwd_impl)
    if decoded is not None:
        return decoded
    return _fwd_impl(q, k, v, softmax_scale, window_left, window_right)

"""What a kernel family receives: validated, allocated tensors, and the flat kernel ABI.

The op layer validates inputs (flashcuda.validate), allocates outputs, builds a FwdCall / BwdCall
and hands it to the first kernel family whose `can_implement(call)` returns None. Every family
module (fwd_simt, fwd_sm80, bwd_simt, bwd_sm80, ...) has the same three functions:

    can_implement(call) -> str | None   # None: yes; else the reason it cannot (logged by dispatch)
    run(call) -> None                   # fills call.out/call.lse (fwd) or call.dq/dk/dv (bwd)
    variants() -> list[(KernelSpec, archs)]   # every specialisation, for the CPU compile lane

Layouts: q (B, Sq, H, D); k, v (B, Sk, Hkv, D) with H % Hkv == 0; any strides with a unit last
stride. out like q (contiguous); lse (B, H, Sq) float32 contiguous, natural log.
Windows are in key positions relative to the bottom-right aligned diagonal (mask.cuh); the host
passes an unbounded side as seqlen_q + seqlen_k, so the kernels see plain integers.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

import numpy as np
import torch

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPE_NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
LOG2E = 1.4426950408889634


def layout_key(t: torch.Tensor) -> tuple:
    """What a plan cache may rely on about a tensor: dtype, shape, strides, device and the
    16-byte alignment of its address (TMA and the vector accesses care), not the address."""
    return (t.dtype, t.shape, t.stride(), t.data_ptr() % 16, t.get_device())


@dataclass(frozen=True)
class FwdCall:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    softmax_scale: float
    window_left: int | None  # None: unbounded
    window_right: int | None  # None: unbounded; causal (bottom-right) is 0; may be negative

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def seqlen_q(self) -> int:
        return self.q.shape[1]

    @property
    def seqlen_k(self) -> int:
        return self.k.shape[1]

    @property
    def nheads(self) -> int:
        return self.q.shape[2]

    @property
    def nheads_kv(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_local(self) -> bool:
        """True when some key is hidden from some row by the window (causal included)."""
        return self.window_left is not None or self.window_right is not None

    def kernel_windows(self) -> tuple[np.int32, np.int32]:
        return kernel_windows(self.seqlen_q, self.seqlen_k, self.window_left, self.window_right)

    def layouts(self) -> tuple:
        """layout_key of q, k, v, out, lse, computed once per call (dispatch and the family's
        plan both key on them)."""
        return _layouts(self, (self.q, self.k, self.v, self.out, self.lse))


def _layouts(call: object, tensors: tuple) -> tuple:
    # calls are frozen: the tensors cannot change under the memo (kept out of the fields)
    got = call.__dict__.get("_layouts")
    if got is None:
        got = call.__dict__["_layouts"] = tuple([layout_key(t) for t in tensors])
    return got


def kernel_windows(seqlen_q: int, seqlen_k: int, window_left: int | None,
                   window_right: int | None) -> tuple[np.int32, np.int32]:
    """Windows as the kernels take them: an unbounded side becomes seqlen_q + seqlen_k, and every
    value is clamped to [-(seqlen_q + seqlen_k), seqlen_q + seqlen_k] so no index sum overflows."""
    big = seqlen_q + seqlen_k

    def clamp(w: int | None) -> np.int32:
        return np.int32(big if w is None else max(-big, min(w, big)))

    return clamp(window_left), clamp(window_right)


def vector_layout_problem(name: str, t: torch.Tensor) -> str | None:
    """Why a (B, S, H, D) tensor cannot be read with 16-byte vector copies (cp.async, TMA), or
    None: unit last stride, other strides multiples of 8 elements, 16-byte aligned data."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return f"{name}: last dimension must be contiguous (stride 1), got stride {t.stride(-1)}"
    for dim in range(t.dim() - 1):
        if t.shape[dim] > 1 and t.stride(dim) % 8:
            return (f"{name}: stride of dimension {dim} must be a multiple of 8 elements "
                    f"(16 bytes), got {t.stride(dim)}")
    if t.data_ptr() % 16:
        return f"{name}: data pointer must be 16-byte aligned, got address {t.data_ptr():#x}"
    return None


def _strides(t: torch.Tensor) -> tuple[np.int64, np.int64, np.int64]:
    """(batch, row, head) strides in elements of a (B, S, H, D) tensor."""
    return np.int64(t.stride(0)), np.int64(t.stride(1)), np.int64(t.stride(2))


def fwd_kernel_args(call: FwdCall) -> tuple:
    """The flat argument list every forward kernel takes, in this order:

    q, k, v, out, lse,
    q_batch_stride, q_row_stride, q_head_stride,   (int64, elements; likewise k, v, out)
    k_..., v_..., out_...,
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim,   (int32)
    scale_log2 = softmax_scale * log2(e),                       (float32)
    window_left, window_right                                   (int32, see mask.cuh)
    """
    wl, wr = call.kernel_windows()
    return (
        call.q, call.k, call.v, call.out, call.lse,
        *_strides(call.q), *_strides(call.k), *_strides(call.v), *_strides(call.out),
        np.int32(call.batch), np.int32(call.seqlen_q), np.int32(call.seqlen_k),
        np.int32(call.nheads), np.int32(call.nheads_kv), np.int32(call.head_dim),
        np.float32(call.softmax_scale * LOG2E),
        wl, wr,
    )


@dataclass(frozen=True)
class BwdCall:
    """Gradients of out = attention(q, k, v). dq/dk/dv are allocated like q/k/v (contiguous, input
    dtype) and must be fully written by `run`. lse is the forward's (B, H, Sq) float32."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    dout: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    softmax_scale: float
    window_left: int | None
    window_right: int | None
    deterministic: bool

    def as_fwd(self) -> FwdCall:
        return FwdCall(self.q, self.k, self.v, self.out, self.lse, self.softmax_scale,
                       self.window_left, self.window_right)

    # Same shape accessors as FwdCall.
    batch = property(lambda self: self.q.shape[0])
    seqlen_q = property(lambda self: self.q.shape[1])
    seqlen_k = property(lambda self: self.k.shape[1])
    nheads = property(lambda self: self.q.shape[2])
    nheads_kv = property(lambda self: self.k.shape[2])
    head_dim = property(lambda self: self.q.shape[3])
    dtype = property(lambda self: self.q.dtype)
    device = property(lambda self: self.q.device)

    def layouts(self) -> tuple:
        """layout_key of q, k, v, out, dout, lse, dq, dk, dv, computed once per call."""
        return _layouts(self, (self.q, self.k, self.v, self.out, self.dout, self.lse, self.dq,
                               self.dk, self.dv))

    def operands(self) -> dict[str, torch.Tensor]:
        """Every tensor of the call in q's dtype, by name (lse, float32, is apart)."""
        return {"q": self.q, "k": self.k, "v": self.v, "out": self.out, "dout": self.dout,
                "dq": self.dq, "dk": self.dk, "dv": self.dv}

    def operand_problem(self) -> str | None:
        """None if every operand has q's dtype and the shape q / k imply (lse float32 of shape
        (B, H, Sq), nheads a multiple of nheads_kv), else what is wrong."""
        for name, t in self.operands().items():
            if t.dtype != self.dtype:
                return f"{name} has dtype {t.dtype}, expected {self.dtype}"
        if self.lse.dtype != torch.float32:
            return f"lse must be float32, got {self.lse.dtype}"
        b, sq, h, d = self.q.shape
        sk, hkv = self.seqlen_k, self.nheads_kv
        for name, t, shape in (("out", self.out, (b, sq, h, d)), ("dout", self.dout, (b, sq, h, d)),
                               ("dq", self.dq, (b, sq, h, d)), ("k", self.k, (b, sk, hkv, d)),
                               ("v", self.v, (b, sk, hkv, d)), ("dk", self.dk, (b, sk, hkv, d)),
                               ("dv", self.dv, (b, sk, hkv, d)), ("lse", self.lse, (b, h, sq))):
            if tuple(t.shape) != shape:
                return f"{name} has shape {tuple(t.shape)}, expected {shape}"
        if hkv == 0 or h % hkv:
            return f"nheads ({h}) must be a multiple of nheads_kv ({hkv})"
        return None


class PlanCache(dict):
    """A kernel family's plans by key (everything its can_implement and launch read), each built
    once by `build(call)` on the first call with that key; a build that raises stores nothing.
    Bounded: past `size` entries it starts over (training brings new layouts; the newest stay)."""

    def __init__(self, build, size: int = 1024) -> None:
        super().__init__()
        self.build = build
        self.size = size

    def plan(self, key: tuple, call):
        got = self.get(key)
        if got is None:
            got = self.build(call)
            if len(self) > self.size:
                self.clear()
            self[key] = got
        return got


SMEM_OPTIN = 232448  # H100 / H200: dynamic shared memory a block may opt in to (227 KB)


class StreamBuffers:
    """Scratch tensors a kernel family keeps between calls, one per (thread, key) — the key names
    the device and the stream: the calls a thread makes on a stream run in the order it launched
    them, so the next call may take the buffer as the previous one left it. (Per thread: two
    threads sharing a stream could interleave their launches.) While the stream is being captured
    into a CUDA graph, a new one per call from torch's allocator (the graph's pool): the graph's
    replays may run beside eager calls on the same stream, so they must not share one. A new
    buffer's contents are undefined."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._local = threading.local()

    def get(self, device: torch.device, key: tuple, numel: int) -> torch.Tensor:
        """A buffer of at least `numel` elements on `device` for this thread's `key`."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.empty(numel, dtype=self.dtype, device=device)
        kept = getattr(self._local, "kept", None)
        if kept is None:
            kept = self._local.kept = {}
        buf = kept.get(key)
        if buf is None or buf.numel() < numel:
            buf = kept[key] = torch.empty(numel, dtype=self.dtype, device=device)
        return buf

    def kept(self) -> list[torch.Tensor]:
        """This thread's kept buffers."""
        return list(getattr(self._local, "kept", {}).values())


def on_cuda(device: torch.device) -> bool:
    """`device` is a CUDA device (a tensor there means CUDA is usable). A family's one test of
    where its tensors are (the seam tests/cpu/simt_emu replaces to run the family's kernels on
    the host)."""
    return device.type == "cuda"


def register_pool(threads: int) -> int:
    """Registers a CTA of `threads` threads holds from launch under __launch_bounds__(threads, 1):
    the per-thread cap (65536 / threads, rounded down to 8) times threads. The sm90 kernels'
    setmaxnreg moves registers between warpgroups inside this pool; an inc that the decs cannot
    cover waits forever (FLASHCUDA_SM90_BWD_DQ=warp at 32 / 240 over 384 threads did)."""
    return (65536 // threads) // 8 * 8 * threads


def defines_suffix(defines: tuple) -> str:
    """The kernel-name suffix of A/B defines: "_fc_name<value>" each, a minus sign as "m" (the
    name is the kernel's C identifier: "FC_X=-1" would otherwise not compile)."""
    return "".join(f"_{k.lower()}{str(v).replace('-', 'm')}" for k, v in defines)


# Kernel knobs of common/sm90.cuh that were measured, lost and were removed (docs/perf-notes.md):
# refused by every sm90 family's parse_defines rather than silently compiling the default
REMOVED_SM90_DEFINES = ("FC_WAIT_HINT", "FC_PRODUCER_WAIT", "FC_PRODUCER_BACKOFF")


def parse_defines(env: str, removed: tuple[str, ...] = ()) -> tuple:
    """The (name, value) pairs of an A/B defines variable (FLASHCUDA_SM90_FWD_DEFINES,
    FLASHCUDA_SM90_BWD_DEFINES): "FC_NAME=<integer>[,...]", sorted; ValueError naming the
    variable otherwise. "+" separates too (an A/B variant list, scripts/gpu_lane.sh's
    AB_VARIANTS, already splits on commas). `removed`: knobs the kernel no longer has (an A/B
    that measured as noise or a loss, taken out of the source): refused, naming them, where the
    build would otherwise ignore them and run the default kernel under another name."""
    raw = os.environ.get(env, "").strip()
    out = []
    for item in filter(None, (x.strip() for x in re.split(r"[,+]", raw))):
        name, _, value = item.partition("=")
        if not re.fullmatch(r"FC_[A-Z0-9_]+", name) or not re.fullmatch(r"-?\d+", value):
            raise ValueError(f"{env}: expected FC_NAME=<integer>[,...], got {raw!r}")
        if name in removed:
            raise ValueError(f"{env}: {name} is no longer a knob of this kernel (removed after it "
                             f"measured as noise or a loss; docs/perf-notes.md has the numbers)")
        out.append((name, int(value)))
    return tuple(sorted(out))

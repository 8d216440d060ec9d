"""The boundary cases of tests/gpu/test_sanitize.py and everything needed to run one of them,
device-agnostic so that tests/cpu/test_boundary_cases.py can prove the plumbing without a GPU.

A case goes through the packaged API (`flashcuda.flash_attn_func`, then autograd's backward)
with the kernel family forced by FLASHCUDA_FORCE_KERNEL, on NaN-prefilled outputs (the op layer's
`_empty_fwd` / `_empty_bwd` are replaced by NaN-filling ones, so an element a kernel never writes
stays NaN and fails the oracle check), and checks against the float64 oracle
(`flashcuda.reference.attention_ref`) with the project's rule (DESIGN.md §7):

    forward   max|ours - ref64| <= 2 x max|torch_same_dtype - ref64| + FA3 rounding floor
              (+ 1e-5 x (1 + max|ref64|): fp32, whose same-dtype error is a few ulps)
    lse       max|ours - ref64| <= 2 x max|torch_same_dtype - ref64| + 1e-4 (+ the same 1e-5)
    gradients max|ours - ref64| <= 3 x max|torch_same_dtype - ref64| + rounding floor + floor,
              floor 1e-5 + 1e-3 x max|ref64| for fp16/bf16 (tests/gpu/test_bwd_sm80.py),
              1e-5 x (1 + max|ref64|) for fp32 (tests/gpu/test_simt.py)

and rows that see no key must be exactly 0 (lse -inf). The oracle runs on the inputs' device; for
seqlen_q > ORACLE_ROWS it is computed in row chunks over the keys those rows can see (65537 x
65537 scores in float64 would be 34 GB), which equals the whole-matrix oracle (CPU-tested).

Layouts (`Case.layout`):
    contig      torch.randn tensors
    offset      q, k, v are views at 16-byte-aligned, non-zero offsets of one NaN-filled buffer,
                NaN guard elements (16 bytes) around each: an overrun reads NaN
    misaligned  as offset, one element further: not 16-byte aligned (sm80 / sm90 refuse; simt runs)
    packed      q, k, v are views of one (B, S, H + 2 Hkv, D) buffer (FlashAttention's packed
                GQA qkv): strided rows, non-zero storage offsets of k and v
    bhsd        (B, H, S, D) buffers seen as (B, S, H, D): strided rows and heads
    oddstride   views of (B, S, H, D + 3) NaN-filled buffers: row and head strides not multiples
                of 8 elements (sm80 / sm90 refuse; simt runs), NaN in the 3 columns past D
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from flashcuda import flash_attn_func, validate
from flashcuda.ops import attention as attention_ops
from flashcuda.ops import decode, dispatch
from flashcuda.reference import attention_ref, max_error, rounding_floor

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPE_NAME = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}
NAN = float("nan")
ORACLE_ROWS = 4096  # query rows per oracle chunk
ALIGNED = ("contig", "offset", "packed", "bhsd")
LAYOUTS = (*ALIGNED, "misaligned", "oddstride")

# family -> (forward family, backward family) forced through FLASHCUDA_FORCE_KERNEL. The sm90
# family's deterministic backward is bwd_sm80's (bwd_sm90 reduces dQ with atomics). "auto"
# forces nothing.
FAMILIES = {
    "sm80": ("fwd_sm80", "bwd_sm80"),
    "sm90": ("fwd_sm90", "bwd_sm90"),
    "simt": ("fwd_simt", "bwd_simt"),
    "auto": (None, None),
}
SM90_ENV = "FLASHCUDA_ENABLE_SM90"
SM90_WIDE_BWD = "bwd_sm90_wide"  # the sm90 family's backward at head dims 192 and 256


@dataclass(frozen=True)
class Case:
    b: int
    sq: int
    sk: int
    h: int
    hkv: int
    d: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)  # FlashAttention's window_size
    layout: str = "contig"
    bwd: bool = True  # also run (and check) the backward
    det: bool = False  # deterministic backward
    dtype: torch.dtype | None = None  # None: the family's rotation (see cases())

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "packed" and self.sq != self.sk:
            raise ValueError("packed layout needs seqlen_q == seqlen_k")

    @property
    def mask(self) -> str:
        left, right = self.window
        if self.causal:
            return "causal" if left < 0 else f"causal_w{left}"
        if self.window == (-1, -1):
            return "full"
        return f"w{left}_{right}"

    @property
    def kernel_window(self) -> tuple[int | None, int | None]:
        return validate.fa_window(self.window, self.causal)

    @property
    def launches(self) -> bool:
        """Whether the API dispatches at all (batch, seqlen_q or seqlen_k 0: no launch)."""
        return self.b > 0 and self.sq > 0 and self.sk > 0

    @property
    def id(self) -> str:
        dt = DTYPE_NAME[self.dtype] if self.dtype is not None else "any"
        tail = ("-bwd" + ("-det" if self.det else "")) if self.bwd else ""
        return (f"{dt}-b{self.b}-q{self.sq}-k{self.sk}-h{self.h}_{self.hkv}-d{self.d}-{self.mask}"
                f"-{self.layout}{tail}")


def C(b, sq, sk, h, hkv, d, *, causal=False, window=(-1, -1), layout="contig", bwd=True,
      det=False, dtype=None) -> Case:
    return Case(b, sq, sk, h, hkv, d, causal, window, layout, bwd, det, dtype)


# The boundary list (issue 8): seqlens 1, 2, the tiles' edges (sm80 / sm90: 64 and 128, so 63,
# 65, 127, 129; simt: 32 (16 at d256), so 31, 33, 17), primes 17, 143, 1021; Sq != Sk both ways;
# full, causal (rows that see nothing when Sq > Sk), sliding windows (one-sided, two-sided, the
# diagonal alone); MHA, GQA, MQA; head dims 64 and 128 with 32, 40 (padded), 96, 192, 256; batch 0,
# seqlen_q 0 and seqlen_k 0 (the API launches nothing); every layout.
BASE = [
    C(1, 1, 1, 1, 1, 64),
    C(2, 2, 2, 2, 1, 128, causal=True, det=True),
    C(1, 1, 129, 4, 2, 64, layout="offset"),  # one decoding row, GQA
    C(1, 129, 1, 2, 2, 128, causal=True),  # Sq > Sk: rows 0..127 see no key
    C(2, 17, 17, 4, 1, 64, window=(8, 0), layout="packed"),  # MQA, sliding window
    C(1, 63, 63, 2, 2, 128, causal=True, layout="packed", det=True),
    C(1, 65, 65, 4, 2, 64, layout="bhsd"),
    C(1, 63, 65, 2, 1, 128, window=(16, 16), layout="offset"),
    C(1, 65, 63, 2, 2, 64, causal=True, det=True),
    C(1, 127, 129, 4, 2, 128, causal=True),
    C(1, 129, 127, 2, 2, 64, layout="offset"),
    C(1, 127, 127, 2, 1, 64, window=(0, 0), layout="bhsd"),  # the diagonal alone
    C(1, 129, 129, 2, 2, 128, window=(64, -1), layout="packed"),
    C(2, 2, 143, 2, 2, 64, causal=True),
    C(1, 143, 2, 4, 1, 128, layout="offset"),
    C(1, 143, 1021, 2, 1, 64, causal=True, layout="offset", det=True),
    C(1, 1021, 143, 2, 2, 128, causal=True),  # rows 0..877 see no key
    C(1, 1021, 1021, 2, 1, 64, window=(100, 0), layout="bhsd"),
    C(1, 1021, 1021, 2, 2, 128, layout="packed"),
    C(1, 31, 33, 2, 1, 64, causal=True),  # simt tile edges
    C(1, 33, 31, 2, 2, 32),  # head dim 32
    C(1, 65, 65, 2, 2, 40, causal=True),  # padded head dim
    C(1, 129, 63, 2, 2, 96, window=(32, 8), det=True),  # head dim 96
    C(1, 127, 17, 2, 1, 256, causal=True),  # head dim 256 (simt tile 16: 17 = 16 + 1)
    C(1, 129, 97, 2, 1, 192, window=(40, 8)),  # head dim 192 (sm90 backward: 96 keys + 1)
    C(0, 17, 17, 2, 2, 64),  # batch 0
    C(2, 0, 17, 2, 1, 64, causal=True),  # seqlen_q 0
    C(2, 17, 0, 2, 1, 64),  # seqlen_k 0: out 0, lse -inf, zero gradients
]

# Layouts no vector-copy family can read: dispatch must fall back to simt (fp16/bf16).
FALLBACK = [
    C(1, 65, 129, 2, 1, 64, causal=True, layout="misaligned", dtype=BF16),
    C(2, 17, 17, 2, 2, 128, layout="oddstride", dtype=FP16),
    C(1, 129, 129, 4, 2, 64, window=(32, 0), layout="misaligned", dtype=FP16, det=True),
]

# simt extras: its fp16/bf16 path (the fallback's kernels) on aligned layouts, and fp32 fallbacks.
SIMT_EXTRA = [
    C(2, 17, 17, 4, 1, 64, window=(8, 0), layout="packed", dtype=BF16),
    C(1, 127, 129, 4, 2, 128, causal=True, dtype=FP16),
    C(1, 63, 65, 2, 1, 64, layout="misaligned", dtype=FP32),
    C(1, 65, 33, 2, 2, 128, causal=True, layout="oddstride", dtype=FP32),
]

# seqlen 65537: one head, batch 1, forward only; cheap because the work per CTA stays small.
BIG = [
    C(1, 65537, 65537, 1, 1, 64, window=(64, 0), bwd=False),  # a sliding band: ~2 tiles per CTA
    C(1, 1, 65537, 1, 1, 128, bwd=False),  # one row over every key tile
    C(1, 65537, 129, 1, 1, 64, bwd=False),  # 513 query blocks (sm80 / sm90), 2049 (simt)
]


def supports(family: str, case: Case, dtype: torch.dtype) -> tuple[bool, bool]:
    """(forward, backward): whether the forced family can run the case (mirrors can_implement,
    apart from the device checks; tests/cpu/test_boundary_cases.py proves the two agree)."""
    half = dtype in (FP16, BF16)
    aligned = case.layout in ALIGNED
    if family == "sm80":
        ok = half and aligned and case.d % 8 == 0
        return ok and case.d <= 256, ok and case.d <= 128
    if family == "sm90":  # (forward at d192 / d256 since session 26, backward since session 27:
        # bwd_sm90 at d64 / d128, bwd_sm90_wide at d192 / d256)
        ok = half and aligned and case.d in (64, 128, 192, 256)
        return ok, ok and not case.det
    if family in ("simt", "auto"):
        return case.d <= 256, case.d <= 256
    raise ValueError(f"family: expected one of {tuple(FAMILIES)}, got {family!r}")


def expected(family: str, case: Case) -> tuple[str | None, str | None]:
    """The families dispatch must report for (forward, backward); None: no dispatch."""
    fwd, bwd = FAMILIES[family]
    if family == "auto":  # only fallback layouts run under "auto": simt is all that can
        fwd, bwd = "fwd_simt", "bwd_simt"
    if not case.launches:
        return None, None
    if family == "sm90" and case.d in (192, 256):
        bwd = SM90_WIDE_BWD
    return fwd, (bwd if case.bwd else None)


def cases(family: str, big: bool = False) -> list[Case]:
    """The concrete cases a family runs: dtypes fixed, backward dropped where it cannot run.
    sm80 alternates bf16 / fp16, sm90 the other way round, simt is fp32 (+ SIMT_EXTRA)."""
    out: list[Case] = []
    if family == "auto":
        return [] if big else list(FALLBACK)
    source = BIG if big else BASE + (SIMT_EXTRA if family == "simt" else [])
    for i, case in enumerate(source):
        dtype = case.dtype
        if dtype is None:
            dtype = {"sm80": (BF16, FP16), "sm90": (FP16, BF16), "simt": (FP32, FP32)}[family][i % 2]
        fwd_ok, bwd_ok = supports(family, case, dtype)
        if case.launches and not fwd_ok:
            continue
        bwd = case.bwd and (bwd_ok or not case.launches)
        out.append(dataclasses.replace(case, dtype=dtype, bwd=bwd))
    return out


# ---- inputs ------------------------------------------------------------------------------------

def _randn(shape, dtype, device, g) -> torch.Tensor:
    """Drawn on the CPU (`g` is a CPU generator) and copied over: a host-to-device copy marks the
    memory initialised for compute-sanitizer's initcheck even when it instruments only
    flashcuda's kernels (memory a torch kernel wrote is then unknown to it)."""
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _to_device(views: tuple[torch.Tensor, ...], device) -> tuple[torch.Tensor, ...]:
    """The same views (sizes, strides, offsets) over device copies of their CPU storages, one
    copy per storage (so q, k, v packed into one buffer stay packed), copied host-to-device."""
    if torch.device(device).type == "cpu":
        return views
    moved: dict[int, torch.Tensor] = {}
    out = []
    for t in views:
        storage = t.untyped_storage()
        if storage.data_ptr() not in moved:
            flat = torch.empty(0, dtype=t.dtype).set_(storage, 0,
                                                       (storage.nbytes() // t.element_size(),))
            moved[storage.data_ptr()] = flat.to(device)
        out.append(moved[storage.data_ptr()].as_strided(t.size(), t.stride(), t.storage_offset()))
    return tuple(out)


def make_inputs(case: Case, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Sq, H, D), k, v (B, Sk, Hkv, D) in the case's layout, seeded; built on the CPU and
    copied to `device` (see _randn)."""
    return _to_device(_make_inputs_cpu(case, seed), device)


def _make_inputs_cpu(case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, sq, sk, h, hkv, d, dtype = case.b, case.sq, case.sk, case.h, case.hkv, case.d, case.dtype
    device = "cpu"
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d)]
    if case.layout == "contig":
        return tuple(_randn(s, dtype, device, g) for s in shapes)
    if case.layout in ("offset", "misaligned"):
        gap = max(1, 16 // torch.empty((), dtype=dtype).element_size())  # 16 bytes of NaN
        skew = 1 if case.layout == "misaligned" else 0
        starts, pos = [], 0
        for s in shapes:
            pos += gap
            starts.append(pos + skew)
            pos = -(-(pos + skew + math.prod(s)) // gap) * gap
        buf = torch.full((pos + gap,), NAN, dtype=dtype, device=device)
        views = []
        for s, start in zip(shapes, starts, strict=True):
            t = buf[start:start + math.prod(s)].view(s)
            t.copy_(_randn(s, dtype, device, g))
            views.append(t)
        return tuple(views)
    if case.layout == "packed":
        buf = _randn((b, sq, h + 2 * hkv, d), dtype, device, g)
        return buf[:, :, :h], buf[:, :, h:h + hkv], buf[:, :, h + hkv:]
    if case.layout == "bhsd":
        return tuple(_randn((s[0], s[2], s[1], s[3]), dtype, device, g).transpose(1, 2)
                     for s in shapes)
    if case.layout == "oddstride":
        views = []
        for s in shapes:
            t = torch.full((*s[:3], s[3] + 3), NAN, dtype=dtype, device=device)[..., :s[3]]
            t.copy_(_randn(s, dtype, device, g))
            views.append(t)
        return tuple(views)
    raise AssertionError(case.layout)


# ---- the oracle and the tolerance rule ---------------------------------------------------------

# cpu: the oracle runs on the host (then the result is copied back). For sanitizer runs: under
# racecheck the oracle's own torch kernel on the banded 65537 x 65537 case died with "Internal
# Sanitizer Error: failed to handle a hardware exception" (session 7, with CUDA_LAUNCH_BLOCKING=1:
# the launch at attention_ref's masked_fill / amax, after flashcuda's kernel had finished).
ORACLE_DEVICE_ENV = "FLASHCUDA_TEST_ORACLE_DEVICE"


def reference(q, k, v, causal=False, window_size=(-1, -1), upcast=True, rows=ORACLE_ROWS,
              scale=None):
    """attention_ref, in chunks of `rows` query rows when seqlen_q > rows: each chunk sees only
    the keys its rows can see, with the window moved to the chunk's own bottom-right diagonal.
    On the host when FLASHCUDA_TEST_ORACLE_DEVICE=cpu."""
    where = os.environ.get(ORACLE_DEVICE_ENV, "").strip()
    if where not in ("", "cpu"):
        raise ValueError(f"{ORACLE_DEVICE_ENV}: expected cpu or unset, got {where!r}")
    if where == "cpu" and q.device.type != "cpu":
        out, lse = _reference(q.cpu(), k.cpu(), v.cpu(), causal, window_size, upcast, rows, scale)
        return out.to(q.device), lse.to(q.device)
    return _reference(q, k, v, causal, window_size, upcast, rows, scale)


def _reference(q, k, v, causal, window_size, upcast, rows, scale):
    wl, wr = validate.fa_window(window_size, causal)
    sq, sk = q.shape[1], k.shape[1]
    if sq <= rows:
        return attention_ref(q, k, v, scale, upcast=upcast, window=(wl, wr))
    shift = sk - sq
    outs, lses = [], []
    for r0 in range(0, sq, rows):
        r1 = min(r0 + rows, sq)
        # Row i sees key j iff i + shift - wl <= j <= i + shift + wr.
        c0 = 0 if wl is None else min(max(r0 + shift - wl, 0), sk)
        c1 = sk if wr is None else min(max(r1 + shift + wr, 0), sk)
        c1 = max(c0, c1)
        # In chunk coordinates (i' = i - r0, j' = j - c0, shift' = (c1 - c0) - (r1 - r0)) the
        # same rule reads i' + shift' - (wl - e) <= j' <= i' + shift' + (wr + e):
        e = r0 - c0 + shift - ((c1 - c0) - (r1 - r0))
        sub = (None if wl is None else wl - e, None if wr is None else wr + e)
        o, lse = attention_ref(q[:, r0:r1], k[:, c0:c1], v[:, c0:c1], scale, upcast=upcast,
                               window=sub)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)



def _amax(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return finite.abs().max().item() if finite.numel() else 0.0


def check_forward(out, lse, q, k, v, causal=False, window_size=(-1, -1)):
    """The forward rule (module docstring); returns (error, bound) of out."""
    ref, ref_lse = reference(q, k, v, causal, window_size)
    base, base_lse = reference(q, k, v, causal, window_size, upcast=False)
    assert not out.isnan().any(), "out has NaN: an element was not written (or is poisoned)"
    assert not lse.isnan().any(), "lse has NaN: an element was not written (or is poisoned)"
    err, berr = max_error(out, ref), max_error(base, ref)
    bound = 2 * berr + rounding_floor(ref, q.dtype) + 1e-5 * (1 + _amax(ref))
    assert err <= bound, f"out: error {err:.3e} > bound {bound:.3e} (torch {q.dtype}: {berr:.3e})"
    dead = torch.isneginf(ref_lse)  # (B, H, Sq): rows that see no key
    assert torch.equal(torch.isneginf(lse), dead), "lse: the -inf rows differ from the oracle's"
    assert (out.permute(0, 2, 1, 3)[dead] == 0).all(), "a row that sees no key is not exactly 0"
    lerr, lberr = max_error(lse, ref_lse), max_error(base_lse, ref_lse)
    lbound = 2 * lberr + 1e-4 + 1e-5 * (1 + _amax(ref_lse))
    assert lerr <= lbound, f"lse: error {lerr:.3e} > bound {lbound:.3e} (torch: {lberr:.3e})"
    return err, bound


def oracle_grads(q, k, v, dout, causal=False, window_size=(-1, -1)):
    """(float64 gradients, same-dtype torch gradients) of out = attention(q, k, v)."""
    def grads(upcast: bool) -> list[torch.Tensor]:
        leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_()
                  for t in (q, k, v)]
        out, _ = reference(*leaves, causal, window_size, upcast=upcast)
        if not out.requires_grad:  # seqlen_k == 0: the oracle's out is a constant 0
            return [torch.zeros_like(t) for t in leaves]
        got = torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, got, strict=True)]

    return grads(True), grads(False)


def grad_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    if dtype == FP32:
        return 1e-5 * (1 + _amax(ref))
    return rounding_floor(ref, dtype) + 1e-5 + 1e-3 * _amax(ref)


def check_grads(grads, ref, base, dtype):
    """The gradient rule (module docstring)."""
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref, base, strict=True):
        assert g.shape == r.shape and g.dtype == dtype, f"{name}: {g.shape} {g.dtype}"
        assert not g.isnan().any(), f"{name} has NaN: an element was not written (or is poisoned)"
        err, berr = max_error(g, r), max_error(b, r)
        bound = 3 * berr + grad_floor(r, dtype)
        assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (torch: {berr:.3e})"


# ---- running a case through the API ------------------------------------------------------------

def _nan_empty_fwd(q):
    b, sq, h, d = q.shape
    return (torch.full((b, sq, h, d), NAN, dtype=q.dtype, device=q.device),
            torch.full((b, h, sq), NAN, dtype=torch.float32, device=q.device))


def _nan_empty_bwd(q, k, v):
    return tuple(torch.full(t.shape, NAN, dtype=t.dtype, device=t.device) for t in (q, k, v))


def prepare(monkeypatch, family: str) -> list[tuple[str, str]]:
    """Force `family` (environment + dispatch caches), NaN-prefill the API's outputs, and return
    the list that will record (direction, family) of every dispatch."""
    fwd, bwd = FAMILIES[family]
    if fwd is None:
        monkeypatch.delenv(dispatch.FORCE_ENV, raising=False)
        monkeypatch.delenv(SM90_ENV, raising=False)
    else:
        # (the sm90 family's backward at d192 / d256 is bwd_sm90_wide's: SM90_WIDE_BWD)
        wide = f",{SM90_WIDE_BWD}" if family == "sm90" else ""
        monkeypatch.setenv(dispatch.FORCE_ENV, f"{fwd},{bwd}{wide}")
        if family == "sm90":
            monkeypatch.setenv(SM90_ENV, "1")
        else:
            monkeypatch.delenv(SM90_ENV, raising=False)
    dispatch._reset()  # as tests/gpu/test_fwd_sm90.py: forget plans made under other settings
    # each case's call reaches the kernels as it is: no decoding views (GQA packing, the split
    # of one row's keys: tests/gpu/test_api.py covers them)
    monkeypatch.setattr(decode, "KERNEL", False)
    monkeypatch.setattr(decode, "PACK_GQA", False)
    monkeypatch.setattr(decode, "SPLIT_MIN_KEYS", 2 ** 62)
    monkeypatch.setattr(attention_ops, "_empty_fwd", _nan_empty_fwd)
    monkeypatch.setattr(attention_ops, "_empty_bwd", _nan_empty_bwd)
    ran: list[tuple[str, str]] = []
    real_fwd, real_bwd = dispatch.forward, dispatch.backward

    def spy_fwd(call):
        name = real_fwd(call)
        ran.append(("fwd", name))
        return name

    def spy_bwd(call):
        name = real_bwd(call)
        ran.append(("bwd", name))
        return name

    monkeypatch.setattr(dispatch, "forward", spy_fwd)
    monkeypatch.setattr(dispatch, "backward", spy_bwd)
    return ran


def run_case(case: Case, device, ran: list, expect: tuple[str | None, str | None],
             seed: int = 0) -> None:
    """Forward (and backward, if case.bwd) through the API, checked against the oracle; `ran`
    (from prepare) must show exactly the expected families."""
    q, k, v = make_inputs(case, device, seed)
    if case.bwd:
        for t in (q, k, v):
            t.requires_grad_()
    out, lse = flash_attn_func(q, k, v, causal=case.causal, window_size=case.window,
                               deterministic=case.det, return_lse=True)
    assert out.shape == q.shape and out.dtype == case.dtype and out.is_contiguous()
    assert lse.shape == (case.b, case.h, case.sq) and lse.dtype == torch.float32
    fwd_expected = [] if expect[0] is None else [("fwd", expect[0])]
    assert ran == fwd_expected, f"forward dispatched {ran}, expected {fwd_expected}"
    qd, kd, vd = (t.detach() for t in (q, k, v))
    check_forward(out.detach(), lse, qd, kd, vd, case.causal, case.window)
    if not case.bwd:
        return
    g = torch.Generator().manual_seed(seed + 1)
    dout = _randn(out.shape, case.dtype, device, g)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    bwd_expected = fwd_expected + ([] if expect[1] is None else [("bwd", expect[1])])
    assert ran == bwd_expected, f"dispatched {ran}, expected {bwd_expected}"
    ref, base = oracle_grads(qd, kd, vd, dout, case.causal, case.window)
    check_grads(grads, ref, base, case.dtype)
    if not case.launches:
        for name, g_ in zip(("dq", "dk", "dv"), grads, strict=True):
            assert (g_ == 0).all(), f"{name}: an empty problem must give zero gradients"


# ---- kernels the cases launch, compiled up front -----------------------------------------------

def specs_for(family: str, case: Case, device_index: int) -> list:
    """The KernelSpecs running `case` under `family` launches (CUDA only: sm80 tiles depend on
    the device's shared memory)."""
    from flashcuda.ops import bwd_simt, bwd_sm80, fwd_simt, fwd_sm80, fwd_sm90

    fwd, bwd = expected(family, case)
    dtype, d = case.dtype, case.d
    specs = []
    if fwd == "fwd_sm80":
        _, per_block, per_sm = fwd_sm80._device_info(device_index)
        specs.append(fwd_sm80.select_config(dtype, d, per_block, per_sm).spec())
    elif fwd == "fwd_sm90":
        specs.append(fwd_sm90.select_config(dtype, d).spec())
    elif fwd == "fwd_simt":
        specs.append(fwd_simt.config_for(dtype, d).spec())
    if bwd == "bwd_sm80":
        cfg = bwd_sm80.config_for(dtype, d)
        specs += [cfg.pre_spec(), cfg.main_spec(not case.det),
                  cfg.dq_spec() if case.det else cfg.convert_spec()]
    elif bwd == "bwd_simt":
        cfg = bwd_simt.config_for(dtype, d)
        specs += [cfg.dot_do_o_spec(), cfg.dkdv_spec()] + ([cfg.dq_spec()] if case.det else [])
    return specs


def prebuild(specs, arch: str) -> int:
    """Compile the specs the disk cache lacks, in parallel spawned processes (an NVRTC compile
    holds the GIL; a flash kernel takes ~7 s). Returns how many were compiled. The cache check
    runs in this process, so a warm cache spawns nothing (which matters under compute-sanitizer,
    which follows child processes)."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from flashcuda.jit import build_cubin, disk_cache
    from flashcuda.jit.compiler import COMPILE_OPTIONS
    from flashcuda.jit.runtime import tool_versions

    versions = tool_versions()
    missing = sorted({s for s in specs
                      if disk_cache().load(f"{s.name}.{arch}",
                                           s.key(arch, COMPILE_OPTIONS, versions)) is None},
                     key=lambda s: s.name)
    if not missing:
        return 0
    workers = max(1, min(len(missing), os.cpu_count() or 2))
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        for future in [pool.submit(build_cubin, s, arch) for s in missing]:
            future.result()
    return len(missing)

"""SIMT flash forward / backward and the OnlineSoftmax struct, on the GPU, against float64.

Kernels are called directly (fwd_simt.run / bwd_simt.run) with NaN-prefilled outputs. The oracle
is masked softmax attention in float64 (torch on the GPU), gradients by autograd on it.

Tolerance (FlashAttention's rule, DESIGN.md §7): max |ours - fp64| <= 2 x max |torch - fp64| for
the output and 3 x for gradients, where "torch" is the same math done by PyTorch in the input
dtype, plus a floor of 1e-5 x (1 + max |fp64|). The floor matters only for fp32, where both
errors are a few ulps and their ratio is luck: our scores are sequential fp32 dot products over up
to 256 terms (relative error ~ sqrt(256) x 6e-8 ~ 1e-6, which exp turns into the same relative
error of P) and our exp2 / lg2 are the 2-ulp approximations, while cuBLAS sums in blocks. 1e-5 is
~80 fp32 ulps of the largest value and still ~100x below the smallest logic error worth catching
(one wrongly visible or invisible key among 1023 moves the output by ~1e-3). For fp16 / bf16 the
floor is negligible next to torch's own error (~1e-3).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import warnings
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from flashcuda.jit import build_cubin, device_arch
from flashcuda.ops import bwd_simt, fwd_simt, softmax_state
from flashcuda.ops.call import BwdCall, FwdCall

pytestmark = pytest.mark.gpu
DEVICE = "cuda"  # (tests/cpu/test_simt_emulated.py runs the flash bodies on the host emulator)

NAN = float("nan")
CAUSAL = (None, 0)
FULL = (None, None)


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    window: tuple[int | None, int | None] = FULL
    packed: bool = False  # q, k, v are views of one (B, S, 3, H, D) tensor
    deterministic: bool = False
    nan_unseen_keys: bool = False  # NaN in K/V at in-range keys no query row sees

    @property
    def id(self) -> str:
        dt = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]
        wl, wr = self.window
        win = "full" if self.window == FULL else "causal" if self.window == CAUSAL else f"w{wl}_{wr}"
        extra = "".join(f"-{name}" for name in ("packed", "deterministic", "nan_unseen_keys")
                        if getattr(self, name))
        return (f"{dt}-b{self.batch}-q{self.seqlen_q}-k{self.seqlen_k}-h{self.nheads}"
                f"_{self.nheads_kv}-d{self.head_dim}-{win}{extra}")


F32, F16, B16 = torch.float32, torch.float16, torch.bfloat16
CASES = [
    # A hand-sized normal case; head dims and lengths that are not multiples of the tiles.
    Case(F32, 1, 128, 128, 2, 2, 64),
    Case(F32, 2, 17, 143, 4, 1, 40, CAUSAL),  # MQA
    Case(F32, 3, 143, 17, 4, 4, 128, CAUSAL),  # Sq > Sk: rows 0..125 see no key
    Case(F32, 1, 1023, 1023, 2, 2, 256),
    Case(F32, 2, 1, 1023, 8, 2, 128, (100, 0)),  # decoding row, GQA 4, sliding window
    Case(F32, 2, 17, 128, 2, 2, 64, (None, 17 - 128)),  # SDPA's top-left causal: negative right
    Case(F32, 1, 1, 1, 1, 1, 64),
    Case(F32, 2, 33, 0, 2, 1, 64),  # no keys at all: out 0, lse -inf, grads 0
    Case(F32, 2, 143, 143, 4, 1, 72, CAUSAL, deterministic=True),
    Case(F16, 2, 1023, 1023, 4, 1, 64, CAUSAL),
    Case(F16, 1, 128, 1023, 2, 2, 128, (64, 32)),
    Case(F16, 2, 143, 143, 3, 3, 64, packed=True),
    Case(F16, 1, 17, 1023, 2, 2, 64, (10, 0), nan_unseen_keys=True),
    Case(F16, 2, 1023, 1023, 8, 2, 128, (31, 7), deterministic=True),
    Case(B16, 3, 17, 1023, 4, 4, 256),
    Case(B16, 2, 1023, 128, 8, 2, 40, CAUSAL),  # rows 0..894 see no key
    Case(B16, 1, 143, 143, 2, 2, 128, CAUSAL, packed=True),
    Case(B16, 2, 143, 1023, 4, 1, 256, CAUSAL, deterministic=True),
] + [Case(F32, 2, 17, 33, 2, 1, d, CAUSAL) for d in (1, 2, 3, 5, 8)] + [
    Case(B16, 1, 33, 17, 2, 2, 7)]


# ------------------------------------------------------------------------------------------------
# One kernel cache for the module (the conftest default is one per test, which would compile every
# kernel once per test), filled up front by parallel NVRTC processes.

@pytest.fixture(autouse=True)
def _private_cache(module_kernel_cache):
    """Overrides conftest.py's per-test cache with the module's one."""
    yield


def _specs_used():
    specs = {softmax_state.spec()}
    for c in CASES:
        b = bwd_simt.config_for(c.dtype, c.head_dim)
        specs |= {fwd_simt.config_for(c.dtype, c.head_dim).spec(), b.dot_do_o_spec(), b.dkdv_spec()}
        if c.deterministic:
            specs.add(b.dq_spec())
    return sorted(specs, key=lambda s: s.name)


@pytest.fixture(scope="module", autouse=True)
def _prebuild(module_kernel_cache):
    """Compile every kernel the module launches, in parallel processes (a compile through
    cuda.core holds the GIL, so threads would not help), into the cache the tests then hit.
    Best effort: whatever fails here is compiled on first use, and reported there."""
    if torch.cuda.is_available():
        arch = device_arch(torch.cuda.current_device())
        specs = _specs_used()
        workers = max(1, min(len(specs), os.cpu_count() or 2))
        try:
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
                for f in [pool.submit(build_cubin, s, arch) for s in specs]:
                    f.result()
        except Exception as exc:  # best effort, see the docstring
            warnings.warn(f"parallel prebuild failed ({exc!r}); compiling on first use", stacklevel=1)
    yield


# ------------------------------------------------------------------------------------------------
# The oracle

def visible_mask(seqlen_q, seqlen_k, window, device):
    """(Sq, Sk) bool: query i sees key j iff -wl <= j - i - (Sk - Sq) <= wr (mask.cuh's rule)."""
    wl, wr = window
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    d = j - i - (seqlen_k - seqlen_q)
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if wr is not None:
        ok &= d <= wr
    if wl is not None:
        ok &= d >= -wl
    return ok


def attention_ref(q, k, v, scale, window, dtype):
    """Masked softmax attention computed in `dtype`: (out (B, Sq, H, D), lse (B, H, Sq) fp32).
    Differentiable, and NaN-free for rows that see no key (out 0, lse -inf, zero gradients)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    ok = visible_mask(q.shape[1], k.shape[1], window, q.device)
    any_key = ok.any(dim=1)[:, None]  # (Sq, 1)
    s = s.masked_fill(~ok, -math.inf).masked_fill(~any_key, 0.0)
    p = torch.softmax(s, dim=-1) * any_key
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    lse = torch.logsumexp(s, dim=-1).masked_fill(~any_key[:, 0], -math.inf)
    lse = lse if dtype == torch.float64 else lse.float()
    return out, lse


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def check_close(name, ours, ref64, torch_same, factor, rel_floor):
    """FlashAttention's rule: |ours - fp64| <= factor * |torch - fp64| + floor."""
    assert not torch.isnan(ours).any(), f"{name}: NaN in the kernel's result"
    err = max_err(ours, ref64)
    base = max_err(torch_same, ref64)
    scale = 1.0 + (ref64.abs().max().item() if ref64.numel() else 0.0)
    bound = factor * base + rel_floor * scale
    assert err <= bound, f"{name}: max err {err:.3g} > {factor} x torch's {base:.3g} + floor"


FLOOR = 1e-5  # relative to 1 + max |fp64|; see the module docstring


# ------------------------------------------------------------------------------------------------
# Inputs

def make_inputs(c: Case, device):
    """q (B, Sq, H, D); k, v (B, Sk, Hkv, D) as views of NaN-padded buffers (NaN at keys >= Sk,
    and optionally at keys no row sees), or of one packed qkv tensor."""
    g = torch.Generator(device=device).manual_seed(zlib.crc32(c.id.encode()))

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(c.dtype)

    if c.packed:
        qkv = randn(c.batch, c.seqlen_q, 3, c.nheads, c.head_dim)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q = randn(c.batch, c.seqlen_q, c.nheads, c.head_dim)
    pad = 37
    kbig = randn(c.batch, c.seqlen_k + pad, c.nheads_kv, c.head_dim)
    vbig = randn(c.batch, c.seqlen_k + pad, c.nheads_kv, c.head_dim)
    kbig[:, c.seqlen_k:] = NAN
    vbig[:, c.seqlen_k:] = NAN
    if c.nan_unseen_keys:
        unseen = ~visible_mask(c.seqlen_q, c.seqlen_k, c.window, device).any(dim=0)
        assert unseen.any()
        kbig[:, : c.seqlen_k][:, unseen] = NAN
        vbig[:, : c.seqlen_k][:, unseen] = NAN
    return q, kbig[:, : c.seqlen_k], vbig[:, : c.seqlen_k]


def clean(t, c: Case):
    """The oracle's copy of k or v: NaN at unseen keys replaced by 0 (they get zero weight)."""
    return torch.nan_to_num(t, nan=0.0) if c.nan_unseen_keys else t


def run_fwd(c: Case, q, k, v, scale):
    out = torch.full(q.shape, NAN, dtype=c.dtype, device=q.device)
    lse = torch.full((c.batch, c.nheads, c.seqlen_q), NAN, dtype=torch.float32, device=q.device)
    call = FwdCall(q, k, v, out, lse, scale, *c.window)
    assert fwd_simt.can_implement(call) is None
    fwd_simt.run(call)
    return out, lse


def run_bwd(c: Case, q, k, v, out, dout, lse, scale, deterministic):
    grads = [torch.full(t.shape, NAN, dtype=c.dtype, device=q.device) for t in (q, k, v)]
    call = BwdCall(q, k, v, out, dout, lse, *grads, softmax_scale=scale,
                   window_left=c.window[0], window_right=c.window[1], deterministic=deterministic)
    assert bwd_simt.can_implement(call) is None
    bwd_simt.run(call)
    return grads


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


# ------------------------------------------------------------------------------------------------
# Tests

@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_flash_simt_matches_fp64(c: Case):
    device = torch.device(DEVICE)
    q, k, v = make_inputs(c, device)
    scale = c.head_dim ** -0.5
    out, lse = run_fwd(c, q, k, v, scale)

    leaves64 = [t.detach().double().requires_grad_() for t in (q, clean(k, c), clean(v, c))]
    leaves = [t.detach().clone().requires_grad_() for t in (q, clean(k, c), clean(v, c))]
    out64, lse64 = attention_ref(*leaves64, scale, c.window, torch.float64)
    out_t, lse_t = attention_ref(*leaves, scale, c.window, c.dtype)

    check_close("out", out, out64, out_t, 2, FLOOR)
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be -inf exactly for rows seeing no key"
    assert (lse[~finite] == -math.inf).all()
    check_close("lse", lse[finite], lse64[finite], lse_t[finite], 2, FLOOR)
    no_key = ~finite.any(dim=(0, 1))
    assert (out[:, no_key] == 0).all(), "rows seeing no key must give out 0"

    dout = torch.randn(out.shape, device=device, dtype=torch.float32).to(c.dtype)
    dq, dk, dv = run_bwd(c, q, k, v, out, dout, lse, scale, c.deterministic)
    g64 = torch.autograd.grad(out64, leaves64, dout.double())
    g_t = torch.autograd.grad(out_t, leaves, dout)
    for name, ours, ref, same in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, g_t, strict=True):
        check_close(name, ours, ref, same, 3, FLOOR)
    if no_key.any():
        assert (dq[:, no_key] == 0).all(), "rows seeing no key must give dq 0"
    if c.nan_unseen_keys:
        unseen = ~visible_mask(c.seqlen_q, c.seqlen_k, c.window, device).any(dim=0)
        assert (dk[:, unseen] == 0).all() and (dv[:, unseen] == 0).all()

    if c.deterministic:
        for _ in range(2):
            again = run_bwd(c, q, k, v, out, dout, lse, scale, True)
            for name, first, second in zip(("dq", "dk", "dv"), (dq, dk, dv), again, strict=True):
                assert torch.equal(first, second), f"{name} differs between deterministic runs"


def test_flash_simt_empty_batch_and_queries_launch_nothing():
    device = torch.device(DEVICE)
    for b, sq in ((0, 16), (2, 0)):
        c = Case(F16, b, sq, 16, 2, 2, 64)
        q, k, v = make_inputs(c, device)
        out, lse = run_fwd(c, q, k, v, 0.125)
        assert out.numel() == 0 or sq == 0
        dq, dk, dv = run_bwd(c, q, k, v, out, torch.zeros_like(out), lse, 0.125, False)
        if b:
            assert (dk == 0).all() and (dv == 0).all()


def _online_softmax_ref(s, v):
    """float64 per-row (m, l, lse, out) of log2-domain scores s (rows, n)."""
    s, v = s.double(), v.double()
    m = s.max(dim=1).values if s.shape[1] else torch.full((s.shape[0],), -math.inf, device=s.device)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp2(s - m_safe[:, None])
    l = p.sum(dim=1)  # noqa: E741
    lse = torch.where(l > 0, (m_safe + torch.log2(l)) * math.log(2), -math.inf)
    out = torch.where(l > 0, (p * v).sum(dim=1) / l, 0.0)
    return m, l, lse, out


@pytest.mark.parametrize("n", [1, 7, 100, 1000])
@pytest.mark.parametrize("tile", [1, 16, 64])
def test_online_softmax_struct_matches_fp64(n, tile):
    device = torch.device(DEVICE)
    rows = 70
    g = torch.Generator(device=device).manual_seed(1000 * n + tile)
    s = torch.randn(rows, n, generator=g, device=device) * 8
    v = torch.randn(rows, n, generator=g, device=device)
    s[0] = -math.inf  # a row that sees nothing
    s[1, : n // 2] = -math.inf  # the first half (and so one merged state) empty
    s[2, n // 2:] = -math.inf  # the second half empty
    s[3] = s[3] - 300  # very negative scores: exp2 of the raw score would underflow
    r = softmax_state.online_softmax_rows(s, v, tile)
    m, l, lse, out = _online_softmax_ref(s, v)  # noqa: E741

    assert torch.equal(r.m.double(), m), "m is the exact max"
    for name, ours in (("out", r.out), ("merged_out", r.merged_out)):
        assert not torch.isnan(ours).any(), name
        assert torch.allclose(ours.double(), out, rtol=1e-5, atol=1e-5), name
    assert torch.allclose(r.l.double(), l, rtol=1e-5, atol=0), "l"
    for name, ours in (("lse", r.lse), ("merged_lse", r.merged_lse)):
        fin = torch.isfinite(lse)
        assert torch.equal(torch.isfinite(ours), fin), name
        assert (ours[~fin] == -math.inf).all(), name
        assert torch.allclose(ours[fin].double(), lse[fin], rtol=1e-5, atol=1e-5), name
    assert r.l[0] == 0 and r.out[0] == 0 and r.merged_out[0] == 0

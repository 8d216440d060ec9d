"""The sanitizer boundary suite's plumbing, without a GPU (tests/gpu/boundary.py,
tests/gpu/test_sanitize.py):

  * every case a forced family is given is one that family's can_implement accepts but for the
    device (on CPU tensors the only objection left is "on cpu"), and the fallback cases are
    refused by sm80 / sm90 for their layout, so the GPU run cannot fail for a wrongly chosen case;
  * the chunked oracle equals attention_ref;
  * small cases pass end to end on the portable path (NaN-prefilled outputs, the dispatch spy,
    the oracle and the tolerance rule), so the checks themselves are sound.
"""

from __future__ import annotations

import importlib
import random
import re

import pytest
import torch

from flashcuda.ops.call import BwdCall, FwdCall
from flashcuda.reference import attention_ref
from tests.gpu import boundary

DEVICE_ONLY = re.compile(r"\bon cpu\b")
FAMILIES = ("sm80", "sm90", "simt", "auto")
ALL = [(f, c) for f in FAMILIES for big in (False, True) for c in boundary.cases(f, big)]


def _calls(case: boundary.Case):
    q, k, v = boundary.make_inputs(case, "cpu")
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(case.b, case.h, case.sq)
    wl, wr = case.kernel_window
    scale = case.d ** -0.5
    fwd = FwdCall(q, k, v, out, lse, scale, wl, wr)
    grads = [torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v)]
    bwd = BwdCall(q, k, v, out, torch.empty_like(out), lse, *grads, scale, wl, wr, case.det)
    return fwd, bwd


def _reason(name: str, call) -> str | None:
    return importlib.import_module(f"flashcuda.ops.{name}").can_implement(call)


def test_ids_are_unique_and_say_the_shape():
    ids = [f"{f}-{c.id}" for f, c in ALL]
    assert len(ids) == len(set(ids))
    assert any("q65537" in i for i in ids) and any("-bwd-det" in i for i in ids)
    for family in ("sm80", "sm90", "simt"):
        mine = [c for f, c in ALL if f == family]
        lengths = {n for c in mine for n in (c.sq, c.sk)}
        assert {1, 2, 17, 63, 65, 127, 129, 143, 1021, 65537} <= lengths, family
        assert {64, 128} <= {c.d for c in mine}
        assert {"offset", "packed", "bhsd"} <= {c.layout for c in mine}
        assert any(c.bwd for c in mine) and any(c.h != c.hkv for c in mine)
        assert {"full", "causal"} <= {c.mask for c in mine} and any(c.mask[0] == "w" for c in mine)
    assert {c.dtype for f, c in ALL if f == "simt"} == {torch.float32, torch.float16,
                                                       torch.bfloat16}


@pytest.mark.parametrize("family,case", [(f, c) for f, c in ALL if c.launches],
                         ids=lambda x: x if isinstance(x, str) else x.id)
def test_forced_family_accepts_its_cases(family, case, monkeypatch):
    monkeypatch.setenv(boundary.SM90_ENV, "1")
    fwd_call, bwd_call = _calls(case)
    fwd, bwd = boundary.expected(family, case)
    reason = _reason(fwd, fwd_call)
    assert reason and DEVICE_ONLY.search(reason), f"{fwd}: {reason}"
    if bwd is not None:
        reason = _reason(bwd, bwd_call)
        assert reason and DEVICE_ONLY.search(reason), f"{bwd}: {reason}"
    if family == "auto":  # the vector-copy families refuse the layout, not the device
        for name, call in (("fwd_sm90", fwd_call), ("fwd_sm80", fwd_call),
                           ("bwd_sm90", bwd_call), ("bwd_sm80", bwd_call)):
            reason = _reason(name, call)
            assert reason and not DEVICE_ONLY.search(reason), f"{name}: {reason}"


def test_offset_layouts_are_what_they_say():
    for dtype in (torch.float16, torch.float32):
        case = boundary.C(2, 5, 7, 2, 1, 16, layout="offset", dtype=dtype)
        views = boundary.make_inputs(case, "cpu")
        base = views[0].untyped_storage().data_ptr()
        for t in views:
            assert t.storage_offset() > 0 and (t.data_ptr() - base) % 16 == 0
            assert not t.isnan().any()
        skewed = boundary.make_inputs(boundary.C(2, 5, 7, 2, 1, 16, layout="misaligned",
                                                 dtype=dtype), "cpu")
        assert all((t.data_ptr() - base) % 16 for t in skewed)
    q, k, v = boundary.make_inputs(boundary.C(1, 9, 9, 4, 2, 8, layout="packed",
                                              dtype=torch.float16), "cpu")
    assert q.stride(1) == 8 * 8 and k.storage_offset() == 4 * 8 and v.storage_offset() == 6 * 8
    q, _, _ = boundary.make_inputs(boundary.C(1, 9, 9, 4, 2, 8, layout="oddstride",
                                              dtype=torch.float16), "cpu")
    assert q.stride()[1:] == (4 * 11, 11, 1)


def test_chunked_oracle_equals_attention_ref():
    rng = random.Random(0)
    for _ in range(60):
        sq, sk = rng.randint(1, 50), rng.randint(0, 50)
        causal = rng.random() < 0.3
        window = rng.choice([(-1, -1), (0, 0), (5, -1), (-1, 3), (7, 2), (30, 0), (2, 40)])
        q = torch.randn(2, sq, 2, 8, dtype=torch.float64)
        k, v = (torch.randn(2, sk, 1, 8, dtype=torch.float64) for _ in range(2))
        rows = rng.randint(3, 12)
        out, lse = boundary.reference(q, k, v, causal, window, rows=rows)
        ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


PORTABLE = [c for c in boundary.cases("sm80") + boundary.cases("auto") + boundary.cases("simt")
            if max(c.sq, c.sk) <= 65][::2]


@pytest.mark.parametrize("case", PORTABLE, ids=lambda c: c.id)
def test_cases_pass_on_the_portable_path(case, monkeypatch):
    ran = boundary.prepare(monkeypatch, "sm80")  # CPU tensors always take the portable path
    expect = ("portable" if case.launches else None,
              "portable" if case.launches and case.bwd else None)
    boundary.run_case(case, "cpu", ran, expect)


def test_an_unwritten_element_fails_the_check(monkeypatch):
    """The NaN prefill is what catches an element the kernel never writes."""
    from flashcuda.ops import dispatch

    case = boundary.C(1, 17, 17, 2, 2, 16, dtype=torch.float32)
    ran = boundary.prepare(monkeypatch, "sm80")
    real = dispatch._run_portable

    def skip_last_row(call):
        out, lse = call.out[:, -1].clone(), call.lse[:, :, -1].clone()
        real(call)
        call.out[:, -1], call.lse[:, :, -1] = out, lse  # back to the prefill: NaN

    monkeypatch.setattr(dispatch, "_run_portable", skip_last_row)
    with pytest.raises(AssertionError, match="NaN"):
        boundary.run_case(case, "cpu", ran, ("portable", "portable"))

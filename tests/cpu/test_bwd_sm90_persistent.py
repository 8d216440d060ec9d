"""FLASHCUDA_SM90_BWD_PERSISTENT=1 (FC_PERSISTENT in flash_bwd_sm90.cu; an A/B variant, session
14, not yet run on a GPU): min(work items, SMs) CTAs walk the (key block, KV head, batch) items,
the next item's K / V loading under the previous one's dK / dV epilogue. For calls without a
mask only; the default (one CTA per item) is the kernel that was measured."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from flashcuda.ops import bwd_sm90
from flashcuda.ops.bwd_sm90 import Sm90BwdConfig

from .sm90_compile import clean_sass


def _call(wl, wr, sk=4096, hkv=4, b=3, d=128):
    return SimpleNamespace(window_left=wl, window_right=wr, seqlen_k=sk, nheads_kv=hkv, batch=b,
                           head_dim=d)


def test_persistent_only_when_asked_and_without_a_mask(monkeypatch):
    monkeypatch.delenv(bwd_sm90.PERSISTENT_ENV, raising=False)
    assert not bwd_sm90.persistent_for(_call(None, None))
    monkeypatch.setenv(bwd_sm90.PERSISTENT_ENV, "1")
    assert bwd_sm90.persistent_for(_call(None, None))
    for window in ((None, 0), (128, 0), (128, 128)):  # causal, sliding windows: the HW schedule
        assert not bwd_sm90.persistent_for(_call(*window))
    monkeypatch.setenv(bwd_sm90.PERSISTENT_ENV, "yes")
    with pytest.raises(ValueError, match=bwd_sm90.PERSISTENT_ENV):
        bwd_sm90.persistent_for(_call(None, None))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_persistent_config(head_dim):
    base = bwd_sm90.select_config(torch.bfloat16, head_dim)
    ps = dataclasses.replace(base, persistent=True)
    assert ps.name == base.name + "_ps"
    assert ps.smem_bytes == base.smem_bytes + bwd_sm90.BARRIER_BYTES  # kv_empty
    assert dict(ps.spec().defines)["FC_PERSISTENT"] == "1"
    assert "FC_PERSISTENT" not in dict(base.spec().defines)
    call = _call(None, None, d=head_dim)  # 32 key blocks x 4 KV heads x 3 batches = 384 items
    assert base.grid(call) == (32, 4, 3)
    assert ps.grid(call, 132) == (132, 1, 1)
    assert ps.grid(_call(None, None, sk=100, hkv=1, b=1, d=head_dim), 132) == (1, 1, 1)
    with pytest.raises(ValueError, match="SM count"):
        ps.grid(call)
    # the timeline keeps one record per item (not per CTA): the same buffer as one CTA per item
    timed = dataclasses.replace(base, persistent=True, timeline=True)
    assert timed.timeline_shape(call) == base.timeline_shape(call) == (3, 4, 32,
                                                                       bwd_sm90.TIMELINE_WORDS)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_persistent_timeline_builds_clean(head_dim, tmp_path):
    """The timeline variant of the persistent kernel (records per item: the producer warp walks
    the items with 24 registers per thread, the timeline pointer and marks added) builds without
    spills, and its marks take no part in the default kernel (whose build the other tests pin)."""
    base = bwd_sm90.select_config(torch.bfloat16, head_dim)
    sass = clean_sass(dataclasses.replace(base, persistent=True, timeline=True), tmp_path)
    assert "GLOBALTIMER" in sass or "globaltimer" in sass.lower()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_persistent_builds_clean(head_dim, tmp_path):
    """The persistent kernel builds without spills or serialized wgmma (as the default, with the
    longest-first tail's remap, and with the previous dQ reductions the GPU tests sweep), with
    the same wgmma count per step: the item loop wraps the step loop, it does not change it."""
    base = bwd_sm90.select_config(torch.bfloat16, head_dim)
    hgmma = lambda sass: len(re.findall(r"\bHGMMA\.", sass))  # noqa: E731
    plain = clean_sass(base, tmp_path)
    ps = clean_sass(dataclasses.replace(base, persistent=True), tmp_path)
    assert hgmma(ps) == hgmma(plain)
    assert "SYNCS" in ps  # (the mbarrier ops, kv_empty's arrive among them)
    clean_sass(dataclasses.replace(base, persistent=True, lpt_tail=8), tmp_path)
    for cfg in (Sm90BwdConfig(torch.float16, head_dim, persistent=True, dq_v4=True),
                Sm90BwdConfig(torch.bfloat16, head_dim, persistent=True, dq_bulk=True)):
        clean_sass(cfg, tmp_path)

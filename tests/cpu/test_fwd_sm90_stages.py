"""FLASHCUDA_SM90_FWD_STAGES (an A/B of the sm90 forward's K / V ring depth, session 12, not yet
run on a GPU): applies to calls without a window, keeps windowed calls at 2 stages, refuses a
depth whose shared memory would not fit (naming the variable) and a malformed value, is part of
the plan key; the three-stage d128 kernel at 128 keys builds clean."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import clean_sass


def test_stages_switch(monkeypatch):
    for env in (fwd_sm90.STAGES_ENV, fwd_sm90.TILES_ENV, fwd_sm90.DEFINES_ENV):
        monkeypatch.delenv(env, raising=False)
    assert fwd_sm90.select_config(torch.bfloat16, 128).stages == 2
    monkeypatch.setenv(fwd_sm90.TILES_ENV, "d128=bm128_bn128")
    monkeypatch.setenv(fwd_sm90.STAGES_ENV, "3")
    cfg = fwd_sm90.select_config(torch.bfloat16, 128)
    assert cfg.stages == 3 and "_s3" in cfg.name and cfg.smem_bytes <= fwd_sm90.SMEM_OPTIN
    assert dict(cfg.spec().defines)["FC_STAGES"] == "3"
    windowed = fwd_sm90.select_config(torch.bfloat16, 128, windowed=True, seqlen_q=4096)
    assert windowed.stages == 2
    cfg3 = fwd_sm90.select_config(torch.bfloat16, 128)  # d128's default tiles are 128 x 128 too
    monkeypatch.delenv(fwd_sm90.TILES_ENV)
    assert fwd_sm90.select_config(torch.bfloat16, 128) == cfg3
    monkeypatch.setenv(fwd_sm90.TILES_ENV, "d128=bm128_bn176")  # three stages need ~303 KB
    with pytest.raises(ValueError, match=fwd_sm90.STAGES_ENV):
        fwd_sm90.select_config(torch.bfloat16, 128)
    for bad in ("0", "three", "9"):
        monkeypatch.setenv(fwd_sm90.STAGES_ENV, bad)
        with pytest.raises(ValueError, match=fwd_sm90.STAGES_ENV):
            fwd_sm90.select_config(torch.bfloat16, 64)
    monkeypatch.setenv(fwd_sm90.STAGES_ENV, "2")
    call = _meta_call()
    key = fwd_sm90._plan_key(call)
    monkeypatch.setenv(fwd_sm90.STAGES_ENV, "3")
    assert fwd_sm90._plan_key(call) != key


def _meta_call():
    from flashcuda.ops.call import FwdCall

    q = torch.empty(2, 512, 4, 128, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(2, 4, 512, dtype=torch.float32, device="meta")
    return FwdCall(q, q, q, q, lse, 0.1, None, None)


def test_three_stage_d128_kernel_builds_clean(tmp_path):
    cfg = fwd_sm90._config(torch.bfloat16, 128, 128, 128)
    clean_sass(dataclasses.replace(cfg, stages=3), tmp_path)

"""FC_MV_SCANNER in flash_fwd_sm90.cu (session 16; the default since session 17,
FLASHCUDA_SM90_FWD_MV_SCANNER=0 the A/B variant without it): the masked-V kernels' scans of partly seen V tiles move from the consumer warpgroups (128
threads each, then a vote on a named barrier) to warp 1 of the producer warpgroup, which publishes
a verdict per scan behind an mbarrier. Built for the masked-V kernels only (windowed calls)."""

from __future__ import annotations

import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import FWD_DISPATCH_CASES as CASES
from .sm90_compile import clean_sass, fwd_without_and_with

WINDOWED = [c for c in CASES if c[1]]


@pytest.mark.parametrize("head_dim,windowed,seqlen", CASES)
def test_scanner_env_builds_the_variant(monkeypatch, head_dim, windowed, seqlen):
    plain, cfg = fwd_without_and_with(monkeypatch, fwd_sm90.MV_SCANNER_ENV, "0", head_dim,
                                      windowed, seqlen)
    assert not plain.mv_scanner and "FC_MV_SCANNER" not in dict(plain.spec().defines)
    if not plain.masked_v:  # without a window there is nothing to scan: the same kernel
        assert cfg == plain
        return
    # v_scanned[], the producer's requests and the verdicts: 1 + 1 + 2 8-byte slots per stage
    assert cfg.mv_scanner and cfg == fwd_sm90.scanned(plain) and "_ms" in cfg.name
    assert cfg.smem_bytes == plain.smem_bytes + 4 * 8 * plain.stages <= fwd_sm90.SMEM_OPTIN
    assert dict(cfg.spec().defines)["FC_MV_SCANNER"] == "1"
    # d128: the producer warpgroup takes 8 registers per thread from the consumers
    regs = (32, plain.consumer_regs - 8) if head_dim == 128 else (24, plain.consumer_regs)
    assert (cfg.producer_regs, cfg.consumer_regs) == regs
    assert {cfg.name, plain.name} <= {c.name for c in fwd_sm90.configs()}


def test_scanner_needs_masked_v():
    with pytest.raises(ValueError, match="mv_scanner"):
        fwd_sm90.Sm90FwdConfig(torch.bfloat16, 64, mv_scanner=True)


@pytest.mark.parametrize("head_dim,windowed,seqlen", WINDOWED)
def test_scanner_builds_clean(monkeypatch, head_dim, windowed, seqlen, tmp_path):
    """No spills (the producer warpgroup's 24 or 32 registers hold the requests' arithmetic), the
    .cu's layout agrees with the host's (a static_assert); the consumers no longer vote
    (bar.red.or is the vote), and the same TMA loads are issued."""
    plain, cfg = fwd_without_and_with(monkeypatch, fwd_sm90.MV_SCANNER_ENV, "0", head_dim,
                                      windowed, seqlen)
    sass, base = clean_sass(cfg, tmp_path), clean_sass(plain, tmp_path)
    assert re.search(r"\bBAR\.RED\.OR\b", base) and not re.search(r"\bBAR\.RED\b", sass)
    loads = lambda s: len(re.findall(r"UTMALDG", s))  # noqa: E731
    assert loads(sass) == loads(base)


def test_scanner_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(fwd_sm90.MV_SCANNER_ENV, "yes")
    with pytest.raises(ValueError, match=fwd_sm90.MV_SCANNER_ENV):
        fwd_sm90.select_config(torch.bfloat16, 64, True, 1024)

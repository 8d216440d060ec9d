"""The V scanner in flash_fwd_sm90.cu (session 16; every masked-V kernel's since session 17, and
since session 39, when its A/B switch FLASHCUDA_SM90_FWD_MV_SCANNER went, the only form): the
masked-V kernels' scans of partly seen V tiles run in warps 1 .. 3 of the producer warpgroup,
which publish a verdict per scan behind an mbarrier; the consumer warpgroups read it instead of
scanning the stage themselves and voting on a named barrier."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import FWD_DISPATCH_CASES as CASES
from .sm90_compile import clean_sass

WINDOWED = [c for c in CASES if c[1]]


@pytest.mark.parametrize("head_dim,windowed,seqlen", CASES)
def test_masked_v_kernels_carry_the_scanner(head_dim, windowed, seqlen):
    cfg = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert "FC_MV_SCANNER" not in dict(cfg.spec().defines)  # (no switch: part of masked V)
    assert cfg.masked_v == windowed and ("_ms" in cfg.name) == cfg.masked_v
    # without masked V and O's own staging tiles: the clean V tiles, and v_scanned[], the
    # producer's requests and the verdicts (1 + 1 + 2 8-byte slots per stage) with masked V only
    bare = dataclasses.replace(cfg, masked_v=False, o_tma=False)
    extra = cfg.consumers * cfg.kv_bytes + 4 * 8 * cfg.stages if cfg.masked_v else 0
    staging = 0 if cfg.masked_v or not cfg.o_tma else cfg.consumers * 64 * head_dim * 2
    assert cfg.smem_bytes == bare.smem_bytes + extra + staging <= fwd_sm90.SMEM_OPTIN
    # from d128 the producer warpgroup takes 8 registers per thread from the consumers
    default = fwd_sm90.CONSUMER_REGS[cfg.consumers]
    regs = (32, default - 8) if cfg.masked_v and head_dim >= 128 else (24, default)
    assert (cfg.producer_regs, cfg.consumer_regs) == regs


@pytest.mark.parametrize("head_dim,windowed,seqlen", WINDOWED)
def test_scanner_builds_clean(monkeypatch, head_dim, windowed, seqlen, tmp_path):
    """No spills (the producer warpgroup's 24 or 32 registers hold the requests' arithmetic), the
    .cu's layout agrees with the host's (a static_assert); the consumers never vote (bar.red.or
    was their vote), and the TMA loads are the kernel's without masked V."""
    cfg = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    monkeypatch.setenv(fwd_sm90.MASKED_V_ENV, "0")
    plain = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert cfg.masked_v and not plain.masked_v
    sass, base = clean_sass(cfg, tmp_path), clean_sass(plain, tmp_path)
    assert not re.search(r"\bBAR\.RED\b", sass)
    loads = lambda s: len(re.findall(r"UTMALDG", s))  # noqa: E731
    assert loads(sass) == loads(base)

"""FC_O_TMA in flash_fwd_sm90.cu (session 15; the default since session 17,
FLASHCUDA_SM90_FWD_O_TMA=0 the A/B variant without it): the epilogue stmatrix-es each consumer warpgroup's normalised O tile into its own
shared-memory staging tile (128B-swizzled, as Q) and one thread stores it with a TMA store,
instead of FC_O_QUAD's quad transposes and 16-byte global stores. Built into every dispatched
kernel (the masked-V ones stage in their clean V tiles)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import FWD_DISPATCH_CASES as CASES
from .sm90_compile import clean_sass, fwd_without_and_with


@pytest.mark.parametrize("head_dim,windowed,seqlen", CASES)
def test_o_tma_env_builds_the_staging(monkeypatch, head_dim, windowed, seqlen):
    plain, staged = fwd_without_and_with(monkeypatch, fwd_sm90.O_TMA_ENV, "0", head_dim,
                                         windowed, seqlen)
    assert not plain.o_tma and "FC_O_TMA" not in dict(plain.spec().defines)
    # one 64-row tile per consumer warpgroup; the masked-V kernels (causal / window) stage O in
    # their consumers' clean V tiles (touched only on the non-finite path): no bytes of their own
    tiles = 0 if plain.masked_v else plain.consumers * 64 * head_dim * 2
    assert staged == dataclasses.replace(plain, o_tma=True) and "_ot" in staged.name
    assert staged.smem_bytes == plain.smem_bytes + tiles <= fwd_sm90.SMEM_OPTIN
    assert dict(staged.spec().defines)["FC_O_TMA"] == "1"
    assert {staged.name, plain.name} <= {c.name for c in fwd_sm90.configs()}


@pytest.mark.parametrize("head_dim,windowed,seqlen", CASES)
def test_o_tma_builds_clean(monkeypatch, head_dim, windowed, seqlen, tmp_path):
    """The .cu's layout agrees with the host's (a static_assert on the byte count), no spills;
    O leaves by kHeadDim / 64 tensor stores per work tile from kHeadDim / 16 stmatrix.x4 per
    thread, and the only global stores left are lse's."""
    plain, staged = fwd_without_and_with(monkeypatch, fwd_sm90.O_TMA_ENV, "0", head_dim,
                                         windowed, seqlen)
    sass, base = clean_sass(staged, tmp_path), clean_sass(plain, tmp_path)
    assert len(re.findall(r"\bSTSM\b", sass)) == head_dim // 16
    assert len(re.findall(r"\bUTMASTG\b", sass)) == head_dim // 64
    assert len(re.findall(r"\bSTG\.E\b", sass)) == 2  # lse, rows g and g + 8
    assert "STSM" not in base and "UTMASTG" not in base
    loads = lambda s: len(re.findall(r"UTMALDG", s))  # noqa: E731
    assert loads(sass) == loads(base)


def test_o_tma_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(fwd_sm90.O_TMA_ENV, "yes")
    with pytest.raises(ValueError, match=fwd_sm90.O_TMA_ENV):
        fwd_sm90.select_config(torch.bfloat16, 64)

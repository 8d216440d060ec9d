"""FC_FIRST_HALF (flash_fwd_sm90.cu; the host's default for d64's 128-row windowed kernels since
session 19, fwd_sm90.FIRST_HALF, proven on the H200 by the forward's GPU tests under it; the
same-process A/B in perf-notes): a work tile's first key tile runs its mask and softmax over the
lower half of its keys in a warp none of whose rows sees the upper half. Here: the kernels
dispatch picks for d64 causal calls below 2k get the define and build the second (lower-half)
copy of the first tile's softmax, more static code than the same kernel without it
(FLASHCUDA_SM90_FWD_DEFINES=FC_FIRST_HALF=0, the A/B variant); d128 (measured slower) and d64's
192-row tiles (not measured with it) do not, nor the A/B variants without ping-pong or the fast
divisions (with it they serialise the wgmma or spill)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashcuda.jit import compile_spec
from flashcuda.ops import fwd_sm90

from .sm90_compile import ARCH, assert_compiled_clean, clean_sass


def _defines(cfg) -> dict:
    return dict(cfg.spec().defines)


@pytest.mark.parametrize("seqlen", [512, 1024])
def test_d64_short_causal_kernels_take_the_lower_half_path(seqlen, tmp_path):
    cfg = fwd_sm90.select_config(torch.bfloat16, 64, True, seqlen)
    assert cfg.block_m == 128 and _defines(cfg).get("FC_FIRST_HALF") == "1", cfg.name
    without = dataclasses.replace(cfg, defines=tuple(cfg.defines) + (("FC_FIRST_HALF", 0),))
    assert _defines(without)["FC_FIRST_HALF"] == "0"
    # the lower-half path is a second copy of the first tile's softmax: more static code
    assert len(clean_sass(cfg, tmp_path).splitlines()) > len(clean_sass(without, tmp_path).splitlines())


@pytest.mark.parametrize("head_dim,windowed,seqlen", [(128, True, 512), (128, True, 4096),
                                                      (64, True, 4096), (64, False, 512)])
def test_other_kernels_keep_one_softmax(head_dim, windowed, seqlen):
    cfg = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert "FC_FIRST_HALF" not in _defines(cfg), cfg.name


@pytest.mark.parametrize("env", [fwd_sm90.PINGPONG_ENV, fwd_sm90.FAST_DIV_ENV])
def test_ab_variants_off_the_default_pipeline_build_without_it(monkeypatch, env):
    """Without ping-pong or without the fast divisions, the lower-half copy makes ptxas serialise
    the wgmma or spill (session 20): those A/B variants build the single softmax and clean."""
    monkeypatch.setenv(env, "0")
    cfg = fwd_sm90.select_config(torch.bfloat16, 64, True, 1024)
    assert cfg.block_m == 128 and "FC_FIRST_HALF" not in _defines(cfg), cfg.name
    assert_compiled_clean(compile_spec(cfg.spec(), ARCH), cfg.name)

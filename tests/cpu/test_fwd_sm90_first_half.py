"""FC_FIRST_HALF (flash_fwd_sm90.cu; the host's default for d64's 128-row windowed ping-pong
kernels since session 19, fwd_sm90.FIRST_HALF, proven on the H200 by the forward's GPU tests under
it; the same-process A/B in perf-notes): a work tile's first key tile runs its mask and softmax
over the lower half of its keys in a warp none of whose rows sees the upper half. Since session 28
dispatch runs those tiles without ping-pong (fwd_sm90.NO_PINGPONG_WINDOWED), which builds without
it; the ping-pong kernels keep it (FLASHCUDA_SM90_PINGPONG=1). Here: those kernels get the define
and build the second (lower-half) copy of the first tile's softmax, more static code than the same
kernel without it (FLASHCUDA_SM90_FWD_DEFINES=FC_FIRST_HALF=0, the A/B variant); d128 (measured
slower) and d64's 192-row tiles (not measured with it) do not, nor the A/B variants without
ping-pong or the fast divisions; forced onto the no-ping-pong kernel
(FLASHCUDA_SM90_FWD_DEFINES=FC_FIRST_HALF=1, an A/B: -3.7 / -5.7% at d64 causal 512 / 1k in
session 29) it builds clean: a warpgroup barrier after its branch keeps ptxas from serialising
the wgmma."""

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
def test_d64_short_causal_kernels_take_the_lower_half_path(monkeypatch, seqlen, tmp_path):
    assert "FC_FIRST_HALF" not in _defines(fwd_sm90.select_config(torch.bfloat16, 64, True, seqlen))
    monkeypatch.setenv(fwd_sm90.PINGPONG_ENV, "1")  # the ping-pong kernel of these tiles
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


def test_forced_onto_the_no_pingpong_kernel_it_builds_clean(tmp_path):
    """The dispatched d64 causal 1k kernel (no ping-pong) with FC_FIRST_HALF=1 through the
    defines: no serialised wgmma (C7519 without the warpgroup barrier after its branch), no
    spills, and the lower-half copy in its SASS."""
    cfg = fwd_sm90.select_config(torch.bfloat16, 64, True, 1024)
    assert not cfg.pingpong and "FC_FIRST_HALF" not in _defines(cfg)
    for c in (cfg, *fwd_sm90.two_passes(cfg)):
        forced = dataclasses.replace(c, defines=tuple(c.defines) + (("FC_FIRST_HALF", 1),))
        assert _defines(forced)["FC_FIRST_HALF"] == "1"
        assert_compiled_clean(compile_spec(forced.spec(), ARCH), forced.name)
    assert (len(clean_sass(forced, tmp_path).splitlines())
            > len(clean_sass(c, tmp_path).splitlines()))

"""FC_MAX_CHAINS (flash_fwd_sm90.cu, an A/B knob through FLASHCUDA_SM90_FWD_DEFINES, written in
session 11 and not yet run on a GPU): a tile row's maximum over four independent FMNMX chains.

On the CPU lane: the variant builds clean for sm_90a at both head dims, and the longest chain of
dependent FMNMX in its SASS is shorter than the default's. Exactness needs no test beyond the
GPU lane's oracle tests: max is associative, so the result is the same value either way.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import clean_sass


def _fmnmx_depth(sass: str) -> int:
    """Longest chain of FMNMX whose source is an earlier FMNMX's destination (in program order,
    registers tracked by name: an over-estimate across register reuse, the same for both)."""
    depth, best = {}, 0
    for dst, a, b in re.findall(r"FMNMX\s+(R\d+),\s*(R\d+),\s*(R\d+)", sass):
        depth[dst] = max(depth.get(a, 0), depth.get(b, 0)) + 1
        best = max(best, depth[dst])
    return best


@pytest.mark.parametrize("head_dim", (64, 128))
def test_max_chains_builds_clean_with_shorter_chains(head_dim, tmp_path):
    base = fwd_sm90.select_config(torch.bfloat16, head_dim)
    var = dataclasses.replace(base, defines=(("FC_MAX_CHAINS", 1),))
    depth = {name: _fmnmx_depth(clean_sass(cfg, tmp_path))
             for name, cfg in (("base", base), ("chains", var))}
    assert depth["chains"] < depth["base"], depth

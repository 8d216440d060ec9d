"""FC_PRODUCER_WAIT / FC_PRODUCER_BACKOFF (common/sm90.cuh's mbar_wait_producer; A/B knobs
through FLASHCUDA_SM90_FWD_DEFINES / _BWD_DEFINES, session 25, not yet run on a GPU): the TMA
producer's waits for a free stage sleep instead of polling. On the CPU lane: the default kernels
poll (no NANOSLEEP anywhere, as before), and both forms build clean in the forward and the
backward with the sleep in the producer's waits only."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import bwd_sm90, fwd_sm90

from .sm90_compile import clean_sass


def _configs():
    fwd = fwd_sm90.select_config(torch.bfloat16, 128, False, 16384)
    bwd = bwd_sm90.select_config(torch.bfloat16, 64)
    return {"fwd": fwd, "bwd": bwd}


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_producer_wait_forms(kind, tmp_path):
    cfg = _configs()[kind]
    defines = dict(cfg.spec().defines)
    assert "FC_PRODUCER_WAIT" not in defines and "FC_PRODUCER_BACKOFF" not in defines
    plain = clean_sass(cfg, tmp_path)
    assert "NANOSLEEP" not in plain
    hinted = clean_sass(dataclasses.replace(cfg, defines=(("FC_PRODUCER_WAIT", 0x989680),)),
                        tmp_path)
    backoff = clean_sass(dataclasses.replace(cfg, defines=(("FC_PRODUCER_BACKOFF", 128),)),
                         tmp_path)
    # the suspend-time hint: a sleep on the sync unit per retry of the producer's waits only
    # (forward: q_empty, k_empty, v_empty; backward: the Q / dO stage's empty), not the
    # consumers' (FC_WAIT_HINT puts one in every wait: five or more in the backward)
    sleeps = re.findall(r"NANOSLEEP\.SYNCS 0x989680", hinted)
    assert 1 <= len(sleeps) <= (3 if kind == "fwd" else 1) * 2, len(sleeps)
    # the back-off: a plain NANOSLEEP of 128 ns between tries, in the same waits
    naps = re.findall(r"NANOSLEEP 0x80\b", backoff)
    assert 1 <= len(naps) <= (3 if kind == "fwd" else 1) * 2, len(naps)

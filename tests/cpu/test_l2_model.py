"""scripts/l2_model.py: the LRU model's two limits, computed independently of its walk."""

from __future__ import annotations

import os

import pytest

from flashcuda.ops import fwd_sm90

from .script_module import load

l2_model = load("l2_model")


@pytest.mark.parametrize("shape,pairs", [((4, 512, 8, 128, 8), 4), ((2, 1000, 8, 64, 2), 4),
                                         ((1, 700, 6, 256, 3), 2)])
def test_dram_reads_at_its_limits(shape, pairs):
    call = l2_model.meta_call(*shape)
    b, s, h, d, hkv = shape
    # an L2 holding everything: each of Q, K and V read once (K / V tiles past S padded)
    cfg = fwd_sm90.plan_config(call, 132)
    kt = fwd_sm90.key_tiles_per_block(call, cfg)
    num_m, num_n = len(kt), int(kt.max())
    once = b * h * num_m * cfg.block_m * d * 2 + 2 * b * hkv * num_n * cfg.block_n * d * 2
    assert l2_model.dram_reads(call, pairs, 1 << 40) == once
    # an L2 smaller than one tile: every load misses (a query block and each key tile's K and V)
    every = b * h * (num_m * cfg.block_m * d * 2 + int(kt.sum()) * 2 * cfg.block_n * d * 2)
    assert l2_model.dram_reads(call, pairs, 1024) == every
    assert l2_model.dram_reads(call, pairs, 1024, jitter=0.5, seed=3) == every


def test_pairs_for_share_restores_the_environment(monkeypatch):
    monkeypatch.delenv(fwd_sm90.L2_SHARE_ENV, raising=False)
    call = l2_model.meta_call(32, 512, 16, 128, 16)
    assert l2_model.pairs_for_share(call, 0.75) > l2_model.pairs_for_share(call, 0.35)
    assert fwd_sm90.L2_SHARE_ENV not in os.environ


def test_main_prints_a_row_per_share_and_pairs(capsys):
    assert l2_model.main(["--shape", "2", "256", "4", "64", "--share", "0.35", "--pairs", "2",
                          "--l2-mb", "1", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("2 x 256 x 4 d64 kv4 causal: Q + K + V 0.8 MB")
    assert [line.split()[:2] for line in out[2:]] == [["share", "0.35"], ["pairs", "2"]]

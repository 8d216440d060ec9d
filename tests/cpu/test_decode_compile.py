"""The decode kernels (flashcuda/ops/fwd_decode.py) on the CPU lane: every variant compiles for
sm_80 and sm_90a within 255 registers and without spills, and the host's choices (config,
split plan, which calls the kernels take) answer correctly without a GPU."""

from __future__ import annotations

import pytest
import torch

from flashcuda.jit import compile_spec
from flashcuda.ops import fwd_decode


def _all_variants():
    return [(spec, arch) for spec, archs in fwd_decode.variants() for arch in archs]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "arch"), _all_variants(),
                         ids=[f"{s.name}-{a}" for s, a in _all_variants()])
def test_decode_variant_compiles_without_spills(spec, arch):
    r = compile_spec(spec, arch).resources()[spec.entry_name]
    assert not r.spills, (spec.name, arch, r)
    assert r.registers <= 255, (spec.name, arch, r)


def test_decode_representative_variants_compile():
    """The fast subset: the decode extra's kernel (bf16 d128, 4 rows), the widest (d256, 8
    rows) and a combine, both targets."""
    specs = [fwd_decode.config_for(torch.bfloat16, 128, 4).spec(),
             fwd_decode.config_for(torch.float16, 256, 16).spec(),
             fwd_decode.combine_spec(torch.bfloat16)]
    for spec in specs:
        for arch in fwd_decode.ARCHS:
            r = compile_spec(spec, arch).resources()[spec.entry_name]
            assert not r.spills, (spec.name, arch, r)


def test_decode_config_buckets_and_rows():
    cfg = fwd_decode.config_for(torch.bfloat16, 72, 6)
    assert (cfg.head_dim, cfg.rows, cfg.slots) == (128, 8, 8)
    assert fwd_decode.config_for(torch.float16, 8, 1).head_dim == 64
    assert fwd_decode.config_for(torch.float16, 256, 32).rows == 8  # 4 row blocks
    assert fwd_decode.config_for(torch.float16, 64, 2).slots == 16
    names = [s.name for s, _ in fwd_decode.variants()]
    assert len(names) == len(set(names)) == 2 * 3 * 4 + 2


@pytest.mark.parametrize("batch,heads_kv,keys", [(1, 8, 65536), (8, 8, 16384), (1, 8, 1000),
                                                 (64, 32, 4096), (1, 1, 1), (3, 2, 77)])
def test_split_plan_covers_every_key_once(batch, heads_kv, keys):
    """Pieces of `chunk` keys (a multiple of the CTA's step) cover [0, keys) with none empty,
    at most MAX_SPLITS, none shorter than MIN_SPLIT_KEYS unless there is one piece, and enough
    CTAs for the GPU where the keys allow."""
    slots = 8
    splits, chunk = fwd_decode.plan_splits(batch, heads_kv, 1, keys, 132, slots)
    assert chunk % (slots * fwd_decode.UNROLL) == 0
    assert (splits - 1) * chunk < keys <= splits * chunk
    assert 1 <= splits <= fwd_decode.MAX_SPLITS
    assert splits == 1 or chunk >= fwd_decode.MIN_SPLIT_KEYS
    ctas = batch * heads_kv * splits
    assert ctas >= min(fwd_decode.CTAS_PER_SM * 132, batch * heads_kv * max(
        1, keys // fwd_decode.MIN_SPLIT_KEYS)) * 0.5


def test_can_take_needs_a_gpu_and_the_layout():
    q = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 100, 8, 128, dtype=torch.bfloat16)
    assert "CUDA" in fwd_decode.can_take(q, k, k)

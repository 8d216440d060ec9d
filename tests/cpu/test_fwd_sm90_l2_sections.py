"""FC_L2_SECTIONS (flash_fwd_sm90.cu's Schedule, an A/B knob through FLASHCUDA_SM90_FWD_DEFINES,
written in session 11 and not yet run on a GPU): the causal / window order walks the (batch, head)
pairs in L2-sized sections, each query-block-major from the heaviest block down.

On the CPU lane: the host's section size (fwd_sm90.l2_section) and the order's arithmetic, written
here as the .cu writes it, checked to be a permutation of every work tile that puts each section's
tiles together, heaviest query block first, and that reduces to plain by_block when one section
holds every pair; the variant compiles clean for sm_90a. Whether the kernels are right with it
(the oracle tests) and faster (DRAM traffic, the causal sweep) is for the GPU lane.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashcuda.ops import fwd_sm90
from flashcuda.ops.call import FwdCall

from .sm90_compile import clean_sass

H200_L2 = 50 * 1024 * 1024


def _call(B=4, S=4096, H=16, Hkv=16, D=128, dtype=torch.bfloat16) -> FwdCall:
    """Shapes only (meta tensors): l2_section reads sizes and the element size."""
    q = torch.empty(B, S, H, D, dtype=dtype, device="meta")
    kv = torch.empty(B, S, Hkv, D, dtype=dtype, device="meta")
    lse = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    return FwdCall(q, kv, kv, q, lse, D ** -0.5, None, 0)


def _order(t: int, num_m: int, heads: int, per: int) -> tuple[int, int]:
    """Schedule::block's (query block, batch * head) of work tile t under FC_L2_SECTIONS with
    by_block = per (the .cu's lines, in Python)."""
    s = t // (num_m * per)
    first = s * per
    size = min(per, heads - first)
    within = t - s * num_m * per
    return num_m - 1 - within // size, first + within % size


def test_section_size_fits_l2_in_whole_groups():
    # 4 x 4096 x 16 d128 bf16: 2 MiB of K and V per head, 37.5 MiB of L2 to fill -> 18 heads
    assert fwd_sm90.l2_section(_call(), H200_L2) == 18
    # GQA 16 / 4: a group of 4 query heads shares one K / V head -> 18 groups, 72 pairs (of 128)
    assert fwd_sm90.l2_section(_call(B=8, Hkv=4), H200_L2) == 72
    assert fwd_sm90.l2_section(_call(Hkv=4), H200_L2) == 64  # all 16 K / V heads fit: every pair
    # never more than every pair, never less than one group
    assert fwd_sm90.l2_section(_call(B=1, S=1024, H=8, Hkv=8), H200_L2) == 8
    assert fwd_sm90.l2_section(_call(B=1, S=1 << 20, H=8, Hkv=2), H200_L2) == 4
    for B, S, H, Hkv in ((4, 4096, 16, 16), (2, 8192, 32, 8), (1, 131072, 4, 1)):
        call = _call(B=B, S=S, H=H, Hkv=Hkv)
        per = fwd_sm90.l2_section(call, H200_L2)
        group = H // Hkv
        assert per % group == 0 or per == B * H
        kv_bytes = (per // group) * 2 * S * 128 * 2
        assert kv_bytes <= fwd_sm90.L2_SECTION_SHARE * H200_L2 or per == group


@pytest.mark.parametrize("num_m,heads,per", [(32, 64, 18), (32, 64, 64), (7, 10, 4),
                                             (1, 5, 2), (9, 9, 9), (5, 12, 1)])
def test_section_order_is_a_permutation_heaviest_first(num_m, heads, per):
    tiles = [_order(t, num_m, heads, per) for t in range(num_m * heads)]
    assert sorted(tiles) == [(m, bh) for m in range(num_m) for bh in range(heads)]
    for t, (m, bh) in enumerate(tiles):
        section = bh // per
        # a section's tiles are consecutive, sections in order
        assert t // (num_m * per) == section
        if t + 1 < len(tiles):
            m2, bh2 = tiles[t + 1]
            if bh2 // per == section:
                assert m2 <= m  # heaviest (last) query block first within a section
    if per >= heads:  # one section: plain by_block's order
        assert tiles == [(num_m - 1 - t // heads, t % heads) for t in range(num_m * heads)]


def test_l2_sections_variant_compiles_clean(tmp_path):
    for d in (64, 128):
        base = fwd_sm90.select_config(torch.bfloat16, d, windowed=True, seqlen_q=4096,
                                      seqlen_k=4096)
        cfg = dataclasses.replace(base, defines=(("FC_L2_SECTIONS", 1),))
        assert cfg.name == base.name + "_fc_l2_sections1"
        clean_sass(cfg, tmp_path)


def test_schedule_arg_only_for_the_variant_and_masked_calls():
    call = _call()
    base = fwd_sm90.select_config(torch.bfloat16, 128, windowed=True, seqlen_q=4096, seqlen_k=4096)
    assert fwd_sm90.schedule_arg(call, base, H200_L2) is None  # the default: by_block = is_local
    var = dataclasses.replace(base, defines=(("FC_L2_SECTIONS", 1),))
    assert fwd_sm90.schedule_arg(call, var, H200_L2) == 18
    q = call.q
    full = FwdCall(q, call.k, call.v, q, call.lse, call.softmax_scale, None, None)  # no mask
    assert fwd_sm90.schedule_arg(full, var, H200_L2) is None  # by_head: sections do not apply
    assert fwd_sm90.constant_args(call, 18)[-1] == 18

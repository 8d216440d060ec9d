"""FC_L2_SECTIONS (flash_fwd_sm90.cu's Schedule; the default since session 12, FC_L2_SECTIONS=0
through FLASHCUDA_SM90_FWD_DEFINES the A/B variant): the causal / window order walks the (batch,
head) pairs in L2-sized sections, each query-block-major, the sections alternating direction with
the last one heaviest-first.

On the CPU lane: the host's section size (fwd_sm90.l2_section) and the order's arithmetic, written
here as the .cu writes it, checked to be a permutation of every work tile that keeps each
section's tiles together and monotone in cost, reduces to plain by_block when one section holds
every pair, and keeps the static snake schedule (next_work) balanced where heaviest-first
sections do not (a cost model: the bench's causal shapes). Whether the kernels are right with it
(the oracle tests) and faster (the causal sweep) is for the GPU lane.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashcuda.ops import fwd_sm90
from flashcuda.ops.call import FwdCall

from .sm90_compile import clean_sass
from .test_fwd_sm90_compile import _kernel_order

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
    sections = -(-heads // per)
    within = t - s * num_m * per
    if (sections - 1 - s) % 2:
        within = num_m * size - 1 - within
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
                                             (1, 5, 2), (9, 9, 9), (5, 12, 1), (64, 32, 8)])
def test_section_order_is_a_permutation_alternating_last_heaviest_first(num_m, heads, per):
    tiles = [_order(t, num_m, heads, per) for t in range(num_m * heads)]
    assert sorted(tiles) == [(m, bh) for m in range(num_m) for bh in range(heads)]
    sections = -(-heads // per)
    for t, (m, bh) in enumerate(tiles):
        section = bh // per
        # a section's tiles are consecutive, sections in order
        assert t // (num_m * per) == section
        if t + 1 < len(tiles):
            m2, bh2 = tiles[t + 1]
            if bh2 // per == section:
                # the last section (and every second one before it) heaviest (last) block first,
                # the others lightest first
                assert (m2 <= m) if (sections - 1 - section) % 2 == 0 else (m2 >= m)
    assert tiles[-1][0] == 0  # the order ends on the lightest blocks
    if per >= heads:  # one section: plain by_block's order
        assert tiles == [(num_m - 1 - t // heads, t % heads) for t in range(num_m * heads)]


def _last_cta_late(block_of, total: int, grid: int = 132, fixed: float = 2.0) -> float:
    """The last CTA's load over the mean under next_work's snake (test_fwd_sm90_compile's
    transcription), work tile t at query block block_of(t) costing `fixed` + block + 1 key tiles
    (session 11's timeline: 3.35 us per work tile, 1.69 us per key tile at d128)."""
    loads = [sum(fixed + block_of(t) + 1 for t in seq) for seq in _kernel_order(total, grid, True)]
    return max(loads) / (sum(loads) / grid)


@pytest.mark.parametrize("seqlen,batch", [(2048, 8), (4096, 4), (8192, 2), (16384, 1)])
def test_alternating_sections_keep_the_snake_balanced(seqlen, batch):
    """The bench's causal d128 shapes (16 heads, 128-row blocks): with sections alternating the
    last CTA ends within 3% of the mean, as plain by_block does; had every section gone
    heaviest-first (a sawtooth of costs) it would end 8-30% late (the miss that session 12's
    first A/B showed at 16k)."""
    call = _call(B=batch, S=seqlen)
    per = fwd_sm90.l2_section(call, H200_L2)
    num_m, heads = seqlen // 128, batch * 16
    assert per < heads  # several sections at every one of these shapes
    total = num_m * heads
    assert _last_cta_late(lambda t: _order(t, num_m, heads, per)[0], total) < 1.03
    # plain by_block (one section)
    assert _last_cta_late(lambda t: _order(t, num_m, heads, heads)[0], total) < 1.04

    def sawtooth(t):  # every section heaviest-first (session 11's form)
        s, within = divmod(t, num_m * per)
        size = min(per, heads - s * per)
        return num_m - 1 - within // size

    assert _last_cta_late(sawtooth, total) > 1.08


def test_plain_by_block_variant_compiles_clean(tmp_path):
    for d in (64, 128):
        base = fwd_sm90.select_config(torch.bfloat16, d, windowed=True, seqlen_q=4096)
        cfg = dataclasses.replace(base, defines=(("FC_L2_SECTIONS", 0),))
        assert cfg.name == base.name + "_fc_l2_sections0"
        clean_sass(cfg, tmp_path)


def test_schedule_arg_for_masked_calls_unless_the_variant_turns_it_off():
    call = _call()
    base = fwd_sm90.select_config(torch.bfloat16, 128, windowed=True, seqlen_q=4096)
    assert fwd_sm90.schedule_arg(call, base, H200_L2) == 18  # the default: L2 sections
    var = dataclasses.replace(base, defines=(("FC_L2_SECTIONS", 0),))
    assert fwd_sm90.schedule_arg(call, var, H200_L2) is None  # by_block = is_local
    q = call.q
    full = FwdCall(q, call.k, call.v, q, call.lse, call.softmax_scale, None, None)  # no mask
    assert fwd_sm90.schedule_arg(full, base, H200_L2) is None  # by_head: sections do not apply
    assert fwd_sm90.constant_args(call, 18)[-1] == 18


def test_l2_share_switch(monkeypatch):
    """FLASHCUDA_SM90_FWD_L2_SHARE (an A/B of the section size) scales the L2 budget of a section
    and is part of the forward's plan key; a value outside (0, 1] is refused naming it."""
    monkeypatch.delenv(fwd_sm90.L2_SHARE_ENV, raising=False)
    call = _call()
    assert fwd_sm90.l2_share() == fwd_sm90.L2_SECTION_SHARE
    key = fwd_sm90._plan_key(call)
    monkeypatch.setenv(fwd_sm90.L2_SHARE_ENV, "0.375")
    assert fwd_sm90.l2_section(call, H200_L2) == 9  # half of the default's 18 heads
    assert fwd_sm90._plan_key(call) != key
    for bad in ("0", "1.5", "half", "-0.2"):
        monkeypatch.setenv(fwd_sm90.L2_SHARE_ENV, bad)
        with pytest.raises(ValueError, match=fwd_sm90.L2_SHARE_ENV):
            fwd_sm90.l2_section(call, H200_L2)

"""FC_LPT_ORDER (flash_bwd_sm90.cu's BlockCoord; an A/B knob through FLASHCUDA_SM90_BWD_DEFINES,
session 12): a causal backward's CTAs walk the (batch, KV head) pairs in L2-sized sections, each
key-block-major from key block 0 (the heaviest under a causal mask), the sections alternating
direction with the last one heaviest-first.

On the CPU lane: the host's section size (bwd_sm90.lpt_sections: 0 for calls where key block 0 is
not the heaviest), the order's arithmetic written here as the .cu writes it (a permutation of
every CTA, monotone in cost within a section), a greedy list-schedule model of the GPU's CTA
dispatch (the plain order ends 5-7% late at the bench's causal shapes, the LPT order within
2.5%), and the variant compiling clean for sm_90a with the default kernels unchanged in name.
Whether it is right (the oracle tests) and faster (the causal sweep) is for the GPU lane.
"""

from __future__ import annotations

import dataclasses
import heapq

import pytest
import torch

from flashcuda.ops import bwd_sm90
from flashcuda.ops.call import BwdCall

from .sm90_compile import clean_sass

H200_L2 = 50 * 1024 * 1024


def _call(B=4, S=4096, H=16, Hkv=16, D=128, window_left=None, window_right=0) -> BwdCall:
    """Shapes only (meta tensors): lpt_sections reads sizes and the windows."""
    q = torch.empty(B, S, H, D, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(B, S, Hkv, D, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    return BwdCall(q, kv, kv, q, q, lse, q, kv, kv, D ** -0.5, window_left, window_right, False)


def _coord(l: int, nkb: int, pairs: int, sections: int) -> tuple[int, int]:
    """BlockCoord's (key block, pair) of linear block index l (the .cu's lines, in Python)."""
    s = l // (nkb * sections)
    first = s * sections
    size = min(sections, pairs - first)
    count = -(-pairs // sections)
    within = l - s * nkb * sections
    if (count - 1 - s) % 2:
        within = nkb * size - 1 - within
    return within // size, first + within % size


def test_sections_only_for_causal_calls_and_within_l2():
    # 4 x 4096 x 16 d128: per pair 4096 (128 (2 + 2 + 4) + 8) + 2 MiB of K / V = 6.2 MB -> 6
    assert bwd_sm90.lpt_sections(_call(), H200_L2) == 6
    assert bwd_sm90.lpt_sections(_call(window_right=None), H200_L2) == 0  # no mask
    assert bwd_sm90.lpt_sections(_call(window_left=256, window_right=0), H200_L2) == 0  # window
    assert bwd_sm90.lpt_sections(_call(window_right=3), H200_L2) > 0  # causal with a shift
    assert bwd_sm90.lpt_sections(_call(B=1, S=1 << 17, H=4, Hkv=1), H200_L2) == 1  # at least 1
    assert bwd_sm90.lpt_sections(_call(B=2, S=512, H=4, Hkv=2), H200_L2) == 4  # at most all
    for B, S, H, Hkv, D in ((4, 4096, 16, 16, 128), (8, 2048, 32, 8, 64), (1, 16384, 16, 2, 128)):
        call = _call(B=B, S=S, H=H, Hkv=Hkv, D=D)
        per = bwd_sm90.lpt_sections(call, H200_L2)
        group = H // Hkv
        pair_bytes = group * S * (D * 8 + 8) + 2 * S * D * 2
        budget = bwd_sm90.L2_SECTION_SHARE * H200_L2
        # as many pairs as fit (at least one, at most all)
        assert 1 <= per <= B * Hkv
        assert per == 1 or per * pair_bytes <= budget
        assert per == B * Hkv or (per + 1) * pair_bytes > budget


@pytest.mark.parametrize("nkb,pairs,sections", [(32, 64, 6), (32, 64, 64), (7, 10, 4), (1, 5, 2),
                                                (9, 9, 9), (5, 12, 1), (128, 16, 3)])
def test_order_is_a_permutation_alternating_last_heaviest_first(nkb, pairs, sections):
    order = [_coord(l, nkb, pairs, sections) for l in range(nkb * pairs)]
    assert sorted(order) == [(kb, p) for kb in range(nkb) for p in range(pairs)]
    count = -(-pairs // sections)
    for l, (kb, p) in enumerate(order):
        s = p // sections
        assert l // (nkb * sections) == s  # a section's CTAs are consecutive, in order
        if l + 1 < len(order) and order[l + 1][1] // sections == s:
            kb2 = order[l + 1][0]
            # key block 0 is the heaviest: the last section (and every second one before it)
            # ascends in key block, the others descend
            assert (kb2 >= kb) if (count - 1 - s) % 2 == 0 else (kb2 <= kb)
    assert order[-1][0] == nkb - 1  # the lightest key block last


def _greedy_finish(costs: list[float], sms: int = 132) -> float:
    """The last SM's finish over the mean when CTAs start in list order on the first free SM."""
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free) / (sum(costs) / sms)


@pytest.mark.parametrize("seqlen,batch", [(1024, 16), (2048, 8), (4096, 4), (8192, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_lpt_order_balances_the_greedy_dispatch(seqlen, batch, head_dim):
    """The bench's causal shapes (16 heads): key block j of 128 keys costs 2 (fixed, as the
    forward's timeline measured) + the query blocks it sees. Plain blockIdx order ends > 4% late,
    the LPT order < 2.5% (the prediction behind the A/B)."""
    block_m = bwd_sm90.BLOCK_M[head_dim]
    nkb, nqb, pairs = seqlen // 128, seqlen // block_m, batch * 16
    sections = bwd_sm90.lpt_sections(_call(B=batch, S=seqlen, D=head_dim), H200_L2)

    def cost(kb: int) -> float:
        return 2.0 + nqb - (kb * 128) // block_m

    plain = [cost(kb) for _ in range(pairs) for kb in range(nkb)]
    lpt = [cost(_coord(l, nkb, pairs, sections)[0]) for l in range(nkb * pairs)]
    assert _greedy_finish(plain) > 1.04
    assert _greedy_finish(lpt) < 1.025


def test_lpt_variant_compiles_clean(tmp_path):
    for d in (64, 128):
        base = bwd_sm90.select_config(torch.bfloat16, d)
        cfg = dataclasses.replace(base, defines=(("FC_LPT_ORDER", 1),))
        assert cfg.name == base.name + "_fc_lpt_order1"
        clean_sass(cfg, tmp_path)

"""The schedule's magic-number divisions in flash_fwd_sm90.cu (Magic, fast_quo; session 16, the
default since session 17, in every kernel since session 39, when the A/B switch
FLASHCUDA_SM90_FWD_FAST_DIV went): the schedule's divisions by runtime values are a multiply-high
and a shift by magic numbers the host computes per call (fwd_sm90.fast_div_magic /
fast_div_args). Here: the magic numbers are exact over the kernel's range, the schedule decoded
with them (the .cu's Schedule::block and next_tile, in Python) equals the one decoded by integer
division at every work tile of masked and unmasked calls, and the kernels build clean with no
division in their SASS."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from flashcuda.jit.runtime import pack_args
from flashcuda.jit.tensor_map import TensorMap
from flashcuda.ops import fwd_sm90
from flashcuda.ops.call import FwdCall

from .sm90_compile import clean_sass, param_table


def fast_quo(n: int, magic: int) -> int:
    """The .cu's fast_quo in 32-bit unsigned arithmetic."""
    mul, shift = magic & 0xFFFFFFFF, magic >> 32
    total = ((n * mul) >> 32) + n
    assert total < 2**32, "the sum must not wrap"
    return total >> shift


def test_magic_is_exact_below_2_31():
    rng = random.Random(16)
    divisors = (list(range(1, 1500)) + [2**k + e for k in range(1, 31) for e in (-1, 0, 1)]
                + [rng.randrange(1, 2**31) for _ in range(1500)])
    for d in divisors:
        if not 0 < d < 2**31:
            continue
        magic = fwd_sm90.fast_div_magic(d)
        for n in [0, 1, d - 1, d, d + 1, 2**31 - 1] + [rng.randrange(0, 2**31) for _ in range(12)]:
            if 0 <= n < 2**31:
                assert fast_quo(n, magic) == n // d, (n, d)
    with pytest.raises(ValueError, match="fast_div_magic"):
        fwd_sm90.fast_div_magic(0)


def _call(B, S, H, Hkv, D=64, causal=True) -> FwdCall:
    q = torch.empty(B, S, H, D, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(B, S, Hkv, D, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(B, H, S, dtype=torch.float32, device="meta")
    return FwdCall(q, kv, kv, q, lse, D ** -0.5, None, 0 if causal else None)


def _decode(t, num_m, nheads, group, batch, by_block, div):
    """Schedule::block's (query block, head, kv head, batch) of work tile t with the given
    quotient function div(n, d, which) (the L2 sections' order under a mask)."""
    heads = nheads * batch
    if by_block:
        s = div(t, num_m * by_block, "section")
        first = s * by_block
        size = min(by_block, heads - first)
        sections = div(heads + by_block - 1, by_block, None)
        within = t - s * num_m * by_block
        if (sections - 1 - s) & 1:
            within = num_m * size - 1 - within
        which = "by_block" if size == by_block else "last"
        q = div(within, size, which)
        m, bh = num_m - 1 - q, first + within - q * size
    else:
        q = div(t, num_m, "num_m")
        m, bh = num_m - 1 - (t - q * num_m), q
    b = div(bh, nheads, "nheads")
    head = bh - b * nheads
    return m, head, div(head, group, "group"), b


@pytest.mark.parametrize("shape,causal,by_block,grid", [
    ((2, 1000, 16, 4), True, 6, 132), ((3, 4096, 12, 12), True, 8, 132),
    ((1, 2048, 7, 7), True, 1, 5), ((5, 777, 6, 2), False, None, 132),
    ((2, 300, 4, 1), True, None, 7)])
def test_schedule_by_magic_equals_integer_division(shape, causal, by_block, grid):
    """Every work tile of the call decodes the same with the host's magic numbers as with integer
    division, and the snake walk's rounds agree (next_tile), up past the last tile."""
    B, S, H, Hkv = shape
    call = _call(B, S, H, Hkv, causal=causal)
    cfg = fwd_sm90.select_config(torch.bfloat16, 64, causal, S)
    args = [int(x) for x in fwd_sm90.fast_div_args(call, cfg, by_block, grid)]
    magic = dict(zip(("num_m", "heads", "section", "by_block", "last", "nheads", "group", "grid"),
                     args[:8], strict=True))
    sections, last_size = args[8:]
    num_m = -(-S // cfg.block_m)
    b = int(call.is_local if by_block is None else by_block)
    exact = lambda n, d, which: n // d  # noqa: E731

    def fast(n, d, which):
        if which is None:  # the section count: an argument of its own
            return sections
        if which == "last":
            assert d == last_size
        return fast_quo(n, magic[which])

    total = num_m * H * B
    for t in range(total):
        assert (_decode(t, num_m, H, H // Hkv, B, b, fast)
                == _decode(t, num_m, H, H // Hkv, B, b, exact)), t
    for t in range(total + 2 * grid):
        assert fast_quo(t, magic["grid"]) == t // grid


def test_kernel_args_need_the_grid():
    call = _call(2, 512, 4, 4)
    cfg = fwd_sm90.select_config(torch.bfloat16, 64, True, 512)
    with pytest.raises(ValueError, match="CTA count"):
        fwd_sm90.constants(call, cfg)
    assert len(fwd_sm90.constants(call, cfg, None, 132)) == len(fwd_sm90.constant_args(call)) + 10


@pytest.mark.parametrize("head_dim,windowed,seqlen", [(64, True, 1024), (128, False, 4096)])
def test_kernels_build_clean_without_divisions(head_dim, windowed, seqlen, tmp_path):
    """No spills; no integer-division idiom (I2F.RP, then a reciprocal: a dozen in the SASS of
    the kernels that divided, before session 17) but the multiply-highs (UIMAD.WIDE.U32); the
    parameter table matches pack_args with the ten arguments after by_block."""
    cfg = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    sass = clean_sass(cfg, tmp_path)
    assert not re.search(r"I2F\S*\.RP", sass) and "UIMAD.WIDE.U32" in sass
    from flashcuda.jit import compile_spec

    table = param_table(compile_spec(cfg.spec(), "sm_90a").cubin, tmp_path)
    m = TensorMap(b"\0" * 128)
    call = _call(2, seqlen, 4, 4, head_dim, windowed)
    args = (*(m,) * (3 + cfg.o_tma), None, None, *fwd_sm90.constants(call, cfg, None, 132))
    _, offsets = pack_args("k", args)
    assert len(table) == len(args)
    assert [table[i][0] - table[0][0] for i in range(len(args))] == list(offsets)
    assert [table[i][1] for i in range(len(args))][-10:] == [8] * 8 + [4, 4]
    assert isinstance(args[-1], np.int32)

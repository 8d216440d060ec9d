"""The sm90 backward's last-wave split (FC_WAVE_SPLIT, kernels/attention/flash_bwd_sm90.cu):
which work items leave MAIN's grid and how their steps are cut into pieces.

MAIN runs one CTA per work item (key block, KV head, batch), one CTA per SM at a time. With T
items on S SMs its last wave holds r = T mod S CTAs (all T when T < S), and S - r SMs idle for
about one CTA's length at the end: 1.5-3.3% of the d64 calls measured (session 37's timelines),
the same for FlashAttention 4, whose grid is ours. The split takes r items out of MAIN and runs
each as p pieces of about n / p of its n steps in a second kernel, MAIN's programmatic
dependent, whose CTAs take the SMs MAIN's last full wave frees; the pieces sum dK / dV in fp32
and the last one of an item writes them.

The r items are MAIN's first ones: its CTAs below `first_main` exit at once, so the GPU starts
them (and every other CTA) early, and the pieces' grid, which may start once every MAIN CTA has
started, is ready when MAIN's last full wave ends. (Taking the last r items instead, measured in
session 38, left the pieces waiting for those r CTAs to be dispatched after MAIN's other CTAs,
at the very end.)

    items   0 .. r - 1      slot i = item i: pieces k = 0 .. p_i - 1, steps
                            [k n_i / p_i, (k + 1) n_i / p_i)
            r .. T - 1      MAIN, whole (first_main = r)

p_i = min(n_i, S // r): every piece has a step, and all pieces fit on the S SMs at once. No
split (None) when S divides T, when fewer than two pieces per item fit, or when no item of the
r has two steps (or the host's `min_steps`).

When it pays (session 38, kernel times and same-process A/Bs at d64, 4096 items): the SMs do
not run their 31 CTAs in lockstep — MAIN's SMs finish their last CTA over a spread of about one
short CTA (~12 us) — so the r extra CTAs of the last wave land on the SMs that finish first and
cost little where a CTA is short: at 512 queries (4 steps, 12.5 us) MAIN without them took as
long as with them (397.8 us both), and the split lost 2.5% to its own costs (the zeroed sums, the
pieces' fixed cost, one more kernel in the chain); at 2k (16 steps, 40 us) MAIN took 19 us less
(1215 against 1235 us) and the backward gained 1.2-1.7%, at 4k 1.2-2.3%.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class WavePlan:
    """The items the pieces take (0 .. first_main - 1, blockIdx order; MAIN runs the rest of the
    `total`) and the pieces: (item, first step, end step, slot) each, slot = item (the kernel's
    int4 table, in launch order)."""

    first_main: int
    total: int
    pieces: tuple[tuple[int, int, int, int], ...]

    @property
    def slots(self) -> int:
        """Work items the pieces share out (one dK / dV sum and step counter each)."""
        return self.first_main

    @property
    def main_ctas(self) -> int:
        """The work items MAIN runs (0: no MAIN launch)."""
        return self.total - self.first_main


def query_blocks(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int,
                 block_m: int, block_n: int, key_block: int) -> int:
    """The query blocks of block_m rows whose rows see a key of key block `key_block` (block_n
    keys): KeyBlockSteps::n_m of kernels/attention/mask.cuh, windows as kernel_windows gives
    them (an unbounded side as seqlen_q + seqlen_k)."""
    shift = seqlen_k - seqlen_q
    n0 = key_block * block_n
    n_end = min(n0 + block_n, seqlen_k)
    q_begin = max(0, n0 - shift - window_right)
    q_end = min(seqlen_q, n_end - 1 - shift + window_left + 1)
    return (q_end - 1) // block_m - q_begin // block_m + 1 if q_end > q_begin else 0


def plan(total: int, steps_of: Callable[[int], int], sms: int,
         min_steps: int = 2) -> WavePlan | None:
    """The split of a grid of `total` work items (blockIdx order), item i of steps_of(i) steps,
    on `sms` SMs, or None where it cannot shorten the last wave (see the module's docstring) or
    where none of the items it would take has `min_steps` steps (the host's threshold: a short
    CTA's last wave hides in the SMs' spread, see below)."""
    if sms < 1:
        raise ValueError(f"wave_split.plan: sms: expected >= 1, got {sms}")
    tail = total if total < sms else total % sms
    if tail == 0 or sms // tail < 2:
        return None
    steps = [steps_of(item) for item in range(tail)]
    if max(steps) < max(2, min_steps):
        return None
    per_item = sms // tail
    pieces = []
    for item, n in enumerate(steps):
        p = max(1, min(n, per_item))
        pieces += [(item, k * n // p, (k + 1) * n // p, item) for k in range(p)]
    return WavePlan(tail, total, tuple(pieces))

"""The sm90 backward's schedule (kernels/attention/flash_bwd_sm90.cu): the order in which MAIN's
CTAs take the work items (FC_ORDER_TABLE) and the items that leave MAIN for the last-wave split's
pieces (FC_WAVE_SPLIT).

A work item is one (key block, KV head, batch); item i of the plain grid (blockIdx order, key
block fastest) is (i % blocks, (i // blocks) % Hkv, i // (blocks Hkv)). The GPU starts CTAs in
blockIdx order (the backward timeline, session 13).

Order table. MAIN's CTA j runs the item the host put at j of an int4 table (key block, KV head,
batch) instead of the one its blockIdx names. Coordinates loaded from memory leave ptxas's
uniform wgmma descriptors alone, where the same order computed from blockIdx (FC_LPT_TAIL) moved
d64's into vector registers (R2UR 22 -> 111; session 37): the table is how d64 gets an order.
Orders (ORDERS):
    plain   the plain grid's order (the table's own cost, for an A/B)
    lpt     under a causal mask (key block 0 has the most steps), the last `tail` (KV head,
            batch) pairs longest-first across them: key block 0 of each, then key block 1, ...
            (FC_LPT_TAIL's order); the rest as the plain grid. Without such a mask, plain.

Last-wave split. With T items on S SMs (one CTA each at a time) the last wave holds r = T mod S
CTAs (all T when T < S), and S - r SMs idle for about one CTA's length at the end: 1.5-3.3% of
the d64 calls measured (session 37's timelines), the same for FlashAttention 4, whose grid is
ours. The split takes r items out of MAIN's table and runs each as p pieces of about n / p of
its n steps in a second kernel, MAIN's programmatic dependent, whose CTAs take the SMs MAIN's
last wave frees; the pieces sum dK / dV in fp32 and the last one of an item writes them.

    items   the first r in the order       pieces k = 0 .. p_i - 1 of item i (slot s: its rank),
                                           steps [k n_i / p_i, (k + 1) n_i / p_i)
            the rest                       MAIN, whole, in the order

p_i = min(n_i, S // r): every piece has a step, and all pieces fit on the S SMs at once. No
split (None) when S divides T, when fewer than two pieces per item fit, or when none of the r
items has two steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ORDERS = ("plain", "lpt")


def item_coords(item: int, blocks: int, nheads_kv: int) -> tuple[int, int, int]:
    """(key block, KV head, batch) of plain-grid item `item` (block_order.cuh's item_coord)."""
    pair, key_block = divmod(item, blocks)
    return key_block, pair % nheads_kv, pair // nheads_kv


def order(total: int, blocks: int, kind: str, tail: int, causal: bool) -> list[int]:
    """The plain-grid items in the order `kind` (ORDERS) gives MAIN's CTAs: `total` items of
    `blocks` key blocks per (KV head, batch) pair; `tail` pairs for lpt, which applies only when
    `causal` (a right edge and no left one)."""
    if kind not in ORDERS:
        raise ValueError(f"bwd_schedule.order: kind: expected one of {ORDERS}, got {kind!r}")
    items = list(range(total))
    if kind == "plain" or not causal or tail <= 0:
        return items
    pairs = total // blocks
    first = (pairs - min(tail, pairs)) * blocks  # the tail's first item
    return items[:first] + sorted(items[first:], key=lambda i: (i % blocks, i // blocks))


@dataclass(frozen=True)
class WavePlan:
    """The split: MAIN's items (its table, in order) and the pieces, (item, first step, end step,
    slot) each, slot = the item's rank among the pieces' items (the pieces' int4 table, in
    launch order)."""

    main: tuple[int, ...]
    pieces: tuple[tuple[int, int, int, int], ...]

    @property
    def slots(self) -> int:
        """Work items the pieces share out (one dK / dV sum and step counter each)."""
        return len({p[3] for p in self.pieces})

    @property
    def total(self) -> int:
        return len(self.main) + self.slots


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


def split_last_wave(items: list[int], steps_of: Callable[[int], int],
                    sms: int) -> WavePlan | None:
    """The split of a grid running `items` in that order, item i of steps_of(i) steps, on `sms`
    SMs, or None where it cannot shorten the last wave (see the module's docstring)."""
    if sms < 1:
        raise ValueError(f"bwd_schedule.split_last_wave: sms: expected >= 1, got {sms}")
    total = len(items)
    tail = total if total < sms else total % sms
    if tail == 0 or sms // tail < 2:
        return None
    steps = [steps_of(item) for item in items[:tail]]
    if max(steps) < 2:
        return None
    per_item = sms // tail
    pieces = []
    for slot, (item, n) in enumerate(zip(items, steps, strict=False)):
        p = max(1, min(n, per_item))
        pieces += [(item, k * n // p, (k + 1) * n // p, slot) for k in range(p)]
    return WavePlan(tuple(items[tail:]), tuple(pieces))

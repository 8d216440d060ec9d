"""The sm90 backward's schedule (kernels/attention/flash_bwd_sm90.cu): the order in which the
grid's last CTAs take the work items (FC_ORDER_TABLE) and the items that leave MAIN for the
last-wave split's pieces (FC_WAVE_SPLIT).

A work item is one (key block, KV head, batch); item i of the plain grid (blockIdx order, key
block fastest) is (i % blocks, (i // blocks) % Hkv, i // (blocks Hkv)). The GPU starts CTAs in
blockIdx order (the backward timeline, session 13).

Order table. MAIN's CTAs from `table_first` on (blockIdx order: the grid's end) run the items
of a host table instead of the ones their blockIdx names; a -1 entry exits at once. Only those
CTAs load (a table for every CTA cost 3-4% at d64, session 38: each CTA's first loads waited
for the lookup). Orders (ORDERS):
    plain   the plain grid's order (the table's own cost, for an A/B)
    lpt     under a causal mask (key block 0 has the most steps), the last `tail` (KV head,
            batch) pairs longest-first across them: key block 0 of each, then key block 1, ...
            (FC_LPT_TAIL's order, which computed from blockIdx cost d64 its uniform wgmma
            descriptors, session 37); the rest as the plain grid. Without such a mask, plain.

Last-wave split. With T items on S SMs (one CTA each at a time) the last wave holds r = T mod S
CTAs (all T when T < S), and S - r SMs idle for about one CTA's length at the end: 1.5-3.3% of
the d64 calls measured (session 37's timelines), the same for FlashAttention 4, whose grid is
ours. The split takes r items from MAIN and runs each as p pieces of about n / p of its n steps
in a second kernel, MAIN's programmatic dependent, whose CTAs take the SMs MAIN's last wave
frees; the pieces sum dK / dV in fp32 and the last one of an item writes them. The r items are
the first r of the table's region, which then starts at least a wave before the grid's end
(T - S): their CTAs exit there, so every MAIN CTA has started (the pieces' grid may start) about
a wave before the end. (Skipping the grid's last r CTAs, session 38's first form, left the
pieces waiting for those CTAs' dispatch at the very end.)

    CTAs    0 .. table_first - 1               their blockIdx's item
            table_first .. + r - 1             exit (their items: the pieces')
            table_first + r .. T - 1           the order's items
    pieces  k = 0 .. p_i - 1 of the r items, steps [k n_i / p_i, (k + 1) n_i / p_i)

p_i = min(n_i, S // r): every piece has a step, and all pieces fit on the S SMs at once. No
split when S divides T, when fewer than two pieces per item fit, or when none of the r items
has two steps.
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
class Schedule:
    """MAIN's order table (the CTAs from table_first on: an item each, -1 to exit) and the
    split's pieces, (item, first step, end step, slot) each, slot = the item's rank among the
    pieces' items (the pieces' int4 table, in launch order; empty: no split)."""

    table_first: int
    entries: tuple[int, ...]
    pieces: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def total(self) -> int:
        """The grid's work items (MAIN's CTAs)."""
        return self.table_first + len(self.entries)

    @property
    def slots(self) -> int:
        """Work items the pieces share out (one dK / dV sum and step counter each)."""
        return len({p[3] for p in self.pieces})

    @property
    def main_items(self) -> int:
        """The work items MAIN's CTAs run (0: no MAIN launch)."""
        return self.total - self.slots


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


def plan(total: int, blocks: int, kind: str, tail: int, causal: bool,
         steps_of: Callable[[int], int], sms: int | None = None) -> Schedule | None:
    """The schedule of a grid of `total` items (`blocks` key blocks per pair) in the order `kind`
    (order(): `tail` pairs, `causal`), split for `sms` SMs (None: no split), item i of
    steps_of(i) steps; None when the grid's own order runs unchanged (see the module's
    docstring)."""
    items = order(total, blocks, kind, tail, causal)
    first = next((j for j, item in enumerate(items) if item != j), total)
    pieces: list[tuple[int, int, int, int]] = []
    if sms is not None:
        if sms < 1:
            raise ValueError(f"bwd_schedule.plan: sms: expected >= 1, got {sms}")
        r = total if total < sms else total % sms
        start = min(first, max(0, total - sms))
        steps = [steps_of(item) for item in items[start:start + r]]
        if r and sms // r >= 2 and max(steps) >= 2:
            first = start
            for slot, (item, n) in enumerate(zip(items[start:start + r], steps, strict=True)):
                p = max(1, min(n, sms // r))
                pieces += [(item, k * n // p, (k + 1) * n // p, slot) for k in range(p)]
    if first == total:
        return None
    skips = len({p[3] for p in pieces})
    return Schedule(first, (-1,) * skips + tuple(items[first + skips:]), tuple(pieces))

"""The causal forward's DRAM reads under an LRU model of the L2 (CPU only; a diagnostic).

    python scripts/l2_model.py --shape 32 512 16 128 [--kv-heads 4] [--share 0.35 0.75]
        [--l2-mb 32 50] [--pairs 8 16] [--jitter 0.1] [--sms 132]

Walks the work tiles of the sm90 forward's causal order as the host dispatches it (the config
plan_config picks, the L2 sections schedule_arg sizes for each --share, or the --pairs given),
each persistent CTA taking its tiles by the kernel's static walk (fwd_sm90.static_cta) one after
another, a tile costing TILE_FIXED_COST plus one unit per key tile (times --jitter's random
spread). Every load (a query block of Q, each key tile of K and V) and the O store go through
one LRU cache of --l2-mb MiB in the order of their times; a load that misses reads its bytes
from DRAM. Prints the bytes read against Q + K + V's.

What it is not: the L2 is not one LRU (two partitions, hashed sets, its own replacement), and
CTAs do not keep the model's time, so the numbers are a shape of the effect, not a forecast
(perf-notes, session 57: at 32 x 512 causal d128 / d64, share 0.75, ncu read 269.6 / 316.6 MB
on an H100 where this model reads that much at an LRU of 32-35 MiB, all of Q, K and V once at
50). Where a section size makes the static walk end unevenly (fwd_sm90.section_makespan well
above 1), CTAs run ahead into later sections and the model's reads jump; the GPU's slowdown at
those sizes was the makespan's alone (H100, session 57), so read them with the makespan. At d128
it is wrong in sign between section sizes: the larger sections of balance mode 3 read 3-7% more
than the even splits on an H100 (session 60's ncu), where this model reads them the same or less
at any LRU size from 24 to 50 MiB. At d256 (1 MB of K / V per pair) it reads fewer bytes under
mode 3, as the GPU did (over Q + K + V: 1.54 -> 1.24 measured, 1.58 -> 1.12 at 32 MiB).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

L2_BYTES = 50 << 20  # what the H100 / H200 report (schedule_arg's section size)


def meta_call(batch: int, seqlen: int, heads: int, head_dim: int, kv_heads: int):
    """A causal bf16 FwdCall of meta tensors (the host's planning reads shapes only)."""
    import torch

    from flashcuda.ops.call import FwdCall

    q = torch.empty(batch, seqlen, heads, head_dim, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(batch, seqlen, kv_heads, head_dim, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(batch, heads, seqlen, dtype=torch.float32, device="meta")
    return FwdCall(q, kv, kv, q, lse, head_dim ** -0.5, None, 0)


def dram_reads(call, pairs: int, l2_bytes: int, sms: int = 132, jitter: float = 0.0,
               seed: int = 0) -> int:
    """Bytes the modelled L2 reads from DRAM for `call` in sections of `pairs` (batch, head)
    pairs (see the module's docstring)."""
    from flashcuda.ops import fwd_sm90

    cfg = fwd_sm90.plan_config(call, sms)
    ctas = cfg.grid(call, sms)[0]
    key_tiles = fwd_sm90.key_tiles_per_block(call, cfg)
    heads, group, d = call.batch * call.nheads, call.nheads // call.nheads_kv, call.head_dim
    blocks, pair = fwd_sm90.section_order(len(key_tiles), heads, pairs)
    cta = fwd_sm90.static_cta(len(blocks), ctas, cfg.snake)
    rng = np.random.default_rng(seed)
    q_bytes, kv_bytes = cfg.block_m * d * 2, cfg.block_n * d * 2
    events = []  # (time, order, key, bytes, is_load)
    clock = np.zeros(ctas)
    for t in range(len(blocks)):  # each CTA's tiles in ascending index: its walk's order
        c, m, bh = cta[t], int(blocks[t]), int(pair[t])
        kv_head = (bh // call.nheads, bh % call.nheads // group)
        step = 1.0 + jitter * (2 * rng.random() - 1)
        start = clock[c]
        events.append((start, 0, ("q", bh, m), q_bytes, True))
        for j in range(int(key_tiles[m])):
            at = start + fwd_sm90.TILE_FIXED_COST + j * step
            events.append((at, 1, ("k", kv_head, j), kv_bytes, True))
            events.append((at, 2, ("v", kv_head, j), kv_bytes, True))
        clock[c] = start + fwd_sm90.TILE_FIXED_COST + key_tiles[m] * step
        events.append((clock[c], 3, ("o", bh, m), q_bytes, False))
    events.sort(key=lambda e: (e[0], e[1]))
    cache: OrderedDict = OrderedDict()
    used = read = 0
    for _, _, key, size, is_load in events:
        if key in cache:
            cache.move_to_end(key)
            continue
        read += size if is_load else 0
        cache[key] = size
        used += size
        while used > l2_bytes:
            used -= cache.popitem(last=False)[1]
    return read


def pairs_for_share(call, share: float, sms: int = 132) -> int:
    """The section size the host dispatches with L2 share `share` (schedule_arg's)."""
    from flashcuda.ops import fwd_sm90

    cfg = fwd_sm90.plan_config(call, sms)
    old = os.environ.get(fwd_sm90.L2_SHARE_ENV)
    os.environ[fwd_sm90.L2_SHARE_ENV] = str(share)
    try:
        return fwd_sm90.schedule_arg(call, cfg, L2_BYTES, cfg.grid(call, sms)[0])
    finally:
        if old is None:
            os.environ.pop(fwd_sm90.L2_SHARE_ENV)
        else:
            os.environ[fwd_sm90.L2_SHARE_ENV] = old


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs=4, type=int, required=True, metavar=("B", "S", "H", "D"))
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--share", nargs="*", type=float, default=[0.35, 0.75])
    ap.add_argument("--pairs", nargs="*", type=int, default=[])
    ap.add_argument("--l2-mb", nargs="+", type=float, default=[32.0, 50.0])
    ap.add_argument("--jitter", type=float, default=0.0)
    ap.add_argument("--sms", type=int, default=132)
    a = ap.parse_args(argv)
    b, s, h, d = a.shape
    hkv = a.kv_heads or h
    if h % hkv:
        ap.error("--kv-heads must divide H")
    if not 0.0 <= a.jitter < 1.0:
        ap.error("--jitter: expected a number in [0, 1)")
    call = meta_call(b, s, h, d, hkv)
    minimum = b * s * d * 2 * (h + 2 * hkv)
    print(f"{b} x {s} x {h} d{d} kv{hkv} causal: Q + K + V {minimum / 1e6:.1f} MB; "
          f"modelled DRAM reads (MB) by LRU size")
    rows = [(f"share {x}", pairs_for_share(call, x, a.sms)) for x in a.share]
    rows += [(f"pairs {p}", p) for p in a.pairs]
    print(f"{'':>12} {'pairs':>6} " + " ".join(f"{f'{mb:g} MiB':>9}" for mb in a.l2_mb))
    for label, pairs in rows:
        reads = [dram_reads(call, pairs, int(mb * (1 << 20)), a.sms, a.jitter) / 1e6
                 for mb in a.l2_mb]
        print(f"{label:>12} {pairs:>6} " + " ".join(f"{r:>9.1f}" for r in reads))
    return 0


if __name__ == "__main__":
    sys.exit(main())

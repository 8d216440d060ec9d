"""The sm90 backward's shared-memory layouts, emulated on the CPU: what its address arithmetic
writes and what its wgmma descriptors read, under the canonical 128B-swizzle layouts of the PTX
ISA ("Shared Memory Matrix Layout", CUTLASS make_gmma_desc):

    K-major   element (mn, k) at start + (mn % 8) * 128 + (mn // 8) * SBO + 2 k
    MN-major  element (mn, k) at start + 2 (mn % 64) + (mn // 64) * LBO + (k % 8) * 128
              + (k // 8) * SBO
    then the 128B swizzle of the absolute address: bits 4-6 ^= bits 7-9 (1024-aligned tiles).

The emulator is first checked against the forward's two proven reads (Q K^T K-major, P V with V
read MN-major, as TMA stores them), then used on the backward's: S^T / dP^T (K-major), dV / dK
(Q, dO read MN-major), and dQ = dS K (dS as store_ds writes it, both layouts; K read MN-major).
It checks the kernel's index arithmetic, mirrored here line by line; it cannot check the
hardware's reading of the descriptors (the GPU tests do).
"""

from __future__ import annotations

import numpy as np
import pytest


def swizzle(addr: int) -> int:
    return addr ^ (((addr >> 7) & 7) << 4)


def desc(start: int, lbo: int, sbo: int) -> tuple[int, int, int]:
    """smem_desc's fields, decoded (start, LBO, SBO in bytes), as the 14-bit >> 4 encoding keeps
    them."""
    enc = ((start & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16) | (((sbo & 0x3FFFF) >> 4) << 32)
    return (enc & 0x3FFF) << 4, ((enc >> 16) & 0x3FFF) << 4, ((enc >> 32) & 0x3FFF) << 4


def read_k_major(mem: np.ndarray, d: tuple[int, int, int], mn: int, k: int) -> int:
    start, _, sbo = d
    return mem[swizzle(start + (mn % 8) * 128 + (mn // 8) * sbo + 2 * k) // 2]


def read_mn_major(mem: np.ndarray, d: tuple[int, int, int], mn: int, k: int) -> int:
    start, lbo, sbo = d
    off = 2 * (mn % 64) + (mn // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo
    return mem[swizzle(start + off) // 2]


def tma_store(mem: np.ndarray, base: int, tile: np.ndarray) -> None:
    """What TMA writes for a [rows][cols] tile: cols / 64 chunks of [rows][64] 128-byte rows."""
    rows, cols = tile.shape
    for c in range(cols // 64):
        for r in range(rows):
            for j in range(64):
                mem[swizzle(base + c * rows * 128 + r * 128 + 2 * j) // 2] = tile[r, 64 * c + j]


def operand(read, mem, descs_for_step, m: int, steps: int) -> np.ndarray:
    """The m x (16 steps) operand the wgmma steps read (descs_for_step(kk) -> descriptor)."""
    out = np.zeros((m, 16 * steps), dtype=np.int64)
    for kk in range(steps):
        d = descs_for_step(kk)
        for mn in range(m):
            for k in range(16):
                out[mn, 16 * kk + k] = read(mem, d, mn, k)
    return out


def labels(rows: int, cols: int, tag: int) -> np.ndarray:
    return tag * 10**6 + np.arange(rows)[:, None] * 1000 + np.arange(cols)[None, :]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_emulator_reproduces_the_proven_forward_reads(head_dim):
    """flash_fwd_sm90.cu's issue_scores (Q, K K-major) and issue_accumulate (V MN-major)."""
    bm = bn = 128
    mem = np.zeros(1 << 17, dtype=np.int64)
    q, k, v = labels(bm, head_dim, 1), labels(bn, head_dim, 2), labels(bn, head_dim, 3)
    q_base, k_base, v_base = 0, bm * head_dim * 2, 2 * bm * head_dim * 2
    for base, t in ((q_base, q), (k_base, k), (v_base, v)):
        tma_store(mem, base, t)
    steps = head_dim // 16
    a = operand(read_k_major, mem, lambda kk: desc(
        q_base + (kk // 4) * bm * 128 + (kk % 4) * 32, 16, 1024), 64, steps)
    assert (a == q[:64]).all()
    b = operand(read_k_major, mem, lambda kk: desc(
        k_base + (kk // 4) * bn * 128 + (kk % 4) * 32, 16, 1024), bn, steps)
    assert (b == k).all()  # B = K^T: element (n = key, k = d)
    bv = operand(read_mn_major, mem, lambda kk: desc(v_base + kk * 16 * 128, bn * 128, 1024),
                 head_dim, bn // 16)
    assert (bv == v.T).all()  # B = V: element (n = d, k = key)


def store_ds(mem: np.ndarray, ds: int, ds_t: np.ndarray, bm: int, bn: int, k_major: bool) -> None:
    """Consumer::store_ds for every lane of both consumers: ds16[kk][f] holds (key r, queries q,
    q + 1), r = 64 c + 16 warp + g + 8 (f & 1), q = 16 kk + 8 (f >> 1) + 2 t."""
    chunk = bm * 128 if k_major else bn * 128
    for c in range(bn // 64):
        for warp in range(4):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                r0 = 64 * c + 16 * warp + g
                for kk in range(bm // 16):
                    for f in range(4):
                        r = r0 + 8 * (f & 1)
                        q = 16 * kk + 8 * (f >> 1) + 2 * t
                        for e in range(2):
                            qe = q + e
                            if k_major:
                                unit = ((r % 64) // 8) ^ (qe % 8)
                                addr = ds + (r // 64) * chunk + qe * 128 + unit * 16 + (r % 8) * 2
                            else:
                                unit = ((q % 64) // 8) ^ (r % 8)
                                addr = ds + (q // 64) * chunk + r * 128 + unit * 16 + (q % 8) * 2
                                addr += 2 * e
                            mem[addr // 2] = ds_t[r, qe]


@pytest.mark.parametrize("k_major", [False, True], ids=["ds-mn", "ds-k"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_reads(head_dim, k_major):
    bm, bn = {64: 128, 128: 64}[head_dim], 128
    mem = np.zeros(1 << 18, dtype=np.int64)
    q, do, k, v = (labels(r, head_dim, i) for i, r in enumerate((bm, bm, bn, bn), 1))
    k_base, v_base = 0, bn * head_dim * 2
    q_base, do_base = 2 * v_base, 2 * v_base + bm * head_dim * 2
    ds_base = do_base + bm * head_dim * 2
    assert ds_base % 1024 == 0
    for base, t in ((q_base, q), (do_base, do), (k_base, k), (v_base, v)):
        tma_store(mem, base, t)
    ds_t = labels(bn, bm, 5)  # dS^T [key][query]
    store_ds(mem, ds_base, ds_t, bm, bn, k_major)
    qchunk, kvchunk = bm * 128, bn * 128

    for c in range(bn // 64):
        # S^T = K_c Q^T, dP^T = V_c dO^T: issue_transposed_scores
        for x_base, x, y_base, y in ((k_base, k, q_base, q), (v_base, v, do_base, do)):
            rows = x_base + 64 * c * 128
            a = operand(read_k_major, mem, lambda kk, rows=rows: desc(
                rows + (kk // 4) * kvchunk + (kk % 4) * 32, 16, 1024), 64, head_dim // 16)
            assert (a == x[64 * c:64 * c + 64]).all()
            b = operand(read_k_major, mem, lambda kk, y_base=y_base: desc(
                y_base + (kk // 4) * qchunk + (kk % 4) * 32, 16, 1024), bm, head_dim // 16)
            assert (b == y).all()
    # dV += P^T dO, dK += dS^T Q: issue_key_grad, B = dO / Q (n = d, k = query)
    for base, t in ((do_base, do), (q_base, q)):
        b = operand(read_mn_major, mem, lambda kk, base=base: desc(
            base + kk * 16 * 128, qchunk, 1024), head_dim, bm // 16)
        assert (b == t.T).all()
    # dQ = dS K: issue_dq, consumer c -> query tile tm, d tile td
    dschunk = bm * 128 if k_major else bn * 128
    for c in range(bn // 64):
        tm, td = c % (bm // 64), c // (bm // 64)
        if k_major:
            a = operand(read_k_major, mem, lambda kk, tm=tm: desc(
                ds_base + (kk // 4) * dschunk + tm * 64 * 128 + (kk % 4) * 32, 16, 1024),
                64, bn // 16)
        else:
            a = operand(read_mn_major, mem, lambda kk, tm=tm: desc(
                ds_base + tm * dschunk + kk * 16 * 128, dschunk, 1024), 64, bn // 16)
        assert (a == ds_t.T[64 * tm:64 * tm + 64]).all()  # A = dS: (m = query, k = key)
        b = operand(read_mn_major, mem, lambda kk, td=td: desc(
            k_base + td * kvchunk + kk * 16 * 128, kvchunk, 1024), 64, bn // 16)
        assert (b == k[:, 64 * td:64 * td + 64].T).all()  # B = K: (n = d, k = key)


def store_ds_trans(mem: np.ndarray, ds: int, ds_t: np.ndarray, bm: int, bn: int) -> None:
    """Consumer::store_ds_trans (FC_DQ_SWAP) for every lane of both consumers: per k16 step kk,
    stmatrix.x4.trans writes matrix f (keys r = row0 + 8 (f & 1) + 0..7, queries 16 kk + 8 (f >> 1)
    + 0..7) transposed: memory row i (the address lane 8 f + i gives) holds query q_i's 8 keys,
    16 contiguous bytes. `ds_t` is dS^T [key][query] as the accumulator holds it."""
    chunk = bm * 128  # [query][key]: chunks of 64 keys x bm queries
    for c in range(bn // 64):
        for warp in range(4):
            row0 = 64 * c + 16 * warp
            for kk in range(bm // 16):
                for lane in range(32):  # the address lane gives: row lane & 7 of matrix lane >> 3
                    f, i = lane >> 3, lane & 7
                    r = row0 + 8 * (f & 1)
                    q = 16 * kk + 8 * (f >> 1) + i
                    unit = ((r % 64) // 8) ^ (q % 8)
                    addr = ds + (r // 64) * chunk + q * 128 + unit * 16
                    for e in range(8):  # the row's element e: fragment row e = key r + e
                        mem[(addr + 2 * e) // 2] = ds_t[r + e, q]


def test_swap_stmatrix_trans_writes_what_the_k_major_store_does():
    """store_ds_trans's stmatrix.trans rows against store_ds's [query][key] scatter (the layout
    both dQ readers of that layout were proven with), at the swap's 80 queries."""
    bm, bn = 80, 128
    ds_t = labels(bn, bm, 5)
    a, b = (np.full(1 << 16, -1, dtype=np.int64) for _ in range(2))
    store_ds(a, 0, ds_t, bm, bn, k_major=True)
    store_ds_trans(b, 0, ds_t, bm, bn)
    assert (a == b).all() and (a >= 0).sum() == bm * bn


def test_swap_reads():
    """FC_DQ_SWAP at d128, 80-query steps: S^T / dP^T (B = Q / dO, N = 80 K-major), dV / dK
    (B = dO / Q MN-major, K = 80 queries in 5 k16 steps) and dQ^T = K^T dS^T (A = K's chunk c read
    MN-major: (m = d, k = key); B = dS as store_ds_trans writes it, read K-major: (n = query,
    k = key))."""
    head_dim, bm, bn = 128, 80, 128
    mem = np.zeros(1 << 18, dtype=np.int64)
    q, do, k, v = (labels(r, head_dim, i) for i, r in enumerate((bm, bm, bn, bn), 1))
    k_base, v_base = 0, bn * head_dim * 2
    q_base, do_base = 2 * v_base, 2 * v_base + bm * head_dim * 2
    ds_base = do_base + bm * head_dim * 2
    assert q_base % 1024 == 0 and do_base % 1024 == 0 and ds_base % 1024 == 0
    for base, t in ((q_base, q), (do_base, do), (k_base, k), (v_base, v)):
        tma_store(mem, base, t)
    ds_t = labels(bn, bm, 5)
    store_ds_trans(mem, ds_base, ds_t, bm, bn)
    qchunk, kvchunk, dschunk = bm * 128, bn * 128, bm * 128
    for y_base, y in ((q_base, q), (do_base, do)):
        b = operand(read_k_major, mem, lambda kk, y_base=y_base: desc(
            y_base + (kk // 4) * qchunk + (kk % 4) * 32, 16, 1024), bm, head_dim // 16)
        assert (b == y).all()
        b = operand(read_mn_major, mem, lambda kk, y_base=y_base: desc(
            y_base + kk * 16 * 128, qchunk, 1024), head_dim, bm // 16)
        assert (b == y.T).all()
    for c in range(bn // 64):  # consumer c: dQ^T rows d = 64 c ..
        a = operand(read_mn_major, mem, lambda kk, c=c: desc(
            k_base + c * kvchunk + kk * 16 * 128, kvchunk, 1024), 64, bn // 16)
        assert (a == k[:, 64 * c:64 * c + 64].T).all()  # A = K^T: (m = d, k = key)
    b = operand(read_k_major, mem, lambda kk: desc(
        ds_base + (kk // 4) * dschunk + (kk % 4) * 32, 16, 1024), bm, bn // 16)
    assert (b == ds_t.T).all()  # B = dS: (n = query, k = key)

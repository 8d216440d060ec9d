"""The sm90 backward's index arithmetic, emulated lane by lane in float64 on the CPU and compared
with autograd: the step list (Steps), the mask and tile_needs_mask, the lse2 / delta reads of
probs / dsoftmax, the dQ tile of each consumer and its staging for the writer warp (FC_DQ_TMA:
the 128B-swizzled boxes and one tensor-map reduce-add per box; FC_DQ_FRAG: each consumer's tile
in its registers' order, one bulk reduce-add each, read back by CONVERT's frag_offset), the
epilogue's dK / dV addresses (the quad transpose and 16-byte chunks), bwd_sm80's PRE (Sq_pad
rows, +inf for padding) and CONVERT around it. The
GEMMs are done as matrices (their operand layouts are tests/cpu/test_bwd_sm90_layouts.py's, the
fragment reuse is the forward's). Every formula below mirrors a line of flash_bwd_sm90.cu.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashcuda.ops.bwd_sm90 import Sm90BwdConfig
from flashcuda.ops.call import kernel_windows
from flashcuda.reference import attention_ref

LOG2E = 1.4426950408889634


class Mask:  # mask.cuh
    def __init__(self, sq, sk, wl, wr):
        self.sq, self.sk, self.wl, self.wr = sq, sk, int(wl), int(wr)

    def shift(self):
        return self.sk - self.sq

    def visible(self, i, j):
        d = j - i - self.shift()
        return j < self.sk and -self.wl <= d <= self.wr

    def tile_needs_mask(self, row0, rows, col0, cols):
        row_last = min(row0 + rows - 1, self.sq - 1)
        col_last = col0 + cols - 1
        return (col_last >= self.sk or col_last > row0 + self.shift() + self.wr
                or col0 < row_last + self.shift() - self.wl)


def steps(mask, n0, bm, bn, nheads, nheads_kv):  # struct Steps
    n_end = min(n0 + bn, mask.sk)
    q_begin = max(0, n0 - mask.shift() - mask.wr)
    q_end = min(mask.sq, n_end - 1 - mask.shift() + mask.wl + 1)
    m_first = q_begin // bm
    n_m = (q_end - 1) // bm - m_first + 1 if q_end > q_begin else 0
    group = nheads // nheads_kv
    return [(head_kv_h, (m_first + it % n_m) * bm) for it in range(n_m * group)
            for head_kv_h in [it // n_m]]


def dq_swizzled(row, col, bm):
    """FC_DQ_TMA's staging: the float index of (row, col) of the step's dQ tile (box col / 32 of
    bm rows x 32 floats, 16-byte chunk ((col % 32) / 4) ^ (row % 8), word col % 4)."""
    return (col // 32) * bm * 32 + row * 32 + (((col % 32) // 4) ^ (row % 8)) * 4 + col % 4


def frag_offset(row, col, bm, D):
    """CONVERT's FC_DQ_FRAG_M reader (flash_bwd_sm80.cu): where (row, col) of a (batch, head)
    slice of dQ lies in the register-order dq_accum."""
    tiles_m, per_tile = bm // 64, bm * D // 4096
    r = row % bm
    rr, cc = r % 64, col % 64
    c = r // 64 + tiles_m * (col // 64)
    w = 32 * (rr // 16) + 4 * (rr % 8) + (cc % 8) // 2
    i = 4 * (cc // 8) + 2 * ((rr % 16) // 8) + cc % 2
    return ((row // bm) * per_tile + c) * 4096 + 512 * (i // 4) + 4 * w + i % 4


def quad_transpose(words):  # common/sm90.cuh: words[q][i] is lane q's a[i]
    a = [list(w) for w in words]
    for k in range(2):
        m = 1 << k
        for lo in (i for i in range(4) if not i & m):
            hi = lo | m
            sent = [a[q][lo] if (q >> k) & 1 else a[q][hi] for q in range(4)]
            for q in range(4):
                a[q][lo if (q >> k) & 1 else hi] = sent[q ^ m]
    return a


def emulate(q, k, v, out, dout, lse, scale, wl, wr, dq):
    B, sq, H, D = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    cfg = Sm90BwdConfig(torch.bfloat16, D, **{f"dq_{dq}": True})
    bm, bn = cfg.block_m, cfg.block_n
    sq_pad = cfg.seqlen_pad(sq)
    wl, wr = kernel_windows(sq, sk, wl, wr)
    mask = Mask(sq, sk, wl, wr)
    q, k, v, out, dout = (t.double().numpy() for t in (q, k, v, out, dout))
    lse = lse.double().numpy()
    # PRE
    lse2 = np.full((B, H, sq_pad), np.inf)
    delta = np.zeros((B, H, sq_pad))
    for b in range(B):
        for h in range(H):
            for r in range(sq):
                delta[b, h, r] = (out[b, r, h] * dout[b, r, h]).sum()
                if lse[b, h, r] != -np.inf:
                    lse2[b, h, r] = lse[b, h, r] * LOG2E
    dq_accum = np.zeros(B * H * sq_pad * D)
    dk = np.full(k.shape, np.nan)
    dv = np.full(v.shape, np.nan)
    scale_log2 = scale * LOG2E
    group = H // hkv

    def rows(t, b, h, r0, n):  # a TMA box: rows past the tensor are zero
        tile = np.zeros((n, D))
        m = max(0, min(n, t.shape[1] - r0))
        tile[:m] = t[b, r0:r0 + m, h]
        return tile

    for b in range(B):
        for head_kv in range(hkv):
            for n0 in range(0, sk, bn):
                kt, vt = rows(k, b, head_kv, n0, bn), rows(v, b, head_kv, n0, bn)
                dk_acc = np.zeros((bn, D))
                dv_acc = np.zeros((bn, D))
                for it_head, m0 in steps(mask, n0, bm, bn, H, hkv):
                    h = head_kv * group + it_head
                    bh = b * H + h
                    qt, dot = rows(q, b, h, m0, bm), rows(dout, b, h, m0, bm)
                    st_lse2, st_delta = lse2[b, h, m0:m0 + bm], delta[b, h, m0:m0 + bm]
                    ds_t = np.zeros((bn, bm))
                    for c in range(bn // 64):
                        wg_key0 = 64 * c
                        s = kt[wg_key0:wg_key0 + 64] @ qt.T
                        dp = vt[wg_key0:wg_key0 + 64] @ dot.T
                        masked = mask.tile_needs_mask(m0, bm, n0 + wg_key0, 64)
                        p_t = np.zeros((64, bm))
                        d_t = np.zeros((64, bm))
                        for warp in range(4):
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                key_row = wg_key0 + 16 * warp + g
                                key0, col0 = n0 + key_row, m0 + 2 * t
                                for j in range(bm // 8):
                                    for e in range(4):
                                        row = 16 * warp + g + 8 * (e >> 1)  # accumulator layout
                                        col = 8 * j + 2 * t + (e & 1)
                                        l2 = st_lse2[2 * t + 8 * j + (e & 1)]
                                        p = np.exp2(s[row, col] * scale_log2 - l2)
                                        if masked and not mask.visible(col0 + 8 * j + (e & 1),
                                                                       key0 + 8 * (e >> 1)):
                                            p = 0.0
                                        dl = st_delta[2 * t + 8 * j + (e & 1)]
                                        ds = p * (dp[row, col] - dl)
                                        if masked and p == 0.0:
                                            ds = 0.0
                                        p_t[row, col], d_t[row, col] = p, ds
                        dv_acc[wg_key0:wg_key0 + 64] += p_t @ dot
                        dk_acc[wg_key0:wg_key0 + 64] += d_t @ qt
                        ds_t[wg_key0:wg_key0 + 64] = d_t
                    # the step's dQ staging; shared memory holds the previous step's tile (or
                    # garbage): NaN here, so a float no consumer stores this step shows up in dq
                    stage = np.full(bm * D, np.nan)
                    for c in range(bn // 64):
                        tm, td = c % (bm // 64), c // (bm // 64)
                        dq_tile = (ds_t.T @ kt)[64 * tm:64 * tm + 64, 64 * td:64 * td + 64]
                        for warp in range(4):
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                # the accumulator fragment: register i of the 64 x 64 tile
                                regs = [dq_tile[16 * warp + g + 8 * ((i % 4) // 2),
                                                8 * (i // 4) + 2 * t + i % 2] for i in range(32)]
                                if dq == "frag":  # stage_dq_frag: float4 k at 512 k + 4 w
                                    w = 32 * warp + lane
                                    for i in range(32):
                                        stage[c * 4096 + 512 * (i // 4) + 4 * w + i % 4] = regs[i]
                                    continue
                                for j in range(8):  # stage_dq: float2 (j, h) at dq_swizzled
                                    for h in range(2):
                                        row = 64 * tm + 16 * warp + g + 8 * h
                                        col = 64 * td + 8 * j + 2 * t
                                        f = dq_swizzled(row, col, bm)
                                        assert f % 2 == 0 and dq_swizzled(row, col + 1, bm) == f + 1
                                        stage[f:f + 2] = regs[4 * j + 2 * h:4 * j + 2 * h + 2]
                    # write_dq, after dq_full
                    assert m0 + bm <= sq_pad, "the step's rows past dq_accum's"
                    if dq == "frag":  # one bulk reduce-add per consumer's 16 KB tile
                        tile = ((b * H + h) * (sq_pad // bm) + m0 // bm) * (bn // 64)
                        for c in range(bn // 64):
                            dq_accum[(tile + c) * 4096:(tile + c + 1) * 4096] += \
                                stage[c * 4096:(c + 1) * 4096]
                    else:  # one tensor-map reduce-add per box: rows row0.., columns 32 bx..
                        row0 = bh * sq_pad + m0
                        for bx in range(D // 32):
                            for r in range(bm):
                                for cc in range(32):
                                    dq_accum[(row0 + r) * D + 32 * bx + cc] += \
                                        stage[dq_swizzled(r, 32 * bx + cc, bm)]
                # epilogue (quad_transpose): per quad (the four lanes t of row g) and row half hh,
                # lane t's word j is its pair at columns 8 j + 2 t; quad_transpose per four
                # chunks, then lane t stores chunk 4 c4 + t whole (words i: columns + 2 i)
                for c in range(bn // 64):
                    for warp in range(4):
                        for g in range(8):
                            key_row = 64 * c + 16 * warp + g
                            for hh in range(2):
                                key = n0 + key_row + 8 * hh
                                row = key_row + 8 * hh
                                words = [[(8 * j + 2 * t, 8 * j + 2 * t + 1) for j in range(D // 8)]
                                         for t in range(4)]
                                for c4 in range(D // 32):
                                    got = quad_transpose([w[4 * c4:4 * c4 + 4] for w in words])
                                    for t in range(4):
                                        if key >= sk:
                                            continue
                                        for i, pair in enumerate(got[t]):
                                            for e, src in enumerate(pair):
                                                col = 8 * (4 * c4 + t) + 2 * i + e
                                                dk[b, key, head_kv, col] = dk_acc[row, src] * scale
                                                dv[b, key, head_kv, col] = dv_acc[row, src]
    # CONVERT
    if dq == "frag":
        slices = dq_accum.reshape(B, H, sq_pad * D)
        at = np.array([[frag_offset(r, col, bm, D) for col in range(D)] for r in range(sq)])
        return slices[:, :, at].transpose(0, 2, 1, 3) * scale, dk, dv
    dq_rows = dq_accum.reshape(B, H, sq_pad, D)[:, :, :sq].transpose(0, 2, 1, 3) * scale
    return dq_rows, dk, dv


CASES = [  # B, Sq, Sk, H, Hkv, D, window
    (1, 17, 143, 2, 1, 64, (None, 0)),
    (1, 143, 17, 1, 1, 128, (None, None)),
    (2, 70, 200, 2, 2, 128, (None, 0)),
    (1, 200, 130, 2, 1, 64, (30, 10)),
    (1, 150, 100, 1, 1, 128, (None, 0)),  # rows < 50 see no key
]


@pytest.mark.parametrize("dq", ["tma", "frag"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:6])) + f"-{c[6]}")
def test_emulated_kernel_matches_autograd(case, dq):
    B, sq, sk, H, hkv, D, window = case
    g = torch.Generator().manual_seed(sq * 31 + sk)
    q, k, v, dout = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in
                     ((B, sq, H, D), (B, sk, hkv, D), (B, sk, hkv, D), (B, sq, H, D)))
    scale = D ** -0.5
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_ref(q64, k64, v64, scale, window=window)
    out.backward(dout)
    got = emulate(q, k, v, out.detach(), dout, lse.detach(), scale, *window, dq=dq)
    for name, ours, ref in zip(("dq", "dk", "dv"), got, (q64.grad, k64.grad, v64.grad),
                               strict=True):
        assert not np.isnan(ours).any(), f"{name}: unwritten elements"
        err = np.abs(ours - ref.numpy()).max()
        assert err < 1e-9, f"{name}: {err:.3e}"

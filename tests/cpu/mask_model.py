"""mask.cuh's Mask, line for line, for the CPU emulations of the kernels' masked-V paths."""

from __future__ import annotations


class Mask:
    def __init__(self, sq, sk, wl, wr):
        self.sq, self.sk, self.wl, self.wr = sq, sk, wl, wr

    def shift(self):
        return self.sk - self.sq

    def visible(self, i, j):
        d = j - i - self.shift()
        return j < self.sk and -self.wl <= d <= self.wr

    def key_begin(self, row_begin):
        return max(row_begin + self.shift() - self.wl, 0)

    def key_end(self, row_end):
        j = row_end - 1 + self.shift() + self.wr + 1
        return 0 if j < 0 else min(j, self.sk)

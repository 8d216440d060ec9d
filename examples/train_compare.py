"""Train a small causal transformer twice — attention by PyTorch SDPA, then by flashcuda — from the
same initial weights and data, and compare the loss curves (issue 5's end-to-end check).

    python examples/train_compare.py --steps 300 --out train-compare     # on a GPU

Model: 4 layers, d_model 512, 8 heads of 64, seqlen 512, batch 16, bf16 autocast, AdamW; q, k, v
reach flashcuda as strided views of the packed qkv projection. Data: a fixed
random first-order Markov chain over 512 tokens (learnable: the loss falls from ln 512 = 6.24 toward
the chain's entropy), same batches for both runs. Writes <out>/train-compare.json and .png; exits 1
if the two curves differ by more than the noise band (mean |difference| over the last 50 steps >
0.05 nats, or any non-finite loss).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashcuda


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attn: str):
        super().__init__()
        self.heads, self.attn = heads, attn
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.unbind(2)  # (B, S, H, D) views of one packed tensor: no copy for flashcuda
        if self.attn == "flashcuda":
            y = flashcuda.flash_attn_func(q, k, v, causal=True)
        else:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True).transpose(1, 2)
        x = x + self.proj(y.reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seqlen: int, attn: str):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seqlen, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, attn) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def make_data(steps: int, batch: int, seqlen: int, vocab: int, seed: int) -> torch.Tensor:
    """(steps, batch, seqlen + 1) tokens of a fixed random Markov chain, drawn once."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    trans = (torch.randn(vocab, vocab, device="cuda", generator=g) * 2.0).softmax(-1)
    tok = torch.randint(vocab, (steps * batch,), device="cuda", generator=g)
    seq = [tok]
    for _ in range(seqlen):
        tok = torch.multinomial(trans[tok], 1, generator=g).squeeze(1)
        seq.append(tok)
    return torch.stack(seq, 1).view(steps, batch, seqlen + 1)


def train(attn: str, args, init_state, data_all: torch.Tensor) -> list[float]:
    model = Model(args.vocab, args.dim, args.heads, args.layers, args.seqlen, attn).cuda()
    model.load_state_dict(init_state)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for step, data in enumerate(data_all):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), data[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0:
            print(f"{attn:9s} step {step:4d} loss {losses[-1]:.4f}", flush=True)
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("train-compare"))
    args = p.parse_args()
    torch.manual_seed(args.seed)
    init = Model(args.vocab, args.dim, args.heads, args.layers, args.seqlen, "sdpa").cuda().state_dict()
    data = make_data(args.steps, args.batch, args.seqlen, args.vocab, args.seed)
    curves, seconds = {}, {}
    for attn in ("sdpa", "flashcuda"):
        t = time.perf_counter()
        curves[attn] = train(attn, args, init, data)
        seconds[attn] = time.perf_counter() - t
    a, b = curves["sdpa"], curves["flashcuda"]
    tail = min(50, len(a))
    diff = sum(abs(x - y) for x, y in zip(a[-tail:], b[-tail:], strict=True)) / tail
    finite = all(math.isfinite(x) for x in a + b)
    ok = finite and diff <= 0.05
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "gpu": torch.cuda.get_device_name(), "losses": curves, "seconds": seconds,
              "mean_abs_diff_last": diff, "tail": tail, "ok": ok}
    (args.out / "train-compare.json").write_text(json.dumps(record))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(a, label="PyTorch SDPA", linewidth=1.2)
    ax.plot(b, label="flashcuda", linewidth=1.2, linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(f"{args.layers}-layer causal transformer, bf16, {torch.cuda.get_device_name()}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / "train-compare.png", dpi=110)
    print(f"final loss sdpa {a[-1]:.4f} flashcuda {b[-1]:.4f}; mean |diff| over the last {tail} "
          f"steps {diff:.4f} -> {'ok' if ok else 'DIFFERENT'}; time sdpa {seconds['sdpa']:.0f}s "
          f"flashcuda {seconds['flashcuda']:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Generate tokens with a KV cache — flashcuda.flash_attn_with_kvcache — and check every step's
logits against recomputing the whole sequence with PyTorch SDPA (no cache).

    python examples/generate_kvcache.py                       # a GPU if there is one, else CPU
    python examples/generate_kvcache.py --device cpu --tokens 8
    python examples/generate_kvcache.py --paged               # the caches as pages + a block table
    python examples/generate_kvcache.py --graph               # each decode step replayed from a
                                                              # CUDA graph (the serving pattern)
    python examples/generate_kvcache.py --paged --runs        # kvcache.SPANS_ON_DEVICE off: a
                                                              # paged step as runs on a gathered copy

Model: a small random-weight causal transformer (GQA: 8 query heads over 2 KV heads, rotary
position embeddings, GPT-NeoX style), a batch of prompts of different lengths (each row's cache
holds its own number of keys: cache_seqlens), a prefill, then one token per step, greedy. The
cache is written in place by the call that attends to it (k / v rotated by rotary_cos /
rotary_sin, appended at cache_seqlens); with --paged, the caches are a pool of 4-position pages
that a block table hands out in shuffled order; with --graph (CUDA), the decode step is captured
once in a CUDA graph and replayed per token, the next token and cache_seqlens written into the
captured tensors on the device (flash_attn_with_kvcache reads nothing on the host while a graph
is captured). A paged decode step is one call of the decode kernels, which read the block table
on the device (flashcuda.kvcache.SPANS_ON_DEVICE, the default); --runs turns that off (a paged
step then runs on a gathered contiguous copy, and --graph cannot page). The full recompute rotates q and k itself
(rotate_half). Prints the largest logit difference per step and exits 1
if any exceeds the dtype's tolerance (fp32 on CPU: 1e-4; bf16 on a GPU: 0.1), or if the two runs
choose different tokens where the top two logits are further apart than that tolerance.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashcuda


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def project(self, x: torch.Tensor):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(dim=2)
        return q, k, v


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, seqlen, heads, head_dim) at positions 0 .. seqlen - 1, GPT-NeoX style:
    x cos + rotate_half(x) sin, with the (positions, head_dim / 2) tables repeated twice."""
    c, s = (torch.cat((t, t), -1)[:x.shape[1], None, :].float() for t in (cos, sin))
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return (x.float() * c + rotated.float() * s).to(x.dtype)


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, kv_heads: int, layers: int,
                 positions: int):
        super().__init__()
        head_dim = dim // heads
        angle = torch.outer(torch.arange(positions).float(),
                            10000.0 ** (-torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("cos", angle.cos())  # (positions, head_dim / 2)
        self.register_buffer("sin", angle.sin())
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.attns = nn.ModuleList(Attention(dim, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def full(self, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Logits of each row's last real token, recomputing every position (SDPA, no cache).
        Rows are right-padded; a causal mask keeps padding from reaching real positions."""
        x = self.embed(tokens)
        for norm, attn in zip(self.norms, self.attns, strict=True):
            q, k, v = attn.project(norm(x))
            q, k = rope(q, self.cos, self.sin), rope(k, self.cos, self.sin)
            group = attn.heads // attn.kv_heads
            k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
            o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                               is_causal=True).transpose(1, 2)
            x = x + attn.out(o.reshape(x.shape))
        last = torch.stack([x[b, n - 1] for b, n in enumerate(lengths)])
        return self.head(last)

    def step(self, tokens: torch.Tensor, caches, seqlens: torch.Tensor,
             table: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the last of `tokens` (batch, new) per row, attending through the caches
        (rotated and appended in place at `seqlens`; paged through `table` when given)."""
        x = self.embed(tokens)
        for norm, attn, (k_cache, v_cache) in zip(self.norms, self.attns, caches, strict=True):
            q, k, v = attn.project(norm(x))
            o = flashcuda.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                  rotary_cos=self.cos.to(q.dtype),
                                                  rotary_sin=self.sin.to(q.dtype),
                                                  cache_seqlens=seqlens, block_table=table,
                                                  causal=True, rotary_interleaved=False)
            x = x + attn.out(o.reshape(x.shape))
        return self.head(x[:, -1])


def capture_step(model: Model, caches, batch: int, seqlens: torch.Tensor,
                 table: torch.Tensor | None = None):
    """model.step for one new token per row, captured in a CUDA graph: returns a step function
    that copies the tokens into the captured input and replays (the caches and `seqlens` are the
    captured tensors themselves; the logits come back in the graph's output tensor)."""
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=seqlens.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on scratch caches: kernels loaded, nothing appended
        scratch = [(kc.clone(), vc.clone()) for kc, vc in caches]
        model.step(tokens, scratch, seqlens.clone(), table)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model.step(tokens, caches, seqlens, table)

    def step(new_tokens, caches_, seqlens_, table=None):
        tokens.copy_(new_tokens)
        graph.replay()
        return logits

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=16, help="tokens to generate per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paged", action="store_true",
                        help="caches as 4-position pages handed out by a block table")
    parser.add_argument("--graph", action="store_true",
                        help="replay the decode step from a CUDA graph (CUDA; with --paged not "
                             "with --runs)")
    parser.add_argument("--runs", action="store_true",
                        help="flashcuda.kvcache.SPANS_ON_DEVICE off: paged steps on a gathered "
                             "copy, one call per run of entries")
    args = parser.parse_args()
    device = torch.device(args.device)
    flashcuda.kvcache.SPANS_ON_DEVICE = not args.runs
    if args.graph and (device.type != "cuda" or (args.paged and args.runs)):
        parser.error("--graph needs a CUDA device, and --paged with --graph cannot take --runs")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 0.1 if dtype == torch.bfloat16 else 1e-4
    torch.manual_seed(args.seed)
    vocab, dim, heads, kv_heads, layers = 256, 256, 8, 2, 2
    lengths = [5, 12, 9]  # prompt lengths: the rows' caches hold different numbers of keys
    batch, cap, page = len(lengths), max(lengths) + args.tokens, 4
    model = Model(vocab, dim, heads, kv_heads, layers, cap).to(device).eval()
    model = model.to(dtype)  # the rotary tables too: flash_attn_with_kvcache takes q's dtype
    prompts = torch.randint(0, vocab, (batch, max(lengths)), device=device)
    table = None
    if args.paged:  # every row's pages drawn from one shuffled pool (two spare pages)
        blocks = -(-cap // page)
        table = torch.randperm(batch * blocks + 2, device=device)[:batch * blocks]
        table = table.view(batch, blocks).to(torch.int32)
        shape = (batch * blocks + 2, page, kv_heads, dim // heads)
    else:
        shape = (batch, cap, kv_heads, dim // heads)
    caches = [(torch.zeros(shape, device=device, dtype=dtype),
               torch.zeros(shape, device=device, dtype=dtype)) for _ in range(layers)]
    seqs = [prompts[b, :n].tolist() for b, n in enumerate(lengths)]
    worst = 0.0
    with torch.no_grad():
        # prefill: each row its own prompt (its own length), one row at a time
        logits = []
        for b, n in enumerate(lengths):
            rows = caches if args.paged else [(kc[b:b + 1], vc[b:b + 1]) for kc, vc in caches]
            logits.append(model.step(prompts[b:b + 1, :n], rows,
                                     torch.zeros(1, dtype=torch.int32, device=device),
                                     None if table is None else table[b:b + 1])[0])
        logits = torch.stack(logits)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        decode = model.step
        if args.graph:
            decode = capture_step(model, caches, batch, seqlens, table)
        for step in range(args.tokens):
            padded = torch.zeros(batch, max(map(len, seqs)), dtype=torch.long, device=device)
            for b, s in enumerate(seqs):
                padded[b, :len(s)] = torch.tensor(s, device=device)
            reference = model.full(padded, [len(s) for s in seqs])
            diff = (logits.float() - reference.float()).abs().max().item()
            top2 = reference.float().topk(2, dim=-1).values
            chosen, wanted = logits.argmax(-1), reference.argmax(-1)
            clear = (top2[:, 0] - top2[:, 1]) > tol  # a tie within tolerance may go either way
            if diff > tol or bool(((chosen != wanted) & clear).any()):
                print(f"step {step}: logits differ by {diff:.3e} (tolerance {tol}) or the "
                      f"chosen tokens differ: {chosen.tolist()} vs {wanted.tolist()}")
                return 1
            worst = max(worst, diff)
            for b in range(batch):
                seqs[b].append(int(chosen[b]))
            logits = decode(chosen[:, None], caches, seqlens, table)
            seqlens += 1  # (in place: a captured step reads it from the device)
    print(f"{args.tokens} tokens x {batch} rows on {device} ({str(dtype).replace('torch.', '')}"
          f"{', paged' if args.paged else ''}): "
          f"cached logits within {worst:.2e} of the full recompute (tolerance {tol})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

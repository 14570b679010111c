"""A PyTorch eager training loop of the GPT-2 model dxrun's one-device benchmark trains: what a
user would otherwise run for a small model on a laptop (nanoGPT's CPU recipe: 4 layers, d_model
128, 4 heads, d_ff 512, seq 64, batch 12, no bias, tied embeddings, AdamW, clip 1.0).

Run by a Python that has torch (never dxrun's: torch is no dependency of dxrun or its tests):

    /work/torch-venv/bin/python benchmarks/torch_reference.py --steps 300 --warmup 20
    /work/torch-venv/bin/python benchmarks/torch_reference.py --serve  # python -m benchmarks --torch

It prints one machine-readable line per timed run (``benchmarks.eager.parse_line`` reads it):

    torch_reference ms_per_step=33.41 cpu_ms_per_step=60.2 steps=300 loss=3.912 threads=2 torch=2.13.0

``--serve``: builds and warms up once, prints ``ready ...``, then runs the number of steps on
each line of stdin and prints one such line per request, so that the benchmark can interleave it
with dxrun's step without rebuilding either. The model is written out here (no dxrun, no JAX)
to match dxrun's GPT-2 block for the same overrides: pre-norm layernorm (no bias), one q/k/v
projection, causal softmax attention, tanh GELU, learned positions, fp32, weight decay on the
block matrices only (dxrun skips norms, biases and embeddings), warmup-cosine lr.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int, d_ff: int, layers: int, std: float):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d, bias=False)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d, bias=False)
        self.up = nn.Linear(d, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d, bias=False)
        for w in (self.qkv.weight, self.up.weight):
            nn.init.normal_(w, std=std)
        for w in (self.proj.weight, self.down.weight):  # GPT-2's depth-scaled residual outputs
            nn.init.normal_(w, std=std / math.sqrt(2 * layers))

    def forward(self, x_BxLxD: torch.Tensor) -> torch.Tensor:
        B, L, D = x_BxLxD.shape
        q, k, v = self.qkv(self.ln1(x_BxLxD)).split(D, dim=-1)
        # (B, L, D) -> (B, H, L, E): the layout scaled_dot_product_attention takes
        q, k, v = (t.view(B, L, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        o_BxHxLxE = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BxLxD = x_BxLxD + self.proj(o_BxHxLxE.transpose(1, 2).reshape(B, L, D))
        h_BxLxF = F.gelu(self.up(self.ln2(x_BxLxD)), approximate="tanh")
        return x_BxLxD + self.down(h_BxLxF)


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, d_ff: int, layers: int,
                 std: float = 0.02):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        for w in (self.wte.weight, self.wpe.weight):
            nn.init.normal_(w, std=std)
        self.blocks = nn.ModuleList(Block(d, heads, d_ff, layers, std) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=False)

    def forward(self, inputs_BxL: torch.Tensor) -> torch.Tensor:
        L = inputs_BxL.shape[1]
        x_BxLxD = self.wte(inputs_BxL) + self.wpe.weight[:L]
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        return self.ln_f(x_BxLxD) @ self.wte.weight.T  # tied: the head is the embedding


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warmup from 0, then cosine to 0 at ``total`` (optax's warmup_cosine_decay)."""
    if step < warmup:
        return peak * step / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * 0.5 * (1 + math.cos(math.pi * t))


class Trainer:
    def __init__(self, a: argparse.Namespace):
        torch.manual_seed(a.seed)
        if a.threads:
            torch.set_num_threads(a.threads)
        self.model = GPT(a.vocab, a.seq, a.d_model, a.heads, a.d_ff, a.layers)
        blocks = [p for n, p in self.model.named_parameters() if n.startswith("blocks.")
                  and p.dim() == 2]
        rest = [p for n, p in self.model.named_parameters() if not (n.startswith("blocks.")
                                                                    and p.dim() == 2)]
        self.opt = torch.optim.AdamW([{"params": blocks, "weight_decay": a.wd},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=a.lr, betas=(a.b1, a.b2))
        g = torch.Generator().manual_seed(a.seed)
        self.batches = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
                        for _ in range(4)]
        self.a, self.step_i = a, 0

    def step(self) -> torch.Tensor:
        a = self.a
        tokens = self.batches[self.step_i % len(self.batches)]
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step_i, a.lr, a.warmup_lr, a.total)
        logits_BxLxV = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits_BxLxV.reshape(-1, a.vocab), tokens[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.clip)
        self.opt.step()
        self.step_i += 1
        return loss

    def timed(self, n: int) -> str:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            loss = self.step()
        value = loss.item()  # eager CPU: already computed; what a logging loop reads
        ms = 1e3 * (time.perf_counter() - t0) / n
        cpu_ms = 1e3 * (time.process_time() - c0) / n  # all threads of the process
        return (f"torch_reference ms_per_step={ms:.3f} cpu_ms_per_step={cpu_ms:.3f} steps={n} "
                f"loss={value:.4f} "
                f"threads={torch.get_num_threads()} torch={torch.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("vocab", 64), ("seq", 64), ("batch", 12), ("layers", 4),
                          ("d-model", 128), ("heads", 4), ("d-ff", 512), ("warmup-lr", 20),
                          ("total", 600), ("seed", 0), ("steps", 300), ("warmup", 20),
                          ("threads", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("lr", 1e-2), ("wd", 0.1), ("b1", 0.9), ("b2", 0.95), ("clip", 1.0)):
        ap.add_argument(f"--{name}", type=float, default=default)
    ap.add_argument("--serve", action="store_true", help="steps per stdin line (see above)")
    a = ap.parse_args()
    t = Trainer(a)
    t.timed(a.warmup)
    if not a.serve:
        print(t.timed(a.steps), flush=True)
        return
    print(f"ready threads={torch.get_num_threads()} torch={torch.__version__}", flush=True)
    for line in sys.stdin:
        if line.strip():
            print(t.timed(int(line)), flush=True)


if __name__ == "__main__":
    main()

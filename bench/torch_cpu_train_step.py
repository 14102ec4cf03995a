#!/usr/bin/env python3
"""PyTorch's CPU training step for the two models of bench/train_step_bench.cc, for comparison.

  /usr/bin/python3 bench/torch_cpu_train_step.py [--steps N] [--warmup W] [--threads T]

The same shapes and math as kiln (plain tensors, x @ W with W (in, out), as in src/models/):
  mlp        batch 64, 784 -> 256 (tanh-GELU) -> 10, cross-entropy (what `kiln train` runs)
  gpt2-tiny  batch 4, T 64, vocab 256, 2 layers, 4 heads, d_model 64 (tests/reference/)
and one step = zero_grad, forward, backward, AdamW (lr 1e-3, weight_decay 0) on a fixed batch.
Prints the median ms/step over N steps after W warmup steps (and min / max), eager mode,
torch.set_num_threads(T) (default 2, the machine's cores).
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "reference"))
from make_gpt2_tiny_reference import gpt2_forward  # noqa: E402  the reference model itself


def mlp_task():
    g = torch.Generator().manual_seed(0)
    sizes = [784, 256, 10]
    params = {}
    for i in range(len(sizes) - 1):
        bound = 1.0 / math.sqrt(sizes[i])
        params[f"fc{i}.weight"] = (torch.rand(sizes[i], sizes[i + 1], generator=g) * 2 - 1) * bound
        params[f"fc{i}.bias"] = torch.zeros(sizes[i + 1])
    x = torch.rand(64, 784, generator=g)
    labels = torch.randint(0, 10, (64,), generator=g)

    def loss_fn(p):
        h = x
        for i in range(len(sizes) - 1):
            h = h @ p[f"fc{i}.weight"] + p[f"fc{i}.bias"]
            if i + 2 < len(sizes):
                h = F.gelu(h, approximate="tanh")
        return F.cross_entropy(h, labels)

    return params, loss_fn


def gpt2_tiny_task():
    g = torch.Generator().manual_seed(0)
    B, T, V, L, H, C = 4, 64, 256, 2, 4, 64
    shapes = {"wte": (V, C), "wpe": (T, C), "lnf.weight": (C,), "lnf.bias": (C,)}
    for l in range(L):
        shapes.update({f"h{l}.ln1.weight": (C,), f"h{l}.ln1.bias": (C,),
                       f"h{l}.attn.weight": (C, 3 * C), f"h{l}.attn.bias": (3 * C,),
                       f"h{l}.proj.weight": (C, C), f"h{l}.proj.bias": (C,),
                       f"h{l}.ln2.weight": (C,), f"h{l}.ln2.bias": (C,),
                       f"h{l}.fc.weight": (C, 4 * C), f"h{l}.fc.bias": (4 * C,),
                       f"h{l}.fc2.weight": (4 * C, C), f"h{l}.fc2.bias": (C,)})
    params = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            params[name] = torch.ones(shape) if name.endswith("ln1.weight") or name.endswith(
                "ln2.weight") or name.endswith("lnf.weight") else torch.zeros(shape)
        else:
            params[name] = torch.randn(shape, generator=g) * 0.02
    idx = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    return params, lambda p: gpt2_forward(p, idx, targets, L, H)[0]


def bench(task, steps, warmup):
    params, loss_fn = task()
    for t in params.values():
        t.requires_grad_(True)
    opt = torch.optim.AdamW(list(params.values()), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(params)
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed * 1e3)
    return statistics.median(times), min(times), max(times), loss.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.steps} steps after {args.warmup} warmup")
    for name, task in (("mlp", mlp_task), ("gpt2-tiny", gpt2_tiny_task)):
        med, lo, hi, loss = bench(task, args.steps, args.warmup)
        print(f"{name:10s} {med:8.3f} ms/step (min {lo:.3f}, max {hi:.3f}), last loss {loss:.4f}")


if __name__ == "__main__":
    main()

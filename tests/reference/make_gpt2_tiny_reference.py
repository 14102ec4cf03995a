#!/usr/bin/env python3
"""The PyTorch reference of kiln's gpt2-tiny: forward, gradients and 10 AdamW steps on the CPU.

Builds gpt2-tiny in PyTorch (float32, CPU) from plain tensors, mirroring src/models/gpt.cc
exactly (kiln's linear weights are (in, out) and applied as x @ W), with kiln's initial weights
and one fixed batch read from INPUTS, and writes OUT with:
  every input (param names as kiln's graph inputs: "wte", "h0.attn.weight", ...; "idx",
  "targets"), "logits" (4, 64, 256) f32, "loss" () f32, "grad.<param>" for every param, and
  "adamw_losses" (10,) f32: the loss before each of 10 AdamW steps (lr 1e-3, betas (0.9, 0.999),
  eps 1e-8, weight_decay 0, no schedule) on the same batch, as train::Trainer::step returns it.
tests/train/gpt2_reference_test.cc compares kiln against OUT.

Regenerate (needs PyTorch; on Debian: apt-get install python3-torch), from the repository root:
  cmake --build BUILD --target dump_gpt2_tiny_inputs
  BUILD/tests/dump_gpt2_tiny_inputs /tmp/gpt2_tiny_inputs.safetensors
  /usr/bin/python3 tests/reference/make_gpt2_tiny_reference.py \
      /tmp/gpt2_tiny_inputs.safetensors tests/reference/gpt2_tiny_reference.safetensors
Safetensors is read and written by safetensors_io.py (struct + json), so only torch is needed.
"""
import math
import sys

import torch
import torch.nn.functional as F

from safetensors_io import load_safetensors, save_safetensors

STEPS = 10


def gpt2_forward(p, idx, targets, layers, heads):
    """src/models/gpt.cc in PyTorch: returns (loss, logits)."""
    B, T = idx.shape
    C = p["wte"].shape[1]
    H, D = heads, C // heads
    x = p["wte"][idx] + p["wpe"][torch.arange(T)]

    def heads_first(t):  # (B, T, C) -> (B, H, T, D)
        return t.reshape(B, T, H, D).transpose(1, 2)

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(layers):
        w = lambda name: p[f"h{l}.{name}"]
        h = F.layer_norm(x, (C,), w("ln1.weight"), w("ln1.bias"), eps=1e-5)
        q, k, v = (h @ w("attn.weight") + w("attn.bias")).split(C, dim=2)
        q, k, v = heads_first(q), heads_first(k), heads_first(v)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
        scores = scores.masked_fill(~causal, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + (y @ w("proj.weight") + w("proj.bias"))
        h = F.layer_norm(x, (C,), w("ln2.weight"), w("ln2.bias"), eps=1e-5)
        m = F.gelu(h @ w("fc.weight") + w("fc.bias"), approximate="tanh")
        x = x + (m @ w("fc2.weight") + w("fc2.bias"))
    x = F.layer_norm(x, (C,), p["lnf.weight"], p["lnf.bias"], eps=1e-5)
    logits = x @ p["wte"].t()  # tied LM head
    loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
    return loss, logits


def main(inputs_path, out_path):
    torch.manual_seed(0)  # nothing here is random; fixed anyway
    inputs, metadata = load_safetensors(inputs_path)
    idx, targets = inputs["idx"], inputs["targets"]
    param_names = sorted(n for n in inputs if n not in ("idx", "targets"))
    layers = 1 + max(int(n.split(".")[0][1:]) for n in param_names if n.startswith("h"))
    heads = 4  # gpt2-tiny: d_model 64, 4 heads
    params = {n: inputs[n].clone().requires_grad_(True) for n in param_names}

    loss, logits = gpt2_forward(params, idx, targets, layers, heads)
    loss.backward()
    out = dict(inputs)
    out["logits"] = logits.detach()
    out["loss"] = loss.detach()
    for n in param_names:
        out["grad." + n] = params[n].grad.detach().clone()

    # 10 AdamW steps on the same batch, from the same initial weights.
    params = {n: inputs[n].clone().requires_grad_(True) for n in param_names}
    opt = torch.optim.AdamW([params[n] for n in param_names], lr=1e-3, betas=(0.9, 0.999),
                            eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss, _ = gpt2_forward(params, idx, targets, layers, heads)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["adamw_losses"] = torch.tensor(losses, dtype=torch.float32)

    metadata = dict(metadata)
    metadata.update({"torch": torch.__version__, "optimizer": "adamw lr 1e-3 betas 0.9 0.999 "
                     "eps 1e-8 weight_decay 0, same batch every step", "steps": str(STEPS)})
    save_safetensors(out_path, out, metadata)
    print(f"loss {out['loss'].item():.6f}; adamw losses " + " ".join(f"{l:.5f}" for l in losses))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} INPUTS.safetensors OUT.safetensors")
    main(sys.argv[1], sys.argv[2])

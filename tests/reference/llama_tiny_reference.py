#!/usr/bin/env python3
"""The PyTorch reference of kiln's llama-tiny: forward, gradients and 10 AdamW steps on the CPU.

Builds the LLaMA model of ../shared/bench/torch_llama.py in PyTorch (float32, CPU) from plain
tensors, as src/models/llama.cc writes it (kiln's linear weights are (in, out), applied as
x @ W): RMSNorm (eps 1e-5) before attention and the MLP, rotary embeddings with
torch_llama.py's own tables and rotate-half, causal grouped-query attention (each key/value
head repeated for its group of query heads, as SDPA's enable_gqa does), SwiGLU
w2(silu(w1 x) * w3 x), an untied head. The ops are written out (torch.nn.RMSNorm and SDPA's
enable_gqa are newer than Debian's PyTorch). Reads kiln's initial weights and one batch from
INPUTS and writes OUT with:
  "logits" (B, T, V) f32, "loss" () f32, "grad.<param>" for every param, and "adamw_losses"
  (10,) f32: the loss before each of 10 AdamW steps (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
  weight_decay 0, no schedule) on the same batch, as train::Trainer::step returns it.
tests/train/llama_reference_test.cc runs this (with /usr/bin/python3, Debian's python3-torch)
and compares kiln against OUT. The layer and head counts come from INPUTS' metadata.
Safetensors is read and written by safetensors_io.py (struct + json), so only torch is needed.
"""
import sys

import torch
import torch.nn.functional as F

from safetensors_io import load_safetensors, save_safetensors

STEPS = 10


# torch_llama.py's rotary tables and rotation, as they are there.
def rope_tables(T, D, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
    ang = torch.outer(torch.arange(T).float(), inv)  # (T, D/2)
    return torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # (T, D)


def rope(x, cos, sin):  # x (B, H, T, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rms_norm(x, weight, eps=1e-5):  # torch.nn.RMSNorm's formula
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def llama_forward(p, idx, targets, layers, heads, kv_heads):
    """src/models/llama.cc (= torch_llama.py's Llama) in PyTorch: returns (loss, logits)."""
    B, T = idx.shape
    C = p["emb.weight"].shape[1]
    D = C // heads
    cos, sin = rope_tables(T, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = p["emb.weight"][idx]
    for l in range(layers):
        w = lambda name: p[f"h{l}.{name}.weight"]
        y = rms_norm(x, w("n1"))
        q = (y @ w("q")).view(B, T, heads, D).transpose(1, 2)
        k = (y @ w("k")).view(B, T, kv_heads, D).transpose(1, 2)
        v = (y @ w("v")).view(B, T, kv_heads, D).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        group = heads // kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / D ** 0.5)
        a = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        x = x + a.transpose(1, 2).reshape(B, T, C) @ w("o")
        y = rms_norm(x, w("n2"))
        x = x + (F.silu(y @ w("w1")) * (y @ w("w3"))) @ w("w2")
    logits = rms_norm(x, p["norm.weight"]) @ p["head.weight"]
    loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
    return loss, logits


def main(inputs_path, out_path):
    inputs, metadata = load_safetensors(inputs_path)
    idx, targets = inputs["idx"], inputs["targets"]
    layers, heads, kv_heads = (int(metadata[k]) for k in ("layers", "heads", "kv_heads"))
    param_names = sorted(n for n in inputs if n not in ("idx", "targets"))
    params = {n: inputs[n].clone().requires_grad_(True) for n in param_names}

    loss, logits = llama_forward(params, idx, targets, layers, heads, kv_heads)
    loss.backward()
    out = {"logits": logits.detach(), "loss": loss.detach()}
    for n in param_names:
        out["grad." + n] = params[n].grad.detach().clone()

    # 10 AdamW steps on the same batch, from the same initial weights.
    params = {n: inputs[n].clone().requires_grad_(True) for n in param_names}
    opt = torch.optim.AdamW([params[n] for n in param_names], lr=1e-3, betas=(0.9, 0.999),
                            eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss, _ = llama_forward(params, idx, targets, layers, heads, kv_heads)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["adamw_losses"] = torch.tensor(losses, dtype=torch.float32)
    save_safetensors(out_path, out, {"torch": torch.__version__, "steps": str(STEPS)})
    print(f"loss {out['loss'].item():.6f}; adamw losses " + " ".join(f"{l:.5f}" for l in losses))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} INPUTS.safetensors OUT.safetensors")
    torch.manual_seed(0)  # nothing here is random; fixed anyway
    torch.set_num_threads(1)  # small tensors: threads cost more than they give (CI has 2 cores)
    main(sys.argv[1], sys.argv[2])

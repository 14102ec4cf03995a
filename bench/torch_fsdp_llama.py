# Reference benchmark: a LLaMA training step sharded with PyTorch FSDP2 (fully_shard, ZeRO-3 style)
# over N GPUs of one host, the LLaMA sibling of ../shared/bench/torch_fsdp_gpt2.py. Prints one JSON
# line last (rank 0): ms/step, tokens/s over all GPUs, MFU per GPU, peak memory per GPU, and the
# first step's end in seconds after the script started (first_step_s: compile included, as kiln
# bench's first_step_s counts from its process start).
#
# The model is kiln's zoo llama (src/models/llama.cc), as ../shared/bench/torch_llama.py writes it:
# pre-RMSNorm blocks (eps 1e-5), rotary embeddings by rotate-half (base --rope-theta), causal
# grouped-query attention (SDPA, enable_gqa), SwiGLU (w2(silu(w1 x) * w3 x)), no biases, an untied
# head; init normal(0, 0.02), o and w2 scaled by 1/sqrt(2 L), norm gains 1. Same names and sizes as
# kiln's --model llama-8b --layers L (... --d-model --heads --kv-heads --hidden --vocab).
#
# Usage (one config per launch; torchrun kills the other ranks if one fails, e.g. on OOM):
#   torchrun --standalone --nproc_per_node=2 bench/torch_fsdp_llama.py --model llama-8b --layers 16 \
#       --batch 4 --seq 2048 --compile
#   ... --compile                # torch.compile each block, fullgraph (torchtitan's per-block recipe)
#   ... --reshard false          # keep gathered params after forward (no backward all-gather)
#   ... --reduce-dtype bf16      # gradient reduce-scatter in bf16 (default f32, torchtitan's default)
#   ... --ac full                # activation checkpointing per block
#   ... --device cpu             # gloo on CPU, for checking the script without GPUs (--model llama-tiny)
# Mixed precision: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32): params all-gathered
# and computed in bf16, gradients reduce-scattered in f32, f32 sharded master weights and AdamW
# state (fused AdamW on the shards). Rotary embeddings are applied in f32 and cast back (as
# torchtitan does); the loss is taken over f32 logits.
# MFU: (6N + 12*L*T*d) FLOPs per token (torch_llama.py's convention) against 989e12 per GPU
# (H100/H200 SXM dense bf16).
import os, time

_START = time.time()  # kiln bench's first_step_s counts from process start: so does ours

# NVLink multicast (NVLS) must stay off on the lent machines: set before torch/NCCL load.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse, gc, json, sys
from datetime import timedelta
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist


# ---- model: kiln's llama (torch_llama.py's, with the rotary base a parameter) ----
def rope_tables(T, D, base):
    inv = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
    ang = torch.outer(torch.arange(T).float(), inv)  # (T, D/2)
    return torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # (T, D)

def rope(x, cos, sin):  # x (B, H, T, D); in f32, back in x's dtype
    y = x.float()
    y1, y2 = y.chunk(2, dim=-1)
    return (y * cos + torch.cat([-y2, y1], -1) * sin).type_as(x)

class Block(nn.Module):
    def __init__(s, d, h, kv, ffn, eps):
        super().__init__()
        s.h, s.kv, s.hd = h, kv, d // h
        s.n1 = nn.RMSNorm(d, eps=eps); s.n2 = nn.RMSNorm(d, eps=eps)
        s.q = nn.Linear(d, d, bias=False); s.k = nn.Linear(d, kv * s.hd, bias=False)
        s.v = nn.Linear(d, kv * s.hd, bias=False); s.o = nn.Linear(d, d, bias=False)
        s.w1 = nn.Linear(d, ffn, bias=False); s.w3 = nn.Linear(d, ffn, bias=False)
        s.w2 = nn.Linear(ffn, d, bias=False)
    def forward(s, x, cos, sin):
        B, T, C = x.shape
        y = s.n1(x)
        q = s.q(y).view(B, T, s.h, s.hd).transpose(1, 2)
        k = s.k(y).view(B, T, s.kv, s.hd).transpose(1, 2)
        v = s.v(y).view(B, T, s.kv, s.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + s.o(a.transpose(1, 2).reshape(B, T, C))
        y = s.n2(x)
        return x + s.w2(F.silu(s.w1(y)) * s.w3(y))

class Llama(nn.Module):
    def __init__(s, T, L, d, h, kv, ffn, V, theta, eps=1e-5):
        super().__init__()
        s.emb = nn.Embedding(V, d)
        s.blocks = nn.ModuleList([Block(d, h, kv, ffn, eps) for _ in range(L)])
        s.norm = nn.RMSNorm(d, eps=eps); s.head = nn.Linear(d, V, bias=False)
        cos, sin = rope_tables(T, d // h, theta)
        s.register_buffer("cos", cos, persistent=False); s.register_buffer("sin", sin, persistent=False)
        for name, p in s.named_parameters():
            if p.dim() == 1: nn.init.ones_(p)
            else: nn.init.normal_(p, std=0.02 / (2 * L) ** 0.5 if name.endswith(("o.weight", "w2.weight")) else 0.02)
    def forward(s, idx, tgt):
        x = s.emb(idx)
        for b in s.blocks: x = b(x, s.cos, s.sin)
        logits = s.head(s.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), tgt.view(-1))

# kiln's zoo configs (src/models/llama.cc): layers, d_model, heads, kv_heads, hidden, vocab, rope base.
CFG = {"llama-tiny": dict(L=2, d=64, h=4, kv=2, ffn=128, V=256, theta=10000.0),
       "llama-160m": dict(L=12, d=768, h=12, kv=4, ffn=2048, V=32000, theta=10000.0),
       "llama-1b": dict(L=16, d=2048, h=32, kv=8, ffn=8192, V=32000, theta=10000.0),
       "llama-8b": dict(L=32, d=4096, h=32, kv=8, ffn=14336, V=128256, theta=500000.0)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="LLaMA under PyTorch FSDP2 (fully_shard); one JSON line last")
    p.add_argument("--model", default="llama-8b", choices=sorted(CFG))
    # Size overrides, kiln's flags (0: the config's).
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--d-model", type=int, default=0)
    p.add_argument("--heads", type=int, default=0)
    p.add_argument("--kv-heads", type=int, default=0)
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--vocab", type=int, default=0)
    p.add_argument("--rope-theta", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=4, help="sequences per GPU (micro-batch = local batch)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, the first of them timed alone")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (fullgraph)")
    p.add_argument("--reshard", default="true", choices=["true", "false"],
                   help="blocks' reshard_after_forward (true = ZeRO-3; the root never reshards)")
    p.add_argument("--reduce-dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--ac", default="none", choices=["none", "full"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--note", default="")
    return p.parse_args(argv)


def config(args):
    c = dict(CFG[args.model])
    for key, flag in (("L", "layers"), ("d", "d_model"), ("h", "heads"), ("kv", "kv_heads"), ("ffn", "hidden"),
                      ("V", "vocab"), ("theta", "rope_theta")):
        v = getattr(args, flag)
        if v < 0: raise SystemExit(f"--{flag.replace('_', '-')} must be > 0 (or 0: the config's), got {v}")
        if v > 0: c[key] = v
    if c["d"] % c["h"] or c["h"] % c["kv"] or (c["d"] // c["h"]) % 2:
        raise SystemExit(f"d_model {c['d']}, heads {c['h']}, kv_heads {c['kv']}: heads must divide d_model into "
                         "an even head dim, and kv_heads divide heads")
    return c


def build(args, c, mesh, device):
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
    torch.manual_seed(0)  # same init on every rank (FSDP shards it; nothing is broadcast)
    with torch.device(device):
        m = Llama(T=args.seq, **c)
    n_params = sum(p.numel() for p in m.parameters())  # before sharding
    if args.ac == "full":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, b in enumerate(m.blocks): m.blocks[i] = checkpoint_wrapper(b)
    if args.compile:
        for b in m.blocks: b.compile(fullgraph=True)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                              reduce_dtype=torch.float32 if args.reduce_dtype == "f32" else torch.bfloat16)
    for b in m.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp, reshard_after_forward=args.reshard == "true")
    # Root group: emb, norm, head (untied); FSDP2 keeps the root unsharded after forward.
    fully_shard(m, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)  # on the local f32 shards
    return m, opt, n_params


def main(argv=None):
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29513")
    os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1")
    on_cuda = args.device == "cuda"
    if on_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=10))
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(args.device, (world,))
    c = config(args)
    B, T = args.batch, args.seq
    result = dict(model=args.model, layers=c["L"], d_model=c["d"], heads=c["h"], kv_heads=c["kv"], hidden=c["ffn"],
                  vocab=c["V"], rope_theta=c["theta"], world=world, batch_per_gpu=B, T=T, compile=args.compile,
                  reshard=args.reshard == "true", mp=f"param=bf16,reduce={args.reduce_dtype}", ac=args.ac,
                  torch=torch.__version__)
    try:
        m, opt, n = build(args, c, mesh, device)
        g = torch.Generator(device=device).manual_seed(1234 + rank)  # each rank its own batch
        idx = torch.randint(0, c["V"], (B, T), device=device, generator=g)
        tgt = torch.randint(0, c["V"], (B, T), device=device, generator=g)

        def step():
            loss = m(idx, tgt)
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
            return loss

        sync = torch.cuda.synchronize if on_cuda else (lambda: None)
        if on_cuda:
            # The whole f32 model was made on each GPU before sharding: give its blocks back.
            gc.collect(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        dist.barrier(); t0 = time.perf_counter()
        step(); sync(); first_s = time.time() - _START
        for _ in range(args.warmup - 1): step()
        sync(); warm_s = time.perf_counter() - t0
        dist.barrier()
        if on_cuda:
            ev0 = torch.cuda.Event(enable_timing=True); ev1 = torch.cuda.Event(enable_timing=True)
            ev0.record()
            for _ in range(args.steps): loss = step()
            ev1.record(); torch.cuda.synchronize()
            ms = ev0.elapsed_time(ev1) / args.steps
        else:
            t1 = time.perf_counter()
            for _ in range(args.steps): loss = step()
            ms = (time.perf_counter() - t1) * 1e3 / args.steps
        peak = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else 0.0
        reserved = torch.cuda.max_memory_reserved() / 2**30 if on_cuda else 0.0
        # The slowest rank, the largest peak and first step over ranks.
        stats = torch.tensor([ms, peak, reserved, first_s, loss.detach().float().item()], dtype=torch.float64,
                             device=device)
        dist.all_reduce(stats[:4], op=dist.ReduceOp.MAX)
        ms, peak, reserved, first_s = (stats[i].item() for i in range(4))
        flops_tok = 6 * n + 12 * c["L"] * T * c["d"]
        tps = B * T * world / (ms / 1e3)
        result.update(ms=round(ms, 2), tok_s=round(tps), tok_s_per_gpu=round(tps / world),
                      mfu_vs_989=round(tps * flops_tok / (989e12 * world), 3),
                      peak_gib=round(peak, 2), reserved_gib=round(reserved, 2), first_step_s=round(first_s, 2),
                      warm_s=round(warm_s, 1), loss=round(stats[4].item(), 3), params_m=round(n / 1e6, 1))
    except torch.OutOfMemoryError:
        result.update(oom=True, rank=rank)
        print(json.dumps(result), flush=True)
        sys.stdout.flush(); os._exit(1)  # torchrun tears the other ranks down
    if args.note: result["note"] = args.note
    if rank == 0: print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

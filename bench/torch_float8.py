# The FP8 anchor for `kiln bench --amp fp8`: the same models as ../shared/bench/torch_llama.py and
# torch_gpt2.py (imported from the folder given by --models), trained by torch.compile with
# torchao's float8 training (convert_to_float8_training, tensorwise dynamic scaling, the default
# recipe), bf16 autocast around it and fused AdamW, as torchao's own benchmarks run it. The LM head
# stays in bf16 (torchao's recipes filter it out; kiln's fp8-linear pass does the same), and so does
# any layer whose dims are not multiples of 16.
# Prints one JSON line per run, like the scripts it imports: ms/step, tokens/s, peak memory.
# With --data FILE --loss-steps N, a run instead trains N steps on the file's bytes (consecutive
# B x T windows, tokens = bytes, lr 6e-4) and prints its per-step losses: torchao's own fp8-vs-bf16
# loss gap, the yardstick for kiln's (scripts/gpu-fp8.sh, FP8_LOSS=1).
# Usage: python3 torch_float8.py --models DIR [--data FILE --loss-steps N] CONFIG:MODE:BATCH[:T] ...
#        MODE: compile | float8
import argparse, json, sys, time

import torch


def build(models_dir, cfg, T):
    sys.path.insert(0, models_dir)
    if cfg.startswith("llama"):
        import torch_llama as m
        c = m.CFG[cfg]
        return m.Llama(T=T, **c).cuda(), c["V"]
    import torch_gpt2 as m
    return m.GPT(T=T, **m.CFG[cfg]).cuda(), 50257


def run(models_dir, cfg, mode, B, T, steps=20, warm=5, data=None, loss_steps=0):
    torch.manual_seed(0)
    model, vocab = build(models_dir, cfg, T)
    if mode == "float8":
        from torchao.float8 import convert_to_float8_training

        def keep(module, fqn):  # torchao's usual filter: not the head, dims multiples of 16
            return "head" not in fqn and module.in_features % 16 == 0 and module.out_features % 16 == 0

        convert_to_float8_training(model, module_filter_fn=keep)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4 if loss_steps else 1e-4, fused=True)
    step_fn = torch.compile(model)
    idx = torch.randint(0, vocab, (B, T), device="cuda")
    tgt = torch.randint(0, vocab, (B, T), device="cuda")
    torch.cuda.reset_peak_memory_stats()

    def step(idx=idx, tgt=tgt):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if loss_steps:  # the same byte windows, in order, for every mode
        text = torch.frombuffer(bytearray(open(data, "rb").read()), dtype=torch.uint8).long()
        per = B * T + 1
        losses = []
        for s in range(loss_steps):
            start = (s * B * T) % (text.numel() - per)
            w = text[start:start + per].cuda()
            losses.append(step(w[:-1].view(B, T), w[1:].view(B, T)).item())
        return dict(cfg=cfg, mode=mode, B=B, T=T, losses=[round(x, 5) for x in losses])

    t0 = time.time()
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    tw = time.time() - t0
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(steps):
        loss = step()
    ev1.record()
    torch.cuda.synchronize()
    ms = ev0.elapsed_time(ev1) / steps
    return dict(cfg=cfg, mode=mode, B=B, T=T, ms=round(ms, 2), tok_s=round(B * T / (ms / 1e3)),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), warm_s=round(tw, 1),
                loss=round(loss.item(), 3))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True, help="folder holding torch_llama.py and torch_gpt2.py")
    ap.add_argument("--data", help="a text file: train on its bytes and print the losses (with --loss-steps)")
    ap.add_argument("--loss-steps", type=int, default=0)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args()
    for p in (r.split(":") for r in a.runs):
        cfg, mode, B = p[:3]
        T = int(p[3]) if len(p) > 3 else (1024 if cfg.startswith("gpt2") else 2048)
        try:
            r = run(a.models, cfg, mode, int(B), T, data=a.data, loss_steps=a.loss_steps)
        except torch.OutOfMemoryError:
            r = dict(cfg=cfg, mode=mode, B=int(B), T=T, oom=True)
        except Exception as e:  # a missing or incompatible torchao: say so, keep the other runs
            r = dict(cfg=cfg, mode=mode, B=int(B), T=T, error=f"{type(e).__name__}: {e}"[:300])
        torch.cuda.empty_cache()
        torch._dynamo.reset()
        print(json.dumps(r), flush=True)

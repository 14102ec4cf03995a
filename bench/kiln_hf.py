# The Hugging Face modules of ../shared/bench/torch_hf.py (random weights from configs, the
# model's own loss from `labels`) trained through kiln.compile on one GPU: bf16, AdamW. Prints one
# JSON line per run in torch_hf.py's format, so the two sit side by side in one device call.
# Usage: python3 bench/kiln_hf.py --torch-hf PATH/torch_hf.py NAME:B:T ...   e.g. hf-gpt2:8:1024
import argparse, json, sys, time, importlib.util


def load(path):
    spec = importlib.util.spec_from_file_location("torch_hf", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(hf, name, B, T, warm=5, steps=20):
    import torch, kiln
    torch.manual_seed(0)
    model, V = hf.make(name)
    m = hf.WithLoss(model).cuda().train()
    ids = torch.randint(0, V, (B, T), device="cuda")
    t0 = time.time()
    step = kiln.compile(m, (ids, ids), device="cuda", amp="bf16", optimizer=kiln.AdamW(lr=1e-4))
    compile_s = time.time() - t0
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    for _ in range(warm):
        loss = step(ids, ids)
    torch.cuda.synchronize(); tw = time.time() - t0
    e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True); e0.record()
    for _ in range(steps):
        loss = step(ids, ids)
    e1.record(); torch.cuda.synchronize(); ms = e0.elapsed_time(e1) / steps
    free, total = torch.cuda.mem_get_info()
    return dict(cfg=name, mode="kiln", B=B, T=T, ms=round(ms, 2), tok_s=round(B * T / (ms / 1e3)),
                used_gib=round((total - free) / 2**30, 2), compile_s=round(compile_s, 1), warm_s=round(tw, 1),
                loss=round(float(loss), 3))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch-hf", required=True)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args()
    hf = load(a.torch_hf)
    for arg in a.runs:
        name, B, T = arg.split(":")
        try:
            r = run(hf, name, int(B), int(T))
        except Exception as e:  # one line per failed run, the rest still measured
            r = dict(cfg=name, mode="kiln", error=f"{type(e).__name__}: {str(e)[:400]}")
        print(json.dumps(r), flush=True)

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


def run(hf, name, B, T, warm=5, steps=20, profile=0, dump=None):
    import torch, kiln
    torch.manual_seed(0)
    model, V = hf.make(name)
    m = hf.WithLoss(model).cuda().train()
    ids = torch.randint(0, V, (B, T), device="cuda")
    # kiln's memory is its own allocations (not torch's allocator): the device's use grown past
    # this point, plus the module's tensors torch holds (kiln trains them in place).
    torch.cuda.synchronize(); free0, _ = torch.cuda.mem_get_info(); held = torch.cuda.memory_allocated()
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
    if dump:
        with open(f"{dump}/{name}.report.txt", "w") as f: f.write(step.report())
    if profile:  # CUPTI sees every kernel of the process, kiln's (graph-replayed) ones included
        from torch.profiler import profile as prof, ProfilerActivity
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(2): step(ids, ids)
            torch.cuda.synchronize()
        print(f"== {name}: kernels over 2 steps", file=sys.stderr)
        print(p.key_averages().table(sort_by="self_device_time_total", row_limit=profile, max_name_column_width=90),
              file=sys.stderr)
    return dict(cfg=name, mode="kiln", B=B, T=T, ms=round(ms, 2), tok_s=round(B * T / (ms / 1e3)),
                peak_gib=round((free0 - free + held) / 2**30, 2), compile_s=round(compile_s, 1), warm_s=round(tw, 1),
                loss=round(float(loss), 3))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch-hf", required=True)
    ap.add_argument("--profile", type=int, default=0, help="print the N kernels with most time (stderr)")
    ap.add_argument("--dump", help="a folder for each model's compile report")
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args()
    hf = load(a.torch_hf)
    for arg in a.runs:
        name, B, T = arg.split(":")
        try:
            r = run(hf, name, int(B), int(T), profile=a.profile, dump=a.dump)
        except Exception as e:  # one line per failed run, the rest still measured
            r = dict(cfg=name, mode="kiln", error=f"{type(e).__name__}: {str(e)[:400]}")
        print(json.dumps(r), flush=True)

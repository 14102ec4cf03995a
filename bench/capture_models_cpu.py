# The model suite of the capture tests (tests/python/capture_models.py: Hugging Face GPT-2, LLaMA,
# BERT, ViT, T5, torch's TransformerEncoder, torchvision's ResNet-18 and MobileNetV2; small
# configurations, random weights, f32) trained on the CPU through kiln.compile (torch.export
# capture) and in PyTorch eager, AdamW, on the same batches: compile seconds, ms per step (the
# median of --steps), the loss after them. One line per model, then a table.
# Usage: PYTHONPATH=build/python python3 bench/capture_models_cpu.py [--threads N] [--steps N] [MODEL ...]
import argparse, copy, json, os, statistics, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))


def _loss(out):
    import torch
    if isinstance(out, torch.Tensor):
        return out
    return out["loss"] if hasattr(out, "keys") and "loss" in out.keys() else out[0]


def run(name, steps):
    import torch, kiln, capture_models
    torch.manual_seed(0)
    model, batch = capture_models.MODELS[name]()
    model.train()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [batch(g) for _ in range(steps)]
    args, kwargs = data[0]
    t0 = time.perf_counter()
    step = kiln.compile(model, kwargs if kwargs else args, optimizer=kiln.AdamW(lr=1e-3))
    compile_s = time.perf_counter() - t0
    kiln_ms = []
    for a, k in data:
        t = time.perf_counter()
        loss = float(step(*a, **k))
        kiln_ms.append(1e3 * (time.perf_counter() - t))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    torch_ms = []
    for a, k in data:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        want = _loss(reference(*a, **k))
        want.backward()
        opt.step()
        torch_ms.append(1e3 * (time.perf_counter() - t))
    return dict(model=name, compile_s=round(compile_s, 2), kiln_ms=round(statistics.median(kiln_ms[1:]), 2),
                torch_ms=round(statistics.median(torch_ms[1:]), 2), kiln_loss=round(loss, 5), torch_loss=round(float(want), 5))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="torch's and kiln's (OpenMP, OpenBLAS) threads; 0: their defaults")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("models", nargs="*")
    a = ap.parse_args()
    if a.threads:  # before kiln loads: its OpenMP and OpenBLAS read these once
        os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = str(a.threads)
        import torch
        torch.set_num_threads(a.threads)
    import capture_models
    rows = []
    for name in a.models or list(capture_models.MODELS):
        try:
            r = run(name, a.steps)
        except Exception as e:  # one line per failed model, the rest still measured
            r = dict(model=name, error=f"{type(e).__name__}: {str(e)[:300]}")
        print(json.dumps(r), flush=True)
        rows.append(r)
    print(f"\n{'model':20} {'compile s':>9} {'kiln ms':>8} {'eager ms':>8} {'speedup':>7}  loss kiln / torch")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:20} error: {r['error'][:80]}")
            continue
        print(f"{r['model']:20} {r['compile_s']:9.2f} {r['kiln_ms']:8.2f} {r['torch_ms']:8.2f} "
              f"{r['torch_ms'] / r['kiln_ms']:6.2f}x  {r['kiln_loss']} / {r['torch_loss']}")

#!/usr/bin/env python3
"""torchvision's MobileNetV2 through ONNX into kiln, next to PyTorch eager, on the CPU, in one run.

    /usr/bin/python3 bench/mobilenet_v2.py --kiln build/kiln [--kiln OTHER/kiln ...] [--batch 4]
        [--size 32] [--classes 10] [--dropout 0.2] [--steps 20] [--repeats 3] [--threads 2]
        [--work DIR]

The model (torchvision.models.mobilenet_v2, BatchNorm in training mode, cross-entropy on its
logits) is exported to ONNX (opset 17, TorchScript exporter, training mode) and, for each kiln
binary given (e.g. this branch's and main's):
  - forward nodes: the imported forward graph (`kiln compile MODEL --report`'s first line);
  - compile s: `kiln compile MODEL --report`'s total (import, passes, memory plan, kernels);
  - kiln ms/step: the best of `repeats` runs' median over `steps` timed steps of `kiln bench MODEL
    --device cpu --json` (f32, AdamW; OMP_NUM_THREADS and OPENBLAS_NUM_THREADS = --threads; a
    shared machine's noise only adds time).
PyTorch eager's training step on the same model, batch and threads (torch.set_num_threads):
zero_grad, forward, backward, AdamW (lr 1e-3), the median over the same number of steps, best of
`repeats` runs; the repeats alternate between kiln and torch. Prints a Markdown table. Needs
torch, torchvision and onnx (Debian: python3-torch, python3-torchvision, python3-onnx). A kiln
whose importer refuses a training-mode Dropout's named mask (before the branch `conv`) needs
--dropout 0.0.
"""
import argparse
import inspect
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F
import torchvision


class WithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        return F.cross_entropy(self.model(x), labels)


def make_model(classes, dropout, seed=0):
    torch.manual_seed(seed)
    return WithLoss(torchvision.models.mobilenet_v2(num_classes=classes, dropout=dropout))


def example(batch, size, classes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)


def export(path, batch, size, classes, dropout):
    model = make_model(classes, dropout)
    model.train()
    # The TorchScript exporter (training mode is its alone; Debian's 1.13 has no other).
    legacy = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    torch.onnx.export(model, example(batch, size, classes), path, input_names=["x", "labels"],
                      output_names=["loss"], opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, **legacy)


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def kiln_compile(kiln, path):
    """(forward nodes, step nodes, compile seconds) from kiln compile --report."""
    report = run([kiln, "compile", path, "--report", "--device", "cpu"])
    forward = int(re.search(r"(\d+) forward nodes", report).group(1))
    step = int(re.search(r"kernels: (\d+) nodes in the step", report).group(1))
    total = float(re.search(r"total ([0-9.]+) s", report).group(1))
    return forward, step, total


def kiln_ms(kiln, path, steps, threads):
    """The median ms/step of one `kiln bench` run, with `threads` OpenMP and OpenBLAS threads."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    out = subprocess.run([kiln, "bench", path, "--device", "cpu", "--amp", "off", "--steps", str(steps), "--untimed-steps",
                          "3", "--json"], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"kiln bench failed:\n{out.stderr.strip() or out.stdout.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])["ms_per_step"]


class TorchStep:
    """PyTorch eager's training step on the model: zero_grad, forward, backward, AdamW."""

    def __init__(self, batch, size, classes, dropout):
        self.model = make_model(classes, dropout)
        self.model.train()
        self.x, self.labels = example(batch, size, classes)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def ms(self, steps, warmup=3):
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            self.opt.zero_grad()
            loss = self.model(self.x, self.labels)
            loss.backward()
            self.opt.step()
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", action="append", required=True, help="a kiln binary (repeatable)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--dropout", type=float, default=0.2, help="the classifier's (torchvision's default 0.2)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", help="write the exported model here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = args.work or tempfile.mkdtemp(prefix="kiln_mobilenet_")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, f"mobilenet_v2_b{args.batch}_{args.size}_c{args.classes}.onnx")
    export(path, args.batch, args.size, args.classes, args.dropout)
    print(f"MobileNetV2 (torchvision {torchvision.__version__}), batch {args.batch}, {args.size}x{args.size}, "
          f"{args.classes} classes, dropout {args.dropout}, f32, CPU ({os.cpu_count()} cores, torch {torch.__version__} with "
          f"{torch.get_num_threads()} threads); best of {args.repeats} medians of {args.steps} steps")
    # Repeats alternate between the programs, so that a shared machine's load falls on each alike.
    compiled = {kiln: kiln_compile(kiln, path) for kiln in args.kiln}
    best = {}
    torch_step = TorchStep(args.batch, args.size, args.classes, args.dropout)
    for _ in range(args.repeats):
        for kiln in args.kiln:
            best[kiln] = min(best.get(kiln, float("inf")), kiln_ms(kiln, path, args.steps, args.threads))
        best["torch"] = min(best.get("torch", float("inf")), torch_step.ms(args.steps))
    print("| | forward nodes | step nodes | compile s | ms/step |")
    print("|---|---|---|---|---|")
    for kiln in args.kiln:
        forward, step, seconds = compiled[kiln]
        print(f"| kiln ({kiln}) | {forward} | {step} | {seconds:.2f} | {best[kiln]:.1f} |")
    print(f"| PyTorch eager (AdamW) | | | | {best['torch']:.1f} |")


if __name__ == "__main__":
    main()

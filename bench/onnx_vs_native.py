"""Imported models against kiln's own: for each family of examples/onnx/torch_models.py at its
benchmark sizes (BENCH), the PyTorch export imported into kiln next to the kiln model of the same
sizes where kiln has one, and the import without the simplifier's recognize pass (the decomposed
forms as exported); per step: the kernels (nodes of the compiled training step, how many of
them fused), the composite ops among them (kiln compile --report), the median ms/step of
`kiln bench`, and the kernels of the CUDA bf16 step (compiled without a GPU). Prints a Markdown
table (docs/onnx.md holds one).

    bench/onnx_vs_native.py --kiln build/kiln [--device cpu|cuda] [--steps 20] [--repeats 3] [--work DIR]
                            [--exported DIR] [FAMILY...]

Needs torch and onnx (Debian's python3-torch and python3-onnx; /usr/bin/python3 is tried), except
with --exported DIR: the models as `examples/onnx/torch_models.py DIR --bench` wrote them,
so that a machine without an exporter (the GPU machine) can measure them.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ["mlp", "cnn", "cnn-batchnorm", "bert", "llama"]  # torch_models.BENCH's, in its order
if "--exported" not in sys.argv:
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "frontend"))
    from torch_step_test import reexec_with_torch  # noqa: E402

    reexec_with_torch()
    sys.path.insert(0, os.path.join(HERE, "..", "examples", "onnx"))
    import torch_models  # noqa: E402

    assert list(torch_models.BENCH) == FAMILIES, "keep FAMILIES in step with torch_models.BENCH"

# The kiln model of the same sizes as each BENCH entry (None: kiln has none). The BERT-style
# encoder's is GPT-2 (pre-LayerNorm, causal, an LM head) at its sizes: the nearest kiln has.
NATIVE = {
    "mlp": ["--model", "mlp", "--batch", "64"],
    "cnn": ["--model", "cnn", "--batch", "32"],
    "cnn-batchnorm": None,
    "bert": ["--model", "gpt2-tiny", "--batch", "8", "--seq", "64", "--layers", "2", "--d-model", "128",
             "--heads", "4", "--vocab", "512"],
    "llama": ["--model", "llama-tiny", "--batch", "8", "--seq", "64", "--layers", "2", "--d-model", "128",
              "--heads", "4", "--kv-heads", "2", "--hidden", "256", "--vocab", "256"],
}


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def kernels(kiln, model_args, device, amp="off"):
    """(nodes, fused nodes, composite ops text) of the training step, from kiln compile --report
    (which needs no GPU for --device cuda)."""
    for line in run([kiln, "compile"] + model_args + ["--report", "--device", device, "--amp", amp]).splitlines():
        if "kernels:" in line:
            # "  kernels: N nodes in the step, F of them fused; composite ops: a 1, b 2"
            head, ops = line.split("; composite ops: ")
            words = head.split()
            return int(words[1]), int(words[6]), ops.strip()
    raise RuntimeError("no kernels line in kiln compile --report")


def ms_per_step(kiln, model_args, device, steps, repeats):
    """The best of `repeats` runs' median ms/step (a shared machine's noise only adds time)."""
    best = None
    for _ in range(repeats):
        out = run([kiln, "bench"] + model_args + ["--device", device, "--amp", "off" if device == "cpu" else "bf16",
                                                  "--steps", str(steps), "--untimed-steps", "3", "--json"])
        ms = json.loads(out.strip().splitlines()[-1])["ms_per_step"]
        best = ms if best is None else min(best, ms)
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kiln", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="runs per model; the best median counts")
    parser.add_argument("--work", help="write the exported models here")
    parser.add_argument("--exported", help="read DIR/NAME.onnx instead of exporting (no torch needed)")
    parser.add_argument("families", nargs="*", default=FAMILIES, help="default: every one")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="kiln_onnx_bench_")
    os.makedirs(work, exist_ok=True)
    print(f"| family | model | {args.device} kernels (fused) | composite ops | ms/step ({args.device}) | "
          "cuda bf16 kernels (fused) |")
    print("|---|---|---|---|---|---|")
    for name in args.families:
        if args.exported:
            path = os.path.join(args.exported, name + ".onnx")
        else:
            path = os.path.join(work, name + ".onnx")
            torch_models.export(name, path, bench=True)
        rows = [(f"imported {name}.onnx", [path]),
                (f"imported, `--disable-pass recognize`", [path, "--disable-pass", "recognize"])]
        if NATIVE[name]:
            rows.append(("kiln " + " ".join(NATIVE[name][1:]), NATIVE[name]))  # "kiln mlp --batch 64"
        for label, model_args in rows:
            nodes, fused, ops = kernels(args.kiln, model_args, args.device, "off" if args.device == "cpu" else "bf16")
            ms = ms_per_step(args.kiln, model_args, args.device, args.steps, args.repeats)
            cuda_nodes, cuda_fused, _ = kernels(args.kiln, model_args, "cuda", "bf16")
            print(f"| {name} | {label} | {nodes} ({fused}) | {ops} | {ms:.2f} | {cuda_nodes} ({cuda_fused}) |", flush=True)


if __name__ == "__main__":
    main()

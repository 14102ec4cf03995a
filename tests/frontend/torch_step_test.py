"""`kiln step` agrees with PyTorch: each model of examples/onnx/torch_models.py (MLP, CNN with
BatchNorm, MobileNet-style depthwise CNN with a grouped ConvTranspose, tiny BERT-style encoder at opsets 17 and 14 and
with its padding mask as a masked_fill, tiny LLaMA-style decoder with grouped-query attention, a head over in-place slice
assignments, cumsum, topk, sort and gather) and Hugging Face's GPT2LMHeadModel called with labels= (gpt2-hf: from a small
config, random weights, its lm_head tied to its embedding; skipped, saying so, without transformers) is exported to ONNX,
and one training step of kiln (AdamW) is compared
with torch's own: the loss (relative 1e-4), every parameter's gradient (1e-3 of the tensor's
largest magnitude), the parameters after the update and BatchNorm's running statistics. The step
must run kiln's composite ops (attention, norms, GELU, ...) where the export decomposed them.

    torch_step_test.py --kiln PATH/TO/kiln [--keep DIR] [--device cpu|cuda] [MODEL ...]

--device cuda runs kiln's step on the GPU (against torch's on the CPU, same tolerances), e.g.
`torch_step_test.py --kiln build/kiln --device cuda cnn` for the CNN's convolutions and pools.

Needs an interpreter with torch and onnx (Debian's python3-torch, python3-onnx): when this one
has none, it runs itself under /usr/bin/python3 if that has them, else it skips (exit code 77).
"""
import argparse
import inspect
import json
import os
import struct
import subprocess
import sys
import tempfile
import warnings

SKIP = 77


def reexec_with_torch():
    try:
        import torch  # noqa: F401
        import onnx  # noqa: F401
        return
    except ImportError:
        pass
    for python in ("/usr/bin/python3",):
        if os.path.realpath(python) == os.path.realpath(sys.executable) or not os.path.exists(python):
            continue
        if subprocess.run([python, "-c", "import torch, onnx"], capture_output=True).returncode == 0:
            sys.exit(subprocess.run([python] + sys.argv).returncode)
    print("SKIP: no Python interpreter with torch and onnx (install python3-torch and python3-onnx)")
    sys.exit(SKIP)


reexec_with_torch()
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "onnx"))
import torch_models  # noqa: E402

DTYPES = {np.dtype("float32"): "F32", np.dtype("int64"): "I64", np.dtype("float64"): "F64"}
NUMPY = {"F32": np.float32, "I64": np.int64, "F64": np.float64, "I32": np.int32, "BOOL": np.bool_}


def save_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        header[name] = {"dtype": DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        blobs.append(a.tobytes())
        offset += a.nbytes
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + b:8 + n + e], dtype=NUMPY[info["dtype"]]).reshape(info["shape"])
    return out


class Gpt2WithLabels(torch.nn.Module):
    """transformers' GPT2LMHeadModel (2 layers, n_embd 64, 4 heads, vocab 128, 32 positions; no
    dropout, so that torch and kiln draw nothing) called with labels=: the loss is its own,
    logits[..., :-1, :] against labels[..., 1:] (open-ended slices in the export)."""

    def __init__(self):
        super().__init__()
        import transformers
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels, return_dict=False)[0]

    def example(self, g):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        return ids, ids.clone()


# Models of this test alone (they need what examples/onnx does not): name -> (class, input names).
EXTRA_MODELS = {"gpt2-hf": (Gpt2WithLabels, ["ids", "labels"])}


def have_transformers():
    try:
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


def export(name, path, seed=0):
    """(model, example inputs, input names) of model `name`, exported to `path` as torch_models.export does."""
    if name not in EXTRA_MODELS:
        return torch_models.export(name, path, seed)
    cls, names = EXTRA_MODELS[name]
    torch.manual_seed(seed)
    model = cls()
    inputs = model.example(torch.Generator().manual_seed(seed + 1))
    model.train()
    legacy = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    with warnings.catch_warnings():  # the tracer's notes on transformers' Python-level checks
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, path, input_names=names, output_names=["loss"], opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, **legacy)
    return model, inputs, names


def torch_step(model, inputs, lr, betas, eps, weight_decay):
    """Loss, gradients, params after AdamW and buffers after the step, by name."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    loss = model(*inputs)
    loss.backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    opt.step()
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    buffers = {n: b.detach().numpy().copy() for n, b in model.named_buffers() if b.dtype.is_floating_point}
    return float(loss), grads, params, buffers


# The composite ops each model's CPU training step runs (kiln compile --report's "composite ops",
# fused nodes' bodies included): the simplifier's recognize pass found the decomposed forms the
# export wrote. bert's attention has a padding mask (an additive (1 - mask) * -10000, or a
# masked_fill for bert-masked-fill): attention's key_bias, and over the split of one projection
# the packed attention_qkv; the CPU pipeline decomposes layer_norm_grad for fusion
# (training-rewrites), so it is not counted.
# mlp's gelu and llama's silu are there twice: once in the forward, once recomputed in the
# backward from an input the backward keeps anyway (the recompute pass); bert's are not.
COMPOSITE_OPS = {
    "mlp": {"gelu": 2, "gelu_grad": 1},
    "cnn": {},
    "depthwise": {},
    "bert": {"attention_qkv": 2, "attention_qkv_grad": 2, "gelu": 2, "gelu_grad": 2, "layer_norm": 5},
    "bert-opset14": {"attention_qkv": 2, "attention_qkv_grad": 2, "gelu": 2, "gelu_grad": 2, "layer_norm": 5},
    "bert-masked-fill": {"attention_qkv": 2, "attention_qkv_grad": 2, "gelu": 2, "gelu_grad": 2, "layer_norm": 5},
    "llama": {"attention": 2, "attention_grad": 2, "rms_norm": 5, "rms_norm_grad": 5, "rotary_embedding": 8,
              "silu": 4},
    "indexing": {},
    # Hugging Face's GPT-2: its tanh GELU and LayerNorms. Its eager attention (scores divided by
    # sqrt(d), the causal mask a where over a bool buffer with finfo.min) is not recognized yet.
    "gpt2-hf": {"gelu": 2, "gelu_grad": 2, "layer_norm": 5},
}


def composite_ops(kiln, path):
    """The step's composite ops by name, from `kiln compile PATH --report`."""
    run = subprocess.run([kiln, "compile", path, "--report"], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"kiln compile failed: {run.stderr.strip()}")
    for line in run.stdout.splitlines():
        if "composite ops:" in line:
            text = line.split("composite ops:")[1].strip()
            return {} if text == "none" else {k: int(v) for k, v in (p.strip().split(" ") for p in text.split(","))}
    raise RuntimeError("no 'composite ops' line in kiln compile --report")


def check_model(name, kiln, work, device="cpu"):
    path = os.path.join(work, name + ".onnx")
    model, inputs, names = export(name, path)
    initial = {n: p.detach().numpy().copy() for n, p in model.state_dict().items()}
    lr, betas, eps, wd = 1e-2, (0.9, 0.95), 1e-6, 0.01
    loss, grads, params, buffers = torch_step(model, inputs, lr, betas, eps, wd)

    given = {n: t.numpy() for n, t in zip(names, inputs)}
    in_path, out_path = os.path.join(work, name + ".in.safetensors"), os.path.join(work, name + ".out.safetensors")
    save_safetensors(in_path, given)
    cmd = [kiln, "step", path, "--inputs", in_path, "--out", out_path, "--optimizer", "adamw", "--lr", str(lr),
           "--beta1", str(betas[0]), "--beta2", str(betas[1]), "--epsilon", str(eps), "--weight-decay", str(wd),
           "--device", device]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return [f"{name}: kiln step failed: {run.stderr.strip() or run.stdout.strip()}"]
    out = load_safetensors(out_path)
    problems = []
    ops = composite_ops(kiln, path)
    if ops != COMPOSITE_OPS[name]:
        problems.append(f"{name}: the step's composite ops are {ops}, expected {COMPOSITE_OPS[name]}")
    if abs(float(out["loss"]) - loss) > 1e-4 * abs(loss):
        problems.append(f"{name}: loss {float(out['loss'])} vs torch {loss}")
    # kiln's params are the ONNX initializers, named as torch names them.
    compared = 0
    for key in sorted(out):
        kind, _, torch_name = key.partition(".")
        if kind not in ("grad", "param", "state"):
            continue
        want = {"grad": grads, "param": params, "state": buffers}[kind].get(torch_name)
        if want is None:
            problems.append(f"{name}: {key}: torch has no {kind} of that name")
            continue
        got, scale = out[key], max(float(np.abs(want).max()), 1e-30)
        if kind == "grad":  # 1e-3 of the largest magnitude; a zero in exact arithmetic is rounding noise
            limit = 1e-3 * scale + 1e-7
            diff = np.abs(got - want)
        elif kind == "param":
            # Where torch's gradient is rounding noise (a conv bias before BatchNorm has a zero
            # gradient in exact arithmetic), AdamW moves the param by +-lr at random: skipped.
            meaningful = np.abs(grads[torch_name]) > 1e-6
            limit = 1e-4 * scale + 5e-3 * lr
            diff = np.where(meaningful, np.abs(got - want), 0)
        else:
            limit = 1e-4 * scale
            diff = np.abs(got - want)
        compared += 1
        if float(diff.max()) > limit:
            problems.append(f"{name}: {key} differs from torch by {float(diff.max()):.3g} (limit {limit:.3g})")
    print(f"{name} ({device}): loss {float(out['loss']):.6f} (torch {loss:.6f}), {compared} tensors compared"
          f"{'' if problems else ', all within tolerance'}; composite ops {ops}")
    return problems


def check_commands(kiln, work):
    """`kiln train|bench|check|compile MODEL.onnx` on the exported models: each model's inputs bind
    to the dataset they fit (the CNN's images to Fashion-MNIST, the LLaMA's token ids to the default
    text), any model to --data random, and inputs that fit no dataset are one error naming them."""
    problems = []

    def kiln_run(args, want_ok, want_text):
        run = subprocess.run([kiln] + args, capture_output=True, text=True)
        out = run.stdout + run.stderr
        if (run.returncode == 0) != want_ok or want_text not in out:
            problems.append(f"kiln {' '.join(args)}: exit {run.returncode}, expected "
                            f"{'success' if want_ok else 'an error'} saying {want_text!r}; got:\n{out.strip()[-600:]}")

    path = lambda name: os.path.join(work, name + ".onnx")  # noqa: E731
    if os.path.exists("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz"):
        kiln_run(["train", path("cnn"), "--steps", "3", "--eval-batches", "2"], True, "on Fashion-MNIST")
    kiln_run(["train", path("llama"), "--steps", "3", "--eval-batches", "2"], True, "eval ppl")
    kiln_run(["train", path("bert"), "--steps", "3", "--data", "random"], True, "on random inputs")
    kiln_run(["train", path("bert"), "--steps", "3"], False, "no built-in dataset fits the model's inputs 'ids' "
             "(i64[4,8]), 'mask' (f32[4,8]), 'labels' (i64[4])")
    kiln_run(["train", path("llama"), "--steps", "3", "--data", "fashion-mnist"], False,
             "--data fashion-mnist: cannot bind 'ids' (i64[2,8]), 'labels' (i64[2,8])")
    kiln_run(["train", path("cnn"), "--steps", "3", "--batch", "16"], False, "takes batches of 4")
    kiln_run(["bench", path("llama"), "--device", "cpu", "--steps", "2", "--untimed-steps", "1"], True, "ms/step")
    kiln_run(["check", path("cnn")], True, "conv2d(")
    kiln_run(["compile", path("llama"), "--report"], True, "recognize: attention 2")
    for p in problems:
        print("FAIL", p)
    print(f"commands: {'all as expected' if not problems else str(len(problems)) + ' problems'}")
    return problems


def fuzz_models(kiln, work, per_model=40, seed=5):
    """Mutated copies of the exported models (1 to 4 random bytes changed): `kiln compile` imports,
    recognizes and compiles each, or fails with one `kiln: error:` line; never a crash or a hang."""
    import random
    rng = random.Random(seed)
    problems, outcomes = [], {"compiled": 0, "error": 0}
    for name in ("cnn", "bert", "llama"):
        data = open(os.path.join(work, name + ".onnx"), "rb").read()
        for trial in range(per_model):
            mutated = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            path = os.path.join(work, f"fuzz_{name}.onnx")
            with open(path, "wb") as f:
                f.write(mutated)
            try:
                run = subprocess.run([kiln, "compile", path, "--report"], capture_output=True, text=True, errors="replace",
                                     timeout=120)
            except subprocess.TimeoutExpired:
                problems.append(f"fuzz {name} trial {trial}: kiln compile did not finish in 120 s")
                continue
            lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
            if run.returncode == 0:
                outcomes["compiled"] += 1
            elif run.returncode == 1 and len(lines) == 1 and lines[0].startswith("kiln: error:"):
                outcomes["error"] += 1
            else:
                problems.append(f"fuzz {name} trial {trial}: exit {run.returncode}, stderr {run.stderr.strip()[-300:]!r}")
    print(f"fuzz: {outcomes['compiled']} mutants compiled, {outcomes['error']} refused with one error line, "
          f"{len(problems)} problems")
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kiln", required=True)
    parser.add_argument("--keep", help="write the models and files here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where kiln's step runs")
    parser.add_argument("models", nargs="*", default=list(torch_models.MODELS) + list(EXTRA_MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = args.keep or tempfile.mkdtemp(prefix="kiln_torch_step_")
    os.makedirs(work, exist_ok=True)
    problems = []
    for name in args.models:
        if name == "gpt2-hf" and not have_transformers():
            print(f"SKIP {name}: this Python has no transformers (scripts/install-deps.sh installs it)")
            continue
        problems += check_model(name, args.kiln, work, args.device)
    if set(args.models) >= {"cnn", "bert", "llama"} and args.device == "cpu":
        problems += check_commands(args.kiln, work)
        problems += fuzz_models(args.kiln, work)
    for p in problems:
        print("FAIL", p)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()

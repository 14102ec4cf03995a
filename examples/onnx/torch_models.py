"""Small PyTorch models of the families kiln's ONNX front end trains, and how to export them.

    python3 examples/onnx/torch_models.py OUT_DIR           # OUT_DIR/<name>.onnx for each model
    python3 examples/onnx/torch_models.py OUT_DIR --bench   # the same families at benchmark sizes

The export that works for training (docs/onnx.md): training=TrainingMode.TRAINING keeps
BatchNorm in training mode and the weights' names; do_constant_folding=False keeps the weights
as initializers instead of folding them into other constants. Each model returns its loss.
tests/frontend/torch_step_test.py exports these and checks `kiln step` against torch's own step;
bench/onnx_vs_native.py times the --bench sizes against kiln's own models of the same sizes.
"""
import inspect
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Mlp(nn.Module):
    """Two linear layers with GPT-2's tanh GELU between them (kiln's mlp at 784, 256, 10)."""

    def __init__(self, inputs=16, hidden=32, classes=10, batch=8):
        super().__init__()
        self.batch, self.inputs, self.classes = batch, inputs, classes
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x, labels):
        return F.cross_entropy(self.fc2(F.gelu(self.fc1(x), approximate="tanh")), labels)

    def example(self, g):
        return (torch.randn(self.batch, self.inputs, generator=g),
                torch.randint(0, self.classes, (self.batch,), generator=g))


class Cnn(nn.Module):
    """Conv + BatchNorm + ReLU + MaxPool, a grouped and dilated conv, a linear head; on 28x28 grey
    images in 10 classes (Fashion-MNIST's shapes: `kiln train cnn.onnx` trains it on that)."""

    def __init__(self, batch=4):
        super().__init__()
        self.batch = batch
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 7 * 7, 10)

    def forward(self, x, labels):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.avg_pool2d(F.relu(self.bn2(self.conv2(h))), 2)
        return F.cross_entropy(self.fc(torch.flatten(h, 1)), labels)

    def example(self, g):
        return (torch.randn(self.batch, 1, 28, 28, generator=g), torch.randint(0, 10, (self.batch,), generator=g))


class DepthwiseCnn(nn.Module):
    """MobileNet's pieces on 12x12 colour images: a stem conv, BatchNorm, ReLU6, a depthwise conv
    with two filters per channel and stride 2, a pointwise one, a grouped transposed conv back up
    (ConvTranspose: stride 2, padding 1, output_padding 1), a linear head."""

    def __init__(self, batch=4):
        super().__init__()
        self.batch = batch
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.depthwise = nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=8)
        self.pointwise = nn.Conv2d(16, 8, 1, bias=False)
        self.up = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.fc = nn.Linear(4 * 12 * 12, 10)

    def forward(self, x, labels):
        h = F.relu6(self.bn(self.stem(x)))
        h = F.relu6(self.pointwise(self.depthwise(h)))
        return F.cross_entropy(self.fc(torch.flatten(self.up(h), 1)), labels)

    def example(self, g):
        return (torch.randn(self.batch, 3, 12, 12, generator=g), torch.randint(0, 10, (self.batch,), generator=g))


class PlainCnn(nn.Module):
    """kiln's cnn: per stage a 3x3 conv (padding 1) with bias, ReLU, 2x2 max pool; a linear head.
    With batchnorm, a BatchNorm after each conv (what kiln's cnn has not)."""

    def __init__(self, channels=(16, 32), batchnorm=False, batch=32):
        super().__init__()
        self.batch = batch
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        c, size = 1, 28
        for out in channels:
            self.convs.append(nn.Conv2d(c, out, 3, padding=1))
            self.norms.append(nn.BatchNorm2d(out) if batchnorm else nn.Identity())
            c, size = out, size // 2
        self.fc = nn.Linear(c * size * size, 10)

    def forward(self, x, labels):
        for conv, norm in zip(self.convs, self.norms):
            x = F.max_pool2d(F.relu(norm(conv(x))), 2)
        return F.cross_entropy(self.fc(torch.flatten(x, 1)), labels)

    example = Cnn.example


class Attention(nn.Module):
    def __init__(self, d, heads, causal, masked_fill=False):
        super().__init__()
        self.heads, self.causal, self.masked_fill = heads, causal, masked_fill
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.reshape(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // self.heads)
        if self.causal:
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        if mask is not None and self.masked_fill:  # (B, T) of 1 for real tokens, 0 for padding
            scores = scores.masked_fill(mask[:, None, None, :] == 0, torch.finfo(scores.dtype).min)
        elif mask is not None:
            scores = scores + (1.0 - mask[:, None, None, :]) * -1e4
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Bert(nn.Module):
    """A tiny BERT-style encoder: embeddings, post-LayerNorm blocks with a padding mask, GELU."""

    masked_fill = False  # the mask as an additive (1 - mask) * -10000 (BERT's), else masked_fill

    def __init__(self, vocab=50, d=32, heads=4, layers=2, seq=8, batch=4):
        super().__init__()
        self.vocab, self.seq, self.batch = vocab, seq, batch
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.ln0 = nn.LayerNorm(d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({"attn": Attention(d, heads, False, self.masked_fill), "ln1": nn.LayerNorm(d),
                                              "fc1": nn.Linear(d, 4 * d), "fc2": nn.Linear(4 * d, d),
                                              "ln2": nn.LayerNorm(d)}))
        self.head = nn.Linear(d, 3)

    def forward(self, ids, mask, labels):
        T = ids.shape[1]
        h = self.ln0(self.tok(ids) + self.pos(torch.arange(T, device=ids.device)))
        for b in self.blocks:
            h = b["ln1"](h + b["attn"](h, mask))
            h = b["ln2"](h + b["fc2"](F.gelu(b["fc1"](h))))
        return F.cross_entropy(self.head(h[:, 0]), labels)

    def example(self, g):
        B, T = self.batch, self.seq
        ids = torch.randint(0, self.vocab, (B, T), generator=g)
        mask = torch.ones(B, T)
        mask[1 % B, T - 2:] = 0  # padding at the end of two rows
        mask[3 % B, T // 2:] = 0
        return (ids, mask, torch.randint(0, 3, (B,), generator=g))


class BertMaskedFill(Bert):
    """The same encoder with its padding mask as masked_fill(mask == 0, finfo.min) (Hugging Face's way)."""

    masked_fill = True


class RmsNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):  # rotary embeddings, the half-split form
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


def repeat_kv(x, n):  # (B, Hkv, T, D) -> (B, Hkv * n, T, D), each head n times in a row
    B, H, T, D = x.shape
    return x[:, :, None, :, :].expand(B, H, n, T, D).reshape(B, H * n, T, D)


class Llama(nn.Module):
    """A tiny LLaMA-style decoder: RMSNorm, rotary embeddings, causal grouped-query attention (two
    query heads per key/value head), SwiGLU. Its vocabulary is bytes (`kiln train llama.onnx`
    trains it on a text, byte-tokenized)."""

    def __init__(self, vocab=256, d=32, heads=4, kv_heads=2, layers=2, seq=8, hidden=64, batch=2):
        super().__init__()
        self.vocab, self.seq, self.batch = vocab, seq, batch
        self.heads, self.kv_heads = heads, kv_heads
        kv = d // heads * kv_heads
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "norm1": RmsNorm(d), "q": nn.Linear(d, d, bias=False), "k": nn.Linear(d, kv, bias=False),
                "v": nn.Linear(d, kv, bias=False), "o": nn.Linear(d, d, bias=False), "norm2": RmsNorm(d),
                "gate": nn.Linear(d, hidden, bias=False), "up": nn.Linear(d, hidden, bias=False),
                "down": nn.Linear(hidden, d, bias=False)}))
        self.norm = RmsNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, labels):
        B, T = ids.shape
        D = self.tok.embedding_dim // self.heads
        freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=ids.device).float() / D))
        angles = torch.arange(T, device=ids.device).float()[:, None] * freq[None, :]
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).triu(1)
        h = self.tok(ids)
        for b in self.blocks:
            x = b["norm1"](h)
            q = b["q"](x).reshape(B, T, self.heads, D).transpose(1, 2)
            k, v = (b[n](x).reshape(B, T, self.kv_heads, D).transpose(1, 2) for n in ("k", "v"))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k, v = repeat_kv(k, self.heads // self.kv_heads), repeat_kv(v, self.heads // self.kv_heads)
            s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(causal, float("-inf"))
            h = h + b["o"]((F.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, -1))
            x = b["norm2"](h)
            h = h + b["down"](F.silu(b["gate"](x)) * b["up"](x))
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(B * T, -1), labels.reshape(B * T))

    def example(self, g):
        shape = (self.batch, self.seq)
        return (torch.randint(0, self.vocab, shape, generator=g), torch.randint(0, self.vocab, shape, generator=g))


class Indexing(nn.Module):
    """The indexing ops real exports use, on a small regression head: T5's _shift_right on (B, T)
    (in-place slice assignments: ScatterND in the export), a running sum (CumSum), torch.topk and
    torch.sort (TopK, the sort's k the whole axis) and a gather by topk's indices (GatherElements)."""

    def __init__(self, d=8, k=3, seq=6, batch=4):
        super().__init__()
        self.d, self.k, self.seq, self.batch = d, k, seq, batch
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(3 * k, 1)

    def forward(self, x, target):  # x (B, T, d), target (B, T)
        h = self.proj(x)
        g = h.mean(-1)  # (B, T)
        t = g.shape[1]
        shifted = g.clone()
        # T5 writes [..., 1:], whose end exports as INT64_MAX, an integer constant that needs the
        # importer's exact int64 constants (not on this branch yet): the end is spelled out.
        shifted[:, 1:t] = g[:, :-1]
        shifted[:, 0] = 0.5
        c = torch.cumsum(h * shifted[..., None], dim=1)
        top, index = torch.topk(c, self.k, dim=-1)
        ascending, _ = torch.sort(c, dim=1)
        picked = torch.gather(h, -1, index)
        y = self.head(torch.cat([top, ascending[..., :self.k], picked], -1)).squeeze(-1)
        return ((y - target) ** 2).mean()

    def example(self, g):
        return (torch.randn(self.batch, self.seq, self.d, generator=g), torch.randn(self.batch, self.seq, generator=g))


# name: (class, input names, opset). bert-opset14 is bert exported where ONNX has no
# LayerNormalization yet: LayerNorm comes as ReduceMean, Sub, Pow, Sqrt, Div, Mul, Add;
# bert-masked-fill writes the padding mask as a Where instead of an Add.
MODELS = {"mlp": (Mlp, ["x", "labels"], 17), "cnn": (Cnn, ["x", "labels"], 17),
          "depthwise": (DepthwiseCnn, ["x", "labels"], 17),
          "bert": (Bert, ["ids", "mask", "labels"], 17), "bert-opset14": (Bert, ["ids", "mask", "labels"], 14),
          "bert-masked-fill": (BertMaskedFill, ["ids", "mask", "labels"], 17),
          "llama": (Llama, ["ids", "labels"], 17), "indexing": (Indexing, ["x", "target"], 17)}

# The families at benchmark sizes: name: (class, input names, sizes), and the kiln model of the same
# sizes where kiln has one (bench/onnx_vs_native.py runs both).
BENCH = {
    "mlp": (Mlp, ["x", "labels"], dict(inputs=784, hidden=256, classes=10, batch=64)),
    "cnn": (PlainCnn, ["x", "labels"], dict(channels=(16, 32), batch=32)),
    "cnn-batchnorm": (PlainCnn, ["x", "labels"], dict(channels=(16, 32), batchnorm=True, batch=32)),
    "bert": (Bert, ["ids", "mask", "labels"], dict(vocab=512, d=128, heads=4, layers=2, seq=64, batch=8)),
    "llama": (Llama, ["ids", "labels"],
              dict(vocab=256, d=128, heads=4, kv_heads=2, layers=2, seq=64, hidden=256, batch=8)),
}


def export(name, path, seed=0, bench=False):
    """Exports model `name` (fresh, seeded; `bench`: at its benchmark sizes) to `path`; returns
    (model, example inputs, input names)."""
    if bench:
        cls, names, sizes = BENCH[name]
        opset = 17
    else:
        (cls, names, opset), sizes = MODELS[name], {}
    torch.manual_seed(seed)
    model = cls(**sizes)
    inputs = model.example(torch.Generator().manual_seed(seed + 1))
    model.train()
    # The TorchScript exporter (PyTorch 2.9 made the dynamo one the default; training mode is the
    # TorchScript exporter's alone; Debian's 1.13 has no choice to make).
    legacy = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    torch.onnx.export(model, inputs, path, input_names=names, output_names=["loss"], opset_version=opset,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, **legacy)
    return model, inputs, names


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    bench = "--bench" in sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    for name in (BENCH if bench else MODELS):
        export(name, os.path.join(out, name + ".onnx"), bench=bench)
        print("wrote", os.path.join(out, name + ".onnx"))

"""Each row of kiln.capture's ATen table (python/kiln/capture/aten.py) against torch: a small
module applies one ATen op to trainable inputs (random, never zeros) and integer or bool data;
kiln compiles its training step (torch.export capture) with SGD at lr 1, so that one step gives
the loss and, as before - after, the gradient of every input; both must equal torch's. Each case
also checks that its op reached the table (torch.export gave it and kiln lowered it, not folded
it as a constant). The errors: an unsupported op names itself and the user's line; control flow
on tensor values says what to do instead."""
import math
import zlib

import pytest

torch = pytest.importorskip("torch")
import kiln  # noqa: E402
from kiln import capture  # noqa: E402

if not capture.available():
    pytest.skip(f"torch {torch.__version__} has no torch.export (PyTorch >= 2.5)", allow_module_level=True)

F = torch.nn.functional


def f(*shape):
    return ("f", shape)


def i(hi, *shape):
    return ("i", hi, shape)


def b(*shape):
    return ("b", shape)


# aten op -> (the function of the inputs that makes torch.export emit it, the inputs).
CASES = {
    "aten.add.Tensor": (lambda x, y: x + 2 * y, [f(3, 4), f(4)]),
    "aten.sub.Tensor": (lambda x, y: x - y, [f(3, 4), f(3, 1)]),
    "aten.mul.Tensor": (lambda x, y: x * y * 3.0, [f(2, 3), f(2, 3)]),
    "aten.div.Tensor": (lambda x, y: x / (y.abs() + 1), [f(2, 3), f(2, 3)]),
    "aten.rsub.Scalar": (lambda x: 1 - x, [f(5)]),
    "aten.maximum.default": (lambda x, y: torch.maximum(x, y), [f(4, 3), f(4, 3)]),
    "aten.minimum.default": (lambda x, y: torch.minimum(x, y), [f(4, 3), f(4, 3)]),
    "aten.eq.Tensor": (lambda x, k: torch.where(torch.eq(k, k * 0 + 1), x, -x), [f(4, 3), i(3, 4, 3)]),
    "aten.ne.Scalar": (lambda x, k: torch.where(k != 1, x, 2 * x), [f(4, 3), i(3, 4, 3)]),
    "aten.lt.Scalar": (lambda x: torch.where(x < 0.2, x, x * x), [f(4, 3)]),
    "aten.le.Tensor": (lambda x, y: torch.where(x <= y, x, y), [f(4, 3), f(4, 3)]),
    "aten.gt.Scalar": (lambda x: torch.where(x > 0.1, x, 3 * x), [f(4, 3)]),
    "aten.ge.Scalar": (lambda x: torch.where(x >= -0.1, 2 * x, x), [f(4, 3)]),
    "aten.abs.default": (lambda x: x.abs(), [f(6)]),
    "aten.neg.default": (lambda x: -x, [f(6)]),
    "aten.exp.default": (lambda x: x.exp(), [f(6)]),
    "aten.log.default": (lambda x: (x.abs() + 0.5).log(), [f(6)]),
    "aten.sqrt.default": (lambda x: (x.abs() + 0.5).sqrt(), [f(6)]),
    "aten.rsqrt.default": (lambda x: (x.abs() + 0.5).rsqrt(), [f(6)]),
    "aten.sin.default": (lambda x: x.sin(), [f(6)]),
    "aten.cos.default": (lambda x: x.cos(), [f(6)]),
    "aten.tanh.default": (lambda x: x.tanh(), [f(6)]),
    "aten.sigmoid.default": (lambda x: x.sigmoid(), [f(6)]),
    "aten.relu.default": (lambda x: F.relu(x), [f(6)]),
    "aten.silu.default": (lambda x: F.silu(x), [f(6)]),
    "aten.gelu.default": (lambda x: F.gelu(x) + F.gelu(x, approximate="tanh"), [f(6)]),
    "aten.erf.default": (lambda x: torch.erf(x), [f(6)]),
    "aten.reciprocal.default": (lambda x: (x.abs() + 1).reciprocal(), [f(6)]),
    "aten.pow.Tensor_Scalar": (lambda x: x ** 2 + (x.abs() + 1) ** 1.5 + (x.abs() + 1) ** -0.5, [f(6)]),
    "aten.pow.Tensor_Tensor": (lambda x, y: (x.abs() + 1) ** y, [f(6), f(6)]),
    "aten.clamp.default": (lambda x: x.clamp(-0.2, 0.3), [f(8)]),
    "aten.hardtanh.default": (lambda x: F.hardtanh(x, -0.5, 0.5), [f(8)]),
    "aten.where.self": (lambda x, y, m: torch.where(m, x, y), [f(3, 4), f(3, 4), b(3, 4)]),
    "aten.masked_fill.Scalar": (lambda x, m: x.masked_fill(m, -2.0), [f(3, 4), b(3, 4)]),
    "aten.__and__.Tensor": (lambda x, m, n: torch.where(m & n, x, -x), [f(3, 4), b(3, 4), b(3, 4)]),
    "aten.__or__.Tensor": (lambda x, m, n: torch.where(m | n, x, -x), [f(3, 4), b(3, 4), b(3, 4)]),
    "aten.logical_not.default": (lambda x, m: torch.where(torch.logical_not(m), x, -x), [f(3, 4), b(3, 4)]),
    "aten.clone.default": (lambda x: x.clone() * 2, [f(3)]),
    # x * x.detach(): the gradient is x, not 2x (the value passes, its gradient does not).
    "aten.detach.default": (lambda x, y: x * x.detach() + y * y.detach().exp(), [f(3, 4), f(4)]),
    "aten.to.dtype": (lambda x: x.to(torch.float64).sum().to(torch.float32) + x, [f(3)]),
    "aten.view.default": (lambda x: x.view(6, 2) * torch.arange(2.0), [f(3, 4)]),
    "aten.reshape.default": (lambda x: x.t().reshape(12) * torch.arange(12.0), [f(3, 4)]),
    "aten.unsqueeze.default": (lambda x, y: x.unsqueeze(1) * y, [f(3), f(3, 2)]),
    "aten.squeeze.dim": (lambda x: x.squeeze(1) * torch.arange(3.0), [f(3, 1)]),
    "aten.flatten.using_ints": (lambda x: x.flatten(1) * torch.arange(6.0), [f(2, 2, 3)]),
    "aten.unflatten.int": (lambda x: x.unflatten(1, (2, 3)) * torch.arange(3.0), [f(2, 6)]),
    "aten.transpose.int": (lambda x: x.transpose(0, 1) * torch.arange(3.0), [f(3, 4)]),
    "aten.permute.default": (lambda x: x.permute(2, 0, 1) * torch.arange(3.0)[:, None, None], [f(2, 4, 3)]),
    "aten.t.default": (lambda x: x.t() * torch.arange(3.0), [f(3, 4)]),
    "aten.expand.default": (lambda x: x.expand(4, 3) * torch.arange(4.0)[:, None], [f(1, 3)]),
    "aten.slice.Tensor": (lambda x: x[:, 1:3] * 2 + x[:, ::2], [f(4, 4)]),
    "aten.select.int": (lambda x: x[:, 2] * x[1], [f(4, 4)]),
    "aten.split.Tensor": (lambda x: torch.split(x, 2, 1)[0] * torch.split(x, 2, 1)[1], [f(3, 4)]),
    "aten.split_with_sizes.default": (lambda x: x.split([1, 3], 1)[1].sum(1, keepdim=True) * x.split([1, 3], 1)[0],
                                      [f(3, 4)]),
    "aten.cat.default": (lambda x, y: torch.cat([x, y, x], 1), [f(2, 3), f(2, 1)]),
    "aten.stack.default": (lambda x, y: torch.stack([x, y], 1), [f(2, 3), f(2, 3)]),
    "aten.pad.default": (lambda x: F.pad(x, (1, 2), value=0.5), [f(2, 3)]),
    "aten.index.Tensor": (lambda x, k: x[k] * 2, [f(5, 3), i(5, 4)]),
    "aten.index_select.default": (lambda x, k: x.index_select(1, k), [f(3, 5), i(5, 4)]),
    "aten.embedding.default": (lambda w, k: F.embedding(k, w), [f(6, 4), i(6, 2, 5)]),
    "aten.sum.dim_IntList": (lambda x: x.sum(1) + x.sum((0, 1), keepdim=True), [f(3, 4)]),
    "aten.mean.dim": (lambda x: x.mean(-1, keepdim=True) * x, [f(3, 4)]),
    "aten.amax.default": (lambda x: x.amax(1), [f(3, 4)]),
    "aten.var.dim": (lambda x: x.var(1) + x.var(1, unbiased=False), [f(3, 4)]),
    "aten.softmax.int": (lambda x: x.softmax(-1) * torch.arange(4.0), [f(3, 4)]),
    "aten.log_softmax.int": (lambda x: x.log_softmax(0), [f(3, 4)]),
    "aten.linear.default": (lambda x, w, c: F.linear(x, w, c), [f(2, 5, 3), f(4, 3), f(4)]),
    "aten.matmul.default": (lambda x, y: x @ y, [f(2, 3, 4), f(4, 5)]),
    "aten.mm.default": (lambda x, y: torch.mm(x, y), [f(3, 4), f(4, 5)]),
    "aten.bmm.default": (lambda x, y: torch.bmm(x, y), [f(2, 3, 4), f(2, 4, 5)]),
    "aten.addmm.default": (lambda c, x, y: torch.addmm(c, x, y), [f(5), f(3, 4), f(4, 5)]),
    "aten.layer_norm.default": (lambda x, w, c: F.layer_norm(x, (4,), w, c, 1e-5), [f(2, 3, 4), f(4), f(4)]),
    "aten.rms_norm.default": (lambda x, w: F.rms_norm(x, (4,), w, 1e-6), [f(2, 3, 4), f(4)]),
    "aten.group_norm.default": (lambda x, w, c: F.group_norm(x, 2, w, c), [f(2, 4, 3, 3), f(4), f(4)]),
    "aten.batch_norm.default": (lambda x, w, c: F.batch_norm(x, None, None, w, c, training=True),
                                [f(4, 3, 2, 2), f(3), f(3)]),
    "aten.scaled_dot_product_attention.default": (
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None, None, :])
        + F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], is_causal=True, enable_gqa=True)
        + F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.bool).tril(-1) |
                                         torch.eye(5, dtype=torch.bool), scale=0.3),
        [f(2, 2, 5, 4), f(2, 2, 5, 4), f(2, 2, 5, 4), b(2, 5)]),
    "aten.cross_entropy_loss.default": (
        lambda x, t: F.cross_entropy(x, t) + F.cross_entropy(x, t, reduction="sum", ignore_index=2) / 7,
        [f(6, 5), i(5, 6)]),
    "aten.nll_loss_nd.default": (lambda x, t: F.nll_loss(x, t, ignore_index=1) + F.nll_loss(x.log_softmax(1), t),
                                 [f(6, 5), i(5, 6)]),
    "aten.mse_loss.default": (lambda x, y: F.mse_loss(x, y), [f(6, 5), f(6, 5)]),
    "aten.conv2d.default": (lambda x, w, c: F.conv2d(x, w, c, stride=2, padding=1), [f(2, 3, 6, 6), f(4, 3, 3, 3), f(4)]),
    "aten.conv1d.default": (lambda x, w: F.conv1d(x, w, padding=1), [f(2, 3, 7), f(4, 3, 3)]),
    "aten.max_pool2d.default": (lambda x: F.max_pool2d(x, 3, 2, 1), [f(2, 3, 6, 6)]),
    "aten.avg_pool2d.default": (lambda x: F.avg_pool2d(x, 2), [f(2, 3, 6, 6)]),
    "aten.adaptive_avg_pool2d.default": (lambda x: F.adaptive_avg_pool2d(x, 1) + F.adaptive_avg_pool2d(x, 2).mean(),
                                         [f(2, 3, 4, 4)]),
    "aten.dropout.default": (lambda x: F.dropout(x, 0.0, training=True) * 2, [f(6)]),
    "aten.add_.Tensor": (lambda x, y: (x * 1).add_(y).relu_(), [f(3, 4), f(3, 4)]),
    "aten.copy_.default": (lambda x, y: _write_slice(x, y), [f(3, 4), f(3, 2)]),
}


def _write_slice(x, y):
    z = x * 2
    z[:, 1:3] = y  # copy_ through a slice view: z is rebuilt around y
    z[0] = 0.5  # fill_ through a select view
    return z


class Probe(torch.nn.Module):
    """fn over the float inputs (trainable) and the others (data): (fn(...) * weights).sum()."""

    def __init__(self, fn, inputs):
        super().__init__()
        self.fn = fn
        self.params = torch.nn.ParameterList([torch.nn.Parameter(x) for x in inputs if x.is_floating_point()])
        self.kinds = [x.is_floating_point() for x in inputs]
        with torch.no_grad():
            shape = fn(*inputs).shape
        self.register_buffer("weights", torch.rand(shape, generator=torch.Generator().manual_seed(7)) + 0.5)

    def forward(self, *data):
        params, data = iter(self.params), iter(data)
        out = self.fn(*[next(params) if floating else next(data) for floating in self.kinds])
        return (out * self.weights).sum()


def _inputs(specs, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        if spec[0] == "f":
            out.append(torch.randn(*spec[1], generator=g))
        elif spec[0] == "i":
            out.append(torch.randint(0, spec[1], spec[2], generator=g))
        else:
            out.append(torch.rand(*spec[1], generator=g) > 0.4)
    return out


@pytest.mark.parametrize("op", list(CASES))
def test_row(op):
    fn, specs = CASES[op]
    inputs = _inputs(specs, zlib.crc32(op.encode()) % 1000)  # str hash() differs per process
    if op == "aten.scaled_dot_product_attention.default":
        inputs[3][:, 0] = True  # every row keeps a key
    if op == "aten.rms_norm.default" and not hasattr(F, "rms_norm"):
        pytest.skip("this torch has no rms_norm")
    data = [x for x in inputs if not x.is_floating_point()]
    model = Probe(fn, inputs)
    reference = Probe(fn, [x.clone() for x in inputs])
    before = [p.detach().clone() for p in model.params]
    step = kiln.compile(model, tuple(data), optimizer=kiln.SGD(lr=1.0))
    assert op in step.aten_ops, f"{op} was not lowered through the table: {step.aten_ops}"
    loss = step(*data)
    want = reference(*data)
    want.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-5, abs=1e-5)
    for got_after, start, p in zip(model.params, before, reference.params):
        grad = start - got_after.detach()
        scale = float(p.grad.abs().max()) + 1e-6
        assert torch.allclose(grad, p.grad, rtol=1e-4, atol=1e-5 * scale), \
            f"{op}: gradient off by {(grad - p.grad).abs().max().item():.3g} at scale {scale:.3g}"


def test_embedding_padding_row_gets_no_gradient():
    """torch's padding_idx: the padding row is read but not trained (gather's padding_index)."""
    weights = torch.randn(6, 4)
    model = Probe(lambda w, k: F.embedding(k, w, padding_idx=2), [weights, torch.zeros(2, 5, dtype=torch.long)])
    ids = torch.tensor([[2, 0, 1, 2, 5], [3, 2, 2, 4, 1]])
    before = model.params[0].detach().clone()
    step = kiln.compile(model, (ids,), optimizer=kiln.SGD(lr=1.0))
    step(ids)
    reference = Probe(lambda w, k: F.embedding(k, w, padding_idx=2), [weights.clone(), ids])
    reference(ids).backward()
    grad = before - model.params[0].detach()
    assert torch.equal(grad[2], torch.zeros(4))
    assert torch.allclose(grad, reference.params[0].grad, rtol=1e-5, atol=1e-6)


def test_no_grad_and_autocast_blocks():
    """`with torch.no_grad()` and `with torch.autocast(..., enabled=False)` inside a forward: the
    export keeps them as calls of submodules, which kiln lowers in place; what a no-grad block
    computes carries no gradient (k is not trained; torch leaves its grad None)."""
    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.k = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.l(x)
            with torch.no_grad():
                t = self.k(x).tanh()
            with torch.autocast("cpu", enabled=False):
                u = h * 2
            return ((u - t) ** 2).mean() + (h * t).sum()

    torch.manual_seed(0)
    model = Blocks()
    reference = Blocks()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = kiln.compile(model, (x,), optimizer=kiln.SGD(lr=1.0))
    loss = step(x)
    want = reference(x)
    want.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    for n, p in reference.named_parameters():
        grad = before[n] - dict(model.named_parameters())[n].detach()
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-6), n
    assert reference.k.weight.grad is None
    # With weight decay, as torch.optim.AdamW: k (no gradient) is left alone, l decays and moves.
    decayed = Blocks()
    decayed.load_state_dict(reference.state_dict())
    k_before = decayed.k.weight.detach().clone()
    l_before = decayed.l.weight.detach().clone()
    step = kiln.compile(decayed, (x,), optimizer=kiln.AdamW(lr=0.1, weight_decay=0.5))
    step(x)
    assert torch.equal(decayed.k.weight.detach(), k_before)
    assert not torch.equal(decayed.l.weight.detach(), l_before)


def test_docs_list_the_table():
    """docs/python.md's list of ATen ops is the table's."""
    import os
    import re
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")
    text = open(path).read().split("The ATen ops of the table")[1].split("\n\n")[0]
    listed = set(re.findall(r"`([a-z_0-9]+\.[A-Za-z_0-9]+)`", text))
    assert listed == {op.replace("aten.", "") for op in capture.supported_ops()}


def test_one_tensor_given_for_two_inputs():
    """Compiled with (x, x), as a language model is with (ids, ids) for inputs and labels: the two
    inputs stay two, so a later step given different tensors reads each."""
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, a, b):
            return (a * self.w).sum() + (b * self.w).square().sum()

    model = Two()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    want = float(model(x, y))
    step = kiln.compile(model, (x, x), optimizer=kiln.SGD(lr=1e-9))
    assert float(step(x, y)) == pytest.approx(want, rel=1e-6)  # the loss before the update


def test_tied_parameters_are_one_tensor():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(7, 4)
            self.head = torch.nn.Linear(4, 7, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return F.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), ids.flatten())

    model = Tied()
    ids = torch.randint(0, 7, (2, 3))
    step = kiln.compile(model, (ids,))
    state = step.state_dict()
    assert state["embed.weight"].data_ptr() == state["head.weight"].data_ptr()
    step(ids)
    assert model.embed.weight is model.head.weight


def test_batch_norm_statistics_are_updated():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 4 * 4, 3))
    reference = Probe(lambda x: x, [torch.ones(1)])  # unused: torch's own module below
    del reference
    import copy
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(5, 3, 6, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
    step = kiln.compile(model, (x, y), loss="cross_entropy")
    step(x, y)
    F.cross_entropy(twin(x), y)
    for name, buffer in twin.named_buffers():
        assert torch.allclose(dict(model.named_buffers())[name].float(), buffer.float(), rtol=1e-5, atol=1e-6), name


def test_unsupported_op_names_itself_and_the_line():
    class Sorter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5))

        def forward(self, x):
            return torch.cummax(self.w * x, 0).values.sum()  # THE LINE

    with pytest.raises(kiln.Error, match=r"aten\.cummax\.default is not supported.*test_capture_ops\.py:\d+ in forward"):
        kiln.compile(Sorter(), (torch.randn(5),))


def test_data_dependent_control_flow_is_explained():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5))

        def forward(self, x):
            if (self.w * x).sum() > 0:
                return (self.w * x).sum()
            return -(self.w * x).sum()

    with pytest.raises(kiln.Error, match=r"(?s)torch.export of Branchy failed.*test_capture_ops.py:\d+.*torch.where"):
        kiln.compile(Branchy(), (torch.randn(5),))


def test_onnx_path_stays():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    step = kiln.compile(model, (x, y), loss="cross_entropy", capture="onnx")
    assert step.aten_ops is None
    assert math.isfinite(float(step(x, y)))


@pytest.mark.skipif(not torch.cuda.is_available() or kiln._kiln.cuda_device_count() == 0, reason="no GPU here")
def test_step_runs_where_the_module_is():
    """A module on the GPU and inputs on the CPU: the capture moves the example, the step runs on
    the GPU (the module's own tensors, trained in place), and the loss comes back to the CPU."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).cuda()
    reference = torch.nn.Sequential(torch.nn.Linear(8, 4))
    reference.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    step = kiln.compile(model, (x, y), loss="cross_entropy", optimizer=kiln.SGD(lr=0.1))
    loss = step(x, y)
    assert loss.device.type == "cpu"
    want = F.cross_entropy(reference(x), y)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    want.backward()
    with torch.no_grad():
        expected = reference[0].weight - 0.1 * reference[0].weight.grad
    assert torch.allclose(model[0].weight.cpu(), expected, rtol=1e-4, atol=1e-6)

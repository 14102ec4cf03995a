"""Real PyTorch models through kiln.compile's torch.export capture (kiln.capture): GPT-2 with
labels, LLaMA (grouped-query attention), BERT with a padded attention mask, torch's
TransformerEncoder with a bool key padding mask, ViT, ResNet-18, MobileNetV2 and T5 with labels
(tests/python/capture_models.py: small configurations, random weights). Each trains 10 AdamW
steps through kiln and through torch (torch.optim.AdamW, the same start) on the same random
batches; the losses must agree to 1e-5 relative and every parameter to 1e-3 of its largest
entry. Entries whose true gradient is zero (an attention key bias: softmax ignores it) move by
AdamW's +-lr on rounding noise, in torch as in kiln, so they are compared by gradient instead:
one step of SGD with lr 1 gives kiln's gradient of every parameter, compared with torch's.
The two CNNs train 2 steps of SGD (momentum 0.9) instead: their training on random batches is
chaotic (BatchNorm over few positions at the last stages): torch in f32 and torch in f64 are
8% apart in loss at the third SGD step of ResNet-18 (lr 1e-2; 1e-4 at 64 x 64, batch 8, lr 1e-3),
so no two implementations can agree to 1e-5 over 10 steps, and AdamW's +-lr moves on near-zero
gradients break the 1e-3 parameter bound at once. The compile time is printed (pytest -s), not
asserted."""
import copy
import time

import pytest

torch = pytest.importorskip("torch")
import kiln  # noqa: E402
from kiln import capture  # noqa: E402

import capture_models  # noqa: E402

if not capture.available():
    pytest.skip(f"torch {torch.__version__} has no torch.export (PyTorch >= 2.5)", allow_module_level=True)

STEPS = 10
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.01
SGD_MODELS, SGD_LR, MOMENTUM, SGD_STEPS = ("resnet18", "mobilenet_v2"), 1e-3, 0.9, 2
# Compared in float64, model and batches: at batch 4 and 32x32, MobileNetV2's last BatchNorms
# normalize 4 values of 1x1 maps, which amplifies f32 rounding (the first step's BatchNorm-bias
# gradients of kiln and torch, both in f32, were 1.1e-3 of their largest entry apart).
F64_MODELS = ("mobilenet_v2",)


def _kiln_optimizer(name):
    if name in SGD_MODELS:
        return kiln.SGD(lr=SGD_LR, momentum=MOMENTUM, weight_decay=WD)
    return kiln.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def _torch_optimizer(name, parameters):
    if name in SGD_MODELS:
        return torch.optim.SGD(parameters, lr=SGD_LR, momentum=MOMENTUM, weight_decay=WD)
    return torch.optim.AdamW(parameters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def _loss(out):
    if isinstance(out, torch.Tensor):
        return out
    return out["loss"] if hasattr(out, "keys") and "loss" in out.keys() else out[0]


def _call(f, batch):
    args, kwargs = batch
    return f(*args, **kwargs)


def _example(batch):
    args, kwargs = batch
    return kwargs if kwargs else args


def _make(name):
    torch.manual_seed(0)
    model, batch = capture_models.MODELS[name]()
    model.train()
    g = torch.Generator().manual_seed(1)
    data = [batch(g) for _ in range(SGD_STEPS if name in SGD_MODELS else STEPS)]
    if name in F64_MODELS:
        wide = lambda x: x.double() if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
        model = model.double()
        data = [(tuple(wide(a) for a in args), {k: wide(v) for k, v in kwargs.items()}) for args, kwargs in data]
    return model, data


def _torch_training(name, reference, data):
    """torch's losses, and per parameter the largest |gradient| each entry had over the steps."""
    opt = _torch_optimizer(name, reference.parameters())
    losses, largest = [], {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for batch in data:
        opt.zero_grad()
        loss = _loss(_call(reference, batch))
        loss.backward()
        for n, p in reference.named_parameters():
            if p.grad is not None:
                largest[n] = torch.maximum(largest[n], p.grad.abs())
        opt.step()
        losses.append(float(loss))
    return losses, largest


def _gradients_match(name):
    """kiln's gradients at the start (one SGD step, lr 1: before - after) against torch's."""
    model, data = _make(name)
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = kiln.compile(model, _example(data[0]), optimizer=kiln.SGD(lr=1.0))
    _call(step, data[0])
    _loss(_call(reference, data[0])).backward()
    for n, p in reference.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        got = before[n] - dict(model.named_parameters())[n].detach()
        scale = float(want.abs().max()) + 1e-12
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * scale + 1e-7), \
            f"{name}: gradient of {n}: max difference {(got - want).abs().max().item():.3g} at scale {scale:.3g}"


# Not compared here yet, and why.
NOT_COMPARED = {}


@pytest.mark.parametrize("name", list(capture_models.MODELS))
def test_trains_as_torch(name):
    if name in NOT_COMPARED:
        pytest.skip(NOT_COMPARED[name])
    model, data = _make(name)
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = time.perf_counter()
    step = kiln.compile(model, _example(data[0]), optimizer=_kiln_optimizer(name))
    seconds = time.perf_counter() - start
    kiln_losses = [float(_call(step, batch)) for batch in data]
    torch_losses, largest = _torch_training(name, reference, data)
    relative = max(abs(a - b) / abs(b) for a, b in zip(kiln_losses, torch_losses))
    worst, failures = 0.0, []
    ref = dict(reference.named_parameters())
    overall = max(float(g.max()) for g in largest.values())
    for n, p in model.named_parameters():
        want, got = ref[n].detach(), p.detach()
        scale = float(want.abs().max())
        # Entries whose gradient is rounding noise (1e-6 of the model's largest) are left to the
        # gradient check.
        real = largest[n] > 1e-6 * overall
        difference = float(((got - want).abs() * real).max()) if real.any() else 0.0
        worst = max(worst, difference / scale if scale else difference)
        if difference > 1e-3 * scale:
            failures.append(f"{n}: max difference {difference:.3g} at scale {scale:.3g}")
    parts = step._record["capture_seconds"]
    print(f"\n{name}: compile {seconds:.2f} s (torch.export {parts['export']:.2f}, lowering {parts['lower']:.2f}, "
          f"kiln {seconds - parts['export'] - parts['lower']:.2f}); losses {kiln_losses[0]:.5f} -> {kiln_losses[-1]:.5f}, "
          f"max loss rel. difference {relative:.2e}, max param difference {worst:.2e} of its largest entry")
    assert not failures, "; ".join(failures)
    assert kiln_losses == pytest.approx(torch_losses, rel=1e-5)
    assert max(float((p.detach() - initial[n]).abs().max()) for n, p in model.named_parameters()) > 1e-4  # it trained
    _gradients_match(name)

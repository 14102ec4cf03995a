"""kiln's optimizers against PyTorch's: several steps of a small model (an embedding, two linear
layers with biases, a LayerNorm) on random batches through kiln.compile and through torch, from
the same start; every parameter must agree. SGD (momentum, Nesterov, weight decay) and AdamW
against torch.optim, Lion against a torch optimizer written here from the paper's Algorithm 2,
Adafactor against transformers.optimization.Adafactor. Torch optimizers are given to
kiln.compile as they are (hyperparameters and param groups); kiln.Lion and kiln.AdamW with the
usual no-decay rule are compared too. And the errors for what kiln cannot honour."""
import copy

import pytest

torch = pytest.importorskip("torch")
import kiln  # noqa: E402
from kiln import capture  # noqa: E402

if not capture.available():
    pytest.skip(f"torch {torch.__version__} has no torch.export (PyTorch >= 2.5)", allow_module_level=True)

STEPS = 5


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.fc1 = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.fc2 = torch.nn.Linear(8, 5)

    def forward(self, ids, y):
        h = self.embed(ids).mean(1)
        logits = self.fc2(torch.relu(self.norm(self.fc1(h))))
        return torch.nn.functional.cross_entropy(logits, y)


class Lion(torch.optim.Optimizer):
    """Lion as Chen et al. 2023 write it (Algorithm 2), in float64: the test's reference."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p, dtype=torch.float64))
                g, w = p.grad.double(), p.double()
                update = (beta1 * m + (1 - beta1) * g).sign()
                w = w - group["lr"] * (update + group["weight_decay"] * w)
                m.mul_(beta2).add_((1 - beta2) * g)
                p.copy_(w)


def _model_and_data():
    torch.manual_seed(0)
    model = Net()
    data = [(torch.randint(0, 11, (4, 3)), torch.randint(0, 5, (4,))) for _ in range(STEPS)]
    return model, data


def _no_decay(model):
    """The usual rule: biases, norm weights (rank < 2) and embedding tables."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embed")]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 or n.startswith("embed")]
    return decay, rest


def _compare(make_torch_optimizer, kiln_optimizer=None, tolerance=1e-5):
    """Trains the model STEPS steps through torch and through kiln; kiln_optimizer(model) makes
    kiln's optimizer (default: the torch optimizer of kiln's own model copy)."""
    model, data = _model_and_data()
    reference = copy.deepcopy(model)
    optimizer = make_torch_optimizer(reference)
    for ids, y in data:
        optimizer.zero_grad()
        reference(ids, y).backward()
        optimizer.step()
    given = kiln_optimizer(model) if kiln_optimizer else make_torch_optimizer(model)
    step = kiln.compile(model, data[0], optimizer=given)
    for ids, y in data:
        step(ids, y)
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        difference = float((p.detach() - want[name].detach()).abs().max())
        scale = max(1.0, float(want[name].detach().abs().max()))
        assert difference <= tolerance * scale, f"{name}: max difference {difference:.3g}"


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_as_torch(momentum, nesterov):
    _compare(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum, nesterov=nesterov,
                                       weight_decay=0.01))


def test_adamw_as_torch():
    _compare(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1))


def test_param_groups_as_torch():
    def groups(m):
        decay, rest = _no_decay(m)
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": rest, "weight_decay": 0.0, "lr": 3e-3, "betas": (0.5, 0.9)}], lr=1e-2)
    _compare(groups)


def test_no_decay_rule_as_torchs_groups():
    def groups(m):
        decay, rest = _no_decay(m)
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.2)
    _compare(groups, lambda m: kiln.AdamW(lr=1e-2, weight_decay=0.2, decay_biases_norms_embeddings=False))


def test_lion_as_the_paper():
    _compare(lambda m: Lion(m.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.5),
             lambda m: kiln.Lion(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.5))
    # A torch optimizer named Lion is read as kiln's.
    _compare(lambda m: Lion(m.parameters(), lr=1e-3, betas=(0.95, 0.98), weight_decay=0.1))


@pytest.mark.parametrize("scale_parameter", [False, True])
def test_adafactor_as_transformers(scale_parameter):
    transformers = pytest.importorskip("transformers")
    _compare(lambda m: transformers.optimization.Adafactor(
        m.parameters(), lr=1e-2, relative_step=False, scale_parameter=scale_parameter, warmup_init=False,
        weight_decay=0.01))


def test_what_kiln_cannot_honour():
    model, data = _model_and_data()
    with pytest.raises(kiln.Error, match="amsgrad=True"):
        kiln.compile(model, data[0], optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True))
    with pytest.raises(kiln.Error, match="dampening=0.5"):
        kiln.compile(model, data[0], optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                               dampening=0.5))
    with pytest.raises(kiln.Error, match="RMSprop: kiln has no such optimizer"):
        kiln.compile(model, data[0], optimizer=torch.optim.RMSprop(model.parameters()))
    with pytest.raises(kiln.Error, match="Adam's L2 weight_decay"):
        kiln.compile(model, data[0], optimizer=torch.optim.Adam(model.parameters(), weight_decay=0.1))
    with pytest.raises(kiln.Error, match="fc2.weight, fc2.bias are in no param group|fc2.bias, fc2.weight are in no"):
        kiln.compile(model, data[0], optimizer=torch.optim.SGD(list(model.parameters())[:-2], lr=0.1))
    with pytest.raises(kiln.Error, match="no hyperparameter 'momentum'"):
        kiln.AdamW(momentum=0.9)
    with pytest.raises(kiln.Error, match="optimizer is a str"):
        kiln.compile(model, data[0], optimizer="adam")

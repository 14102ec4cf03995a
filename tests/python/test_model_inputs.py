"""What models from torch and Hugging Face configs bring to kiln.compile: bool inputs (attention
and padding masks), integer ids out of range (an embedding's negative id, a label that is not
ignore_index), and tied parameters (GPT-2's lm_head.weight is transformer.wte.weight). Each is
compared with what torch does on the same module."""
import copy

import numpy as np
import pytest

import kiln

torch = pytest.importorskip("torch")
if not kiln._kiln.onnx_available():
    pytest.skip("kiln is built without the ONNX front end", allow_module_level=True)
from kiln._tensors import from_kiln, to_kiln  # noqa: E402

needs_cuda = pytest.mark.skipif(kiln._kiln.cuda_device_count() == 0 or not torch.cuda.is_available(),
                                reason="no CUDA device (or a kiln without CUDA)")
F = torch.nn.functional
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-6, 0.01


def adamw():
    return kiln.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def torch_losses(model, batches):
    """torch's own training of `model` (its forward returns the loss) with the same AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def assert_same_params(model, reference):
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        want = ref[name].detach()
        assert torch.allclose(p.detach().cpu(), want, rtol=1e-3, atol=1e-4 * float(want.abs().max()) + 1e-5), name


# ---- bool inputs ----

class MaskedPool(torch.nn.Module):
    """A masked mean over the positions a bool mask keeps, then a classifier: the mask is a data
    input of dtype bool, used as masked_fill's condition and as a count."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, keep, labels):
        h = torch.tanh(self.proj(x)).masked_fill(~keep[..., None], 0.0)
        pooled = h.sum(1) / keep.sum(1, keepdim=True).to(h.dtype)
        return F.cross_entropy(self.head(pooled), labels)


def masked_batches(count, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        keep = torch.rand(4, 5, generator=g) < 0.6
        keep[:, 0] = True  # every row keeps a position
        out.append((torch.randn(4, 5, 6, generator=g), keep, torch.randint(0, 3, (4,), generator=g)))
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_bool_input_trains_as_torch(device):
    torch.manual_seed(0)
    model = MaskedPool()
    reference = copy.deepcopy(model)
    model.to(device)
    data = masked_batches(5)
    on_device = [tuple(t.to(device) for t in b) for b in data]
    step = kiln.compile(model, on_device[0], optimizer=adamw(), device=device)
    assert "bool[4, 5]" in step.input_types
    losses = [float(step(*b)) for b in on_device]
    assert losses == pytest.approx(torch_losses(reference, data), rel=1e-4, abs=1e-6)
    assert_same_params(model, reference)
    with torch.no_grad():
        want = reference(*data[0])
    assert float(step.evaluate(*on_device[0])) == pytest.approx(float(want), rel=1e-4)


def test_bool_input_in_the_training_loop():
    torch.manual_seed(0)
    model = MaskedPool()
    reference = copy.deepcopy(model)
    data = masked_batches(4, seed=2)
    result = kiln.train(model, data, loss=None, optimizer=adamw(), progress=False)
    assert result.steps_done == 4 and result.skipped_batches == 0
    assert result.losses == pytest.approx(torch_losses(reference, data), rel=1e-4, abs=1e-6)


def test_bool_padding_mask_of_a_transformer_encoder():
    """torch's TransformerEncoder with src_key_padding_mask (True: a padded position)."""
    torch.manual_seed(0)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 1)
            self.head = torch.nn.Linear(16, 3)

        def forward(self, x, padded, labels):
            h = self.encoder(x, src_key_padding_mask=padded)
            return F.cross_entropy(self.head(h[:, 0]), labels)

    model = Encoder()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    data = []
    for _ in range(3):
        padded = torch.rand(2, 6, generator=g) < 0.4
        padded[:, 0] = False
        data.append((torch.randn(2, 6, 16, generator=g), padded, torch.randint(0, 3, (2,), generator=g)))
    step = kiln.compile(model, data[0], optimizer=adamw())
    losses = [float(step(*b)) for b in data]
    assert losses == pytest.approx(torch_losses(reference, data), rel=1e-4, abs=1e-6)


def test_bool_tensors_cross_without_copies():
    mask = torch.rand(3, 4) < 0.5
    back = from_kiln(kiln._kiln.dlpack_view(to_kiln(mask, "mask")), "torch")
    assert back.dtype == torch.bool and torch.equal(back, mask) and back.data_ptr() == mask.data_ptr()
    array = np.random.default_rng(0).random((3, 4)) < 0.5
    back = from_kiln(kiln._kiln.dlpack_view(to_kiln(array, "mask")), "numpy")
    assert back.dtype == np.bool_ and np.array_equal(back, array)


# ---- ids out of range ----

class Tagger(torch.nn.Module):
    """Token ids through an embedding, a classifier per token; labels may be ignore_index (-100).
    `rows[pick]` indexes a parameter by data the other way torch has (wrapping negatives)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.rows = torch.nn.Parameter(torch.randn(4, 8))
        self.head = torch.nn.Linear(8, 5)

    def forward(self, ids, pick, labels):
        h = self.embed(ids) + self.rows[pick][:, None, :]
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def tagger_batch(seed, ids=None, pick=None, labels=None):
    g = torch.Generator().manual_seed(seed)
    default_ids = torch.randint(0, 11, (3, 4), generator=g)
    default_labels = torch.randint(0, 5, (3, 4), generator=g)
    return (default_ids if ids is None else ids, torch.tensor([0, 3, 1]) if pick is None else pick,
            default_labels if labels is None else labels)


def ids_with(value, seed=5):
    ids = tagger_batch(seed)[0].clone()
    ids[1, 2] = value
    return ids


def labels_with(value, seed=5):
    labels = tagger_batch(seed)[2].clone()
    labels[2, 1] = value
    return labels


def every_tensor(step):
    """Copies of the step's params and state, the optimizer's included."""
    return {n: from_kiln(a, "torch").clone() for n, a in step._session.tensors(False).items()}


def check_refused(step, batch, says, device="cpu"):
    """`batch` is a kiln.Error naming the bad value; on the CPU the step changes nothing."""
    before = every_tensor(step)
    steps = step.steps_done
    with pytest.raises(kiln.Error, match=says):
        step(*batch)
        step.synchronize()  # a CUDA kernel's data error surfaces when the host waits
    if device == "cpu":
        assert step.steps_done == steps
        for n, t in every_tensor(step).items():
            assert torch.equal(t, before[n]), f"{n} changed"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_ids_out_of_range_are_refused(device):
    torch.manual_seed(0)
    model = Tagger().to(device)
    on = lambda batch: tuple(t.to(device) for t in batch)  # noqa: E731
    step = kiln.compile(model, on(tagger_batch(1)), optimizer=adamw(), device=device)
    # torch refuses the same ids (its embedding raises; the cross-entropy's label check too).
    with pytest.raises((IndexError, RuntimeError)):
        copy.deepcopy(model).cpu()(*tagger_batch(1, ids=ids_with(-1)))
    with pytest.raises((IndexError, RuntimeError)):
        copy.deepcopy(model).cpu()(*tagger_batch(1, labels=labels_with(-5)))
    check_refused(step, on(tagger_batch(1, ids=ids_with(-1))), r"gather: index -1 .*0\.\.10", device)
    check_refused(step, on(tagger_batch(1, ids=ids_with(-11))), r"gather: index -11", device)
    check_refused(step, on(tagger_batch(1, ids=ids_with(11))), r"gather: index 11 ", device)
    check_refused(step, on(tagger_batch(1, labels=labels_with(-5))),
                  r"label -5 .*out of range \[0, 5\) and is not ignore_index -100", device)
    check_refused(step, on(tagger_batch(1, labels=labels_with(5))), r"label 5 ", device)
    if device == "cuda":
        return  # CUDA kernels carry on past a data error (device_errors.h): the step has run
    # What torch accepts trains as torch: -100 (ignore_index) labels, a negative `pick`
    # (indexing counts it from the end), after the refusals changed nothing.
    reference = copy.deepcopy(model)
    data = [tagger_batch(2, labels=labels_with(-100)), tagger_batch(3, pick=torch.tensor([-1, 2, -4]))]
    losses = [float(step(*b)) for b in data]
    assert losses == pytest.approx(torch_losses(reference, data), rel=1e-4, abs=1e-6)
    assert_same_params(model, reference)


@pytest.mark.parametrize("log_softmax", [True, False])
def test_nll_loss_labels_out_of_range_are_refused(log_softmax):
    """F.nll_loss exports as NegativeLogLikelihoodLoss, which kiln imports as a one_hot pick (on
    log_softmax's output the simplifier makes it cross_entropy again; on other scores it stays):
    its labels are checked either way (one_hot alone would give a bad one no loss)."""

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 4)

        def forward(self, x, labels):
            scores = self.fc(x)
            return F.nll_loss(F.log_softmax(scores, -1) if log_softmax else scores, labels)

    torch.manual_seed(0)
    model = Classifier()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    x, labels = torch.randn(5, 6, generator=g), torch.randint(0, 4, (5,), generator=g)
    step = kiln.compile(model, (x, labels), optimizer=adamw())
    for bad in (-3, 4):
        given = labels.clone()
        given[1] = bad
        with pytest.raises((IndexError, RuntimeError)):
            reference(x, given)
        check_refused(step, (x, given), rf"(label|index) {bad} ")
    ignored = labels.clone()
    ignored[2] = -100
    data = [(x, ignored), (x, labels)]
    assert [float(step(*b)) for b in data] == pytest.approx(torch_losses(reference, data), rel=1e-4, abs=1e-6)


# ---- tied parameters ----

class TiedLm(torch.nn.Module):
    """A language model whose output layer is its embedding (as GPT-2's)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(13, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 13, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids, labels):
        return F.cross_entropy(self.out(torch.tanh(self.mix(self.embed(ids)))).flatten(0, 1), labels.flatten())


def lm_batches(count, seed=1, vocab=13):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (2, 5), generator=g), torch.randint(0, vocab, (2, 5), generator=g))
            for _ in range(count)]


def test_tied_parameters_under_every_name(tmp_path):
    torch.manual_seed(0)
    model = TiedLm()
    reference = copy.deepcopy(model)
    data = lm_batches(4)
    step = kiln.compile(model, data[0], optimizer=adamw())
    losses = [float(step(*b)) for b in data[:3]]
    assert losses == pytest.approx(torch_losses(reference, data[:3]), rel=1e-4, abs=1e-6)
    state = step.state_dict()
    assert list(state) == list(model.state_dict())  # torch's order: the tied head last
    assert state["out.weight"] is state["embed.weight"]  # one tensor: the module's own
    assert state["out.weight"].data_ptr() == model.embed.weight.data_ptr()
    assert_same_params(model, reference)

    # Into torch and back: a torch state_dict has both names.
    fresh = TiedLm()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.out.weight, model.embed.weight)
    other = TiedLm()
    other_step = kiln.compile(other, data[0], optimizer=adamw())
    other_step.load_state_dict(reference.state_dict())
    assert torch.equal(other.embed.weight, reference.embed.weight)
    one_name = {n: t for n, t in reference.state_dict().items() if n != "out.weight"}
    other_step.load_state_dict(one_name)  # one name of a tied tensor suffices
    # Two names of one tensor with different values: an error, nothing copied.
    conflicting = {n: t.clone() for n, t in reference.state_dict().items()}
    conflicting["out.weight"] += 1
    conflicting["mix.bias"] += 1
    before = {n: t.clone() for n, t in other_step.state_dict().items()}
    with pytest.raises(kiln.Error, match="'embed.weight' and 'out.weight' are one tied tensor"):
        other_step.load_state_dict(conflicting)
    for n, t in other_step.state_dict().items():
        assert torch.equal(t, before[n]), n

    # A checkpoint: the loaded step (no module) names the tensor twice too, and continues.
    path = tmp_path / "tied.safetensors"
    step.save(path)
    loaded = kiln.load(path)
    loaded_state = loaded.state_dict()
    assert list(loaded_state) == list(state)
    assert loaded_state["out.weight"].data_ptr() == loaded_state["embed.weight"].data_ptr()
    assert float(loaded(*data[3])) == pytest.approx(float(step(*data[3])), rel=1e-6)


def test_gpt2_tied_head():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight

    def loss(out, labels):  # the next-token loss with the labels shifted by the caller
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    ids = torch.randint(0, 128, (2, 16))
    step = kiln.compile(model, (ids, torch.roll(ids, -1, 1)), loss=loss, optimizer=adamw())
    step(ids, torch.roll(ids, -1, 1))
    state = step.state_dict()
    assert set(state) == set(model.state_dict())
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    fresh = transformers.GPT2LMHeadModel(config)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.lm_head.weight, model.transformer.wte.weight)
    step.load_state_dict(fresh.state_dict())

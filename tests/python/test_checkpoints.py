"""state_dict round trips, and Step.save / kiln.load continue a run exactly."""
import copy

import pytest

import kiln

torch = pytest.importorskip("torch")
if not kiln._kiln.onnx_available():
    pytest.skip("kiln is built without the ONNX front end", allow_module_level=True)
import torch_models  # noqa: E402


def data(count, seed=1):
    g = torch.Generator().manual_seed(seed)
    example = torch_models.Cnn().example
    return [example(g) for _ in range(count)]


def fresh(seed=0):
    torch.manual_seed(seed)
    return torch_models.Cnn()


def test_state_dict_round_trip():
    batches = data(3)
    a = kiln.compile(fresh(0), batches[0])
    a(*batches[0])
    other = fresh(7)
    b = kiln.compile(other, batches[0])
    state = {n: t.clone() for n, t in a.state_dict().items()}
    assert set(state) == set(b.state_dict())
    assert "bn1.running_mean" in state and "conv1.weight" in state
    b.load_state_dict(state)
    for n, t in b.state_dict().items():
        assert torch.equal(t, state[n]), n
    assert torch.equal(other.conv1.weight.detach(), state["conv1.weight"])  # into the module's own tensors
    with pytest.raises(kiln.Error, match="unexpected nope"):
        b.load_state_dict({**state, "nope": torch.zeros(1)})
    dims = ",".join(str(d) for d in state["conv1.weight"].shape)
    with pytest.raises(kiln.Error, match=rf"'conv1.weight' is f32\[{dims}\], the value given is f32\[2\]"):
        b.load_state_dict({**state, "conv1.weight": torch.zeros(2)})


def test_save_and_load_continue_exactly(tmp_path):
    batches = data(6)
    whole = kiln.compile(fresh(), batches[0], optimizer=kiln.AdamW(lr=1e-2, warmup_steps=2, decay_steps=6))
    want = [float(whole(*b)) for b in batches]

    first = kiln.compile(fresh(), batches[0], optimizer=kiln.AdamW(lr=1e-2, warmup_steps=2, decay_steps=6))
    got = [float(first(*b)) for b in batches[:3]]
    path = tmp_path / "step.safetensors"
    first.save(path)
    resumed = kiln.load(path)
    assert resumed.steps_done == 3
    got += [float(resumed(*b)) for b in batches[3:]]
    assert got == want  # bit for bit: the same program, params, optimizer state and schedule
    for n, t in resumed.state_dict().items():
        assert torch.equal(t, whole.state_dict()[n]), n


def test_load_refuses_other_files(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"garbage")
    with pytest.raises(kiln.Error, match="not a readable safetensors"):
        kiln.load(path)

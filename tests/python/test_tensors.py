"""Tensors cross without copies: the DLPack bridge keeps the data pointer both ways (torch and
numpy, CPU and CUDA); the step trains the module's own tensors in place and reads its inputs
where they are; what kiln cannot read in place is a kiln.Error, never a silent copy."""
import inspect

import numpy as np
import pytest

import kiln

torch = pytest.importorskip("torch")

needs_onnx = pytest.mark.skipif(not kiln._kiln.onnx_available(), reason="kiln is built without the ONNX front end")
needs_cuda = pytest.mark.skipif(kiln._kiln.cuda_device_count() == 0 or not torch.cuda.is_available(),
                                reason="no CUDA device (kiln's or torch's)")


def test_numpy_crosses_without_copy():
    a = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    view = np.asarray(kiln._kiln.dlpack_view(a))
    assert view.ctypes.data == a.ctypes.data
    a[1, 2] = 42.0
    assert view[1, 2] == 42.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16])
def test_torch_crosses_without_copy(dtype):
    t = (torch.randn(4, 6) * 10).to(dtype)
    back = torch.from_dlpack(kiln._kiln.dlpack_view(t))
    assert back.data_ptr() == t.data_ptr()
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_not_contiguous_is_an_error():
    t = torch.randn(4, 6)
    with pytest.raises(kiln.Error, match="not contiguous"):
        kiln._kiln.dlpack_view(t.t())
    with pytest.raises(kiln.Error, match="not contiguous"):
        kiln._kiln.dlpack_view(np.ones((4, 6), np.float32)[:, ::2])


def test_unknown_dtype_is_an_error():
    with pytest.raises(kiln.Error, match="complex64"):
        kiln._kiln.dlpack_view(torch.zeros(3, dtype=torch.complex64))


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


@needs_onnx
def test_step_trains_the_module_in_place():
    model = small_model()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    x_before = x.clone()
    step = kiln.compile(model, (x, y), loss="cross_entropy")
    weights = model[0].weight
    pointer, before = weights.data_ptr(), weights.detach().clone()
    state = step.state_dict()
    assert state["0.weight"].data_ptr() == pointer
    loss = step(x, y)
    assert loss.shape == () and loss.dtype == torch.float32
    assert weights.data_ptr() == pointer and not torch.equal(weights.detach(), before)
    assert torch.equal(state["0.weight"], weights.detach())  # the same memory, updated
    assert torch.equal(x, x_before)  # inputs are read in place, never written


def export_small_model(path, x, y):
    """small_model() with its cross-entropy loss, exported by hand to the ONNX file `path`."""
    model = small_model()

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.net(x), y)

    legacy = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    torch.onnx.export(WithLoss(), (x, y), str(path), input_names=["x", "y"], opset_version=17,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, **legacy)


@needs_onnx
def test_numpy_inputs_give_numpy_outputs(tmp_path):
    path = tmp_path / "mlp.onnx"
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    export_small_model(path, x, y)
    step = kiln.compile(str(path), (x.numpy(), y.numpy()))
    loss = step(x.numpy(), y.numpy())
    assert isinstance(loss, np.ndarray) and loss.shape == ()
    state = step.state_dict()
    assert isinstance(state["net.0.weight"], np.ndarray)
    assert "fusion" in step.report()


@needs_cuda
@needs_onnx
def test_cuda_step_without_copies():
    model = small_model().cuda()
    x, y = torch.randn(4, 8, device="cuda"), torch.randint(0, 3, (4,), device="cuda")
    step = kiln.compile(model, (x, y), loss="cross_entropy", device="cuda")
    pointer = model[0].weight.data_ptr()
    assert step.state_dict()["0.weight"].data_ptr() == pointer
    losses = [step(x, y) for _ in range(3)]
    assert all(l.is_cuda for l in losses)
    reference = small_model()
    cpu = kiln.compile(reference, (x.cpu(), y.cpu()), loss="cross_entropy")
    want = [float(cpu(x.cpu(), y.cpu())) for _ in range(3)]
    assert [float(l) for l in losses] == pytest.approx(want, rel=1e-3)
    assert model[0].weight.data_ptr() == pointer
    assert torch.allclose(model[0].weight.cpu(), reference[0].weight, rtol=1e-3, atol=1e-5)
    t = torch.randn(5, 7, device="cuda")
    assert torch.from_dlpack(kiln._kiln.dlpack_view(t)).data_ptr() == t.data_ptr()


@needs_cuda
@needs_onnx
def test_cuda_outputs_stay_on_the_device(tmp_path):
    # Every tensor a CUDA step returns is a torch CUDA tensor on the step's device: the loss,
    # evaluate()'s outputs and state_dict() (a module's own tensors, or an ONNX file's weights
    # over kiln's memory), and they equal the CPU step's.
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    path = tmp_path / "mlp.onnx"
    export_small_model(path, x, y)
    cpu = kiln.compile(str(path), (x, y))
    want_loss, want_eval = float(cpu(x, y)), float(cpu.evaluate(x, y))
    for model in (small_model().cuda(), str(path)):
        step = kiln.compile(model, (x.cuda(), y.cuda()), loss="cross_entropy" if not isinstance(model, str) else None,
                            device="cuda")
        loss = step(x.cuda(), y.cuda())
        evaluation = step.evaluate(x.cuda(), y.cuda())
        assert loss.is_cuda and evaluation.is_cuda and evaluation.shape == ()
        assert float(loss) == pytest.approx(want_loss, rel=1e-4)
        assert float(evaluation) == pytest.approx(want_eval, rel=1e-4)
        state = step.state_dict()
        assert all(t.is_cuda for t in state.values()), {n: t.device for n, t in state.items()}
        want = {n.removeprefix("net."): t for n, t in cpu.state_dict().items()}
        for n, t in state.items():
            assert torch.allclose(t.cpu(), want[n.removeprefix("net.")], rtol=1e-3, atol=1e-5), n
        # An evaluation's outputs are its own: the next one does not overwrite them.
        again = step.evaluate(x.cuda() + 1, y.cuda())
        assert float(evaluation) == pytest.approx(want_eval, rel=1e-4) and float(again) != float(evaluation)


@needs_onnx
def test_cpu_evaluation_outputs_are_fresh():
    # On the CPU evaluate() returns the forward step's own fresh output buffers (no copy): the
    # next evaluation does not overwrite them.
    model = small_model()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = kiln.compile(model, (x, y), loss="cross_entropy")
    first = step.evaluate(x, y)
    value = float(first)
    second = step.evaluate(x + 1, y)
    assert float(first) == value and float(second) != value and first.data_ptr() != second.data_ptr()

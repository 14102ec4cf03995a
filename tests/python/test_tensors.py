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


@needs_onnx
def test_numpy_inputs_give_numpy_outputs(tmp_path):
    path = tmp_path / "mlp.onnx"
    model = small_model()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    with_loss = torch.nn.Sequential()  # a module returning its loss, exported by hand
    del with_loss

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.net(x), y)

    legacy = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    torch.onnx.export(WithLoss(), (x, y), str(path), input_names=["x", "y"], opset_version=17,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, **legacy)
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

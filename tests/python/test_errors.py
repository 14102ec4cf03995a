"""Bad inputs are kiln.Error with kiln's message, naming what was given and what was wanted."""
import numpy as np
import pytest

import kiln

torch = pytest.importorskip("torch")
if not kiln._kiln.onnx_available():
    pytest.skip("kiln is built without the ONNX front end", allow_module_level=True)


@pytest.fixture(scope="module")
def step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return kiln.compile(model, (torch.randn(4, 8), torch.randint(0, 3, (4,))), loss="cross_entropy")


def test_wrong_dtype(step):
    with pytest.raises(kiln.Error, match=r"'input'.*must be f32\[4,8\], got f64\[4,8\]"):
        step(torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 3, (4,)))


def test_wrong_shape(step):
    with pytest.raises(kiln.Error, match=r"must be f32\[4,8\], got f32\[5,8\]"):
        step(torch.randn(5, 8), torch.randint(0, 3, (5,)))


def test_not_contiguous(step):
    with pytest.raises(kiln.Error, match="input 'input'.*not contiguous"):
        step(torch.randn(8, 4).t(), torch.randint(0, 3, (4,)))


def test_wrong_count_and_kind(step):
    with pytest.raises(kiln.Error, match="takes 2 inputs"):
        step(torch.randn(4, 8))
    with pytest.raises(kiln.Error, match="input 'target' is a list"):
        step(torch.randn(4, 8), [0, 1, 2, 0])


def test_error_leaves_the_step_usable(step):
    done = step.steps_done
    with pytest.raises(kiln.Error):
        step(torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 3, (4,)))
    assert step.steps_done == done
    step(torch.randn(4, 8), torch.randint(0, 3, (4,)))
    assert step.steps_done == done + 1


def test_missing_and_garbage_onnx(tmp_path):
    with pytest.raises(kiln.Error, match="cannot read ONNX model"):
        kiln.compile(str(tmp_path / "nothing.onnx"), (np.zeros(3, np.float32),))
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"this is not an onnx model \x00\x01\x02" * 10)
    with pytest.raises(kiln.Error):
        kiln.compile(str(garbage), (np.zeros(3, np.float32),))


def test_bad_options():
    model = torch.nn.Linear(3, 2)
    x = (torch.randn(2, 3), torch.randint(0, 2, (2,)))
    with pytest.raises(kiln.Error, match="amp 'fp4'"):
        kiln.compile(model, x, loss="cross_entropy", amp="fp4")
    with pytest.raises(kiln.Error, match="device 'tpu'"):
        kiln.compile(model, x, loss="cross_entropy", device="tpu")
    with pytest.raises(kiln.Error, match="model is a int"):
        kiln.compile(3, x)
    with pytest.raises(kiln.Error, match="learning rate"):
        kiln.compile(model, x, loss="cross_entropy", optimizer=kiln.AdamW(lr=-1))  # kiln: "learning rate must be > 0"


def test_error_is_an_exception():
    assert issubclass(kiln.Error, Exception)
    assert kiln.Error.__module__ == "kiln"

"""One training session behind the Python package and the CLI: a captured PyTorch module trained by
kiln.compile's steps gives the losses and params that `kiln step` gives, step after step, on the
same captured graph (its IR text), the same starting params and the same batches."""
import os
import shutil
import subprocess

import numpy as np
import pytest

import kiln

torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

# The CLI of the build the package comes from (build/python/kiln -> build/kiln), else KILN_CLI or PATH.
_BUILT = os.path.join(os.path.dirname(kiln.__file__), "..", "..", "kiln")
CLI = os.environ.get("KILN_CLI") or (_BUILT if os.path.isfile(_BUILT) else shutil.which("kiln"))


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 4))


def batches(count, rows=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), torch.randint(0, 4, (rows,), generator=g)) for _ in range(count)]


def test_python_steps_and_kiln_step_agree(tmp_path):
    if not CLI:
        pytest.skip("no kiln CLI found (set KILN_CLI)")
    data = batches(3)
    step = kiln.compile(model(), data[0], loss="cross_entropy", optimizer=kiln.SGD(lr=0.2))
    program = step._session.program
    data_names = [n for n, role, _, _ in program.inputs if role == "data"]
    param_names = [n for n, role, _, _ in program.inputs if role == "param"]
    params = {n: np.array(a, copy=True) for n, a in step._session.tensors(True).items() if n in param_names}
    assert len(params) == 4
    python_losses = [float(step(*batch)) for batch in data]
    python_params = {n: np.array(a, copy=True) for n, a in step._session.tensors(True).items() if n in param_names}

    model_path = tmp_path / "model.kir"
    model_path.write_text(program.ir)
    cli_losses = []
    for k, batch in enumerate(data):
        inputs = dict(params)
        inputs.update({n: t.numpy() for n, t in zip(data_names, batch)})
        safetensors_numpy.save_file(inputs, str(tmp_path / f"in{k}.safetensors"))
        out = tmp_path / f"out{k}.safetensors"
        subprocess.run([CLI, "step", str(model_path), "--inputs", str(tmp_path / f"in{k}.safetensors"), "--out",
                        str(out), "--optimizer", "sgd", "--lr", "0.2"], check=True, capture_output=True, text=True)
        result = safetensors_numpy.load_file(str(out))
        cli_losses.append(float(result["loss"]))
        params = {n: result["param." + n] for n in param_names}
    np.testing.assert_allclose(cli_losses, python_losses, rtol=1e-6, atol=1e-7)
    for n in param_names:
        np.testing.assert_allclose(params[n], python_params[n], rtol=1e-6, atol=1e-7, err_msg=n)

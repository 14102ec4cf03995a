"""kiln.compile(..., shard=...): data parallelism from Python, as `kiln train --shard` runs it.

Two child processes (sharded_worker.py) with torchrun's variables form a Gloo group; each trains
the same torch MLP on its half of every global batch with shard dp, zero2 and zero3, under SGD
and AdamW. They must give what one process gives on the whole batch: the losses (the ranks'
mean), the evaluation, and the parameters (state_dict(), full shape, named as the module's), to
the tolerances of the C++ test of the same claim (tests/distributed/sharded_training_test.cc,
which says why: each rank's mean and the average over ranks round differently from one mean
over all rows; SGD carries that to the params as it is, AdamW may move an element whose gradient
is within rounding of zero by up to lr, so its params are compared to 10% of lr). Both ranks
must agree, and a checkpoint that a group saved loads into one process.
"""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import kiln  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sharded  # noqa: E402

MODES = ("dp", "zero2", "zero3")
PARAM_TOLERANCE = {"sgd": 2e-5, "adamw": 0.1 * 1e-2}

needs_group = pytest.mark.skipif(not kiln._kiln.onnx_available(), reason="kiln is built without the ONNX front end")
# The ranks form a CPU (Gloo) group: a build without Gloo (the GPU machines') has none.
pytestmark = pytest.mark.skipif(not kiln._kiln.gloo_available(), reason="kiln is built without Gloo")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Runs the two ranks once (every mode); returns (their results, the output folder)."""
    out = tmp_path_factory.mktemp("sharded")
    port = free_port()
    package = os.path.dirname(os.path.dirname(os.path.abspath(kiln.__file__)))
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([package, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "sharded_worker.py"), str(out), *MODES],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{text[-3000:]}"
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(2)], out


def single_process(name):
    """One process on the whole batches: losses, the last evaluation, the params (and the step)."""
    model = sharded.model()
    step = kiln.compile(model, sharded.batch(0), loss="cross_entropy", optimizer=sharded.RUNS[name]())
    for i in range(sharded.STEPS):
        step(*sharded.batch(i))
    evaluation = step.evaluate(*sharded.batch(sharded.STEPS - 1))
    return step.losses(), float(evaluation), {n: t.numpy().copy() for n, t in step.state_dict().items()}


def assert_params_close(got, want, tolerance, what):
    for n, w in want.items():
        g = got[n]
        assert g.shape == w.shape, f"{what}: {n} is {g.shape}, expected {w.shape}"
        error = np.abs(g - w) - (tolerance + 1e-5 * np.abs(w))
        assert float(error.max()) <= 0, f"{what}: {n} differs by {float(np.abs(g - w).max()):.3g}"


@needs_group
@pytest.mark.parametrize("name", sorted(sharded.RUNS))
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_equal_one_process(ranks, mode, name):
    results, _ = ranks
    losses, evaluation, params = single_process(name)
    assert abs(losses[0] - losses[-1]) > 1e-3  # it trains
    key = f"{mode}.{name}"
    for rank, r in enumerate(results):
        what = f"{key} rank {rank}"
        np.testing.assert_allclose(r[f"{key}.losses"], losses, rtol=1e-5, atol=1e-6, err_msg=what)
        assert abs(float(r[f"{key}.eval"]) - evaluation) <= 1e-5 * (1 + abs(evaluation)), what
        got = {n: r[f"{key}.param.{n}"] for n in params}
        assert_params_close(got, params, PARAM_TOLERANCE[name], what)
        # dp and zero2 hold every param whole: the module's tensors are kiln's memory; zero3's
        # state_dict() gathered into them.
        for n in params:
            assert bool(r[f"{key}.same.{n}"]), f"{what}: state_dict()['{n}'] is not the module's tensor"
    for n in params:  # the ranks agree exactly: the same update of the same (averaged) gradient
        np.testing.assert_array_equal(results[0][f"{key}.param.{n}"], results[1][f"{key}.param.{n}"])


@needs_group
@pytest.mark.parametrize("mode", MODES)
def test_group_checkpoint_loads_alone(ranks, mode):
    results, out = ranks
    step = kiln.load(out / f"{mode}.adamw.safetensors")
    assert step.steps_done == sharded.STEPS and step.world_size == 1
    for n, t in step.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), results[0][f"{mode}.adamw.param.{n}"], err_msg=n)


def test_shard_needs_a_distributed_job(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = sharded.model()
    with pytest.raises(kiln.Error, match=r"shard='zero2' needs several processes, and WORLD_SIZE is unset: launch"):
        kiln.compile(model, sharded.batch(0), loss="cross_entropy", shard="zero2")
    with pytest.raises(kiln.Error, match=r"shard 'zero4': expected None, 'auto', 'dp', 'zero1', 'zero2' or 'zero3'"):
        kiln.compile(model, sharded.batch(0), loss="cross_entropy", shard="zero4")


@needs_group
def test_auto_alone_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    step = kiln.compile(sharded.model(), sharded.batch(0), loss="cross_entropy", shard="auto")
    assert (step.shard, step.rank, step.world_size) == ("none", 0, 1)

"""kiln.train: the loop's steps, metrics and skipped batches, and Ctrl-C stopping it cleanly."""
import pytest

import kiln

torch = pytest.importorskip("torch")
if not kiln._kiln.onnx_available():
    pytest.skip("kiln is built without the ONNX front end", allow_module_level=True)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 4))


def batches(count, rows=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), torch.randint(0, 4, (rows,), generator=g)) for _ in range(count)]


def test_train_runs_steps_and_reports_metrics(capsys):
    data = batches(4) + batches(1, rows=3)  # a short last batch, as a DataLoader gives
    result = kiln.train(model(), data, steps=10, loss="cross_entropy", optimizer=kiln.AdamW(lr=1e-2), log_every=3,
                        progress=False)
    assert result.steps_done == 10 and len(result.losses) == 10
    assert result.skipped_batches == 2  # one per pass over the data (3 passes, the last cut at 10 steps)
    assert result.final_loss < result.losses[0]
    assert not result.interrupted and result.step.steps_done == 10


def test_train_matches_the_steps():
    data = batches(5)
    net = model()
    result = kiln.train(net, data, loss="cross_entropy", progress=False)
    step = kiln.compile(model(), data[0], loss="cross_entropy")
    assert result.losses == [float(step(*b)) for b in data]


def test_ctrl_c_stops_cleanly(capsys):
    net = model()

    def data():
        for i, batch in enumerate(batches(100)):
            if i == 7:
                raise KeyboardInterrupt
            yield batch

    result = kiln.train(net, data(), steps=50, loss="cross_entropy", log_every=100, progress=True)
    assert result.interrupted and result.steps_done == 7 and len(result.losses) == 7
    assert "stopped by Ctrl-C after 7 steps" in capsys.readouterr().out
    assert result.step.steps_done == 7
    result.step(*batches(1)[0])  # still usable

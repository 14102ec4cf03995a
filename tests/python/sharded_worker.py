"""One rank of test_sharded.py's job: run by the test as a child process with torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as torchrun would start it.

    sharded_worker.py OUT_DIR MODE [MODE...]

For each mode and optimizer (sharded.RUNS), trains sharded.model() on this rank's rows of
sharded.batch(step) and writes what it saw to OUT_DIR/rank{R}.npz: the losses, the last batch's
evaluation, state_dict() (which must be the module's own tensors, full shape), and whether
state_dict() gave the module's tensors themselves; rank 0 also saves a checkpoint per run."""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kiln  # noqa: E402
import sharded  # noqa: E402

torch.set_num_threads(1)


def main():
    out, modes = sys.argv[1], sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rows = slice(rank * sharded.BATCH // world, (rank + 1) * sharded.BATCH // world)
    saved = {}
    for mode in modes:
        for name, optimizer in sharded.RUNS.items():
            model = sharded.model()
            x, y = sharded.batch(0)
            step = kiln.compile(model, (x[rows], y[rows]), loss="cross_entropy", optimizer=optimizer(), shard=mode)
            assert (step.shard, step.rank, step.world_size) == (mode, rank, world), (step.shard, step.rank, step.world_size)
            for i in range(sharded.STEPS):
                x, y = sharded.batch(i)
                step(x[rows], y[rows])
            key = f"{mode}.{name}"
            saved[f"{key}.losses"] = np.array(step.losses())
            saved[f"{key}.eval"] = step.evaluate(x[rows], y[rows]).numpy()
            state = step.state_dict()
            module = dict(model.named_parameters())
            assert sorted(state) == sorted(module), (sorted(state), sorted(module))
            for n, t in state.items():
                saved[f"{key}.param.{n}"] = t.numpy().copy()
                # The module's own tensors: trained in place (dp, zero1/2), or given the gathered
                # values by state_dict() (zero3, whose ranks hold shards).
                saved[f"{key}.same.{n}"] = np.array(t.data_ptr() == module[n].data_ptr())
            step.save(os.path.join(out, f"{key}.safetensors"))  # every rank calls it; rank 0 writes
    np.savez(os.path.join(out, f"rank{rank}.npz"), **saved)


if __name__ == "__main__":
    main()

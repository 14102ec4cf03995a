"""What test_sharded.py and its ranks (sharded_worker.py) share: the model, the global batches,
the optimizers and the number of steps."""
import torch

import kiln

BATCH = 8  # global: each of 2 ranks trains 4 rows
STEPS = 4
RUNS = {"sgd": lambda: kiln.SGD(lr=0.1), "adamw": lambda: kiln.AdamW(lr=1e-2)}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def batch(step):
    """Global batch `step`: the same on every rank and in the single-process reference."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 12, generator=g), torch.randint(0, 4, (BATCH,), generator=g)

"""The optimizers a kiln step runs inside its graph: AdamW and SGD, with torch's defaults and
meanings (torch.optim.AdamW and torch.optim.SGD), plus kiln's learning-rate schedule (linear
warmup, cosine decay) and global-norm gradient clipping."""
from dataclasses import dataclass

from . import _kiln


@dataclass
class _Schedule:
    warmup_steps: int = 0       # linear warmup from lr / warmup_steps to lr
    decay_steps: int = 0        # cosine decay to min_lr_ratio * lr by this step; 0: constant lr
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.0      # max global gradient norm; 0: no clipping

    def _config(self, name):
        config = _kiln.OptimizerConfig()
        config.name = name
        config.warmup_steps = int(self.warmup_steps)
        config.decay_steps = int(self.decay_steps)
        config.min_lr_ratio = float(self.min_lr_ratio)
        config.grad_clip = float(self.grad_clip)
        return config


@dataclass
class AdamW(_Schedule):
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **schedule):
        super().__init__(**schedule)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay

    def _config(self):
        config = super()._config("adamw")
        config.lr, config.epsilon, config.weight_decay = float(self.lr), float(self.eps), float(self.weight_decay)
        if len(self.betas) != 2:
            raise _kiln.Error(f"AdamW: betas takes two values, got {self.betas!r}")
        config.beta1, config.beta2 = (float(b) for b in self.betas)
        return config


@dataclass
class SGD(_Schedule):
    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __init__(self, lr=1e-3, momentum=0.0, weight_decay=0.0, nesterov=False, **schedule):
        super().__init__(**schedule)
        self.lr, self.momentum, self.weight_decay, self.nesterov = lr, momentum, weight_decay, nesterov

    def _config(self):
        config = super()._config("sgd")
        config.lr, config.momentum = float(self.lr), float(self.momentum)
        config.weight_decay, config.nesterov = float(self.weight_decay), bool(self.nesterov)
        return config


def _from_config(values):
    """An optimizer from the fields a checkpoint recorded (Step.save)."""
    values = dict(values)
    name = values.pop("name")
    return AdamW(**values) if name == "adamw" else SGD(**values)

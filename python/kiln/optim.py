"""The optimizers a kiln step runs inside its graph, one class per entry of kiln's optimizer
registry (kiln.SGD, kiln.AdamW, kiln.Lion, kiln.Adafactor): their hyperparameters and defaults are
the registry's (PyTorch's where PyTorch has the optimizer; `kiln train --help` lists the same),
plus kiln's learning-rate schedule (linear warmup, cosine decay), global-norm gradient clipping and
parameter groups. A torch.optim optimizer is read as it is (`from_torch`), or refused naming what
kiln cannot honour."""
from . import _kiln

# Python's spelling of an optimizer's class where it is not name.capitalize().
_CLASS_NAMES = {"sgd": "SGD", "adamw": "AdamW"}
# torch's keywords for pairs and single values of kiln's hyperparameters.
_PAIRS = {"betas": ("beta1", "beta2"), "eps": ("eps1", "eps2")}
_SINGLE = {"eps": "epsilon"}


def _entries():
    """name -> (help, {hyperparameter: (default, boolean, help)}, slots), from the registry."""
    return {name: (help_, {h: (d, b, hh) for h, d, b, hh in hyper}, slots)
            for name, help_, hyper, slots in _kiln.optimizers()}


def _hyper_values(name, given, where):
    """kiln's hyperparameters of optimizer `name` from keywords (torch's pairs and spellings too)."""
    hyper = _entries()[name][1]
    values = {}
    for key, value in given.items():
        if key in _PAIRS and _PAIRS[key][0] in hyper:
            if value is None or len(value) != 2:
                raise _kiln.Error(f"{where}: {key} takes two values, got {value!r}")
            for k, v in zip(_PAIRS[key], value):
                values[k] = v
        elif key in hyper:
            values[key] = value
        elif _SINGLE.get(key) in hyper:
            values[_SINGLE[key]] = value
        else:
            raise _kiln.Error(f"{where}: no hyperparameter {key!r} (it has: {', '.join(hyper)})")
    for key, value in values.items():
        values[key] = bool(value) if hyper[key][1] else float(value)
    return values


class Optimizer:
    """An optimizer of kiln's registry (the subclasses set `name`).

    lr: the peak learning rate. Hyperparameters by keyword (PyTorch's spellings betas=(b1, b2) and
    eps= are accepted where they mean the same); unset ones take the optimizer's defaults.
    param_groups: a list of dicts {"params": [param names], "lr": ..., hyperparameters...} with
        values of their own for those params (the module's names, or kiln's).
    decay_biases_norms_embeddings: False exempts biases and norm weights (params of rank < 2)
        and embedding tables from weight decay.
    warmup_steps, decay_steps, min_lr_ratio: linear warmup from lr / warmup_steps, then cosine
        decay to min_lr_ratio * lr by decay_steps (0: constant lr). grad_clip: the largest global
        gradient norm (0: no clipping).
    """
    name = None

    def __init__(self, lr=1e-3, *, param_groups=(), decay_biases_norms_embeddings=True, warmup_steps=0,
                 decay_steps=0, min_lr_ratio=0.1, grad_clip=0.0, **hyper):
        where = type(self).__name__
        self.lr = float(lr)
        defaults = {k: (bool(d) if b else d) for k, (d, b, _) in _entries()[self.name][1].items()}
        self.hyperparameters = {**defaults, **_hyper_values(self.name, hyper, where)}
        self.param_groups = []
        for group in param_groups:
            group = dict(group)
            params = group.pop("params", None)
            if not params or isinstance(params, str):
                raise _kiln.Error(f"{where}: a param group needs 'params', a list of param names, got {params!r}")
            lr_ = group.pop("lr", None)
            self.param_groups.append({"params": list(params), **({"lr": float(lr_)} if lr_ is not None else {}),
                                      **_hyper_values(self.name, group, f"{where} param group")})
        self.decay_biases_norms_embeddings = bool(decay_biases_norms_embeddings)
        self.warmup_steps, self.decay_steps = int(warmup_steps), int(decay_steps)
        self.min_lr_ratio, self.grad_clip = float(min_lr_ratio), float(grad_clip)

    def __getattr__(self, key):
        hyper = self.__dict__.get("hyperparameters", {})
        if key in hyper:
            return hyper[key]
        if key == "betas" and "beta1" in hyper:
            return (hyper["beta1"], hyper["beta2"])
        raise AttributeError(f"{type(self).__name__} has no attribute {key!r}")

    def __repr__(self):
        values = ", ".join(f"{k}={v!r}" for k, v in {"lr": self.lr, **self.hyperparameters}.items())
        return f"{type(self).__name__}({values})"

    def _record(self):
        """What a checkpoint keeps of it (read back by _from_config)."""
        return {"name": self.name, "lr": self.lr, "hyperparameters": self.hyperparameters,
                "param_groups": self.param_groups, "decay_biases_norms_embeddings": self.decay_biases_norms_embeddings,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps,
                "min_lr_ratio": self.min_lr_ratio, "grad_clip": self.grad_clip}

    def _config(self, names=None):
        """kiln's OptimizerConfig; `names`: module name -> kiln name, for param_groups."""
        config = _kiln.OptimizerConfig()
        config.name, config.lr = self.name, self.lr
        config.hyper = {k: float(v) for k, v in self.hyperparameters.items()}
        groups = []
        for g in self.param_groups:
            group = _kiln.ParamGroup()
            group.params = [(names or {}).get(p, p) for p in g["params"]]
            group.lr = g.get("lr")
            group.hyper = {k: float(v) for k, v in g.items() if k not in ("params", "lr")}
            groups.append(group)
        config.groups = groups
        config.decay_biases_norms_embeddings = self.decay_biases_norms_embeddings
        config.warmup_steps, config.decay_steps = self.warmup_steps, self.decay_steps
        config.min_lr_ratio, config.grad_clip = self.min_lr_ratio, self.grad_clip
        return config


def _class_of(name):
    return _CLASSES.get(name)


_CLASSES = {}
for _name, (_help, _hyper, _slots) in _entries().items():
    _cls = type(_CLASS_NAMES.get(_name, _name.capitalize()), (Optimizer,), {
        "name": _name,
        "__doc__": f"{_help}.\n\nHyperparameters (defaults): "
                   + ", ".join(f"{k}={d if not b else bool(d)!r}" for k, (d, b, _) in _hyper.items())
                   + f"; state per param: {', '.join(_slots)}.\n\n" + Optimizer.__doc__,
        "__module__": __name__})
    _CLASSES[_name] = _cls
    globals()[_cls.__name__] = _cls
del _name, _help, _hyper, _slots, _cls
__all__ = ["Optimizer", "from_torch"] + [c.__name__ for c in _CLASSES.values()]


def _from_config(values):
    """An optimizer from what a checkpoint recorded (Optimizer._record)."""
    values = dict(values)
    name = values.pop("name")
    cls = _class_of(name)
    if cls is None:
        raise _kiln.Error(f"the checkpoint's optimizer {name!r} is none of kiln's ({', '.join(_CLASSES)})")
    return cls(values.pop("lr"), **values.pop("hyperparameters"), **values)


def _number(value):
    return float(value.item() if hasattr(value, "item") else value)


def from_torch(optimizer, names):
    """The kiln optimizer that does what torch optimizer `optimizer` does: its class, its
    hyperparameters and its param groups as they are (a constant lr: a torch lr scheduler is a
    separate object). `names`: id(tensor) -> kiln param name for the module's parameters.
    Raises kiln.Error naming what kiln cannot honour."""
    cls = type(optimizer)
    where = f"{cls.__module__}.{cls.__name__}"
    refused = []

    def refuse(what):
        refused.append(what)

    def flag(group, key, allowed=(False, None)):
        if group.get(key, allowed[0]) not in allowed:
            refuse(f"{key}={group[key]!r}")

    kind = cls.__name__
    to = {"AdamW": "adamw", "Adam": "adamw", "SGD": "sgd", "Lion": "lion", "Adafactor": "adafactor"}.get(kind)
    if to is None:
        raise _kiln.Error(f"optimizer {where}: kiln has no such optimizer (it has: "
                          f"{', '.join(c.__name__ for c in _CLASSES.values())}; from torch: AdamW, Adam, SGD, "
                          "and Lion and transformers' Adafactor)")
    if optimizer.state and any(len(s) for s in optimizer.state.values()):
        refuse("state from steps already taken (kiln starts from zero state)")
    groups = []
    for group in optimizer.param_groups:
        for key in ("maximize", "amsgrad", "nesterov" if to != "sgd" else "", "differentiable"):
            if key:
                flag(group, key)
        hyper = {}
        if to == "adamw":
            decoupled = kind == "AdamW" or group.get("decoupled_weight_decay", False)
            if not decoupled and _number(group.get("weight_decay", 0)) != 0:
                refuse("Adam's L2 weight_decay (kiln's AdamW decays decoupled: use torch.optim.AdamW)")
            beta1, beta2 = group["betas"]
            hyper = {"beta1": _number(beta1), "beta2": _number(beta2), "epsilon": _number(group["eps"]),
                     "weight_decay": _number(group["weight_decay"]) if decoupled else 0.0}
        elif to == "sgd":
            if _number(group.get("dampening", 0)) != 0:
                refuse(f"dampening={group['dampening']!r}")
            hyper = {"momentum": _number(group["momentum"]), "nesterov": bool(group.get("nesterov", False)),
                     "weight_decay": _number(group["weight_decay"])}
        elif to == "lion":
            beta1, beta2 = group["betas"]
            hyper = {"beta1": _number(beta1), "beta2": _number(beta2), "weight_decay": _number(group["weight_decay"])}
        else:  # transformers.optimization.Adafactor
            if group.get("relative_step") or group.get("warmup_init"):
                refuse("relative_step=True / warmup_init=True (kiln's Adafactor takes a fixed lr)")
            if group.get("beta1") is not None:
                refuse(f"beta1={group['beta1']!r} (kiln's Adafactor keeps no first moment)")
            if group.get("lr") is None:
                refuse("lr=None (give a fixed lr)")
            eps1, eps2 = group["eps"]
            hyper = {"eps1": _number(eps1), "eps2": _number(eps2), "clip_threshold": _number(group["clip_threshold"]),
                     "decay_rate": _number(group["decay_rate"]), "scale_parameter": bool(group["scale_parameter"]),
                     "weight_decay": _number(group["weight_decay"])}
        params = []
        for p in group["params"]:
            if id(p) not in names:
                refuse(f"a param of shape {tuple(p.shape)} that is no parameter of the module")
            else:
                params.append(names[id(p)])
        groups.append({"params": params, "lr": _number(group["lr"]) if group.get("lr") is not None else 1e-3,
                       **hyper})
    covered = {p for g in groups for p in g["params"]}
    missing = sorted(set(names.values()) - covered)
    if missing:
        refuse(f"the module's params {', '.join(missing)} are in no param group (kiln would train them)")
    if refused:
        raise _kiln.Error(f"optimizer {where}: kiln cannot honour {'; '.join(dict.fromkeys(refused))}")
    first = {k: v for k, v in groups[0].items() if k not in ("params", "lr")}
    return _CLASSES[to](groups[0]["lr"], param_groups=groups, **first)

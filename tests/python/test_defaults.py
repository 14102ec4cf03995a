"""One set of defaults: the optimizer defaults that `kiln train --help`, `kiln step --help`,
`kiln bench --help` and `kiln compile --help` print are the Python classes' (kiln.SGD,
kiln.AdamW, ...), and PyTorch's where PyTorch has the same optimizer and hyperparameter."""
import inspect
import os
import re
import shutil
import subprocess

import pytest

import kiln

# The CLI of the build the package comes from (build/python/kiln -> build/kiln), else KILN_CLI or PATH.
_BUILT = os.path.join(os.path.dirname(kiln.__file__), "..", "..", "kiln")
CLI = os.environ.get("KILN_CLI") or (_BUILT if os.path.isfile(_BUILT) else shutil.which("kiln"))


def _help(command):
    if not CLI:
        pytest.skip("no kiln CLI found (set KILN_CLI)")
    out = subprocess.run([CLI, command, "--help"], capture_output=True, text=True, check=True).stdout
    return " ".join(out.split())


def _classes():
    return {cls.name: cls for cls in (getattr(kiln, n) for n in dir(kiln))
            if isinstance(cls, type) and issubclass(cls, kiln.Optimizer) and cls.name}


def _cli_defaults(text):
    """{optimizer: {hyperparameter: default}} and the --lr default, from one --help text: each
    "(defaults: adamw 0.01, lion 0)" belongs to the flag before it."""
    defaults, flag = {}, None
    for token in re.finditer(r"--(?:no-)?([a-z0-9-]+)|\(defaults: ([^)]*)\)", text):
        if token.group(1):
            flag = token.group(1).replace("-", "_")
            continue
        for item in token.group(2).split(", "):
            name, value = item.split(" ")
            value = {"true": True, "false": False}.get(value, value)
            defaults.setdefault(name, {})[flag] = value if isinstance(value, bool) else float(value)
    lr = re.search(r"--lr FLOAT=([0-9.e-]+)", text)
    return defaults, float(lr.group(1)) if lr else None


@pytest.mark.parametrize("command", ["train", "step", "bench", "compile"])
def test_cli_defaults_are_pythons(command):
    defaults, lr = _cli_defaults(_help(command))
    classes = _classes()
    assert set(defaults) == set(classes), f"--help lists {sorted(defaults)}, Python has {sorted(classes)}"
    for name, cls in classes.items():
        python = cls()
        assert defaults[name] == python.hyperparameters, name
        assert lr == python.lr, name
    optimizer = re.search(r"--optimizer TEXT:\{([^}]*)\}=(\w+)", _help(command))
    assert optimizer and optimizer.group(2) == "adamw" and set(optimizer.group(1).split(",")) == set(classes)


def test_defaults_are_pytorchs_where_pytorch_has_them():
    torch = pytest.importorskip("torch")
    spelled = {"epsilon": "eps"}
    for cls, theirs in ((kiln.AdamW, torch.optim.AdamW), (kiln.SGD, torch.optim.SGD)):
        params = inspect.signature(theirs.__init__).parameters
        ours = cls()
        assert ours.lr == params["lr"].default, cls
        for name, value in ours.hyperparameters.items():
            if name in ("beta1", "beta2"):
                assert value == params["betas"].default[name == "beta2"], (cls, name)
            else:
                assert value == params[spelled.get(name, name)].default, (cls, name)
    assert kiln.AdamW().weight_decay == 0.01 and kiln.SGD().momentum == 0.0

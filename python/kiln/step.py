"""kiln.compile: a torch module or an ONNX file to a compiled training step (kiln.Step), and
kiln.load: a step back from a checkpoint that Step.save wrote.

A torch module reaches kiln through torch.export (PyTorch >= 2.5: kiln.capture lowers its ATen
graph into kiln's IR, docs/python.md), or, with an older torch or capture="onnx", as an ONNX export
made in-process (docs/onnx.md: training mode, no constant folding, so BatchNorm keeps batch
statistics and every weight stays an initializer under its state_dict name). kiln then trains the
module's own tensors in place: its parameters and BatchNorm's running statistics are the step's
memory, so after `step(x, y)` the module holds the updated weights, with no copy either way
(zero3's params excepted: each rank holds a shard; and a step on another device than the module's
tensors, device=..., trains copies of them).

Sharded data parallelism (shard="dp" | "zero1" | "zero2" | "zero3" | "auto"): the process is one
rank of a job launched by torchrun or `kiln launch` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
which it joins at the first sharded compile, as `kiln train --shard` does (docs/distributed.md).
"""
import inspect
import io
import json
import os
import struct
import warnings

from . import _kiln, capture as _capture
from ._tensors import framework_of, from_kiln, is_torch, to_kiln, torch_module
from .optim import AdamW, Optimizer, _from_config
from .optim import from_torch as from_torch_optimizer

_FORMAT = 2  # of the "kiln.python" checkpoint metadata (2: the optimizer as Optimizer._record)


def _device(device, group=None):
    """("cpu" | "cuda", CUDA device index) from "cpu", "cuda", "cuda:N" or a torch.device; a bare
    "cuda" is the group's GPU (LOCAL_RANK) in a group, else torch's current one."""
    text = str(device)
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise _kiln.Error(f"device '{text}': expected 'cpu', 'cuda' or 'cuda:N'")
    if kind == "cuda" and _kiln.cuda_device_count() == 0:
        raise _kiln.Error(f"device '{text}': kiln sees no CUDA device (a build without CUDA, or no GPU here)")
    if kind == "cuda" and not index:
        torch = torch_module()
        index = (group.local_rank if group is not None
                 else torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else 0)
    return kind, int(index or 0)


_SHARD_MODES = ("none", "auto", "dp", "zero1", "zero2", "zero3")
_groups = {}  # "cpu" | "cuda" -> the process group this process joined (one per process and device kind)


def _group(shard, device):
    """The process group a step sharded by `shard` runs over (None: alone), joined at first use
    from torchrun's variables, as `kiln train` joins it (Gloo on the CPU, NCCL on GPUs)."""
    shard = "none" if shard is None else str(shard)
    if shard not in _SHARD_MODES:
        raise _kiln.Error(f"shard '{shard}': expected None, 'auto', 'dp', 'zero1', 'zero2' or 'zero3'")
    if shard == "none":
        return shard, None
    kind = str(device).partition(":")[0]
    if kind not in ("cpu", "cuda"):
        return shard, None  # _device says what is wrong
    if kind not in _groups:
        world = os.environ.get("WORLD_SIZE")
        if world is None or world.strip() == "1":
            if shard == "auto":
                return shard, None
            raise _kiln.Error(
                f"shard='{shard}' needs several processes, and WORLD_SIZE is {'unset' if world is None else world}: "
                f"launch the script with torchrun --nproc_per_node=N or kiln launch -n N -- python3 SCRIPT "
                f"(they set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
        _groups[kind] = _kiln.join_group(kind)
    return shard, _groups[kind]


def _memory_budget(budget):
    """Bytes from an int or a string like "512MiB", "2GiB", "1.5GB"."""
    if budget is None or isinstance(budget, int):
        return budget
    text = str(budget).strip()
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    for unit, scale in units.items():
        if text.lower().endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * scale)
            except ValueError:
                break
    raise _kiln.Error(f"memory_budget '{budget}': expected bytes (an int) or a size such as '2GiB'")


class _WithLoss:
    """A module whose forward is loss(model(*inputs[:-1]), inputs[-1]), its params under "model."."""

    @staticmethod
    def make(model, loss):
        torch = torch_module()

        class WithLoss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, *inputs):
                return loss(self.model(*inputs[:-1]), inputs[-1])

        return WithLoss()


def _input_names(module, count, with_target):
    """The forward's parameter names where they are plain positional ones, else input0, input1..."""
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params][: count - int(with_target)]
    if with_target:
        names.append("target")
    if len(names) != count or len(set(names)) != count:
        names = [f"input{i}" for i in range(count)]
    return names


def _tied_names(module, tensors):
    """Each tensor of `tensors` that the module holds under further names (tied parameters:
    GPT-2's lm_head.weight is transformer.wte.weight) -> those names. named_parameters() and the
    export name a tied tensor once; its state_dict names it under every name."""
    first = {id(t): n for n, t in tensors.items()}
    tied = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in first and first[id(t)] != name:
            tied.setdefault(first[id(t)], []).append(name)
    return tied


def _export(model, inputs, loss):
    """ONNX bytes of `model` (with `loss` on its output), its input names, its tensors by the
    names the export gives them, the names to keep fixed (buffers that are no BatchNorm
    statistics, parameters that need no gradient), the prefix of the module's names, and the
    further names of tied tensors (_tied_names)."""
    torch = torch_module()
    if isinstance(loss, str):
        if loss != "cross_entropy":
            raise _kiln.Error(f"loss '{loss}': expected 'cross_entropy' or a callable (output, target) -> loss")
        loss = torch.nn.functional.cross_entropy
    module = _WithLoss.make(model, loss) if loss is not None else model
    prefix = "model." if loss is not None else ""
    names = _input_names(model, len(inputs), loss is not None)
    batch_norms = (torch.nn.modules.batchnorm._BatchNorm,)
    statistics = set()
    for name, sub in module.named_modules():
        if isinstance(sub, batch_norms):
            statistics |= {f"{name}.running_mean" if name else "running_mean", f"{name}.running_var" if name else "running_var"}
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    frozen += [n for n, b in module.named_buffers() if n not in statistics]
    # The export traces the forward once: BatchNorm updates its statistics and dropout draws
    # random numbers. Both are put back, so that the first step starts where the module was.
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    rng = torch.random.get_rng_state()
    data = io.BytesIO()
    try:
        with warnings.catch_warnings():  # the tracer's notes on Python-level control flow, not the user's concern
            warnings.simplefilter("ignore")
            # The TorchScript exporter: training mode is its alone (PyTorch 2.9 made the dynamo
            # exporter the default; 1.13, Debian's, has no choice to make).
            legacy = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
            torch.onnx.export(module, tuple(inputs), data, input_names=names, output_names=["loss"], opset_version=17,
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, **legacy)
    except Exception as e:  # torch's own errors: kiln.Error with what torch said
        raise _kiln.Error(f"exporting {type(model).__name__} to ONNX failed: {type(e).__name__}: {e}") from e
    finally:
        with torch.no_grad():
            for n, b in module.named_buffers():
                b.copy_(saved[n])
        torch.random.set_rng_state(rng)
    return data.getvalue(), names, tensors, frozen, prefix, _tied_names(module, tensors)


def _import(data, source, frozen, loss, labels, tensors):
    """The Program of ONNX `data`; with the module's `tensors`, initializers that are none of
    them (constants the export made) are fixed, and every module parameter must be a param."""
    program = _kiln.import_onnx(data, source, list(frozen), loss, labels)
    if tensors is None:
        return program
    onnx_name = lambda n: program.onnx_names.get(n, n)  # noqa: E731
    trained = [(n, role) for n, role, _, _ in program.inputs if role in ("param", "state")]
    strangers = [onnx_name(n) for n, role in trained if onnx_name(n) not in tensors]
    if strangers:
        program = _kiln.import_onnx(data, source, list(frozen) + strangers, loss, labels)
        trained = [(n, role) for n, role, _, _ in program.inputs if role in ("param", "state")]
    kept = {onnx_name(n) for n, _ in trained}
    missing = [n for n, t in tensors.items() if n not in kept and n not in frozen and t.requires_grad]
    if missing and strangers:
        raise _kiln.Error(f"the ONNX export renamed parameters: {', '.join(missing)} of the module are not among "
                          f"its initializers, which have {', '.join(strangers)} instead")
    return program


class Step:
    """A compiled training step (kiln.compile, kiln.load): `loss = step(*inputs)`."""

    def __init__(self, session, names, module_tensors, framework, device, index, record, input_names=None):
        self._session = session
        self._names = names                  # kiln name -> the user's name (torch's or ONNX's)
        self._aliases = record.get("aliases", {})  # kiln name -> the other names of a tied tensor
        self._module_tensors = module_tensors  # kiln name -> the module's tensor (trained in place unless gathered)
        self._gathered = set(module_tensors) & set(session.sharded)  # zero3's params: state_dict() gathers them
        self._framework = framework          # "torch" or "numpy": what comes back
        self._device, self._index = device, index
        self._record = record                # what save() writes to rebuild the step
        if device == "cuda":
            self._framework = "torch"        # CUDA tensors come back as torch's
        self._stream = None
        if device == "cuda":
            torch = torch_module()
            self._stream = torch.cuda.ExternalStream(session.stream, device=f"cuda:{index}")
        inputs = [(n, dtype, shape) for n, role, dtype, shape in session.program.inputs if role == "data"]
        self.input_names = list(input_names or record.get("input_names") or [n for n, _, _ in inputs])
        self.input_types = [f"{dtype}{list(shape)}" for _, dtype, shape in inputs]

    # ---- running ----
    def __call__(self, *inputs, **named):
        """One training step (forward, backward, optimizer update) on `inputs` (positional, or by
        the names of the example's keyword inputs); returns the loss (computed before the update)
        as a 0-dim tensor on the inputs' device, without waiting for the step's device."""
        inputs = self._ordered(inputs, named)
        data = self._data(inputs)
        if self._device == "cpu":
            return self._back(from_kiln(self._session.step(data), framework_of(inputs, self._framework)), inputs)
        torch = torch_module()
        loss = torch.empty((), dtype=_torch_dtype(torch, self._session.loss_dtype), device=f"cuda:{self._index}")
        self._enter(data + [loss])
        self._session.step(data, loss)
        self._leave()
        return self._back(loss, inputs)

    def evaluate(self, *inputs, **named):
        """The forward's outputs (the loss first) on `inputs` with the current parameters, no
        update; tensors on the inputs' device, without waiting for the step's. One output is
        returned as it is, several as a tuple. In a group every rank must call it (the loss is
        the ranks' mean, as the step's)."""
        inputs = self._ordered(inputs, named)
        data = self._data(inputs)
        if self._device == "cpu":
            outputs = [self._back(from_kiln(a, framework_of(inputs, self._framework)), inputs)
                       for a in self._session.evaluate(data)]
        else:
            torch = torch_module()
            outputs = [torch.empty(shape, dtype=_torch_dtype(torch, dtype), device=f"cuda:{self._index}")
                       for dtype, shape in self._session.output_types]
            self._enter(data + outputs)
            self._session.evaluate(data, [to_kiln(o, f"output buffer {i}") for i, o in enumerate(outputs)])
            self._leave()
            outputs = [self._back(o, inputs) for o in outputs]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def losses(self):
        """The losses of the steps since the last call, as floats (waits for the device once)."""
        return self._session.take_losses()

    def synchronize(self):
        """Waits until every step issued so far is done."""
        self._session.synchronize()

    @property
    def aten_ops(self):
        """The ATen ops of a module captured through torch.export that kiln lowered (None for
        the other paths)."""
        return self._record.get("aten_ops")

    @property
    def steps_done(self):
        return self._session.steps_done

    @property
    def lr(self):
        """The learning rate of the next step (kiln's schedule)."""
        return self._session.lr

    @property
    def shard(self):
        """The sharding that runs: "none", "dp", "zero1", "zero2" or "zero3" ("auto" resolved)."""
        return self._session.shard

    @property
    def rank(self):
        """This process's rank in the step's group (0 alone)."""
        return self._session.rank

    @property
    def world_size(self):
        """The ranks the step is sharded over (1 alone)."""
        return self._session.world_size

    # ---- tensors ----
    def state_dict(self):
        """The model's parameters and state (BatchNorm's running statistics) by their names, at
        their full shapes, over the step's own memory (no copies): they change with every step.
        A module's step returns the module's own tensors. Sharded: every rank must call it; a
        tensor held as shards (zero3's params) is gathered from every rank, into the module's
        tensor for a module (which the steps do not update in place) or a new one. A tied tensor
        (GPT-2's lm_head.weight is transformer.wte.weight) is there under each of its names, the
        same tensor each time."""
        self._leave()
        arrays = self._session.tensors(True)
        out = {}
        for kiln_name, user_name in self._names.items():
            tensor = self._module_tensors.get(kiln_name)
            if tensor is None:
                value = from_kiln(arrays[kiln_name], self._framework)
            else:
                if kiln_name in self._gathered:  # zero3: the module's tensor takes the gathered value
                    with torch_module().no_grad():
                        tensor.copy_(from_kiln(arrays[kiln_name], "torch"))
                value = tensor.detach()
            out[user_name] = value
        for kiln_name, further in self._aliases.items():  # tied: one storage under every name, after
            out.update({name: out[self._names[kiln_name]] for name in further})  # the others, as in torch's
        return out

    def load_state_dict(self, state_dict, strict=True):
        """Copies the values of `state_dict` (names as state_dict() has them) into the step. A tied
        tensor takes its value from any of its names (a torch state_dict has them all); two of
        its names with different values are an error, and nothing is copied."""
        by_user = {u: k for k, u in self._names.items()}
        by_user.update({a: k for k, names in self._aliases.items() for a in names})
        unknown = [n for n in state_dict if n not in by_user]
        given = {by_user[n] for n in state_dict if n in by_user}
        missing = [u for k, u in self._names.items() if k not in given]
        if strict and (unknown or missing):
            raise _kiln.Error("load_state_dict: " + "; ".join(
                part for part in (f"unexpected {', '.join(unknown)}" if unknown else "",
                                  f"missing {', '.join(missing)}" if missing else "") if part))
        named = {}  # kiln name -> (the first of its names given, the value)
        for n, v in state_dict.items():
            if n not in by_user:
                continue
            k = by_user[n]
            if k in named and not _same_values(named[k][1], v):
                raise _kiln.Error(f"load_state_dict: '{named[k][0]}' and '{n}' are one tied tensor of the model, "
                                  f"and the state dict gives them different values")
            named.setdefault(k, (n, v))
        values = {k: to_kiln(v, f"'{n}'") for k, (n, v) in named.items()}
        self._enter(list(values.values()))
        for kiln_name, value in values.items():
            self._session.copy_into(kiln_name, value)

    # ---- checkpoints and reports ----
    def save(self, path):
        """A checkpoint (safetensors: params, optimizer state, step count, and what kiln.load
        needs to rebuild the step), written atomically. Sharded: every rank must call it; the
        shards are gathered and rank 0 writes every tensor whole, so that one process or a group
        of any size and sharding loads it."""
        self._session.save(os.fspath(path), {"kiln.python": json.dumps(self._record)})

    def load(self, path):
        """Continues from checkpoint `path` (of this model): params, optimizer state, step count."""
        self._session.load(os.fspath(path))

    def report(self):
        """The compile report: each pass's time and node counts, fusion groups, planned memory."""
        return self._session.report(self._record["what"])

    def __repr__(self):
        inputs = ", ".join(f"{n}: {t}" for n, t in zip(self.input_names, self.input_types))
        return f"<kiln.Step {self._record['what']} ({inputs}) on {self._device}, {self.steps_done} steps done>"

    # ---- helpers ----
    def _ordered(self, inputs, named):
        """The inputs in the step's order, from positional ones followed by named ones."""
        if not named:
            return inputs
        unknown = [n for n in named if n not in self.input_names[len(inputs):]]
        if unknown:
            raise _kiln.Error(f"the step has no input {', '.join(repr(n) for n in unknown)} after the "
                              f"{len(inputs)} positional ones: its inputs are {', '.join(self.input_names)}")
        missing = [n for n in self.input_names[len(inputs):] if n not in named]
        if missing:
            raise _kiln.Error(f"the step's input {', '.join(repr(n) for n in missing)} is not given")
        return tuple(inputs) + tuple(named[n] for n in self.input_names[len(inputs):])

    def _data(self, inputs):
        if len(inputs) != len(self.input_names):
            raise _kiln.Error(f"the step takes {len(self.input_names)} inputs "
                              f"({', '.join(f'{n}: {t}' for n, t in zip(self.input_names, self.input_types))}), "
                              f"{len(inputs)} given")
        here = "cpu" if self._device == "cpu" else f"cuda:{self._index}"
        # torch tensors on another device than the step's move to it (and results come back).
        inputs = [x.to(here) if is_torch(x) and str(x.device) != here and
                  not (here == "cpu" and x.device.type == "cpu") else x for x in inputs]
        return [to_kiln(x, f"input '{n}'") for x, n in zip(inputs, self.input_names)]

    def _back(self, result, inputs):
        """`result` on the device of the torch tensors among `inputs` (the step's where none is)."""
        devices = {x.device for x in inputs if is_torch(x)}
        if len(devices) == 1 and is_torch(result):
            device = devices.pop()
            if result.device != device:
                return result.to(device)
        return result

    def _enter(self, tensors):
        """CUDA: kiln's stream waits for torch's current one. The tensors kiln reads need no
        record_stream: _leave makes torch's stream wait for kiln's, so torch reuses their memory
        only after kiln is past them (and a record on kiln's stream would outlive it: torch's
        allocator then aborts the process when it frees them at exit)."""
        if self._stream is None:
            return
        torch = torch_module()
        self._stream.wait_stream(torch.cuda.current_stream(self._index))

    def _leave(self):
        """CUDA: torch's current stream waits for kiln's (no host wait)."""
        if self._stream is not None:
            torch_module().cuda.current_stream(self._index).wait_stream(self._stream)


def compile(model, example_inputs, loss=None, optimizer=None, device=None, amp="off", shard=None,
            memory_budget=None, *, labels="labels", disable_passes=(), dialects=(), capture="auto"):
    """Compiles the training step of `model`: a torch.nn.Module (captured in-process, in training
    mode; kiln trains its own tensors in place) or the path of an ONNX file.

    example_inputs: the step's inputs: a tuple of tensors, or a dict of keyword inputs (a Hugging
        Face model's input_ids=..., labels=...); their shapes and dtypes are the step's, and the
        step is called the same way (step(x, y) or step(input_ids=..., labels=...)).
    loss: None (the model returns its loss first), "cross_entropy", or a callable
        (output, target) -> loss for a torch module; the target is then the last input.
        For an ONNX file, "cross_entropy" trains the logits it returns against input `labels`.
    optimizer: kiln.AdamW(...) (default), kiln.SGD, kiln.Lion, kiln.Adafactor (kiln.optim), or a
        torch.optim optimizer of the module's parameters (AdamW, Adam, SGD; Lion; transformers'
        Adafactor), taken with its hyperparameters and param groups as they are, or refused
        naming what kiln cannot honour (amsgrad=True, dampening, a class kiln lacks, ...).
    device: "cpu", "cuda" or "cuda:N"; None: where the module's parameters are (the CPU for an
    ONNX file). Inputs on another device are moved to it, and results come back to theirs.
    amp: "off", "bf16", "f16" or "fp8" (mixed precision, f32 master weights; "fp8" is bf16 with the
        linear layers' products in FP8 with per-tensor scales, sm_89 or newer on CUDA).
    memory_budget: bytes (or "2GiB") the step's activations may take (rematerialization).
    shard: None (this process alone), or "dp", "zero1", "zero2", "zero3", "auto" (as kiln train
        --shard): data parallelism over the ranks of a job launched by torchrun or kiln launch.
        Each rank compiles the same model and passes its own rows of the global batch (its
        example_inputs have the per-rank shape); the loss is the mean over all ranks.
    capture: how a torch module becomes kiln's graph: "export" (torch.export, PyTorch >= 2.5),
        "onnx" (the TorchScript ONNX exporter, then kiln's ONNX import), or "auto" (export where
        this torch has it, else onnx).
    """
    optimizer = optimizer if optimizer is not None else AdamW()
    from_torch = not isinstance(optimizer, Optimizer)
    if from_torch and not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "state")):
        raise _kiln.Error(f"optimizer is a {type(optimizer).__name__}: expected kiln.AdamW(...), kiln.SGD(...), "
                          "kiln.Lion(...), kiln.Adafactor(...) or a torch.optim optimizer of the module's parameters")
    if amp not in ("off", "bf16", "f16", "fp8"):
        raise _kiln.Error(f"amp '{amp}': expected 'off', 'bf16', 'f16' or 'fp8'")
    if capture not in ("auto", "export", "onnx"):
        raise _kiln.Error(f"capture '{capture}': expected 'auto', 'export' or 'onnx'")
    torch = torch_module()
    is_module = torch is not None and isinstance(model, torch.nn.Module)
    if device is None:
        device = _module_device(model) if is_module else "cpu"
    shard, group = _group(shard, device)
    kind, index = _device(device, group)
    kwargs = {}
    if isinstance(example_inputs, dict):
        kwargs, inputs = dict(example_inputs), ()
    else:
        inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    module_tensors, input_names, aliases, aten_ops, seconds = {}, None, {}, None, {}
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if loss not in (None, "cross_entropy"):
            raise _kiln.Error(f"loss {loss!r} for an ONNX file: expected None or 'cross_entropy'")
        if kwargs:
            raise _kiln.Error("example_inputs for an ONNX file: expected a tuple of tensors in the model's input order")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise _kiln.Error(f"cannot read ONNX model '{path}': {e.strerror}") from None
        program = _import(data, path, [], loss or "", labels, None)
        names = {n: program.onnx_names.get(n, n) for n, role, _, _ in program.inputs if role != "data"}
        what, framework = f"ONNX model {path}", framework_of(inputs, "numpy")
    elif is_module and _use_export(capture):
        program, names, module_tensors, input_names, aliases, aten_ops, seconds = \
            _capture_module(model, inputs, kwargs, loss)
        what, framework = f"module {type(model).__name__}", "torch"
    elif is_module:
        if kwargs:
            raise _kiln.Error("keyword example_inputs need capture='export' (PyTorch >= 2.5); the ONNX path takes a "
                              "tuple of tensors")
        data, input_names, tensors, frozen, prefix, tied = _export(model, inputs, loss)
        program = _import(data, type(model).__name__, frozen, "", labels, tensors)
        names, module_tensors = {}, {}
        for n, role, _, _ in program.inputs:
            if role == "data":
                continue
            onnx_name = program.onnx_names.get(n, n)
            names[n] = onnx_name[len(prefix):] if onnx_name.startswith(prefix) else onnx_name
            module_tensors[n] = tensors[onnx_name]
            if onnx_name in tied:
                aliases[n] = [t[len(prefix):] if t.startswith(prefix) else t for t in tied[onnx_name]]
        input_names = None
        what, framework = f"module {type(model).__name__}", "torch"
    else:
        raise _kiln.Error(f"model is a {type(model).__name__}: expected a torch.nn.Module or an ONNX file's path")
    if from_torch:
        if not is_module:
            raise _kiln.Error(f"a torch optimizer ({type(optimizer).__name__}) takes a torch module's parameters; "
                              f"for {what} give kiln.AdamW(...) or another kiln optimizer")
        optimizer = from_torch_optimizer(optimizer, _param_names(model, program, names, aliases))
    here = kind if kind == "cpu" else f"cuda:{index}"
    # The module's tensors are the step's memory where they are on the step's device; elsewhere
    # (device= another one) the step starts from copies of them, and state_dict() gives its own.
    copies = {}
    if module_tensors and any(str(t.device) != here for t in module_tensors.values()):
        copies, module_tensors = module_tensors, {}
    record = {"format": _FORMAT, "what": what, "ir": program.ir, "names": names,
              "optimizer": optimizer._record(),
              "amp": amp, "memory_budget": _memory_budget(memory_budget), "disable_passes": list(disable_passes),
              "dialects": list(dialects)}
    if input_names:
        record["input_names"] = list(input_names)
    if aliases:
        record["aliases"] = aliases
    if aten_ops is not None:
        record["aten_ops"] = aten_ops  # the ATen ops torch.export gave and kiln lowered
        record["capture_seconds"] = seconds  # {"export": torch.export, "lower": the table}
    session = _session(program, optimizer, amp, kind, index, record, shard, group)
    sharded = set(session.sharded)
    for n, tensor in module_tensors.items():
        if n not in sharded:
            session.adopt(n, tensor.detach(), tensor)
        elif aten_ops is not None:  # parsed IR has no initial values: this rank's shard is copied in
            session.copy_into(n, tensor.detach().contiguous())
    for n, tensor in copies.items():
        session.copy_into(n, tensor.detach().to(here).contiguous())
    step = Step(session, names, module_tensors, framework, kind, index, record, input_names)
    return step


def _module_device(model):
    """The device of the module's first parameter (or buffer); the CPU for one with none."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        return str(tensor.device)
    return "cpu"


def _use_export(capture):
    if capture == "onnx":
        return False
    if _capture.available():
        return True
    if capture == "export":
        raise _kiln.Error(f"capture='export' needs PyTorch >= 2.5 (torch.export); this is torch "
                          f"{torch_module().__version__}: use capture='onnx', or install a newer torch "
                          f"(docs/python.md)")
    return False


def _capture_module(model, inputs, kwargs, loss):
    """(Program, kiln name -> module name, kiln name -> module tensor, the data inputs' names,
    tied names) of a module captured through torch.export."""
    torch = torch_module()
    if isinstance(loss, str):
        if loss != "cross_entropy":
            raise _kiln.Error(f"loss '{loss}': expected 'cross_entropy' or a callable (output, target) -> loss")
        loss = torch.nn.functional.cross_entropy
    if loss is not None and kwargs:
        raise _kiln.Error("loss= with keyword example_inputs: give the inputs as a tuple, the target last")
    module = _WithLoss.make(model, loss) if loss is not None else model
    prefix = "model." if loss is not None else ""
    # The export runs on the module's device: example inputs elsewhere are moved there.
    where = _module_device(model)
    move = lambda x: x.to(where) if torch.is_tensor(x) and str(x.device) != where else x  # noqa: E731
    inputs = tuple(move(x) for x in inputs)
    kwargs = {k: move(v) for k, v in kwargs.items()}
    # Positional inputs keep the forward's parameter names (as the ONNX path's), the target last.
    data_names = None if kwargs else _input_names(model, len(inputs), loss is not None)
    captured = _capture.capture(module, inputs, kwargs, type(model).__name__, data_names=data_names)
    program = _kiln.parse_program(captured.ir)
    strip = lambda n: n[len(prefix):] if n.startswith(prefix) else n  # noqa: E731
    names = {k: strip(u) for k, u in captured.names.items()}
    aliases = {k: [strip(u) for u in us if strip(u) != names[k]] for k, us in captured.aliases.items()}
    input_names = captured.input_names
    return program, names, captured.tensors, input_names, {k: v for k, v in aliases.items() if v}, \
        sorted(captured.aten_ops), captured.seconds


def _same_values(a, b):
    """Whether tensors or arrays `a` and `b` hold the same shape and values."""
    if a is b:
        return True
    if is_torch(a) and is_torch(b):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch_module().equal(a.detach(), b.detach().to(a.device)))
    import numpy
    as_numpy = lambda x: x.detach().cpu().numpy() if is_torch(x) else numpy.asarray(x)  # noqa: E731
    return bool(numpy.array_equal(as_numpy(a), as_numpy(b)))


def _torch_dtype(torch, name):
    return {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16,
            "i32": torch.int32, "i64": torch.int64, "bool": torch.bool, "u8": torch.uint8}[name]


def _param_names(model, program, names, aliases):
    """id(parameter) -> kiln's param name, for the module's parameters that the step trains."""
    params = {n for n, role, _, _ in program.inputs if role == "param"}
    kiln_name = {}
    for n in params:
        for module_name in [names.get(n, n)] + aliases.get(n, []):
            kiln_name[module_name] = n
    return {id(p): kiln_name[n] for n, p in model.named_parameters(remove_duplicate=False) if n in kiln_name}


def _session(program, optimizer, amp, kind, index, record, shard="none", group=None):
    config = optimizer._config({module: n for n, module in record["names"].items()})
    config.amp = amp
    options = _kiln.SessionOptions()
    options.device, options.device_index = kind, index
    options.shard = shard if group is not None else "none"
    options.memory_budget = record["memory_budget"]
    options.disabled_passes = record["disable_passes"]
    options.dialects = record["dialects"]
    return _kiln.Session(program, config, options, group)


def _metadata(path):
    """The __metadata__ of safetensors file `path`."""
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise _kiln.Error(f"'{path}' is not a readable safetensors checkpoint: {e}") from None
    return header.get("__metadata__", {})


def load(path, device=None, shard=None):
    """The step that Step.save wrote to `path`, ready to continue (params, optimizer state, step
    count); on `device` (the CPU unless given), sharded by `shard` as kiln.compile's (a group of
    any size: the checkpoint holds every tensor whole)."""
    path = os.fspath(path)
    meta = _metadata(path)
    if "kiln.python" not in meta:
        raise _kiln.Error(f"'{path}' has no kiln.python metadata: not a checkpoint of Step.save")
    record = json.loads(meta["kiln.python"])
    if record.get("format") != _FORMAT:
        raise _kiln.Error(f"'{path}': checkpoint format {record.get('format')}, this kiln reads {_FORMAT}")
    shard, group = _group(shard, device or "cpu")
    kind, index = _device(device or "cpu", group)
    program = _kiln.parse_program(record["ir"])
    optimizer = _from_config(record["optimizer"])
    session = _session(program, optimizer, record["amp"], kind, index, record, shard, group)
    session.load(path)
    framework = "torch" if torch_module() is not None else "numpy"
    return Step(session, record["names"], {}, framework, kind, index, record)

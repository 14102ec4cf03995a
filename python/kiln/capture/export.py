"""A torch module to kiln's IR through torch.export (PyTorch >= 2.5): the module is exported
non-strict in training mode (dropout and BatchNorm keep their training semantics), and its ATen
graph is lowered node by node through THE table (aten.py) into IR text (ir.py), which
kiln.compile parses and trains like any other program.

What the walk does besides the table:
- Inputs: the module's trainable parameters are `param` inputs under their module names (tied
  ones, one tensor under several names, are one input); buffers that the forward writes
  (BatchNorm's running statistics, its step count) are `state` inputs with an `update`; the
  other buffers, frozen parameters and the export's lifted constants are constants.
- Constants are folded in Python: a node whose tensor inputs are all constants is computed by
  torch (position ids, causal masks, rotary tables, relative position buckets), so the graph
  keeps only what depends on the data and the parameters.
- In-place ops (the export keeps them: add_, relu_, masked_fill_, copy_ into a slice, and
  batch_norm's statistics) become values: the op's functional row, then a write that rebinds the
  tensor, and through a view (slice, select, reshape, transpose) its base, rebuilt around the
  new part. A view read after its base was written elsewhere is an error, never a stale value.
- Errors: an op outside the table, or a case its row cannot express, is kiln.Error naming the
  ATen op and the user's source line (the node's stack trace)."""
import operator
import os
import re

from .. import _kiln
from . import aten as table
from .ir import Builder, Unsupported, Value

# ATen ops that make a view of their first argument (a write to the view writes its base).
VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default",
         "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.flatten.using_ints",
         "aten.unflatten.int", "aten.alias.default", "aten.slice.Tensor", "aten.select.int", "aten.narrow.default",
         "aten.transpose.int", "aten.permute.default", "aten.t.default", "aten.expand.default",
         "aten.view_as.default", "aten.detach.default"}
# Ops with no output value, only checks of the export's assumptions.
CHECKS = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten.sym_constrain_range.default",
          "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg"}
# Ops that update BatchNorm's running statistics (arguments 3 and 4) when argument 5 (training) is set.
_WRITES_STATISTICS = {"aten.batch_norm.default", "aten._batch_norm_impl_index.default"}
# Higher-order ops that run a submodule (argument `lead`) on the arguments after it: the
# export's form of `with torch.no_grad()` and `with torch.autocast(...)` inside a forward.
_REGIONS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}
# Frozen tensors above this many elements stay tensors (state inputs without an update)
# instead of becoming constants written into the IR text.
_LARGEST_CONSTANT = 1 << 16


def available():
    """Whether this torch has torch.export (2.5 and later)."""
    try:
        import torch
    except ImportError:
        return False
    version = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])
    return version >= (2, 5) and hasattr(torch, "export")


class Captured:
    """The result: IR text, and what kiln.compile binds to it."""

    def __init__(self):
        self.ir = ""
        self.names = {}          # kiln input name -> the module's name (params and state)
        self.aliases = {}        # kiln input name -> every module name of that tensor (tied ones)
        self.tensors = {}        # kiln input name -> the module's tensor (adopted: trained in place)
        self.input_names = []    # the data inputs, in the order the step takes them
        self.aten_ops = set()    # the ATen ops lowered through the table (not folded by torch)
        self.seconds = {}        # "export", "lower"


def capture(module, args, kwargs, name, options=None, data_names=None):
    """Captured of `module` called as module(*args, **kwargs) (training mode, non-strict export);
    `data_names`: the names of the tensor inputs in order (else the export's)."""
    import time

    import torch
    clock = time.perf_counter()
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    rng = torch.random.get_rng_state()
    training = module.training
    module.train()
    # The same tensor given for two inputs (a language model's (ids, ids) as inputs and labels)
    # would be one input of the export's graph, read for both: later steps given two different
    # tensors would then compute with one of them. Each input gets its own tensor.
    seen = set()

    def distinct(x):
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return x.clone()
            seen.add(id(x))
        return x
    args = tuple(distinct(a) for a in args)
    kwargs = {k: distinct(v) for k, v in (kwargs or {}).items()}
    try:
        program = torch.export.export(module, tuple(args), dict(kwargs or {}), strict=False)
    except Exception as e:  # torch's own errors, data-dependent control flow among them
        raise _kiln.Error(f"torch.export of {name} failed: {type(e).__name__}: {_first_lines(str(e))}"
                          f"{_hint(e)}") from e
    finally:
        module.train(training)
        with torch.no_grad():
            for n, b in module.named_buffers():
                b.copy_(saved[n])
        torch.random.set_rng_state(rng)
    exported = time.perf_counter()
    out = Lowering(program, module, name, options or {}, data_names).run()
    out.seconds = {"export": exported - clock, "lower": time.perf_counter() - exported}
    return out


def _first_lines(text, count=6):
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:count])


def _hint(e):
    text = str(e)
    hint = ""
    frames = [f for f in re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', text) if "/torch/" not in f[0]]
    if frames:
        path, line, function, code = frames[-1]
        hint = f"\nat {path}:{line} in {function}: {code.strip()}"
    if "data-dependent" in text or "GuardOnDataDependent" in type(e).__name__ or "Could not guard" in text:
        hint += ("\n(kiln compiles one static graph: control flow on tensor values, such as `if x.sum() > 0`, "
                 "cannot be captured; compute both branches and select with torch.where)")
    return hint


def _source_line(node):
    """The user's line that made `node`: the last frame of its stack trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return "an unknown line"
    import torch
    inside = os.path.dirname(torch.__file__)
    # The last frame outside torch itself (a module's forward, not nn.Linear's).
    outside = [f for f in frames if not f[0].startswith(inside)]
    path, line, function, code = (outside or frames)[-1]
    return f"{path}:{line} in {function}: {code.strip()}"


class _Context:
    """What a table row sees of the node it lowers (aten.py's `c`)."""

    def __init__(self, lowering, node, name):
        self.b = lowering.b
        self.node = node
        self.name = name
        self.options = lowering.options
        self.outs = _outputs_of(node)
        self.out = self.outs[0] if self.outs else (None, ())
        self._lowering = lowering

    def assign(self, arg, value):
        self._lowering.write(arg, value)

    def log_softmax_source(self, value):
        return self._lowering.log_softmax_of.get(value.name)


def _outputs_of(node):
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    out = []
    for v in vals:
        if v is not None and hasattr(v, "dtype") and hasattr(v, "shape"):
            out.append((v.dtype, tuple(int(d) for d in v.shape)))
        else:
            out.append((None, ()))
    return out


class Lowering:
    def __init__(self, program, module, name, options, data_names=None):
        self.program = program
        self.data_names = list(data_names or [])
        self.module = module
        self.options = options
        self.b = Builder(re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "module")
        self.env = {}             # fx node -> Value (or list of Values for several outputs)
        self.view_base = {}       # fx node -> the node it is a view of
        self.version = {}         # root node -> count of writes to it
        self.bound = {}           # fx node -> its root's version when its value was bound
        self.log_softmax_of = {}  # kiln name of a log_softmax output -> its input (nll_loss -> cross_entropy)
        self.out = Captured()
        self.inputs = {}          # placeholder node -> its input Value (role param/state/data)
        self.roles = {}           # placeholder node -> "param" | "state" | "data" | "constant"
        self.modules = [program.graph_module]  # whose attributes get_attr reads (regions nest)

    # ---- the walk ----
    def run(self):
        graph = self.program.graph
        mutated = self._mutated_roots(graph)
        self._bind_inputs(graph, mutated)
        outputs = None
        for node in graph.nodes:
            if node.op == "call_function":
                self._lower(node)
            elif node.op == "output":
                outputs = node.args[0]
        self._finish(outputs)
        return self.out

    def _root(self, node):
        while node in self.view_base:
            node = self.view_base[node]
        return node

    def _mutated_roots(self, graph):
        """The nodes (through views) that an op writes in place, from the ops' schemas."""
        import torch
        views = {}
        roots = set()
        for node in graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            if str(node.target) in VIEWS and isinstance(node.args[0], torch.fx.Node):
                views[node] = node.args[0]
            written = [i for i, arg in enumerate(node.target._schema.arguments)
                       if arg.alias_info is not None and arg.alias_info.is_write]
            if str(node.target) in _WRITES_STATISTICS and len(node.args) > 5 and node.args[5]:
                written = [3, 4]  # batch_norm in training: its schema hides the running statistics' update
            for i in written:
                arg = node.target._schema.arguments[i]
                target = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                while target in views:
                    target = views[target]
                if isinstance(target, torch.fx.Node):
                    roots.add(target)
        return roots

    def _bind_inputs(self, graph, mutated):
        import torch
        signature = self.program.graph_signature
        kinds = {spec.arg.name: spec for spec in signature.input_specs}
        named = dict(self.module.named_parameters(remove_duplicate=False))
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        by_tensor = {}  # id of a module tensor -> its kiln input (tied parameters share one)
        for node in graph.nodes:
            if node.op != "placeholder":
                continue
            spec = kinds.get(node.name)
            kind = spec.kind.name if spec is not None else "USER_INPUT"
            val = node.meta.get("val")
            if kind == "USER_INPUT":
                if not isinstance(val, torch.Tensor):
                    self.env[node] = val
                    continue
                count = len(self.out.input_names)
                user = self.data_names[count] if count < len(self.data_names) else node.name
                name = self._unique(user)
                if node in mutated:
                    raise _kiln.Error(f"the module writes its input '{user}' in place: kiln's inputs are read-only")
                value = self.b.input(name, val.dtype, val.shape, "data")
                self.out.input_names.append(user)
                self.inputs[node], self.roles[node] = value, "data"
                self._bind(node, value)
                continue
            if kind == "PARAMETER":
                tensor = named[spec.target]
            elif kind == "BUFFER":
                tensor = buffers[spec.target]
            elif kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
                tensor = self.program.constants[spec.target]
                if not isinstance(tensor, torch.Tensor):
                    raise _kiln.Error(f"the export has a constant {spec.target} of type {type(tensor).__name__}")
            else:
                raise _kiln.Error(f"an export input of kind {kind} ({node.name}): kiln takes parameters, buffers, "
                                  f"constants and tensor inputs")
            user_name = spec.target
            key = id(tensor)
            if key in by_tensor:  # tied: one storage under several names
                value, kiln_name, _ = by_tensor[key]
                self.out.aliases.setdefault(kiln_name, [self.out.names[kiln_name]]).append(user_name)
                self._bind(node, value)
                self.inputs[node], self.roles[node] = value, self.roles[by_tensor[key][2]]
                continue
            trainable = kind == "PARAMETER" and tensor.requires_grad
            if node in mutated and kind == "PARAMETER":
                raise _kiln.Error(f"the module writes its parameter '{user_name}' in place in its forward: kiln "
                                  f"updates parameters only through the optimizer")
            if trainable:
                role = "param"
            elif node in mutated or tensor.numel() > _LARGEST_CONSTANT:
                role = "state"
            else:
                role = "constant"
            if role == "constant":
                value = self.b.const(tensor.detach().cpu() if tensor.device.type != "cpu" else tensor.detach())
                kiln_name = None
            else:
                kiln_name = self._unique(user_name)
                value = self.b.input(kiln_name, tensor.dtype, tensor.shape, role)
                self.out.names[kiln_name] = user_name
                self.out.tensors[kiln_name] = tensor
            by_tensor[key] = (value, kiln_name, node)
            self.inputs[node], self.roles[node] = value, role
            self._bind(node, value)

    def _unique(self, name):
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        if name.isdigit():
            name = "_" + name
        taken = {line.split(":")[0][1:] for line in self.b.inputs}
        base, i = name, 1
        while name in taken:
            name = f"{base}_{i}"
            i += 1
        return name

    def _bind(self, node, value):
        self.env[node] = value
        self.bound[node] = self.version.get(self._root(node), 0)

    def _read(self, node):
        value = self.env[node]
        root = self._root(node)
        if root is not node and self.bound.get(node) != self.version.get(root, 0):
            raise Unsupported(f"'{node.name}' is a view read after its base '{root.name}' was written in place "
                              f"through another view")
        return value

    def _args(self, node):
        import torch

        def convert(a):
            if isinstance(a, torch.fx.Node):
                return self._read(a)
            if isinstance(a, (list, tuple)):
                return type(a)(convert(x) for x in a)
            return a
        return convert(node.args), {k: convert(v) for k, v in node.kwargs.items()}

    def _lower(self, node):
        import torch
        name = str(node.target)
        try:
            if node.target is operator.getitem:
                parts = self._read(node.args[0])
                self._bind(node, parts[node.args[1]])
                return
            if name in CHECKS:
                return
            if name in _REGIONS:
                self._bind(node, self._region(node, name))
                return
            if not isinstance(node.target, torch._ops.OpOverload):
                raise Unsupported("not an ATen op")
            if name in VIEWS and isinstance(node.args[0], torch.fx.Node):
                self.view_base[node] = node.args[0]
            args, kwargs = self._args(node)
            schema = node.target._schema
            writes = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
            if name not in table.RANDOM and (name in table.SHAPE_ONLY or self._all_constant(args, kwargs)):
                result = self._fold(node, name, args, kwargs)
            else:
                result = self._table_row(node, name, args, kwargs, writes)
            # An in-place op (add_, copy_, masked_fill_, ...) returns the tensor it wrote; batch_norm
            # writes its running statistics itself (c.assign).
            if writes and (schema.name.endswith("_") or name == "aten.copy_.default"):
                written = node.args[writes[0]]
                self.write(written, result[0] if isinstance(result, list) else result)
                result = self.env[written]
            if isinstance(result, Value) and result.name is not None and result.const is None and \
                    name in ("aten._log_softmax.default", "aten.log_softmax.int"):
                self.log_softmax_of[result.name] = args[0]
            self._bind(node, result)
        except Unsupported as e:
            raise _kiln.Error(f"{name} is not supported: {e}; at {_source_line(node)}") from None
        except _kiln.Error:
            raise
        except Exception as e:  # a bug of the lowering: named, never a crash
            raise _kiln.Error(f"lowering {name} failed ({type(e).__name__}: {e}); at {_source_line(node)}") from e

    def _region(self, node, name):
        """A `with torch.no_grad()` / `torch.autocast(...)` block of the forward, which the export
        keeps as a call of a submodule: its nodes lowered in place. No-grad outputs are
        stop_gradient (torch's detach); autocast is kiln's own amp's business, so its settings
        are not replayed (a region that disables it computes in the captured dtypes)."""
        lead = _REGIONS[name]
        grad_enabled = node.args[0] if name == "wrap_with_set_grad_enabled" else True
        module = self.modules[-1]
        sub = getattr(module, node.args[lead].target)
        args = node.args[lead + 1:]
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(args):
            raise Unsupported(f"a region of {len(placeholders)} inputs called with {len(args)}")
        import torch
        for ph, arg in zip(placeholders, args):
            if isinstance(arg, torch.fx.Node):
                self.view_base[ph] = arg  # an alias: a write inside writes the caller's tensor
                self._bind(ph, self._read(arg))
            else:
                self.env[ph] = arg
        self.modules.append(sub)
        try:
            result = None
            for n in sub.graph.nodes:
                if n.op == "call_function":
                    self._lower(n)
                elif n.op == "output":
                    result = [self._read(a) if isinstance(a, torch.fx.Node) else a for a in n.args[0]]
        finally:
            self.modules.pop()
        if not grad_enabled:
            result = [self.b.unary("stop_gradient", v) if isinstance(v, Value) and v.const is None and
                      v.dtype.is_floating_point else v for v in result]
        return result

    def _table_row(self, node, name, args, kwargs, writes):
        row = table.ATEN.get(name)
        if row is None and writes:
            row = self._functional_row(name)
        if row is None:
            raise Unsupported("kiln has no lowering for it (docs/python.md lists the ATen ops kiln takes)")
        context = _Context(self, node, name)
        self.out.aten_ops.add(name)
        return row(context, *args, **kwargs)

    def _functional_row(self, name):
        """The row of an in-place op's functional form: add_ -> add; copy_ and fill_ are their own."""
        _, op, overload = name.split(".")
        if op == "copy_":
            return _copy_into
        if op in ("fill_", "zero_"):
            return _fill
        return table.ATEN.get(f"aten.{op.rstrip('_')}.{overload}")

    def _all_constant(self, args, kwargs):
        values = []

        def collect(a):
            if isinstance(a, Value):
                values.append(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    collect(x)
        collect(args)
        collect(list(kwargs.values()))
        return all(v.const is not None for v in values)

    def _fold(self, node, name, args, kwargs):
        """The node computed by torch on constants (a copy of them: in-place ops write their copy)."""
        import torch

        def concrete(a):
            if isinstance(a, Value):  # SHAPE_ONLY ops read no values: zeros stand in
                return a.const.clone() if a.const is not None else torch.zeros(a.shape, dtype=a.dtype)
            if isinstance(a, (list, tuple)):
                return type(a)(concrete(x) for x in a)
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a
        kwargs = {k: concrete(v) for k, v in kwargs.items()}
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        result = node.target(*concrete(args), **kwargs)
        if isinstance(result, (list, tuple)):
            return [self.b.const(r) if isinstance(r, torch.Tensor) else r for r in result]
        return self.b.const(result) if isinstance(result, torch.Tensor) else result

    # ---- writes ----
    def write(self, node, value):
        """`node` (a tensor the graph wrote in place) holds `value` from now on; through a view,
        its base is rebuilt around the new part."""
        chain = [node]
        while chain[-1] in self.view_base:
            chain.append(self.view_base[chain[-1]])
        root = chain[-1]
        new = {node: value}
        for view, base in zip(chain, chain[1:]):
            new[base] = self._scatter(view, base, new[view])
        self.version[root] = self.version.get(root, 0) + 1
        for n, v in new.items():
            self._bind(n, v)
        if root in self.roles and self.roles[root] in ("param", "data"):
            raise Unsupported(f"an in-place write of the module's {self.roles[root]} '{root.name}'")

    def _scatter(self, view, base, part):
        """`base` with the elements that `view` shows replaced by `part`."""
        old = self.env[base]
        b = self.b
        part = b.cast(part, old.dtype)
        name = str(view.target)
        args = view.args
        if name in ("aten.slice.Tensor", "aten.select.int", "aten.narrow.default"):
            axis = (args[1] if len(args) > 1 else 0) % old.rank
            dim = old.shape[axis]
            if name == "aten.slice.Tensor":
                start, end = table._bounds(dim, args[2] if len(args) > 2 else None, args[3] if len(args) > 3 else None,
                                           args[4] if len(args) > 4 else 1)
                if (args[4] if len(args) > 4 else 1) != 1:
                    raise Unsupported("an in-place write through a strided slice")
            elif name == "aten.select.int":
                start = args[2] % dim
                end = start + 1
                part = b.reshape(part, tuple(1 if i == axis else d for i, d in enumerate(old.shape)))
            else:
                start = args[2] % dim
                end = start + args[3]
            pieces = [b.slice(old, axis, 0, start), part, b.slice(old, axis, end, dim)]
            return b.concat([p for i, p in enumerate(pieces) if i == 1 or p.shape[axis] > 0], axis)
        if name in ("aten.transpose.int", "aten.permute.default", "aten.t.default"):
            if name == "aten.transpose.int":
                perm = list(range(old.rank))
                d0, d1 = args[1] % old.rank, args[2] % old.rank
                perm[d0], perm[d1] = perm[d1], perm[d0]
            elif name == "aten.permute.default":
                perm = [d % old.rank for d in args[1]]
            else:
                perm = list(reversed(range(old.rank)))
            inverse = [perm.index(i) for i in range(len(perm))]
            return b.transpose(part, inverse)
        if name == "aten.expand.default":
            raise Unsupported("an in-place write through expand")
        return b.reshape(part, old.shape)  # view, reshape, unsqueeze, squeeze, flatten, alias

    # ---- the end ----
    def _finish(self, outputs):
        import torch
        for node, value in self.inputs.items():
            if self.roles[node] == "state" and self.env[node] is not value:
                self.b.update(value, self.env[node])
        specs = self.program.graph_signature.output_specs
        results = []
        for spec, arg in zip(specs, outputs):
            if spec.kind.name != "USER_OUTPUT" or not isinstance(arg, torch.fx.Node):
                continue
            value = self.env.get(arg)
            if isinstance(value, Value):
                results.append(value)
        if not results:
            raise _kiln.Error(f"{self.b.graph_name} returns no tensor: kiln trains a module whose forward returns "
                              f"its loss first (or pass loss=)")
        loss = results[0]
        if loss.shape != () or not loss.dtype.is_floating_point:
            raise _kiln.Error(f"{self.b.graph_name}'s first output is {loss.dtype} of shape {list(loss.shape)}: kiln "
                              f"trains a module whose forward returns a scalar loss first (or pass loss=)")
        self.out.ir = self.b.text(results)


def _copy_into(c, dst, src, non_blocking=False):
    return c.b.broadcast(c.b.cast(src, dst.dtype), dst.shape)


def _fill(c, x, value=0):
    if isinstance(value, Value):
        return c.b.broadcast(c.b.cast(value, x.dtype), x.shape)
    return c.b.full(value, x.dtype, x.shape)


def supported_ops():
    """The ATen ops the table lowers (their functional forms; in-place variants follow them)."""
    return sorted(table.ATEN) + ["aten.copy_.default", "aten.fill_.Scalar", "aten.fill_.Tensor", "aten.zero_.default"]


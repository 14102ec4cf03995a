"""Writes kiln's IR text (docs/ir.md) from Python: the values of a graph being built, and one
method per kiln op form the ATen table (aten.py) needs.

A Value is a kiln value (its name in the text), or a torch constant not yet in the text: constants
are folded in Python (torch computes them, as the module would) and enter the graph only where a
kiln op reads them, as a `full` or a `constant` node. Node outputs get numeric names (%12), which
the parser treats as positional labels, so they never clash with the module's names."""
import math

_DTYPES = {}  # torch dtype -> kiln dtype name, filled on first use (torch is imported late)


def kiln_dtype(dtype):
    if not _DTYPES:
        import torch
        _DTYPES.update({torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
                        torch.int64: "i64", torch.int32: "i32", torch.bool: "bool", torch.uint8: "u8"})
    if dtype not in _DTYPES:
        raise Unsupported(f"dtype {dtype}: kiln has f32, f64, f16, bf16, i64, i32, bool and u8")
    return _DTYPES[dtype]


class Unsupported(Exception):
    """A construct the lowering has no kiln form for; export.py adds the ATen op and the user's line."""


class Value:
    __slots__ = ("name", "dtype", "shape", "const")

    def __init__(self, name, dtype, shape, const=None):
        self.name = name            # "%name" in the text, None for a constant not yet emitted
        self.dtype = dtype          # torch dtype
        self.shape = tuple(int(d) for d in shape)
        self.const = const          # the torch tensor of a constant (folded in Python), else None

    @property
    def rank(self):
        return len(self.shape)

    @property
    def numel(self):
        return math.prod(self.shape)

    def __repr__(self):
        return f"Value({self.name}, {self.dtype}, {self.shape})"


def _number(x):
    x = float(x)
    if math.isnan(x):
        raise Unsupported("a NaN attribute")
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(x)


def _attr(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, Dtype):
        return value.name
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, bool) or isinstance(v, int) for v in value):
            return "[" + ", ".join(str(int(v)) for v in value) + "]"
        return "[" + ", ".join(_number(v) for v in value) + "]"
    raise TypeError(f"attribute value {value!r}")


class Dtype:
    """A dtype attribute (written bare: dtype=f32)."""

    def __init__(self, torch_dtype):
        self.name = kiln_dtype(torch_dtype)


def type_text(dtype, shape):
    return f"{kiln_dtype(dtype)}[{','.join(str(d) for d in shape)}]"


class Builder:
    """The graph being written: inputs, nodes, updates; `emit` appends one node."""

    def __init__(self, name):
        self.graph_name = name
        self.inputs = []   # "%name: TYPE role"
        self.lines = []    # node lines
        self.updates = []  # "update %target = %value"
        self._count = 0
        self.seed = 0      # dropout seeds, one per dropout node
        self.producer = {}  # name -> (op, source Value[, perm]) of reshape, broadcast_to and transpose nodes
        self.constants = {}  # (dtype, shape, digest of the bytes) -> the Value of its node

    # ---- inputs and nodes ----
    def input(self, name, dtype, shape, role):
        self.inputs.append(f"%{name}: {type_text(dtype, shape)} {role}")
        return Value(f"%{name}", dtype, shape)

    def emit(self, op, inputs, attrs=None, outputs=()):
        """Node `op` over `inputs` (Values) with `attrs`; `outputs` are (dtype, shape) pairs, one per
        output, written as the node's types (kiln's parser checks them against its inference)."""
        names = []
        for _ in outputs:
            names.append(f"%{self._count}")
            self._count += 1
        args = ", ".join(self.ref(v) for v in inputs)
        attr_text = ""
        if attrs:
            attr_text = " {" + ", ".join(f"{k}={_attr(v)}" for k, v in sorted(attrs.items()) if v is not None) + "}"
        types = ", ".join(type_text(d, s) for d, s in outputs)
        self.lines.append(f"  {', '.join(names)} = {op}({args}){attr_text} : {types}")
        return [Value(n, d, s) for n, (d, s) in zip(names, outputs)]

    def op(self, op, inputs, out_dtype, out_shape, **attrs):
        """One node with one output of `out_dtype` and `out_shape`."""
        return self.emit(op, inputs, attrs, [(out_dtype, tuple(out_shape))])[0]

    def ref(self, v):
        """`v`'s name in the text, emitting a constant's node first."""
        if v.name is None:
            v.name = self._constant(v.const).name
        return v.name

    def _constant(self, tensor):
        """The node of a constant; one node for equal constants (every layer of a LLaMA folds the
        same rotary tables: written once, not once per layer)."""
        import hashlib

        import torch
        t = tensor.detach().cpu().contiguous()
        key = (t.dtype, tuple(t.shape), hashlib.sha1(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
        if key not in self.constants:
            self.constants[key] = self._constant_node(t)
        return self.constants[key]

    def _constant_node(self, t):
        import torch
        shape = list(t.shape)
        flat = t.reshape(-1)
        if flat.numel() > 0 and bool((flat == flat[0]).all()):
            value = flat[0].item()
            return self.op("full", [], t.dtype, shape, dtype=Dtype(t.dtype), shape=shape, value=float(value))
        if t.dtype in (torch.int64, torch.int32) and flat.numel() and int(flat.abs().max()) >= 2**53:
            raise Unsupported("an integer constant beyond 2^53 (kiln's constants hold doubles)")
        values = flat.double().tolist() if t.dtype != torch.bool else [float(x) for x in flat.tolist()]
        return self.op("constant", [], t.dtype, shape, dtype=Dtype(t.dtype), shape=shape, values=values)

    def update(self, target, value):
        self.updates.append(f"  update {target.name} = {self.ref(value)}")

    def text(self, outputs):
        body = self.lines + self.updates + [f"  return {', '.join(self.ref(v) for v in outputs)}"]
        return f"graph @{self.graph_name}({', '.join(self.inputs)}) {{\n" + "\n".join(body) + "\n}\n"

    # ---- helpers the table uses ----
    def const(self, tensor):
        return Value(None, tensor.dtype, tuple(tensor.shape), tensor)

    def scalar(self, value, dtype):
        import torch
        return self.const(torch.tensor(value, dtype=dtype))

    def full(self, value, dtype, shape):
        import torch
        return self.const(torch.full(tuple(shape), value, dtype=dtype))

    def cast(self, v, dtype):
        if v.dtype == dtype:
            return v
        if v.const is not None:
            return self.const(v.const.to(dtype))
        return self.op("cast", [v], dtype, v.shape, dtype=Dtype(dtype))

    def reshape(self, v, shape):
        shape = tuple(int(d) for d in shape)
        if v.shape == shape:
            return v
        if v.const is not None:
            return self.const(v.const.reshape(shape))
        out = self.op("reshape", [v], v.dtype, shape, shape=list(shape))
        self.producer[out.name] = ("reshape", v)
        return out

    def broadcast(self, v, shape):
        shape = tuple(int(d) for d in shape)
        if v.shape == shape:
            return v
        if v.const is not None:
            return self.const(v.const.expand(shape).contiguous())
        if v.rank < len(shape):
            v = self.reshape(v, (1,) * (len(shape) - v.rank) + v.shape)
        out = self.op("broadcast_to", [v], v.dtype, shape, shape=list(shape))
        self.producer[out.name] = ("broadcast_to", v)
        return out

    def broadcast_source(self, v):
        """The value that `v` broadcasts, where v is broadcast_to(s) reshaped any number of times
        back to the broadcast's own shape (reshapes move no data); else None."""
        x = v
        while x.name in self.producer and self.producer[x.name][0] == "reshape":
            x = self.producer[x.name][1]
        if x.shape != v.shape or x.name not in self.producer:
            return None
        return self.producer[x.name][1]

    def transpose(self, v, perm):
        perm = [int(p) for p in perm]
        if v.name in self.producer and self.producer[v.name][0] == "transpose":
            # A transpose of a transpose is one (the identity cancels: attention's layouts).
            inner, source = self.producer[v.name][2], self.producer[v.name][1]
            perm, v = [inner[p] for p in perm], source
        if perm == list(range(len(perm))):
            return v
        if v.const is not None:
            return self.const(v.const.permute(perm).contiguous())
        out = self.op("transpose", [v], v.dtype, tuple(v.shape[p] for p in perm), perm=perm)
        self.producer[out.name] = ("transpose", v, perm)
        return out

    def transposed_from(self, v, perm):
        """The value that `v` is transpose(perm) of, else None."""
        entry = self.producer.get(v.name)
        if entry is not None and entry[0] == "transpose" and entry[2] == list(perm):
            return entry[1]
        return None

    def slice(self, v, axis, start, end, step=1):
        """v[start:end:step] along `axis` (bounds already clamped, as torch clamps them)."""
        axis = axis % v.rank
        if start == 0 and end == v.shape[axis] and step == 1:
            return v
        starts, ends, steps = [0] * v.rank, list(v.shape), [1] * v.rank
        starts[axis], ends[axis], steps[axis] = start, end, step
        shape = list(v.shape)
        shape[axis] = max(0, (end - start + step - 1) // step)
        return self.op("slice", [v], v.dtype, shape, starts=starts, ends=ends,
                       steps=steps if step != 1 else None)

    def concat(self, values, axis):
        if len(values) == 1:
            return values[0]
        axis = axis % values[0].rank
        shape = list(values[0].shape)
        shape[axis] = sum(v.shape[axis] for v in values)
        return self.op("concat", values, values[0].dtype, shape, axis=axis)

    def binary(self, op, a, b, dtype=None):
        """Elementwise `op` of a and b broadcast (numpy rules), both cast to `dtype` (a's if None);
        comparisons give bool."""
        dtype = dtype or a.dtype
        a, b = self.cast(a, dtype), self.cast(b, dtype)
        shape = broadcast_shape(a.shape, b.shape)
        out = bool_dtype() if op in ("eq", "ne", "lt", "le", "gt", "ge") else dtype
        return self.op(op, [a, b], out, shape)

    def unary(self, op, x, **attrs):
        return self.op(op, [x], x.dtype, x.shape, **attrs)

    def where(self, cond, a, b):
        shape = broadcast_shape(broadcast_shape(cond.shape, a.shape), b.shape)
        return self.op("where", [cond, a, self.cast(b, a.dtype)], a.dtype, shape)

    def reduce(self, op, x, axes, keepdims):
        axes = sorted({a % x.rank for a in axes}) if x.rank else []
        shape = [1 if i in axes else d for i, d in enumerate(x.shape)] if keepdims else \
            [d for i, d in enumerate(x.shape) if i not in axes]
        return self.op(op, [x], x.dtype, shape, axes=axes, keepdims=bool(keepdims) or None)

    def matmul(self, a, b, transpose_b=False):
        m = a.shape[-2] if a.rank > 1 else 1
        n = (b.shape[-2] if transpose_b else b.shape[-1])
        batch = broadcast_shape(a.shape[:-2], b.shape[:-2])
        return self.op("matmul", [a, b], a.dtype, tuple(batch) + (m, n), transpose_b=transpose_b or None)


def bool_dtype():
    import torch
    return torch.bool


def broadcast_shape(a, b):
    out = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x != y and x != 1 and y != 1:
            raise Unsupported(f"shapes {tuple(a)} and {tuple(b)} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


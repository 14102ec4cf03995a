"""THE table from ATen ops to kiln ops: one small function per ATen op (or family), keyed by the
op's name as torch.export writes it ("aten.add.Tensor"). Composite ops that kiln has kernels for
stay whole (scaled_dot_product_attention -> attention, layer_norm, rms_norm, embedding -> gather,
cross_entropy_loss -> cross_entropy, conv2d, batch_norm, dropout), mirroring the op choices of
kiln's own models (src/models/gpt.cc, llama.cc); the others become kiln ops one to one or a few.

Each function takes the lowering context `c` (c.b: the ir.Builder; c.out: (dtype, shape) of the
node's first output as torch computed it; c.assign(node_arg, value): an in-place write) and the
node's arguments with tensors as ir.Values, and returns a Value (or a list, several outputs). An
op outside the table, or a case a row cannot express, raises ir.Unsupported; export.py turns it
into kiln.Error naming the ATen op and the user's source line. In-place variants (add_, relu_,
...) are their functional row followed by a write (export.py), so only the functional ones are
listed. Ops whose inputs are all constants never reach the table: torch computes them."""
import math

from .ir import Dtype, Unsupported, Value

ATEN = {}


def aten(*names):
    def register(fn):
        for name in names:
            assert name not in ATEN, name
            ATEN["aten." + name] = fn
        return fn
    return register


def _torch():
    import torch
    return torch


def _axis(axis, rank):
    return axis % rank if rank else 0


def _operand(c, v, dtype):
    """A Value of `dtype` for tensor or number `v`."""
    if isinstance(v, Value):
        return c.b.cast(v, dtype)
    return c.b.scalar(v, dtype)


# ---- elementwise ----

def _binary(op):
    def lower(c, a, b, alpha=1, rounding_mode=None):
        dtype = c.out[0]
        if rounding_mode is not None:
            raise Unsupported(f"rounding_mode='{rounding_mode}'")
        a, b = _operand(c, a, dtype), _operand(c, b, dtype)
        if alpha != 1:
            b = c.b.binary("mul", b, c.b.scalar(alpha, dtype))
        return c.b.binary(op, a, b)
    return lower


aten("add.Tensor", "add.Scalar")(_binary("add"))
aten("sub.Tensor", "sub.Scalar")(_binary("sub"))
aten("mul.Tensor", "mul.Scalar")(_binary("mul"))
aten("div.Tensor", "div.Scalar", "div.Tensor_mode")(_binary("div"))
aten("maximum.default")(_binary("maximum"))
aten("minimum.default", "min.other")(_binary("minimum"))
aten("max.other")(_binary("maximum"))


@aten("rsub.Scalar", "rsub.Tensor")
def _rsub(c, a, b, alpha=1):
    return _binary("sub")(c, b, a) if alpha == 1 else _binary("sub")(c, c.b.binary("mul", _operand(c, b, c.out[0]), c.b.scalar(alpha, c.out[0])), a)


def _compare(op):
    def lower(c, a, b):
        torch = _torch()
        dtype = torch.result_type(_probe(a), _probe(b))
        return c.b.binary(op, _operand(c, a, dtype), _operand(c, b, dtype))
    return lower


def _probe(v):
    """A torch value with v's dtype for torch.result_type (a 0-dim tensor for a Value)."""
    torch = _torch()
    if isinstance(v, Value):
        return torch.empty((1,) * v.rank, dtype=v.dtype)
    return v


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    aten(f"{_name}.Tensor", f"{_name}.Scalar")(_compare(_name))


def _unary(op, **attrs):
    def lower(c, x):
        return c.b.unary(op, c.b.cast(x, c.out[0]), **attrs)
    return lower


for _name in ("abs", "neg", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "silu", "erf",
              "reciprocal"):
    aten(f"{_name}.default")(_unary(_name))


@aten("gelu.default")
def _gelu(c, x, approximate="none"):
    return c.b.unary("gelu", x, approximate=approximate if approximate != "none" else None)


@aten("log1p.default")
def _log1p(c, x):
    return c.b.unary("log", c.b.binary("add", x, c.b.scalar(1.0, x.dtype)))


@aten("square.default")
def _square(c, x):
    return c.b.unary("square", x)


@aten("pow.Tensor_Scalar")
def _pow(c, x, exponent):
    x = c.b.cast(x, c.out[0])
    if exponent == 1:
        return x
    if exponent == 2:
        return c.b.unary("square", x)
    if exponent == 0.5:
        return c.b.unary("sqrt", x)
    if exponent == -0.5:
        return c.b.unary("rsqrt", x)
    if exponent == -1:
        return c.b.unary("reciprocal", x)
    return c.b.binary("pow", x, c.b.scalar(exponent, x.dtype))


@aten("pow.Tensor_Tensor")
def _pow_tensor(c, x, y):
    return c.b.binary("pow", c.b.cast(x, c.out[0]), c.b.cast(y, c.out[0]))


@aten("clamp.default", "clamp_min.default", "clamp_max.default", "hardtanh.default")
def _clamp(c, x, low=None, high=None):
    if c.name == "aten.clamp_max.default":
        low, high = None, low
    if c.name == "aten.hardtanh.default":
        low = -1.0 if low is None else low
        high = 1.0 if high is None else high
    if low is not None:
        x = c.b.binary("maximum", x, c.b.scalar(low, x.dtype))
    if high is not None:
        x = c.b.binary("minimum", x, c.b.scalar(high, x.dtype))
    return x


@aten("relu6.default")
def _relu6(c, x):
    return _clamp(c, x, 0.0, 6.0)


@aten("where.self", "where.ScalarOther", "where.ScalarSelf", "where.Scalar")
def _where(c, cond, a, b):
    dtype = c.out[0]
    return c.b.where(cond, _operand(c, a, dtype), _operand(c, b, dtype))


@aten("masked_fill.Scalar", "masked_fill.Tensor")
def _masked_fill(c, x, mask, value):
    return c.b.where(mask, _operand(c, value, x.dtype), x)


def _logical(kind):
    # kiln has no boolean ops: and / or / xor as a where over bools.
    def lower(c, a, b):
        torch = _torch()
        if a.dtype != torch.bool or b.dtype != torch.bool:
            raise Unsupported(f"{kind} of {a.dtype} and {b.dtype} (kiln has it for bool only)")
        false, true = c.b.scalar(False, torch.bool), c.b.scalar(True, torch.bool)
        for x, y in ((a, b), (b, a)):  # a mask and'ed with all-true constants (Hugging Face's masks)
            if kind == "and" and x.const is not None and bool(x.const.all()):
                return c.b.broadcast(y, c.out[1])
        if kind == "and":
            return c.b.where(a, b, false)
        if kind == "or":
            return c.b.where(a, true, b)
        return c.b.binary("ne", a, b)
    return lower


aten("__and__.Tensor", "logical_and.default", "bitwise_and.Tensor")(_logical("and"))
aten("__or__.Tensor", "logical_or.default", "bitwise_or.Tensor")(_logical("or"))
aten("logical_xor.default", "bitwise_xor.Tensor", "__xor__.Tensor")(_logical("xor"))


@aten("logical_not.default", "bitwise_not.default")
def _not(c, x):
    torch = _torch()
    if x.dtype != torch.bool:
        raise Unsupported(f"not of {x.dtype} (kiln has it for bool only)")
    return c.b.binary("eq", x, c.b.scalar(False, torch.bool))


# ---- copies, casts and views (kiln's values are immutable: a view is a reshape/transpose/slice) ----

@aten("detach.default")
def _detach(c, x):
    """x.detach(): the value, without its gradient (kiln's stop_gradient)."""
    return c.b.unary("stop_gradient", x) if x.dtype.is_floating_point else x


@aten("clone.default", "contiguous.default", "alias.default", "lift_fresh_copy.default",
      "_to_copy.default", "to.dtype", "to.dtype_layout", "to.device", "to.other", "type_as.default")
def _copy(c, x, *args, **kwargs):
    return c.b.cast(x, c.out[0])


@aten("view.default", "reshape.default", "_unsafe_view.default", "unsqueeze.default", "squeeze.dim", "squeeze.dims",
      "squeeze.default", "flatten.using_ints", "unflatten.int", "view_as.default", "reshape_as.default")
def _reshape(c, x, *args):
    return c.b.reshape(x, c.out[1])


@aten("transpose.int")
def _transpose(c, x, d0, d1):
    perm = list(range(x.rank))
    d0, d1 = _axis(d0, x.rank), _axis(d1, x.rank)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return c.b.transpose(x, perm)


@aten("broadcast_tensors.default")
def _broadcast_tensors(c, tensors):
    return [c.b.broadcast(t, out[1]) for t, out in zip(tensors, c.outs)]


@aten("t.default")
def _t(c, x):
    return c.b.transpose(x, list(reversed(range(x.rank))))


@aten("permute.default")
def _permute(c, x, dims):
    return c.b.transpose(x, [_axis(d, x.rank) for d in dims])


@aten("expand.default", "expand_as.default", "broadcast_to.default")
def _expand(c, x, *args):
    shape = c.out[1]
    if x.rank < len(shape):
        x = c.b.reshape(x, (1,) * (len(shape) - x.rank) + x.shape)
    return c.b.broadcast(x, shape)


def _bounds(dim, start, end, step):
    start, end, _ = slice(start, end, step).indices(dim)
    return start, max(end, start)


@aten("slice.Tensor")
def _slice(c, x, dim=0, start=None, end=None, step=1):
    axis = _axis(dim, x.rank)
    lo, hi = _bounds(x.shape[axis], start, end, step)
    return c.b.slice(x, axis, lo, hi, step)


@aten("select.int")
def _select(c, x, dim, index):
    axis = _axis(dim, x.rank)
    index = index % x.shape[axis]
    return c.b.reshape(c.b.slice(x, axis, index, index + 1), c.out[1])


@aten("narrow.default")
def _narrow(c, x, dim, start, length):
    axis = _axis(dim, x.rank)
    start = start % x.shape[axis]
    return c.b.slice(x, axis, start, start + length)


@aten("split.Tensor", "split_with_sizes.default", "chunk.default", "unbind.int")
def _split(c, x, size_or_sizes, dim=0):
    axis = _axis(dim, x.rank)
    sizes = [o[1][axis] if c.name != "aten.unbind.int" else 1 for o in c.outs]
    parts = c.b.emit("split", [x], {"axis": axis, "sizes": sizes},
                     [(x.dtype, tuple(s if i == axis else d for i, d in enumerate(x.shape))) for s in sizes])
    if c.name == "aten.unbind.int":
        return [c.b.reshape(p, o[1]) for p, o in zip(parts, c.outs)]
    return parts


@aten("cat.default", "concat.default")
def _cat(c, tensors, dim=0):
    tensors = [t for t in tensors if t.numel > 0 or t.rank > 1]  # torch skips empty 1-D tensors
    dtype = c.out[0]
    return c.b.concat([c.b.cast(t, dtype) for t in tensors], _axis(dim, len(c.out[1])))


@aten("stack.default")
def _stack(c, tensors, dim=0):
    axis = _axis(dim, len(c.out[1]))
    parts = [c.b.reshape(t, t.shape[:axis] + (1,) + t.shape[axis:]) for t in tensors]
    return c.b.concat(parts, axis)


@aten("constant_pad_nd.default", "pad.default")
def _pad(c, x, pad, mode="constant", value=None):
    if mode != "constant":
        raise Unsupported(f"padding mode '{mode}' (kiln pads with a constant)")
    value = 0.0 if value is None else value
    for i in range(len(pad) // 2):
        axis = x.rank - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        if before < 0 or after < 0:
            x = c.b.slice(x, axis, max(0, -before), x.shape[axis] - max(0, -after))
            before, after = max(0, before), max(0, after)
        parts = []
        for n in (before, None, after):
            if n is None:
                parts.append(x)
            elif n > 0:
                parts.append(c.b.full(value, x.dtype, tuple(n if a == axis else d for a, d in enumerate(x.shape))))
        x = c.b.concat(parts, axis)
    return x


@aten("index.Tensor")
def _index(c, x, indices):
    """x[..., i, j, ...] with integer index tensors: one is a gather along its axis; several
    (constants, on adjacent axes) index the axes flattened into one, and are a reshape where they
    read every element in order (Hugging Face's mask building does that)."""
    torch = _torch()
    given = [(a, i) for a, i in enumerate(indices) if i is not None]
    if any(i.dtype == torch.bool for _, i in given):
        raise Unsupported("indexing with a boolean mask (its result's shape depends on the data)")
    if len(given) == 1:
        axis, idx = given[0]
        return c.b.reshape(_gather_rows(c, x, idx, axis), c.out[1])
    axes = [a for a, _ in given]
    if axes != list(range(axes[0], axes[0] + len(axes))) or any(i.const is None for _, i in given):
        raise Unsupported("advanced indexing with several index tensors that are not constants on adjacent axes")
    first, dims = axes[0], [x.shape[a] for a in axes]
    parts = torch.broadcast_tensors(*[i.const.long() % d for (_, i), d in zip(given, dims)])
    linear = torch.zeros_like(parts[0])
    for part, d in zip(parts, dims):
        linear = linear * d + part
    flat = c.b.reshape(x, x.shape[:first] + (math.prod(dims),) + x.shape[first + len(dims):])
    if linear.numel() == math.prod(dims) and bool((linear.reshape(-1) == torch.arange(linear.numel())).all()):
        return c.b.reshape(flat, c.out[1])
    return c.b.reshape(_gather_rows(c, flat, c.b.const(linear), first), c.out[1])


def _gather_rows(c, table, idx, axis, padding_index=None, wrap=True):
    """Rows `idx` of `table` along `axis`. wrap: a negative index counts from the end, as torch's
    indexing and index_select do (below -dim the kernel refuses it); embedding does not wrap."""
    torch = _torch()
    if idx.dtype not in (torch.int64, torch.int32):
        idx = c.b.cast(idx, torch.int64)
    if idx.const is not None and wrap and bool((idx.const < 0).any()):
        idx = c.b.const(idx.const % table.shape[axis])
    elif idx.const is None and wrap:
        dim = c.b.scalar(table.shape[axis], idx.dtype)
        idx = c.b.where(c.b.binary("lt", idx, c.b.scalar(0, idx.dtype)), c.b.binary("add", idx, dim), idx)
    shape = table.shape[:axis] + idx.shape + table.shape[axis + 1:]
    return c.b.op("gather", [table, idx], table.dtype, shape, axis=axis or None, padding_index=padding_index)


@aten("index_select.default")
def _index_select(c, x, dim, index):
    return _gather_rows(c, x, index, _axis(dim, x.rank))


@aten("cumsum.default")
def _cumsum(c, x, dim, dtype=None):
    if dtype is not None:
        x = c.b.cast(x, dtype)
    return c.b.op("cumsum", [x], x.dtype, x.shape, axis=_axis(dim, x.rank))


@aten("topk.default")
def _topk(c, x, k, dim=-1, largest=True, sorted=True):
    """Values best first, ties to the lower index (torch leaves tie order unspecified)."""
    axis = _axis(dim, x.rank)
    shape = x.shape[:axis] + (k,) + x.shape[axis + 1:]
    return c.b.emit("topk", [x], {"k": k, "axis": axis, "largest": bool(largest)},
                    [(x.dtype, shape), (_torch().int64, shape)])


@aten("sort.default", "sort.stable")
def _sort(c, x, *args, **kwargs):
    """torch.sort as a topk over the whole axis (ties to the lower index: a stable sort)."""
    if c.name == "aten.sort.stable":  # sort.stable(x, *, stable, dim, descending)
        args = ()
    dim = kwargs.get("dim", args[0] if args else -1)
    descending = kwargs.get("descending", args[1] if len(args) > 1 else False)
    axis = _axis(dim, x.rank)
    return _topk(c, x, x.shape[axis], axis, bool(descending))


@aten("embedding.default")
def _embedding(c, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq:
        raise Unsupported("embedding with scale_grad_by_freq")
    padding = padding_idx if padding_idx is not None and padding_idx >= 0 else None
    return _gather_rows(c, weight, indices, 0, padding, wrap=False)  # padding row: read, never trained


@aten("gather.default")
def _torch_gather(c, x, dim, index, sparse_grad=False):
    """kiln's gather_elements: out[..., i, ...] = x[..., index[..., i, ...], ...] along dim; its kernel
    refuses an index outside [0, dim), as torch does."""
    if index.rank != x.rank:
        raise Unsupported(f"torch.gather with an index of rank {index.rank} for an input of rank {x.rank}")
    if index.dtype != _torch().int64:
        index = c.b.cast(index, _torch().int64)
    return c.b.op("gather_elements", [x, index], x.dtype, index.shape, axis=_axis(dim, x.rank))


# ---- reductions ----

def _dims(x, dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.rank))
    return [dim] if isinstance(dim, int) else list(dim)


@aten("sum.dim_IntList", "sum.default")
def _sum(c, x, dim=None, keepdim=False, dtype=None):
    x = c.b.cast(x, c.out[0])
    return c.b.reduce("sum", x, _dims(x, dim), keepdim)


@aten("mean.dim", "mean.default")
def _mean(c, x, dim=None, keepdim=False, dtype=None):
    x = c.b.cast(x, c.out[0])
    return c.b.reduce("mean", x, _dims(x, dim), keepdim)


@aten("amax.default")
def _amax(c, x, dim=(), keepdim=False):
    return c.b.reduce("max", x, _dims(x, dim), keepdim)


@aten("max.default")
def _max_all(c, x):
    return c.b.reduce("max", x, _dims(x, None), False)


@aten("var.correction", "var.dim")
def _var(c, x, dim=None, unbiased=None, keepdim=False, correction=None):
    dims = _dims(x, dim)
    n = math.prod(x.shape[d] for d in dims)
    correction = correction if correction is not None else (1 if unbiased in (None, True) else 0)
    centered = c.b.binary("sub", x, c.b.reduce("mean", x, dims, True))
    var = c.b.reduce("mean", c.b.unary("square", centered), dims, keepdim)
    return c.b.binary("mul", var, c.b.scalar(n / max(n - correction, 0) if n > correction else math.inf, x.dtype))


@aten("argmax.default")
def _argmax(c, x, dim=None, keepdim=False):
    if dim is None:
        x, dim = c.b.reshape(x, (x.numel,)), 0
    out = c.b.op("argmax", [x], _torch().int64, c.out[1], axis=_axis(dim, x.rank), keepdims=keepdim or None)
    return out


@aten("_softmax.default", "softmax.int", "_log_softmax.default", "log_softmax.int")
def _softmax(c, x, dim, half_or_dtype=None):
    x = c.b.cast(x, c.out[0])
    op = "log_softmax" if "log" in c.name else "softmax"
    return c.b.unary(op, x, axis=_axis(dim, x.rank))


# ---- matrix products ----

@aten("linear.default")
def _linear(c, x, weight, bias=None):
    y = c.b.matmul(x, weight, transpose_b=True)
    return c.b.binary("add", y, bias) if bias is not None else y


@aten("addmm.default")
def _addmm(c, bias, a, b, beta=1, alpha=1):
    y = c.b.matmul(a, b)
    if alpha != 1:
        y = c.b.binary("mul", y, c.b.scalar(alpha, y.dtype))
    if beta != 1:
        bias = c.b.binary("mul", bias, c.b.scalar(beta, bias.dtype))
    return c.b.binary("add", y, bias) if beta != 0 else y


@aten("mm.default", "bmm.default", "matmul.default")
def _matmul(c, a, b):
    if a.rank == 1 or b.rank == 1:
        a1 = c.b.reshape(a, (1,) + a.shape) if a.rank == 1 else a
        b1 = c.b.reshape(b, b.shape + (1,)) if b.rank == 1 else b
        return c.b.reshape(c.b.matmul(a1, b1), c.out[1])
    return c.b.matmul(a, b)


# ---- normalization ----

def _norm_rows(c, x, normalized_shape):
    """x as (..., prod(normalized_shape)): kiln normalizes over the last axis."""
    k = len(normalized_shape)
    if k == 1:
        return x
    return c.b.reshape(x, x.shape[:-k] + (math.prod(normalized_shape),))


@aten("layer_norm.default")
def _layer_norm(c, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    rows = _norm_rows(c, x, normalized_shape)
    width = rows.shape[-1]
    gamma = c.b.reshape(weight, (width,)) if weight is not None else c.b.full(1.0, x.dtype, (width,))
    beta = c.b.reshape(bias, (width,)) if bias is not None else c.b.full(0.0, x.dtype, (width,))
    y = c.b.op("layer_norm", [rows, gamma, beta], x.dtype, rows.shape, epsilon=float(eps))
    return c.b.reshape(y, x.shape)


@aten("rms_norm.default")
def _rms_norm(c, x, normalized_shape, weight=None, eps=None):
    torch = _torch()
    rows = _norm_rows(c, x, normalized_shape)
    width = rows.shape[-1]
    gamma = c.b.reshape(weight, (width,)) if weight is not None else c.b.full(1.0, x.dtype, (width,))
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    y = c.b.op("rms_norm", [rows, gamma], x.dtype, rows.shape, epsilon=float(eps))
    return c.b.reshape(y, x.shape)


def _per_channel(c, v, rank):
    return c.b.reshape(v, (1, v.numel) + (1,) * (rank - 2))


@aten("batch_norm.default", "_native_batch_norm_legit_functional.default", "native_batch_norm.default",
      "_batch_norm_impl_index.default")
def _batch_norm(c, x, weight, bias, running_mean, running_var, training, momentum, eps, *rest):
    """Training: the batch's statistics normalize and the running ones move toward them (the
    unbiased variance, as torch); the running statistics' new values are writes (state updates)."""
    if x.rank < 2:
        raise Unsupported(f"batch_norm of a {x.rank}-D input (expected (N, C, ...))")
    rank, channels = x.rank, x.shape[1]
    axes = [0] + list(range(2, rank))
    use_batch = training or running_mean is None
    if use_batch:
        mean = c.b.reduce("mean", x, axes, False)
        centered = c.b.binary("sub", x, _per_channel(c, mean, rank))
        var = c.b.reduce("mean", c.b.unary("square", centered), axes, False)
    else:
        mean, var = running_mean, running_var
        centered = c.b.binary("sub", x, _per_channel(c, mean, rank))
    inv = c.b.unary("rsqrt", c.b.binary("add", var, c.b.scalar(float(eps), x.dtype)))
    scale = c.b.binary("mul", inv, weight) if weight is not None else inv
    y = c.b.binary("mul", centered, _per_channel(c, scale, rank))
    if bias is not None:
        y = c.b.binary("add", y, _per_channel(c, bias, rank))
    outputs = [y]
    if training and running_mean is not None:
        if momentum is None:
            raise Unsupported("batch_norm with momentum=None (a cumulative average)")
        count = x.numel // channels
        unbiased = c.b.binary("mul", var, c.b.scalar(count / (count - 1) if count > 1 else 1.0, x.dtype))
        keep, take = c.b.scalar(1.0 - momentum, x.dtype), c.b.scalar(float(momentum), x.dtype)
        new_mean = c.b.binary("add", c.b.binary("mul", running_mean, keep), c.b.binary("mul", mean, take))
        new_var = c.b.binary("add", c.b.binary("mul", running_var, keep), c.b.binary("mul", unbiased, take))
        if c.name == "aten._native_batch_norm_legit_functional.default":
            return [y, mean, inv, new_mean, new_var]
        c.assign(c.node.args[3], new_mean)
        c.assign(c.node.args[4], new_var)
    if c.name == "aten.batch_norm.default":
        return y
    return outputs + [mean, inv] + ([None] if c.name == "aten._batch_norm_impl_index.default" else [])


@aten("group_norm.default")
def _group_norm(c, x, groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    n = x.shape[0]
    grouped = c.b.reshape(x, (n, groups, x.numel // (n * groups)))
    mean = c.b.reduce("mean", grouped, [2], True)
    centered = c.b.binary("sub", grouped, mean)
    var = c.b.reduce("mean", c.b.unary("square", centered), [2], True)
    y = c.b.binary("mul", centered, c.b.unary("rsqrt", c.b.binary("add", var, c.b.scalar(float(eps), x.dtype))))
    y = c.b.reshape(y, x.shape)
    if weight is not None:
        y = c.b.binary("mul", y, _per_channel(c, weight, x.rank))
    if bias is not None:
        y = c.b.binary("add", y, _per_channel(c, bias, x.rank))
    return y


# ---- attention ----

@aten("scaled_dot_product_attention.default")
def _sdpa(c, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """kiln's attention (layout "bhtd": q (..., H, Tq, D), k and v (..., Hkv, Tk, D), grouped-query
    when Hkv divides H) where the mask is none, causal, or one row of keys per batch entry (a
    padding mask: kiln's key_bias); any other mask: the decomposed softmax(q k^T * scale + mask) v."""
    torch = _torch()
    if dropout_p:
        raise Unsupported(f"scaled_dot_product_attention with dropout_p={dropout_p} (kiln's attention has no dropout)")
    if q.rank < 3:
        raise Unsupported(f"scaled_dot_product_attention of q {q.shape} (expected (..., H, T, D))")
    causal, key_bias, general = bool(is_causal), None, None
    if attn_mask is not None:
        kind, value = _mask_kind(c, attn_mask, q, k)
        if kind == "causal" and not causal:
            causal = True
        elif kind == "keys":
            key_bias = value
        elif kind == "general":
            general = value
    scale_attr = float(scale) if scale is not None else None
    if general is not None:
        return _attention_decomposed(c, q, k, v, causal, scale, general if general is not None else key_bias)
    # q, k, v made (..., H, T, D) from (..., T, H, D) by a transpose (Hugging Face's and GPT-2's
    # head split): kiln's attention reads them where they are ("bthd", as src/models/gpt.cc), and
    # the transpose back after it cancels the one the module applies to the output.
    r = q.rank
    swap = list(range(r - 3)) + [r - 2, r - 3, r - 1]
    sources = [c.b.transposed_from(x, swap) for x in (q, k, v)]
    layout = None
    if all(x is not None for x in sources):
        q, k, v = sources
        layout = "bthd"
    inputs = [q, k, v] + ([key_bias] if key_bias is not None else [])
    lse = (torch.float32 if q.dtype != torch.float64 else q.dtype, q.shape[:-1])
    out, _ = c.b.emit("attention", inputs, {"causal": causal or None, "scale": scale_attr, "layout": layout},
                      [(q.dtype, q.shape[:-1] + (v.shape[-1],)), lse])
    return c.b.transpose(out, swap) if layout else out


def _mask_kind(c, mask, q, k):
    """("none" | "causal" | "keys" | "general", value): what an attention mask says. A bool mask
    is True where attention is allowed; a float mask is added to the scores."""
    torch = _torch()
    tq, tk = q.shape[-2], k.shape[-2]
    lead = q.shape[:-3]  # the batch dims (heads excluded)
    if mask.const is not None:
        m = mask.const
        full = m.expand(*(lead + (q.shape[-3], tq, tk))) if m.dim() <= q.rank else m
        if m.dtype == torch.bool:
            if bool(full.all()):
                return "none", None
            if tq == tk and bool((full == torch.ones(tq, tk, dtype=torch.bool).tril()).all()):
                return "causal", None
            bias = torch.zeros(full.shape, dtype=q.dtype).masked_fill(~full, -math.inf)
        else:
            bias = full.to(q.dtype)
            if not bool(bias.any()):
                return "none", None
        # One row of keys per batch entry, the same for every head and query: a key bias.
        rows = bias[..., :1, :1, :]
        if bool((bias == rows).all()):
            return "keys", c.b.const(rows.reshape(lead + (tk,)).contiguous())
        return "general", c.b.const(bias)
    source = c.b.broadcast_source(mask)
    if source is not None and source.rank == q.rank and source.shape[-3:] == (1, 1, tk) and \
            source.shape[:-3] == lead:
        bias = source
        if bias.dtype == torch.bool:
            bias = c.b.where(bias, c.b.scalar(0.0, q.dtype), c.b.scalar(-math.inf, q.dtype))
        return "keys", c.b.reshape(c.b.cast(bias, q.dtype), lead + (tk,))
    if mask.dtype == torch.bool:
        return "general", c.b.where(mask, c.b.scalar(0.0, q.dtype), c.b.scalar(-math.inf, q.dtype))
    return "general", c.b.cast(mask, q.dtype)


def _attention_decomposed(c, q, k, v, causal, scale, bias):
    """softmax(q k^T * scale + bias [+ causal]) v, for the masks kiln's attention does not take;
    k and v repeat their heads for grouped-query attention."""
    torch = _torch()
    hq, hk = q.shape[-3], k.shape[-3]
    if hk != hq:
        g = hq // hk

        def repeat(x):
            lead = x.shape[:-3]
            x = c.b.reshape(x, lead + (hk, 1) + x.shape[-2:])
            x = c.b.broadcast(x, lead + (hk, g) + x.shape[-2:])
            return c.b.reshape(x, lead + (hq,) + x.shape[-2:])
        k, v = repeat(k), repeat(v)
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = c.b.matmul(q, k, transpose_b=True)
    scores = c.b.binary("mul", scores, c.b.scalar(float(scale), q.dtype))
    if causal:
        allowed = torch.ones(tq, tk, dtype=torch.bool).tril()
        scores = c.b.binary("add", scores, c.b.const(torch.zeros(tq, tk, dtype=q.dtype).masked_fill(~allowed, -math.inf)))
    if bias is not None:
        if bias.rank == q.rank - 2 + 0 and bias.shape[-1] == tk and bias.rank == len(q.shape[:-3]) + 1:
            bias = c.b.reshape(bias, q.shape[:-3] + (1, 1, tk))
        scores = c.b.binary("add", scores, bias)
    weights = c.b.unary("softmax", scores, axis=scores.rank - 1)
    return c.b.matmul(weights, v)


# ---- losses ----

def _reduction(reduction):
    return {0: "none", 1: "mean", 2: "sum"}[int(reduction)]


def _class_last(c, logits, target):
    """(N, C, d...) logits and (N, d...) targets as (rows, C) and (rows,)."""
    if logits.rank > 2:
        perm = [0] + list(range(2, logits.rank)) + [1]
        logits = c.b.transpose(logits, perm)
    if logits.rank != 2:
        logits = c.b.reshape(logits, (logits.numel // logits.shape[-1], logits.shape[-1]))
    if target.rank != 1:
        target = c.b.reshape(target, (target.numel,))
    return logits, target


@aten("cross_entropy_loss.default")
def _cross_entropy(c, logits, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    torch = _torch()
    if weight is not None:
        raise Unsupported("cross_entropy with class weights")
    if label_smoothing:
        raise Unsupported(f"cross_entropy with label_smoothing={label_smoothing}")
    if target.dtype.is_floating_point:
        raise Unsupported("cross_entropy with class probabilities as targets (kiln takes class indices)")
    shape = logits.shape
    rows, labels = _class_last(c, logits, target)
    if labels.dtype != torch.int64:
        labels = c.b.cast(labels, torch.int64)
    red = _reduction(reduction)
    out_shape = () if red != "none" else (rows.shape[0],)
    loss = c.b.op("cross_entropy", [rows, labels], logits.dtype, out_shape, ignore_index=int(ignore_index),
                  reduction=red if red != "mean" else None)
    if red == "none" and len(shape) > 2:
        loss = c.b.reshape(loss, c.out[1])
    return loss


@aten("nll_loss.default", "nll_loss_forward.default", "nll_loss_nd.default", "nll_loss2d_forward.default")
def _nll_loss(c, logp, target, weight=None, reduction=1, ignore_index=-100):
    """-logp[target], ignored rows left out: the cross entropy of the logits where logp is their
    log_softmax (kiln's fused cross_entropy), else a one-hot product."""
    if weight is not None:
        raise Unsupported("nll_loss with class weights")
    red = _reduction(reduction)
    source = c.log_softmax_source(logp)
    if source is not None:
        loss = _cross_entropy(c, source, target, None, reduction, ignore_index)
    else:
        rows, labels = _class_last(c, logp, target)
        # The picked score per row, read by gather_elements, whose kernel refuses a label outside
        # [0, classes) as torch does; ignored rows read class 0 and are masked below.
        ignored = c.b.binary("eq", labels, c.b.scalar(int(ignore_index), labels.dtype))
        safe = c.b.reshape(c.b.where(ignored, c.b.scalar(0, labels.dtype), labels), labels.shape + (1,))
        picked = c.b.reshape(c.b.op("gather_elements", [rows, safe], rows.dtype, labels.shape + (1,), axis=1),
                             labels.shape)
        keep = c.b.cast(c.b.binary("ne", labels, c.b.scalar(int(ignore_index), labels.dtype)), rows.dtype)
        per_row = c.b.binary("mul", c.b.unary("neg", picked), keep)
        if red == "none":
            loss = per_row
        elif red == "sum":
            loss = c.b.reduce("sum", per_row, [0], False)
        else:
            loss = c.b.binary("div", c.b.reduce("sum", per_row, [0], False), c.b.reduce("sum", keep, [0], False))
    if c.name in ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default"):
        return [loss, c.b.scalar(0.0, logp.dtype)]
    return loss


@aten("mse_loss.default")
def _mse_loss(c, x, y, reduction=1):
    sq = c.b.unary("square", c.b.binary("sub", x, y))
    red = _reduction(reduction)
    return sq if red == "none" else c.b.reduce(red, sq, list(range(sq.rank)), False)


# ---- convolution and pooling ----

def _pair(v, n=2):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


@aten("conv2d.default", "conv1d.default", "convolution.default", "_convolution.default")
def _conv(c, x, weight, bias=None, stride=1, padding=0, dilation=1, *rest):
    if c.name.startswith("aten.convolution") or c.name.startswith("aten._convolution"):
        transposed, groups = rest[0], rest[2]
        if transposed:
            raise Unsupported("transposed convolution")
    else:
        groups = rest[0] if rest else 1
    if isinstance(padding, str):
        raise Unsupported(f"convolution padding '{padding}' (give the sizes)")
    one_d = x.rank == 3
    if one_d:
        x = c.b.reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2]))
        weight = c.b.reshape(weight, weight.shape[:2] + (1, weight.shape[2]))
        stride, padding, dilation = [1] + _pair(stride, 1), [0] + _pair(padding, 1), [1] + _pair(dilation, 1)
    if x.rank != 4:
        raise Unsupported(f"convolution of a {x.rank}-D input (kiln has 1-D and 2-D)")
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    if any(d != 1 for d in dilation):
        weight = _dilated(c, weight, dilation)
    n, _, h, w = x.shape
    o, _, kh, kw = weight.shape
    oh, ow = (h + 2 * padding[0] - kh) // stride[0] + 1, (w + 2 * padding[1] - kw) // stride[1] + 1
    attrs = {"stride": stride if stride != [1, 1] else None, "padding": padding if padding != [0, 0] else None}
    y = c.b.op("conv2d", [x, weight], x.dtype, (n, o, oh, ow), groups=groups if groups != 1 else None, **attrs)
    if bias is not None:
        y = c.b.binary("add", y, c.b.reshape(bias, (1, o, 1, 1)))
    return c.b.reshape(y, c.out[1]) if one_d else y


def _dilated(c, weight, dilation):
    """The kernel with dilation - 1 zeros between its taps (a dilated convolution is the plain
    one over it; the gradient reaches the taps through the reshapes and slices)."""
    for axis, d in ((2, dilation[0]), (3, dilation[1])):
        k = weight.shape[axis]
        if d == 1 or k == 1:
            continue
        shape = weight.shape
        spread = c.b.reshape(weight, shape[:axis + 1] + (1,) + shape[axis + 1:])
        zeros = c.b.full(0.0, weight.dtype, shape[:axis + 1] + (d - 1,) + shape[axis + 1:])
        spread = c.b.concat([spread, zeros], axis + 1)
        spread = c.b.reshape(spread, shape[:axis] + (k * d,) + shape[axis + 1:])
        weight = c.b.slice(spread, axis, 0, (k - 1) * d + 1)
    return weight


def _pool_args(kernel, stride, padding):
    kernel = _pair(kernel)
    stride = _pair(stride) if stride else kernel
    return kernel, stride, _pair(padding)


@aten("max_pool2d.default", "max_pool2d_with_indices.default")
def _max_pool(c, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    if any(d != 1 for d in _pair(dilation)) or ceil_mode:
        raise Unsupported("max_pool2d with dilation or ceil_mode")
    kernel, stride, padding = _pool_args(kernel, stride, padding)
    y = c.b.op("max_pool2d", [x], x.dtype, c.out[1], kernel=kernel, stride=stride if stride != kernel else None,
               padding=padding if padding != [0, 0] else None)
    if c.name == "aten.max_pool2d_with_indices.default":
        return [y, None]
    return y


@aten("avg_pool2d.default")
def _avg_pool(c, x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    kernel, stride, padding = _pool_args(kernel, stride, padding)
    if ceil_mode or divisor_override is not None or (not count_include_pad and padding != [0, 0]):
        raise Unsupported("avg_pool2d with ceil_mode, divisor_override or count_include_pad=False over padding")
    return c.b.op("avg_pool2d", [x], x.dtype, c.out[1], kernel=kernel, stride=stride if stride != kernel else None,
                  padding=padding if padding != [0, 0] else None)


@aten("adaptive_avg_pool2d.default", "_adaptive_avg_pool2d.default")
def _adaptive_avg_pool(c, x, output_size):
    oh, ow = _pair(output_size)
    h, w = x.shape[-2:]
    if (oh, ow) == (1, 1):
        return c.b.reduce("mean", x, [x.rank - 2, x.rank - 1], True)
    if h % oh or w % ow:
        raise Unsupported(f"adaptive_avg_pool2d from {h}x{w} to {oh}x{ow} (kiln needs the size to divide)")
    kernel = [h // oh, w // ow]
    return c.b.op("avg_pool2d", [x], x.dtype, c.out[1], kernel=kernel)


# ---- randomness ----

@aten("dropout.default", "native_dropout.default", "feature_dropout.default")
def _dropout(c, x, p, train=True):
    if c.name == "aten.feature_dropout.default" and p and train:
        raise Unsupported("feature (channel) dropout")
    if not p or train is False:
        y = x
    else:
        c.b.seed += 1
        y = c.b.unary("dropout", x, p=float(p), seed=c.b.seed)
    if c.name == "aten.native_dropout.default":
        return [y, None]
    return y


# ---- sources (folded by torch when every input is a constant; listed for reference) ----
SOURCES = {"aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.zeros.default",
           "aten.ones.default", "aten.full.default", "aten.empty.memory_format", "aten.scalar_tensor.default",
           "aten.zeros_like.default", "aten.ones_like.default", "aten.full_like.default", "aten.empty_like.default",
           "aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default", "aten.new_empty.default",
           "aten.tril.default", "aten.triu.default"}
# Sources whose tensor inputs give only a shape and dtype, never values.
SHAPE_ONLY = {"aten.zeros_like.default", "aten.ones_like.default", "aten.full_like.default", "aten.empty_like.default",
              "aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default", "aten.new_empty.default"}
# Ops that draw random numbers: never folded.
RANDOM = {"aten.dropout.default", "aten.native_dropout.default", "aten.feature_dropout.default", "aten.rand.default",
          "aten.randn.default", "aten.rand_like.default", "aten.randn_like.default", "aten.randint.low",
          "aten.bernoulli.p", "aten.bernoulli.default"}

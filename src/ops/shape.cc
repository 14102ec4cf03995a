// Shape ops: move, copy or index data without arithmetic (scatter_add's sum aside). Any dtype.
//   reshape {shape}: same elements, another shape; at most one -1 (inferred).
//   transpose {perm = [] (reverse the axes)}: output dim i is input dim perm[i].
//   broadcast_to {shape}: numpy broadcasting to exactly `shape` (rank may grow).
//   slice {starts, ends, steps = [] (all 1)}: one entry per dim; negative start/end count from
//     the end; output dim = ceil((end - start) / step).
//   concat {axis = 0}: 1+ inputs joined along axis.
//   split {axis = 0, sizes}: one output per entry of sizes, which sum to the dim.
//   gather(table, indices) {axis = 0, padding_index (optional)}: table.shape[:axis] +
//     indices.shape + table.shape[axis+1:]; rows read at padding_index get no gradient (torch's
//     embedding padding_idx: the padding row is read, never trained by what reads it).
//   scatter_add(base, indices, updates) {axis = 0}: base with updates summed into the rows that
//     indices name (gather's transpose: the embedding gradient).
//   one_hot(indices) {depth, dtype = f32}: indices.shape + [depth].
// Reference kernels copy element by element, exactly for every dtype (Tensor::copy_element, the
// integer accessors for indices); they are the test oracle.
// Gradient rules are each op's adjoint: reshape/transpose undo themselves, broadcast_to sums,
// slice scatters into zeros, concat and split swap, gather and scatter_add swap. one_hot has an
// integer input and no gradient.
#include <algorithm>
#include <cstring>

#include "ir/builder.h"
#include "ops/checked_index.h"
#include "ops/common.h"
#include "ops/gradient.h"
#include "ops/slice.h"

namespace kiln::ops {
namespace {

using Ints = std::vector<int64_t>;

std::string ints_text(const Ints& values) { return fmt::format("[{}]", fmt::join(values, ", ")); }

// Row-major multi-index of flat `index` in `shape`.
Ints unravel(int64_t index, const Shape& shape) {
  Ints out(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    out[d] = shape[d] == 0 ? 0 : index % shape[d];
    index = shape[d] == 0 ? 0 : index / shape[d];
  }
  return out;
}

// A shape seen as (outer, dim, inner) around one axis: element (o, a, i) is at
// (o * dim + a) * inner + i.
struct AxisView {
  int64_t outer = 1;
  int64_t dim = 1;
  int64_t inner = 1;
};

AxisView view_around(const Shape& shape, int axis) {
  AxisView v;
  for (int d = 0; d < axis; ++d) v.outer *= shape[d];
  v.dim = shape[axis];
  for (size_t d = axis + 1; d < shape.size(); ++d) v.inner *= shape[d];
  return v;
}

// Axis of a concat/split/gather/scatter_add on a tensor of `shape`; those ops need rank >= 1.
int axis_of(const Attributes& attrs, const Shape& shape, const char* what) {
  KILN_CHECK(!shape.empty(), "{} has shape (), expected rank >= 1", what);
  return normalize_axis(attrs.i("axis"), static_cast<int>(shape.size()));
}

void check_index_dtype(const TensorType& indices) {
  KILN_CHECK(indices.dtype == DType::kI32 || indices.dtype == DType::kI64,
             "indices are {}, expected i32 or i64", dtype_name(indices.dtype));
}

// Shape `table` would have after replacing its dim `axis` by the dims of `indices`.
Shape gathered_shape(const Shape& table, int axis, const Shape& indices) {
  Shape out(table.begin(), table.begin() + axis);
  out.insert(out.end(), indices.begin(), indices.end());
  out.insert(out.end(), table.begin() + axis + 1, table.end());
  return out;
}

// ---- reshape ----

Shape reshape_target(const Shape& in, const Ints& requested) {
  int inferred = -1;
  int64_t known = 1;
  for (size_t i = 0; i < requested.size(); ++i) {
    int64_t d = requested[i];
    if (d == -1) {
      KILN_CHECK(inferred < 0, "cannot reshape {} to {}: more than one -1", to_string(in),
                 to_string(requested));
      inferred = static_cast<int>(i);
    } else {
      KILN_CHECK(d >= 0, "cannot reshape {} to {}: dimension {} is negative (only -1 is allowed)",
                 to_string(in), to_string(requested), d);
      known *= d;
    }
  }
  Shape out = requested;
  const int64_t n = numel(in);
  if (inferred >= 0) {
    KILN_CHECK(known > 0 && n % known == 0,
               "cannot reshape {} ({} elements) to {}: no size for -1 makes the counts match",
               to_string(in), n, to_string(requested));
    out[inferred] = n / known;
  }
  KILN_CHECK(numel(out) == n, "cannot reshape {} ({} elements) to {} ({} elements)",
             to_string(in), n, to_string(requested), numel(out));
  return out;
}

// ---- transpose ----

Ints transpose_perm(const Attributes& attrs, int rank) {
  Ints perm = attrs.ints("perm");
  if (perm.empty() && rank > 0) {
    for (int d = rank - 1; d >= 0; --d) perm.push_back(d);
    return perm;
  }
  KILN_CHECK(static_cast<int>(perm.size()) == rank,
             "perm {} has {} entries, expected {} (the input's rank)", ints_text(perm),
             perm.size(), rank);
  std::vector<bool> seen(rank, false);
  for (int64_t& p : perm) {
    KILN_CHECK(p >= -rank && p < rank, "perm {} is not a permutation of 0..{}: {} is out of range",
               ints_text(attrs.ints("perm")), rank - 1, p);
    p = normalize_axis(p, rank);
    KILN_CHECK(!seen[p], "perm {} is not a permutation of 0..{}: axis {} appears twice",
               ints_text(attrs.ints("perm")), rank - 1, p);
    seen[p] = true;
  }
  return perm;
}

// ---- slice ----


// ---- gradient rules ----

std::vector<Expr> reshape_gradient(const GradContext& c) {
  return {reshape(c.dy(), c.x().shape())};
}

std::vector<Expr> transpose_gradient(const GradContext& c) {
  // Output axis d is input axis perm[d], so input axis perm[d] comes back from output axis d.
  Ints perm = transpose_perm(c.attrs(), c.x().rank());
  Ints inverse(perm.size());
  for (size_t d = 0; d < perm.size(); ++d) inverse[perm[d]] = static_cast<int64_t>(d);
  return {transpose(c.dy(), inverse)};
}

std::vector<Expr> broadcast_to_gradient(const GradContext& c) {
  return {reduce_to_shape(c.dy(), c.x().shape())};
}

std::vector<Expr> slice_gradient(const GradContext& c) {
  // dy goes back to the positions it was read from; the rest of x gets 0. One axis at a time:
  // a step-1 axis is padded with zeros (concat), a strided one scattered (scatter_add).
  const Expr& x = c.x();
  Builder& b = c.builder;
  const SliceBounds bounds = slice_bounds(x.shape(), c.attrs());
  if (numel(bounds.out) == 0) return {b.full(x.shape(), 0.0, x.dtype())};
  Expr g = c.dy();
  for (int d = 0; d < x.rank(); ++d) {
    const int64_t dim = x.shape()[d], count = bounds.out[d];
    const int64_t start = bounds.starts[d], step = bounds.steps[d];
    if (count == dim) continue;  // the whole axis was read (so start 0, step 1)
    auto zeros = [&](int64_t size) {
      Shape shape = g.shape();
      shape[d] = size;
      return b.full(shape, 0.0, g.dtype());
    };
    if (step == 1 || count == 1) {
      std::vector<Expr> pieces;
      if (start > 0) pieces.push_back(zeros(start));
      pieces.push_back(g);
      if (dim - start - count > 0) pieces.push_back(zeros(dim - start - count));
      g = concat(pieces, d);
    } else {
      std::vector<int64_t> positions;
      for (int64_t i = 0; i < count; ++i) positions.push_back(start + i * step);
      g = scatter_add(zeros(dim), b.constant_ints({count}, positions), g, d);
    }
  }
  return {g};
}

std::vector<Expr> concat_gradient(const GradContext& c) {
  const int axis = normalize_axis(c.attrs().i("axis"), c.x().rank());
  Ints sizes;
  for (const Expr& x : c.inputs) sizes.push_back(x.shape()[axis]);
  return split(c.dy(), sizes, axis);
}

std::vector<Expr> split_gradient(const GradContext& c) {
  // Outputs that got no gradient arrive as zeros, so every piece is there.
  return {concat(c.output_grads, c.attrs().i("axis"))};
}

std::vector<Expr> gather_gradient(const GradContext& c) {
  // Each gathered row's gradient is summed into the row it came from (repeats add up).
  const Expr &table = c.x(0), &indices = c.x(1);
  const int axis = normalize_axis(c.attrs().i("axis"), table.rank());
  Expr dy = c.dy();
  if (c.attrs().has("padding_index")) {
    // dy's rows read at padding_index are dropped: indices (as dy's rank, 1 elsewhere) != it.
    const Shape index_shape = indices.shape();
    Shape mask_shape(static_cast<size_t>(axis), 1);
    mask_shape.insert(mask_shape.end(), index_shape.begin(), index_shape.end());
    mask_shape.resize(static_cast<size_t>(dy.rank()), 1);
    Expr padding = c.builder.full({}, static_cast<double>(c.attrs().i("padding_index")), indices.dtype());
    Expr keep = reshape(ne(indices, padding), mask_shape);
    dy = where(keep, dy, c.builder.full({}, 0.0, dy.dtype()));
  }
  Expr zeros = c.builder.full(table.shape(), 0.0, table.dtype());
  return {scatter_add(zeros, indices, dy, axis), Expr()};
}

std::vector<Expr> scatter_add_gradient(const GradContext& c) {
  // y = base + (updates summed into rows): base passes dy through; each update reads its row.
  return {c.dy(), Expr(), gather(c.dy(), c.x(1), c.attrs().i("axis"))};
}

}  // namespace

// Reads index `p` of `indices` and checks it against [0, dim); kernel-time data error otherwise.
int64_t checked_index(const char* op, const Tensor& indices, int64_t p, int64_t dim, int axis) {
  const int64_t index = indices.get_int(p);
  if (index < 0 || index >= dim)
    fail("{}: index {} (at position {} of indices) is out of range for axis {} of dim {} "
         "(expected 0..{})",
         op, index, p, axis, dim, dim - 1);
  return index;
}

SliceBounds slice_bounds(const Shape& in, const Attributes& attrs) {
  const int rank = static_cast<int>(in.size());
  SliceBounds b{attrs.ints("starts"), attrs.ints("ends"), attrs.ints("steps"), {}};
  if (b.steps.empty()) b.steps.assign(rank, 1);
  for (const auto& [name, list] : {std::pair<const char*, const Ints*>{"starts", &b.starts},
                                   {"ends", &b.ends}, {"steps", &b.steps}}) {
    KILN_CHECK(static_cast<int>(list->size()) == rank,
               "{} {} has {} entries, expected one per dimension of {} ({})", name,
               ints_text(*list), list->size(), to_string(in), rank);
  }
  for (int d = 0; d < rank; ++d) {
    const int64_t dim = in[d];
    const int64_t given_start = b.starts[d], given_end = b.ends[d];
    int64_t& start = b.starts[d];
    int64_t& end = b.ends[d];
    if (start < 0) start += dim;
    if (end < 0) end += dim;
    KILN_CHECK(start >= 0 && start <= dim, "axis {}: start {} is out of range for dim {}", d,
               given_start, dim);
    KILN_CHECK(end >= 0 && end <= dim, "axis {}: end {} is out of range for dim {}", d, given_end,
               dim);
    KILN_CHECK(start <= end, "axis {}: start {} is after end {} (dim {})", d, given_start,
               given_end, dim);
    KILN_CHECK(b.steps[d] >= 1, "axis {}: step {} must be >= 1", d, b.steps[d]);
    // ceil((end - start) / step) without overflowing for steps near INT64_MAX.
    b.out.push_back(end == start ? 0 : (end - start - 1) / b.steps[d] + 1);
  }
  return b;
}

void define_shape_ops(OpRegistry& registry) {
  registry.define(Op::kReshape, OpDef{
      {required("shape", AttrKind::kInts)},
      [](std::span<const TensorType> in, const Attributes& a) {
        return std::vector<TensorType>{{in[0].dtype, reshape_target(in[0].shape, a.ints("shape"))}};
      },
      [](const KernelArgs& k) {
        // Row-major order is the same before and after: a flat copy.
        std::memcpy(k.outputs[0].raw(), k.inputs[0].raw(), k.outputs[0].bytes());
      },
      reshape_gradient});

  registry.define(Op::kTranspose, OpDef{
      {with_default("perm", Ints{})},
      [](std::span<const TensorType> in, const Attributes& a) {
        Ints perm = transpose_perm(a, in[0].rank());
        Shape out;
        for (int64_t p : perm) out.push_back(in[0].shape[p]);
        return std::vector<TensorType>{{in[0].dtype, out}};
      },
      [](const KernelArgs& k) {
        const Tensor& x = k.inputs[0];
        Tensor& y = k.outputs[0];
        Ints perm = transpose_perm(k.attrs, x.rank());
        Ints x_strides = strides_of(x.shape());
        for (int64_t i = 0; i < y.numel(); ++i) {
          Ints index = unravel(i, y.shape());  // output axis d is input axis perm[d]
          int64_t offset = 0;
          for (size_t d = 0; d < perm.size(); ++d) offset += index[d] * x_strides[perm[d]];
          y.copy_element(i, x, offset);
        }
      },
      transpose_gradient});

  registry.define(Op::kBroadcastTo, OpDef{
      {required("shape", AttrKind::kInts)},
      [](std::span<const TensorType> in, const Attributes& a) {
        Shape target = shape_attr(a);
        const Shape& from = in[0].shape;
        bool ok = from.size() <= target.size();
        for (size_t i = 0; ok && i < from.size(); ++i) {
          int64_t f = from[from.size() - 1 - i], t = target[target.size() - 1 - i];
          ok = f == t || f == 1;
        }
        KILN_CHECK(ok, "cannot broadcast {} to {}", to_string(from), to_string(target));
        return std::vector<TensorType>{{in[0].dtype, target}};
      },
      [](const KernelArgs& k) {
        for_each_broadcast(k.outputs[0].shape(), {k.inputs[0].shape()},
                           [&](int64_t i, std::span<const int64_t> offsets) {
                             k.outputs[0].copy_element(i, k.inputs[0], offsets[0]);
                           });
      },
      broadcast_to_gradient});

  registry.define(Op::kSlice, OpDef{
      {required("starts", AttrKind::kInts), required("ends", AttrKind::kInts),
       with_default("steps", Ints{})},
      [](std::span<const TensorType> in, const Attributes& a) {
        return std::vector<TensorType>{{in[0].dtype, slice_bounds(in[0].shape, a).out}};
      },
      [](const KernelArgs& k) {
        const Tensor& x = k.inputs[0];
        Tensor& y = k.outputs[0];
        SliceBounds b = slice_bounds(x.shape(), k.attrs);
        Ints x_strides = strides_of(x.shape());
        for (int64_t i = 0; i < y.numel(); ++i) {
          Ints index = unravel(i, y.shape());
          int64_t offset = 0;
          for (size_t d = 0; d < index.size(); ++d)
            offset += (b.starts[d] + index[d] * b.steps[d]) * x_strides[d];
          y.copy_element(i, x, offset);
        }
      },
      slice_gradient});

  registry.define(Op::kConcat, OpDef{
      {with_default("axis", int64_t{0})},
      [](std::span<const TensorType> in, const Attributes& a) {
        int axis = axis_of(a, in[0].shape, "input 0");
        Shape out = in[0].shape;
        for (size_t j = 1; j < in.size(); ++j) {
          KILN_CHECK(in[j].dtype == in[0].dtype, "input {} is {}, expected {} like input 0", j,
                     dtype_name(in[j].dtype), dtype_name(in[0].dtype));
          KILN_CHECK(in[j].rank() == in[0].rank(),
                     "input {} has shape {}, expected rank {} like input 0 {}", j,
                     to_string(in[j].shape), in[0].rank(), to_string(in[0].shape));
          for (int d = 0; d < in[0].rank(); ++d) {
            if (d == axis) continue;
            KILN_CHECK(in[j].shape[d] == in[0].shape[d],
                       "input {} has shape {}, expected dim {} to be {} like input 0 {} "
                       "(only axis {} may differ)",
                       j, to_string(in[j].shape), d, in[0].shape[d], to_string(in[0].shape), axis);
          }
          out[axis] += in[j].shape[axis];
        }
        return std::vector<TensorType>{{in[0].dtype, out}};
      },
      [](const KernelArgs& k) {
        Tensor& y = k.outputs[0];
        int axis = normalize_axis(k.attrs.i("axis"), y.rank());
        AxisView out = view_around(y.shape(), axis);
        int64_t axis_offset = 0;  // where this input starts along axis
        for (const Tensor& x : k.inputs) {
          AxisView v = view_around(x.shape(), axis);
          for (int64_t o = 0; o < v.outer; ++o)
            for (int64_t a = 0; a < v.dim; ++a)
              for (int64_t i = 0; i < v.inner; ++i)
                y.copy_element((o * out.dim + axis_offset + a) * out.inner + i, x,
                               (o * v.dim + a) * v.inner + i);
          axis_offset += v.dim;
        }
      },
      concat_gradient});

  registry.define(Op::kSplit, OpDef{
      {with_default("axis", int64_t{0}), required("sizes", AttrKind::kInts)},
      [](std::span<const TensorType> in, const Attributes& a) {
        int axis = axis_of(a, in[0].shape, "input");
        const Ints& sizes = a.ints("sizes");
        KILN_CHECK(!sizes.empty(), "sizes is [], expected at least one entry (one per output)");
        int64_t total = 0;
        for (int64_t s : sizes)
          KILN_CHECK(s >= 0, "sizes {} has a negative entry {}", ints_text(sizes), s);
        for (int64_t s : sizes) {
          KILN_CHECK(s <= in[0].shape[axis] - total, "sizes {} sum to more than {} (dim {} of input {})",
                     ints_text(sizes), in[0].shape[axis], axis, to_string(in[0].shape));
          total += s;
        }
        KILN_CHECK(total == in[0].shape[axis],
                   "sizes {} sum to {}, expected {} (dim {} of input {})", ints_text(sizes), total,
                   in[0].shape[axis], axis, to_string(in[0].shape));
        std::vector<TensorType> outs;
        for (int64_t s : sizes) {
          Shape shape = in[0].shape;
          shape[axis] = s;
          outs.push_back({in[0].dtype, shape});
        }
        return outs;
      },
      [](const KernelArgs& k) {
        const Tensor& x = k.inputs[0];
        int axis = normalize_axis(k.attrs.i("axis"), x.rank());
        AxisView in = view_around(x.shape(), axis);
        int64_t axis_offset = 0;  // where this output starts along axis
        for (Tensor& y : k.outputs) {
          AxisView v = view_around(y.shape(), axis);
          for (int64_t o = 0; o < v.outer; ++o)
            for (int64_t a = 0; a < v.dim; ++a)
              for (int64_t i = 0; i < v.inner; ++i)
                y.copy_element((o * v.dim + a) * v.inner + i, x,
                               (o * in.dim + axis_offset + a) * in.inner + i);
          axis_offset += v.dim;
        }
      },
      split_gradient});

  registry.define(Op::kGather, OpDef{
      {with_default("axis", int64_t{0}), optional("padding_index", AttrKind::kInt)},
      [](std::span<const TensorType> in, const Attributes& a) {
        const TensorType &table = in[0], &indices = in[1];
        int axis = axis_of(a, table.shape, "table");
        check_index_dtype(indices);
        return std::vector<TensorType>{
            {table.dtype, gathered_shape(table.shape, axis, indices.shape)}};
      },
      [](const KernelArgs& k) {
        const Tensor &table = k.inputs[0], &indices = k.inputs[1];
        Tensor& y = k.outputs[0];
        int axis = normalize_axis(k.attrs.i("axis"), table.rank());
        AxisView t = view_around(table.shape(), axis);
        const int64_t n = indices.numel();
        for (int64_t p = 0; p < n; ++p) {
          int64_t row = checked_index("gather", indices, p, t.dim, axis);
          for (int64_t o = 0; o < t.outer; ++o)
            for (int64_t i = 0; i < t.inner; ++i)
              y.copy_element((o * n + p) * t.inner + i, table, (o * t.dim + row) * t.inner + i);
        }
      },
      gather_gradient});

  registry.define(Op::kScatterAdd, OpDef{
      {with_default("axis", int64_t{0})},
      [](std::span<const TensorType> in, const Attributes& a) {
        const TensorType &base = in[0], &indices = in[1], &updates = in[2];
        int axis = axis_of(a, base.shape, "base");
        check_index_dtype(indices);
        KILN_CHECK(updates.dtype == base.dtype, "updates are {}, expected {} like base",
                   dtype_name(updates.dtype), dtype_name(base.dtype));
        Shape expected = gathered_shape(base.shape, axis, indices.shape);
        KILN_CHECK(updates.shape == expected,
                   "updates have shape {}, expected {} (base {} with axis {} replaced by "
                   "indices {})",
                   to_string(updates.shape), to_string(expected), to_string(base.shape), axis,
                   to_string(indices.shape));
        return std::vector<TensorType>{base};
      },
      [](const KernelArgs& k) {
        const Tensor &base = k.inputs[0], &indices = k.inputs[1], &updates = k.inputs[2];
        Tensor& y = k.outputs[0];
        int axis = normalize_axis(k.attrs.i("axis"), base.rank());
        AxisView b = view_around(base.shape(), axis);
        std::memcpy(y.raw(), base.raw(), y.bytes());
        const bool integers = !is_float(y.dtype());
        const int64_t n = indices.numel();
        for (int64_t p = 0; p < n; ++p) {
          int64_t row = checked_index("scatter_add", indices, p, b.dim, axis);
          for (int64_t o = 0; o < b.outer; ++o)
            for (int64_t i = 0; i < b.inner; ++i) {
              int64_t dst = (o * b.dim + row) * b.inner + i;
              const int64_t from = (o * n + p) * b.inner + i;
              if (integers)  // exact, wrapping like the elementwise add
                y.set_int(dst, static_cast<int64_t>(static_cast<uint64_t>(y.get_int(dst)) +
                                                    static_cast<uint64_t>(updates.get_int(from))));
              else
                y.set(dst, y.get(dst) + updates.get(from));
            }
        }
      },
      scatter_add_gradient});

  registry.define(Op::kOneHot, OpDef{
      {required("depth", AttrKind::kInt), with_default("dtype", DType::kF32)},
      [](std::span<const TensorType> in, const Attributes& a) {
        KILN_CHECK(is_integer(in[0].dtype), "indices are {}, expected an integer dtype (i32, i64, u8)",
                   dtype_name(in[0].dtype));
        int64_t depth = a.i("depth");
        KILN_CHECK(depth > 0, "depth is {}, expected > 0", depth);
        Shape out = in[0].shape;
        out.push_back(depth);
        return std::vector<TensorType>{{a.dtype("dtype"), out}};
      },
      [](const KernelArgs& k) {
        // An index outside [0, depth) gives an all-zero row rather than an error, so that
        // masked positions (e.g. cross_entropy's ignore_index, -100) simply contribute nothing.
        const Tensor& indices = k.inputs[0];
        Tensor& y = k.outputs[0];
        const int64_t depth = k.attrs.i("depth");
        for (int64_t p = 0; p < indices.numel(); ++p) {
          const int64_t index = indices.get_int(p);
          for (int64_t c = 0; c < depth; ++c) y.set(p * depth + c, c == index ? 1.0 : 0.0);
        }
      },
      nullptr, /*differentiable=*/false});  // integer input: nothing to differentiate
}

}  // namespace kiln::ops

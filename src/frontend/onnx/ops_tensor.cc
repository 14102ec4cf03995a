// ONNX rules for data movement, constants and shapes, indexing and reductions. Shapes are static
// in kiln, so Shape, Size, ConstantOfShape, Range and the like give known values (folded at
// import), and the ops that take a shape as an input (Reshape, Expand, Tile, Slice, Pad, ...)
// need it known.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {
namespace {

using Ints = std::vector<int64_t>;

// Range's output is built at import: at most this many elements.
constexpr int64_t kMaxRangeElements = int64_t{1} << 28;

int64_t axis_in(NodeContext& c, int64_t axis, int rank) {
  if (axis < -rank || axis >= std::max(rank, 1)) c.fail("axis {} is out of range for rank {}", axis, rank);
  return axis < 0 ? axis + rank : axis;
}

Expr const_i64(Builder& b, const Ints& values) {
  return b.constant_ints({static_cast<int64_t>(values.size())}, values, DType::kI64);
}

// Gathers positions `index` (constant) of x along `axis`.
Expr take(Builder& b, const Expr& x, const Ints& index, int64_t axis) {
  return gather(x, const_i64(b, index), axis);
}

// The axes of a Squeeze/Unsqueeze/Reduce*: an input from `input_opset` on, an attribute before.
std::optional<Ints> axes_of(NodeContext& c, int64_t input_opset, int input = 1) {
  if (c.opset() >= input_opset) {
    if (!c.has_input(input)) return std::nullopt;
    return c.ints(input, "axes");
  }
  if (!c.has_attr("axes")) return std::nullopt;
  return c.attr_ints("axes");
}

// Indices normalized to [0, dim): negative ones count from the end.
Expr wrap_indices(const Expr& indices, int64_t dim) {
  Expr zero = scalar_like(indices, 0.0);
  return where(lt(indices, zero), indices + scalar_like(indices, static_cast<double>(dim)), indices);
}

// The row-major position within `dims` that each last-axis vector of `indices` (..., K), K =
// dims' rank, names: i64 of shape indices.shape[:-1]. Negative entries count from the end; an
// entry out of range makes its position hugely negative, so that the gather or scatter reading
// it stops with an index error instead of reaching another element.
Expr linear_index(const Expr& indices, const Shape& dims) {
  Builder& b = indices.builder();
  const int last = indices.rank() - 1;
  Shape lead = indices.shape();
  lead.pop_back();
  const Expr index = cast_to(indices, DType::kI64);
  const Expr out_of_range = b.scalar(-4611686018427387904.0, DType::kI64);  // -2^62
  Expr flat = b.full(lead, 0.0, DType::kI64);
  int64_t stride = 1;
  for (int j = static_cast<int>(dims.size()) - 1; j >= 0; --j) {
    Expr component = wrap_indices(reshape(slice_axis(index, last, j, j + 1), lead), dims[j]);
    Expr bad = where(lt(component, scalar_like(component, 0.0)), b.scalar(1.0, DType::kBool),
                     ge(component, scalar_like(component, static_cast<double>(dims[j]))));
    flat = where(bad, out_of_range, flat + component * static_cast<double>(stride));
    stride *= dims[j];
  }
  return flat;
}

const std::vector<std::string> kScatterReductions = {"none", "add", "mul", "max", "min"};

std::string scatter_reduction(NodeContext& c) {
  const std::string reduction = c.attr_string("reduction", "none");
  if (std::find(kScatterReductions.begin(), kScatterReductions.end(), reduction) == kScatterReductions.end())
    c.unsupported("reduction \"{}\" (kiln has none, add, mul, max, min)", reduction);
  return reduction;
}

Expr scatter_elements_op(const Expr& data, const Expr& indices, const Expr& updates, int64_t axis,
                         const std::string& reduction) {
  return data.builder().apply1(Op::kScatterElements, {data, indices, updates},
                               {{"axis", axis}, {"reduction", reduction}});
}

Rule reduce(std::string kind, int64_t axes_input_opset) {
  return [kind, axes_input_opset](NodeContext& c) {
    Expr x = c.in(0);
    const bool keepdims = c.attr_int("keepdims", 1) != 0;
    const bool noop = c.attr_int("noop_with_empty_axes", 0) != 0;
    Ints axes = axes_of(c, axes_input_opset).value_or(Ints{});
    if (axes.empty() && noop) return std::vector<Expr>{x};
    for (int64_t& a : axes) a = axis_in(c, a, x.rank());
    std::sort(axes.begin(), axes.end());
    axes.erase(std::unique(axes.begin(), axes.end()), axes.end());
    const bool all_axes = axes.empty();
    int64_t count = 1;
    for (int d = 0; d < x.rank(); ++d)
      if (all_axes || std::find(axes.begin(), axes.end(), d) != axes.end()) count *= x.dim(d);
    if (count == 0 && kind != "sum" && kind != "sum_square" && kind != "l1" && kind != "l2" && kind != "prod")
      c.unsupported("a {} over an empty set", kind);
    auto float_x = [&] {
      if (!is_float(x.dtype())) c.unsupported("Reduce{} of {} (kiln computes it on floats)", kind, dtype_name(x.dtype()));
      return x;
    };
    Expr y;
    if (kind == "sum") y = sum(x, axes, keepdims);
    else if (kind == "mean") y = mean(float_x(), axes, keepdims);
    else if (kind == "max") y = max(x, axes, keepdims);
    else if (kind == "prod") y = c.b().apply1(Op::kProd, {x}, {{"axes", axes}, {"keepdims", keepdims}});
    else if (kind == "min") {
      if (is_float(x.dtype())) y = -max(-x, axes, keepdims);
      else y = cast(-max(-cast(x, DType::kI64), axes, keepdims), x.dtype());
    } else if (kind == "l1") y = sum(abs(x), axes, keepdims);
    else if (kind == "l2") y = sqrt(sum(square(float_x()), axes, keepdims));
    else if (kind == "sum_square") y = sum(square(x), axes, keepdims);
    else if (kind == "log_sum") y = log(sum(float_x(), axes, keepdims));
    else if (kind == "log_sum_exp") {
      Expr xf = float_x();
      Expr m = max(xf, axes, true);
      // Rows of -inf: their max is -inf, x - m would be NaN; such rows give -inf either way.
      Expr safe = where(ne(m, m * 0.0), scalar_like(m, 0.0), m);
      Expr s = log(sum(exp(xf - safe), axes, true)) + safe;
      y = keepdims ? s : reshape(s, sum(xf, axes, false).shape());
    } else {
      c.unsupported("Reduce{}", kind);
    }
    return std::vector<Expr>{y};
  };
}

Rule arg_extreme(bool is_max) {
  return [is_max](NodeContext& c) {
    Expr x = c.in(0);
    const int64_t axis = axis_in(c, c.attr_int("axis", 0), x.rank());
    const bool keepdims = c.attr_int("keepdims", 1) != 0;
    const bool last = c.attr_int("select_last_index", 0) != 0;
    if (!is_max) x = is_float(x.dtype()) ? -x : -cast(x, DType::kI64);
    const int64_t dim = x.dim(axis);
    if (last) {
      Ints reversed(dim);
      for (int64_t i = 0; i < dim; ++i) reversed[i] = dim - 1 - i;
      x = take(c.b(), x, reversed, axis);
    }
    Expr i = argmax(x, axis, keepdims);
    if (last) i = scalar_like(i, static_cast<double>(dim - 1)) - i;
    return std::vector<Expr>{i};
  };
}

// Reshape's target: 0 copies the input's dim (unless allowzero), one -1 is inferred.
Shape reshape_target(NodeContext& c, const Shape& in, Ints shape, bool allow_zero) {
  int64_t known = 1;
  int infer = -1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0 && !allow_zero) {
      if (d >= in.size()) c.fail("shape {} copies dim {} of an input of rank {}", to_string(shape), d, in.size());
      shape[d] = in[d];
    }
    if (shape[d] == -1) {
      if (infer >= 0) c.fail("shape {} has two -1", to_string(shape));
      infer = static_cast<int>(d);
    } else {
      known *= shape[d];
    }
  }
  if (infer >= 0) {
    const int64_t total = numel(in);
    if (known == 0 || total % known != 0)
      c.fail("cannot reshape {} to {}", to_string(in), to_string(shape));
    shape[infer] = total / known;
  }
  return shape;
}

}  // namespace

Expr pad_axis(Builder& b, Expr x, int64_t axis, int64_t before, int64_t after, const std::string& mode,
              const Expr& value) {
  if (before == 0 && after == 0) return x;
  const int64_t dim = x.dim(axis);
  if (before < 0 || after < 0) {  // negative pads crop
    x = slice_axis(x, axis, std::max<int64_t>(-before, 0), dim - std::max<int64_t>(-after, 0));
    return pad_axis(b, x, axis, std::max<int64_t>(before, 0), std::max<int64_t>(after, 0), mode, value);
  }
  if (mode == "constant") {
    std::vector<Expr> parts;
    Shape s = x.shape();
    if (before > 0) {
      s[axis] = before;
      parts.push_back(broadcast_to(value, s));
    }
    parts.push_back(x);
    if (after > 0) {
      s[axis] = after;
      parts.push_back(broadcast_to(value, s));
    }
    return concat(parts, axis);
  }
  Ints index;
  for (int64_t i = -before; i < dim + after; ++i) {
    int64_t j = i;
    if (mode == "edge") {
      j = std::clamp<int64_t>(i, 0, dim - 1);
    } else {  // reflect: mirror without repeating the edge
      const int64_t period = 2 * (dim - 1);
      if (period == 0) j = 0;
      else {
        j = ((i % period) + period) % period;
        if (j >= dim) j = period - j;
      }
    }
    index.push_back(j);
  }
  return take(b, x, index, axis);
}

void add_tensor_rules(RuleTable& r) {
  // ---- constants and shapes
  r["Constant"] = [](NodeContext& c) {
    Tensor t;
    if (c.has_attr("value")) {
      t = c.attr_tensor("value");
    } else if (c.has_attr("value_float")) {
      t = Tensor::from_f64({DType::kF32, {}}, std::vector<double>{c.attr_float("value_float", 0)});
    } else if (c.has_attr("value_int")) {
      t = Tensor::from_i64({DType::kI64, {}}, Ints{c.attr_int("value_int", 0)});
    } else if (c.has_attr("value_floats")) {
      std::vector<double> v = c.attr_floats("value_floats");
      t = Tensor::from_f64({DType::kF32, {int64_t(v.size())}}, v);
    } else if (c.has_attr("value_ints")) {
      Ints v = c.attr_ints("value_ints");
      t = Tensor::from_i64({DType::kI64, {int64_t(v.size())}}, v);
    } else {
      c.unsupported("only tensor, float and int values are supported");
    }
    return std::vector<Expr>{constant_of(c.b(), t)};
  };
  r["Shape"] = [](NodeContext& c) {
    const Shape s = c.in(0).shape();
    const int rank = static_cast<int>(s.size());
    auto clamp_axis = [&](int64_t a) { return std::clamp<int64_t>(a < 0 ? a + rank : a, 0, rank); };
    const int64_t start = clamp_axis(c.attr_int("start", 0)), end = clamp_axis(c.attr_int("end", rank));
    Ints part(s.begin() + start, s.begin() + std::max(start, end));
    return std::vector<Expr>{const_i64(c.b(), part)};
  };
  r["Size"] = [](NodeContext& c) {
    return std::vector<Expr>{c.b().scalar(static_cast<double>(c.in(0).type().numel()), DType::kI64)};
  };
  r["ConstantOfShape"] = [](NodeContext& c) {
    const Ints shape = c.ints(0, "shape");
    for (int64_t d : shape)
      if (d < 0) c.fail("shape {} has a negative dim", to_string(shape));
    if (!c.has_attr("value")) return std::vector<Expr>{c.b().full(shape, 0.0, DType::kF32)};
    const Tensor v = c.attr_tensor("value");
    if (v.numel() != 1) c.fail("its value must hold one element, got {}", to_string(v.type()));
    // full's value is a double: an integer it does not hold exactly is a constant (exact).
    if (is_float(v.dtype()) || std::abs(static_cast<double>(v.get_int(0))) <= std::ldexp(1.0, 53))
      return std::vector<Expr>{c.b().full(shape, v.get(0), v.dtype())};
    Tensor filled(TensorType{v.dtype(), shape});
    for (int64_t i = 0; i < filled.numel(); ++i) filled.copy_element(i, v, 0);
    return std::vector<Expr>{constant_of(c.b(), filled)};
  };
  r["Range"] = [](NodeContext& c) {
    const Tensor start = c.constant(0, "start"), limit = c.constant(1, "limit"), delta = c.constant(2, "delta");
    for (const Tensor* t : {&start, &limit, &delta})
      if (t->numel() != 1) c.fail("start, limit and delta must be scalars, got {}", to_string(t->type()));
    if (!is_float(start.dtype())) {
      // Integers in int64, exactly: n = ceil((limit - start) / delta), in 128 bits so that no
      // difference of two int64 overflows.
      const int64_t s = start.get_int(0), l = limit.get_int(0), d = delta.get_int(0);
      if (d == 0) c.fail("delta is 0");
      const __int128 span = static_cast<__int128>(l) - s;
      __int128 n = span / d;
      if (n * d != span && (span > 0) == (d > 0)) ++n;  // ceil of a positive quotient
      n = std::max<__int128>(n, 0);
      if (n > kMaxRangeElements) c.fail("gives {} elements, more than kiln folds", static_cast<int64_t>(n));
      Ints values(static_cast<size_t>(n));
      for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) values[i] = s + i * d;
      return std::vector<Expr>{constant_of(c.b(), Tensor::from_i64({start.dtype(), {int64_t(n)}}, values))};
    }
    const double s = start.get(0), l = limit.get(0), d = delta.get(0);
    if (d == 0) c.fail("delta is 0");
    const double count = std::max(0.0, std::ceil((l - s) / d));
    if (!(count <= kMaxRangeElements)) c.fail("gives {} elements, more than kiln folds", count);
    const int64_t n = static_cast<int64_t>(count);
    std::vector<double> values(n);
    for (int64_t i = 0; i < n; ++i) values[i] = s + static_cast<double>(i) * d;
    Tensor t = Tensor::from_f64({start.dtype(), {n}}, values);
    return std::vector<Expr>{constant_of(c.b(), t)};
  };
  r["EyeLike"] = [](NodeContext& c) {
    Expr x = c.in(0);
    if (x.rank() != 2) c.fail("needs a 2-D input, got {}", to_string(x.type()));
    const DType dtype = c.has_attr("dtype") ? dtype_of(int(c.attr_int("dtype", 1)), c.where()) : x.dtype();
    const int64_t k = c.attr_int("k", 0);
    Tensor t(TensorType{dtype, x.shape()});
    for (int64_t i = 0; i < x.dim(0); ++i)
      if (i + k >= 0 && i + k < x.dim(1)) t.set(i * x.dim(1) + i + k, 1.0);
    return std::vector<Expr>{constant_of(c.b(), t)};
  };

  // ---- reshapes and moves
  r["Reshape"] = [](NodeContext& c) {
    Expr x = c.in(0);
    const Ints shape = c.opset() >= 5 ? c.ints(1, "shape") : c.attr_ints("shape");
    const bool allow_zero = c.attr_int("allowzero", 0) != 0;
    return std::vector<Expr>{reshape(x, reshape_target(c, x.shape(), shape, allow_zero))};
  };
  r["Flatten"] = [](NodeContext& c) {
    Expr x = c.in(0);
    int64_t axis = c.attr_int("axis", 1);
    if (axis < -x.rank() || axis > x.rank()) c.fail("axis {} is out of range for rank {}", axis, x.rank());
    if (axis < 0) axis += x.rank();
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < x.rank(); ++d) (d < axis ? outer : inner) *= x.dim(d);
    return std::vector<Expr>{reshape(x, {outer, inner})};
  };
  r["Squeeze"] = [](NodeContext& c) {
    Expr x = c.in(0);
    std::optional<Ints> axes = axes_of(c, 13);
    std::vector<bool> drop(x.rank(), false);
    if (axes) {
      for (int64_t a : *axes) {
        const int64_t d = axis_in(c, a, x.rank());
        if (x.dim(int(d)) != 1) c.fail("cannot squeeze dim {} of {}: it is not 1", d, to_string(x.type()));
        drop[d] = true;
      }
    } else {
      for (int d = 0; d < x.rank(); ++d) drop[d] = x.dim(d) == 1;
    }
    Shape out;
    for (int d = 0; d < x.rank(); ++d)
      if (!drop[d]) out.push_back(x.dim(d));
    return std::vector<Expr>{reshape(x, out)};
  };
  r["Unsqueeze"] = [](NodeContext& c) {
    Expr x = c.in(0);
    std::optional<Ints> axes = axes_of(c, 13);
    if (!axes) c.fail("needs axes");
    const int rank = x.rank() + static_cast<int>(axes->size());
    std::vector<bool> inserted(rank, false);
    for (int64_t a : *axes) inserted[axis_in(c, a, rank)] = true;
    Shape out;
    int next = 0;
    for (int d = 0; d < rank; ++d) out.push_back(inserted[d] ? 1 : x.dim(next++));
    return std::vector<Expr>{reshape(x, out)};
  };
  r["Transpose"] = [](NodeContext& c) {
    Expr x = c.in(0);
    return std::vector<Expr>{transpose(x, c.attr_ints("perm"))};
  };
  r["Concat"] = [](NodeContext& c) {
    std::vector<Expr> xs;
    for (int i = 0; i < c.num_inputs(); ++i)
      if (c.has_input(i)) xs.push_back(c.in(i));
    if (xs.empty()) c.fail("needs at least one input");
    const int64_t axis = axis_in(c, c.attr_int("axis", 0), xs.at(0).rank());
    // ONNX lets a piece be empty, but only with the other pieces' rank and dims off the axis:
    // an empty piece of another shape is an error, never silently dropped.
    for (size_t i = 1; i < xs.size(); ++i) {
      bool same = xs[i].rank() == xs[0].rank() && xs[i].dtype() == xs[0].dtype();
      for (int d = 0; same && d < xs[0].rank(); ++d) same = d == axis || xs[i].dim(d) == xs[0].dim(d);
      if (!same)
        c.fail("input {} is {}, expected {} like input 0 on every axis but {}", i, to_string(xs[i].type()),
               to_string(xs[0].type()), axis);
    }
    // Empty pieces change nothing (kiln's concat takes only real ones).
    std::vector<Expr> parts;
    for (const Expr& x : xs)
      if (x.type().numel() > 0) parts.push_back(x);
    if (parts.empty()) return std::vector<Expr>{concat(xs, axis)};
    return std::vector<Expr>{parts.size() == 1 ? parts[0] : concat(parts, axis)};
  };
  r["Split"] = [](NodeContext& c) {
    Expr x = c.in(0);
    const int64_t axis = axis_in(c, c.attr_int("axis", 0), x.rank());
    const int64_t dim = x.dim(int(axis));
    Ints sizes;
    if (c.opset() >= 13 && c.has_input(1)) sizes = c.ints(1, "split");
    else if (c.opset() < 13 && c.has_attr("split")) sizes = c.attr_ints("split");
    else {
      const int64_t n = c.has_attr("num_outputs") ? c.attr_int("num_outputs", 1) : c.num_outputs();
      if (n < 1 || (dim > 0 && n > dim)) c.fail("{} outputs for a dim of {}", n, dim);
      const int64_t each = (dim + n - 1) / n;
      for (int64_t i = 0, left = dim; i < n; ++i, left -= each)
        sizes.push_back(std::clamp<int64_t>(left, 0, each));  // the last chunks smaller (or empty)
    }
    return split(x, sizes, axis);
  };
  r["Slice"] = [](NodeContext& c) {
    Expr x = c.in(0);
    Ints starts, ends, axes, steps;
    if (c.opset() >= 10) {
      starts = c.ints(1, "starts");
      ends = c.ints(2, "ends");
      if (c.has_input(3)) axes = c.ints(3, "axes");
      if (c.has_input(4)) steps = c.ints(4, "steps");
    } else {
      starts = c.attr_ints("starts");
      ends = c.attr_ints("ends");
      axes = c.attr_ints("axes");
    }
    if (axes.empty())
      for (size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<int64_t>(i));
    if (steps.empty()) steps.assign(starts.size(), 1);
    if (ends.size() != starts.size() || axes.size() != starts.size() || steps.size() != starts.size())
      c.fail("starts, ends, axes and steps have different lengths");
    // Bounds as numpy clamps them (ONNX's reference is numpy slicing, and PyTorch exports
    // x[:, k:] with an end of INT64_MAX): a negative bound counts from the end, then a positive
    // step clamps both to [0, dim], a negative one to [-1, dim - 1] (-1: before the first
    // element). All in int64: INT64_MIN + dim and the clamps cannot overflow.
    Ints lo(x.rank(), 0), hi = x.shape(), step(x.rank(), 1);
    std::vector<bool> sliced(x.rank(), false);
    for (size_t i = 0; i < starts.size(); ++i) {
      const int64_t a = axis_in(c, axes[i], x.rank()), dim = x.dim(int(a));
      if (sliced[a]) c.fail("axes {} name axis {} twice", to_string(axes), a);
      sliced[a] = true;
      int64_t s = starts[i], e = ends[i];
      const int64_t st = steps[i];
      if (st == 0) c.fail("step 0 on axis {}", a);
      if (s < 0) s += dim;
      if (e < 0) e += dim;
      if (st > 0) {
        s = std::clamp<int64_t>(s, 0, dim);
        e = std::clamp<int64_t>(e, 0, dim);
        lo[a] = s;
        hi[a] = std::max(s, e);
        step[a] = st;
      } else {  // backwards: the positions, gathered
        s = std::clamp<int64_t>(s, -1, dim - 1);
        e = std::clamp<int64_t>(e, -1, dim - 1);
        Ints index;
        for (int64_t p = s; p > e; p += st) index.push_back(p);
        x = take(c.b(), x, index, a);
        hi[a] = x.dim(int(a));  // whole from here on
      }
    }
    bool whole = true;
    for (int d = 0; d < x.rank(); ++d) whole = whole && lo[d] == 0 && hi[d] == x.dim(d) && step[d] == 1;
    return std::vector<Expr>{whole ? x : slice(x, lo, hi, step)};
  };
  // ONNX counts a negative index from the end. PyTorch's embedding lookup (aten::embedding, its
  // exporter's one Gather without an axis attribute; its indexing and index_select write one)
  // refuses a negative id instead: from PyTorch such a lookup keeps its ids as they are, so that
  // the gather's range check refuses a negative one as torch does (a kiln::Error), where wrapping
  // would silently read a row from the end of the table.
  r["Gather"] = [](NodeContext& c) {
    Expr x = c.in(0), indices = c.in(1);
    const bool torch_embedding = c.from_pytorch() && !c.has_attr("axis");
    const int64_t axis = axis_in(c, c.attr_int("axis", 0), x.rank());
    return std::vector<Expr>{gather(x, torch_embedding ? indices : wrap_indices(indices, x.dim(int(axis))), axis)};
  };
  // out[i][j][k] = data[index[i][j][k]][j][k] (axis 0): kiln's gather_elements.
  r["GatherElements"] = [](NodeContext& c) {
    Expr x = c.in(0), indices = c.in(1);
    if (x.rank() != indices.rank()) c.fail("data {} and indices {} differ in rank", to_string(x.type()),
                                           to_string(indices.type()));
    if (x.rank() == 0) c.fail("needs rank >= 1");
    const int64_t axis = axis_in(c, c.attr_int("axis", 0), x.rank());
    return std::vector<Expr>{c.b().apply1(Op::kGatherElements, {x, wrap_indices(indices, x.dim(int(axis)))},
                                          {{"axis", axis}})};
  };
  // data[indices[i][j][k]][j][k] (axis 0) combined with updates[i][j][k]: kiln's scatter_elements.
  // Scatter is its opset 9-10 name.
  const Rule scatter_elements = [](NodeContext& c) {
    Expr data = c.in(0), indices = c.in(1), updates = c.in(2);
    if (data.rank() == 0) c.fail("needs rank >= 1");
    const int64_t axis = axis_in(c, c.attr_int("axis", 0), data.rank());
    const std::string reduction = scatter_reduction(c);
    return std::vector<Expr>{
        scatter_elements_op(data, wrap_indices(indices, data.dim(int(axis))), updates, axis, reduction)};
  };
  r["ScatterElements"] = scatter_elements;
  r["Scatter"] = scatter_elements;
  // data[indices[i]] (a slice of data's last r - K dims) combined with updates[i]: scatter_elements
  // along axis 0 of data seen as rows (N, R), N the positions its K leading dims address, each
  // update row's position repeated over its R columns. (torch's in-place slice assignment
  // x[:, 1:] = y exports as this.)
  r["ScatterND"] = [](NodeContext& c) {
    Expr data = c.in(0), indices = c.in(1), updates = c.in(2);
    const std::string reduction = scatter_reduction(c);
    const Shape dims = data.shape();
    if (indices.rank() < 1 || indices.dim(-1) > data.rank())
      c.fail("indices {} need rank >= 1 and a last dim <= data's rank {}", to_string(indices.type()), data.rank());
    const int64_t k = indices.dim(-1);
    Shape expected = indices.shape();
    expected.pop_back();
    expected.insert(expected.end(), dims.begin() + k, dims.end());
    if (updates.shape() != expected)
      c.fail("updates are {}, expected shape {} (indices' leading dims, then data's past the first {})",
             to_string(updates.type()), to_string(expected), k);
    const int64_t n = numel(Shape(dims.begin(), dims.begin() + k)), row = numel(Shape(dims.begin() + k, dims.end()));
    Expr position = linear_index(indices, Shape(dims.begin(), dims.begin() + k));
    const int64_t m = numel(position.shape());
    Expr rows_index = broadcast_to(reshape(position, {m, 1}), {m, row});
    Expr rows = scatter_elements_op(reshape(data, {n, row}), rows_index, reshape(updates, {m, row}), 0, reduction);
    return std::vector<Expr>{reshape(rows, dims)};
  };
  // data[batch..., indices[batch..., i]] (a slice of data's dims past batch_dims + K): a gather of
  // rows of data seen as (B N, R), B the batch positions, N those the K index dims address.
  r["GatherND"] = [](NodeContext& c) {
    Expr data = c.in(0), indices = c.in(1);
    const int64_t batch_dims = c.attr_int("batch_dims", 0);
    const Shape dims = data.shape();
    if (indices.rank() < 1 || batch_dims < 0 || batch_dims >= std::min(indices.rank(), data.rank()) ||
        batch_dims + indices.dim(-1) > data.rank())
      c.fail("indices {} with batch_dims {} do not index data {}", to_string(indices.type()), batch_dims,
             to_string(data.type()));
    for (int64_t d = 0; d < batch_dims; ++d)
      if (indices.dim(int(d)) != dims[d]) c.fail("indices {} and data {} differ in batch dim {}", to_string(indices.type()), to_string(data.type()), d);
    const int64_t k = indices.dim(-1);
    const Shape index_dims(dims.begin() + batch_dims, dims.begin() + batch_dims + k);
    const Shape rest(dims.begin() + batch_dims + k, dims.end());
    const int64_t batch = numel(Shape(dims.begin(), dims.begin() + batch_dims));
    Expr position = linear_index(indices, index_dims);
    const Shape lead = position.shape();
    const int64_t batch_stride = numel(index_dims);
    int64_t stride = batch_stride;
    for (int64_t d = batch_dims - 1; d >= 0; --d) {  // the batch coordinates' own positions
      position = position + c.b().iota(lead, d, DType::kI64) * static_cast<double>(stride);
      stride *= dims[d];
    }
    Expr rows = gather(reshape(data, {batch * batch_stride, numel(rest)}), position, 0);
    Shape out = lead;
    out.insert(out.end(), rest.begin(), rest.end());
    return std::vector<Expr>{reshape(rows, out)};
  };
  r["CumSum"] = [](NodeContext& c) {
    Expr x = c.in(0);
    const Ints axis = c.ints(1, "axis");
    if (axis.size() != 1) c.fail("axis must be one value, got {}", axis.size());
    Attributes attrs{{"axis", axis_in(c, axis[0], x.rank())},
                     {"exclusive", c.attr_int("exclusive", 0) != 0},
                     {"reverse", c.attr_int("reverse", 0) != 0}};
    return std::vector<Expr>{c.b().apply1(Op::kCumsum, {x}, attrs)};
  };
  r["TopK"] = [](NodeContext& c) {
    Expr x = c.in(0);
    int64_t k = 0;
    if (c.opset() < 10) {
      k = c.attr_int("k", -1);
    } else {
      const Ints ks = c.ints(1, "K");
      if (ks.size() != 1) c.fail("K must be one value, got {}", ks.size());
      k = ks[0];
    }
    const int64_t axis = axis_in(c, c.attr_int("axis", -1), x.rank());
    c.attr_int("sorted", 1);
    Attributes attrs{{"k", k}, {"axis", axis}, {"largest", c.attr_int("largest", 1) != 0}};
    return c.b().apply(Op::kTopk, {x}, attrs);
  };
  r["Expand"] = [](NodeContext& c) {
    Expr x = c.in(0);
    const Shape shape = broadcast_shapes(x.shape(), c.ints(1, "shape"));
    return std::vector<Expr>{shape == x.shape() ? x : broadcast_to(x, shape)};
  };
  r["Tile"] = [](NodeContext& c) {
    Expr x = c.in(0);
    const Ints repeats = c.ints(1, "repeats");
    if (static_cast<int>(repeats.size()) != x.rank()) c.fail("{} repeats for rank {}", repeats.size(), x.rank());
    Shape spread, tiled, out;
    for (int d = 0; d < x.rank(); ++d) {
      spread.insert(spread.end(), {1, x.dim(d)});
      tiled.insert(tiled.end(), {repeats[d], x.dim(d)});
      out.push_back(repeats[d] * x.dim(d));
    }
    return std::vector<Expr>{reshape(broadcast_to(reshape(x, spread), tiled), out)};
  };
  r["DepthToSpace"] = [](NodeContext& c) {
    Expr x = c.in(0);
    const int64_t bs = c.attr_int("blocksize", 1);
    const std::string mode = c.attr_string("mode", "DCR");
    if (x.rank() != 4) c.fail("needs (N, C, H, W), got {}", to_string(x.type()));
    const int64_t n = x.dim(0), ch = x.dim(1), h = x.dim(2), w = x.dim(3);
    Expr y = mode == "DCR" ? transpose(reshape(x, {n, bs, bs, ch / (bs * bs), h, w}), {0, 3, 4, 1, 5, 2})
                           : transpose(reshape(x, {n, ch / (bs * bs), bs, bs, h, w}), {0, 1, 4, 2, 5, 3});
    return std::vector<Expr>{reshape(y, {n, ch / (bs * bs), h * bs, w * bs})};
  };
  r["SpaceToDepth"] = [](NodeContext& c) {
    Expr x = c.in(0);
    const int64_t bs = c.attr_int("blocksize", 1);
    if (x.rank() != 4) c.fail("needs (N, C, H, W), got {}", to_string(x.type()));
    const int64_t n = x.dim(0), ch = x.dim(1), h = x.dim(2), w = x.dim(3);
    Expr y = transpose(reshape(x, {n, ch, h / bs, bs, w / bs, bs}), {0, 3, 5, 1, 2, 4});
    return std::vector<Expr>{reshape(y, {n, ch * bs * bs, h / bs, w / bs})};
  };
  r["Trilu"] = [](NodeContext& c) {
    Expr x = c.in(0);
    const bool upper = c.attr_int("upper", 1) != 0;
    const int64_t k = c.has_input(1) ? c.int_scalar(1, "k") : 0;
    if (x.rank() < 2) c.fail("needs rank >= 2");
    const int64_t rows = x.dim(-2), cols = x.dim(-1);
    Tensor mask(TensorType{DType::kBool, {rows, cols}});
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) mask.set(i * cols + j, upper ? j - i >= k : j - i <= k);
    return std::vector<Expr>{where(constant_of(c.b(), mask), x, scalar_like(x, 0.0))};
  };
  r["OneHot"] = [](NodeContext& c) {
    Expr indices = cast_to(c.in(0), DType::kI64);
    const int64_t depth = c.int_scalar(1, "depth");
    Expr values = c.in(2);
    const int64_t axis = axis_in(c, c.attr_int("axis", -1), indices.rank() + 1);
    Expr off = reshape(slice_axis(values, 0, 0, 1), {}), on = reshape(slice_axis(values, 0, 1, 2), {});
    Expr hot = one_hot(wrap_indices(indices, depth), depth, values.dtype());
    Expr y = off + hot * (on - off);
    if (axis != indices.rank()) {
      Ints perm;
      for (int d = 0; d < indices.rank(); ++d) {
        if (d == axis) perm.push_back(indices.rank());
        perm.push_back(d);
      }
      y = transpose(y, perm);
    }
    return std::vector<Expr>{y};
  };
  r["Pad"] = [](NodeContext& c) {
    Expr x = c.in(0);
    const std::string mode = c.attr_string("mode", "constant");
    if (mode != "constant" && mode != "reflect" && mode != "edge") c.unsupported("mode '{}'", mode);
    Ints pads;
    double value = 0;
    Ints axes;
    if (c.opset() >= 11) {
      pads = c.ints(1, "pads");
      if (c.has_input(2)) value = c.scalar(2, "constant_value");
      if (c.has_input(3)) axes = c.ints(3, "axes");
    } else {
      pads = c.attr_ints("pads");
      value = c.attr_float("value", 0.0);
    }
    if (axes.empty())
      for (int d = 0; d < x.rank(); ++d) axes.push_back(d);
    if (pads.size() != 2 * axes.size()) c.fail("{} pads for {} axes", pads.size(), axes.size());
    Expr fill = scalar_like(x, value);
    for (size_t i = 0; i < axes.size(); ++i) {
      const int64_t axis = axis_in(c, axes[i], x.rank()), before = pads[i], after = pads[i + axes.size()];
      // The padded dim in 128 bits (pads are int64 and may be anything): cropped past nothing,
      // padded within what a tensor can hold.
      const __int128 dim = static_cast<__int128>(x.dim(int(axis))) + before + after;
      if (dim < 0 || dim > (__int128{1} << 40))
        c.fail("pads {} and {} on axis {} of {} give a dim of {}", before, after, axis, to_string(x.type()),
               dim < 0 ? "less than 0" : "more than 2^40");
      x = pad_axis(c.b(), x, axis, before, after, mode, fill);
    }
    return std::vector<Expr>{x};
  };
  r["Dropout"] = [](NodeContext& c) {
    Expr x = c.in(0);
    double ratio = 0.5;
    bool training = false;
    if (c.opset() >= 12) {
      if (c.has_input(1)) ratio = c.scalar(1, "ratio");
      if (c.has_input(2)) training = c.scalar(2, "training_mode") != 0;
    } else {
      ratio = c.attr_float("ratio", 0.5);
      if (c.opset() < 7) training = c.attr_int("is_test", 0) == 0;
    }
    const int64_t seed = c.attr_int("seed", 0);
    if (!training || ratio == 0) {
      Expr mask = c.b().full(x.shape(), 1, DType::kBool);
      return std::vector<Expr>{x, mask};
    }
    if (c.wants_output(1)) c.unsupported("the mask output in training mode");
    return std::vector<Expr>{dropout(x, ratio, seed)};
  };

  // ---- reductions (axes became an input in opset 13 for ReduceSum, 18 for the others)
  r["ReduceSum"] = reduce("sum", 13);
  r["ReduceMean"] = reduce("mean", 18);
  r["ReduceMax"] = reduce("max", 18);
  r["ReduceMin"] = reduce("min", 18);
  r["ReduceL1"] = reduce("l1", 18);
  r["ReduceL2"] = reduce("l2", 18);
  r["ReduceSumSquare"] = reduce("sum_square", 18);
  r["ReduceLogSum"] = reduce("log_sum", 18);
  r["ReduceLogSumExp"] = reduce("log_sum_exp", 18);
  r["ReduceProd"] = reduce("prod", 18);
  r["ArgMax"] = arg_extreme(true);
  r["ArgMin"] = arg_extreme(false);
}

}  // namespace kiln::onnx

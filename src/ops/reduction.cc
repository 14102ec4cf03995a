// Reduction ops.
//   sum, mean, max {axes: ints ([] = all axes), keepdims: bool}: axes may be negative, must be
//     distinct and in range. sum and max take integers and floats, mean floats only; the output
//     has the input's dtype. Over an empty axis sum gives 0; mean and max are errors.
//   prod {axes, keepdims}: the product, floats and integers (exact: int64 products that wrap,
//     never through double); over an empty axis 1.
//   argmax {axis: int (default -1), keepdims: bool}: i64 output, the first index of the maximum;
//     NaN counts as the maximum (like numpy), so max and argmax agree on NaN.
//
// Gradient rules: sum and mean broadcast dy back over the reduced axes (mean also divides by
// the count); max sends dy to every position equal to the maximum, divided equally among ties
// (two equal maxima get dy / 2 each, like maximum's tie rule). Where the maximum is NaN no
// element equals it and the gradient is 0. prod: each element gets dy times the product of the
// others, computed without dividing by a zero: y / x where the line has no zero, the product of
// the rest at a line's only zero (0 elsewhere on that line), 0 where a line has two zeros or
// more. argmax has an integer output: not differentiable.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ir/builder.h"
#include "ops/common.h"
#include "ops/gradient.h"

namespace kiln::ops {
namespace {

// The reduced axes of `in` as a mask over its dimensions: all of them when `axes` is empty.
std::vector<bool> reduced_axes(const TensorType& in, const std::vector<int64_t>& axes) {
  std::vector<bool> reduced(in.rank(), axes.empty());
  for (int64_t axis : axes) {
    KILN_CHECK(in.rank() > 0, "axis {} given for a scalar input {}, which has no axes", axis,
               to_string(in));
    int d = normalize_axis(axis, in.rank());
    KILN_CHECK(!reduced[d], "axes {} name axis {} twice (input {})", fmt::join(axes, ", "), d,
               to_string(in));
    reduced[d] = true;
  }
  return reduced;
}

// The output shape: reduced dimensions become 1 (keepdims) or disappear.
Shape reduced_shape(const Shape& in, const std::vector<bool>& reduced, bool keepdims) {
  Shape out;
  for (size_t d = 0; d < in.size(); ++d) {
    if (!reduced[d]) {
      out.push_back(in[d]);
    } else if (keepdims) {
      out.push_back(1);
    }
  }
  return out;
}

void check_not_empty(const TensorType& in, const std::vector<bool>& reduced,
                     std::string_view what) {
  for (size_t d = 0; d < reduced.size(); ++d)
    KILN_CHECK(!reduced[d] || in.shape[d] != 0, "cannot take {} over an empty axis: axis {} of {}",
               what, d, to_string(in));
}

// Calls fn(in_index, out_index) for every input element in row-major order. The output is
// addressed through the keepdims shape broadcast back to the input shape, which gives stride 0
// along the reduced axes.
template <typename Fn>
void for_each_reduced(const Shape& in, const std::vector<bool>& reduced, Fn&& fn) {
  Shape kept = reduced_shape(in, reduced, /*keepdims=*/true);
  for_each_broadcast(in, {in, kept},
                     [&](int64_t, std::span<const int64_t> at) { fn(at[0], at[1]); });
}

enum class Reduce { kSum, kMean, kMax };

std::vector<TensorType> infer_reduce(Reduce kind, const TensorType& x, const Attributes& a) {
  if (kind == Reduce::kMean) {
    KILN_CHECK(is_float(x.dtype), "needs a float tensor, got {}", to_string(x));
  } else {
    KILN_CHECK(is_float(x.dtype) || is_integer(x.dtype),
               "needs a float or integer tensor, got {} (cast bool tensors first)", to_string(x));
  }
  std::vector<bool> reduced = reduced_axes(x, a.ints("axes"));
  if (kind == Reduce::kMean) check_not_empty(x, reduced, "mean");
  if (kind == Reduce::kMax) check_not_empty(x, reduced, "max");
  return {{x.dtype, reduced_shape(x.shape, reduced, a.b("keepdims"))}};
}

// Integer sum and max, in int64 (never through double, which does not hold every int64): the
// sum wraps modulo 2^64 (computed in uint64), set_int wraps it to the output's width.
void reduce_integers(Reduce kind, const Tensor& x, Tensor& out, const std::vector<bool>& reduced) {
  std::vector<uint64_t> sum(out.numel(), 0);
  std::vector<int64_t> best(out.numel(), 0);
  std::vector<bool> seen(out.numel(), false);
  for_each_reduced(x.shape(), reduced, [&](int64_t i, int64_t o) {
    const int64_t v = x.get_int(i);
    sum[o] += static_cast<uint64_t>(v);
    if (!seen[o] || v > best[o]) best[o] = v;
    seen[o] = true;
  });
  for (int64_t o = 0; o < out.numel(); ++o)
    out.set_int(o, kind == Reduce::kMax ? best[o] : static_cast<int64_t>(sum[o]));
}

void reduce_reference(Reduce kind, const KernelArgs& k) {
  const Tensor& x = k.inputs[0];
  Tensor& out = k.outputs[0];
  std::vector<bool> reduced = reduced_axes(x.type(), k.attrs.ints("axes"));
  if (is_integer(x.dtype())) {
    reduce_integers(kind, x, out, reduced);
    return;
  }
  std::vector<double> acc(out.numel(), kind == Reduce::kMax ? -INFINITY : 0.0);
  for_each_reduced(x.shape(), reduced, [&](int64_t i, int64_t o) {
    double v = x.get(i);
    if (kind != Reduce::kMax) {
      acc[o] += v;
    } else if (!std::isnan(acc[o]) && (std::isnan(v) || v > acc[o])) {
      acc[o] = v;  // once NaN, stays NaN
    }
  });
  double count = out.numel() == 0 ? 0.0 : static_cast<double>(x.numel() / out.numel());
  for (int64_t o = 0; o < out.numel(); ++o)
    out.set(o, kind == Reduce::kMean ? acc[o] / count : acc[o]);
}

// ---- gradient rules ----

// The input's shape with the reduced axes kept as 1: the shape at which an output-shaped tensor
// (y, dy) broadcasts against the input.
Shape kept_shape(const GradContext& c) {
  const TensorType& x = c.x().type();
  return reduced_shape(x.shape, reduced_axes(x, c.attrs().ints("axes")), /*keepdims=*/true);
}
Expr reshape_to(Expr e, const Shape& shape) { return e.shape() == shape ? e : reshape(e, shape); }
Expr broadcast_back(Expr e, const Shape& shape) {
  return e.shape() == shape ? e : broadcast_to(e, shape);
}

std::vector<Expr> sum_gradient(const GradContext& c) {
  return {broadcast_back(reshape_to(c.dy(), kept_shape(c)), c.x().shape())};
}

std::vector<Expr> mean_gradient(const GradContext& c) {
  Shape kept = kept_shape(c);
  // Inference rejects empty reduced axes, so count >= 1.
  double count = static_cast<double>(c.x().type().numel() / numel(kept));
  return {broadcast_back(reshape_to(c.dy(), kept) * (1.0 / count), c.x().shape())};
}

std::vector<Expr> max_gradient(const GradContext& c) {
  const Expr& x = c.x();
  Shape kept = kept_shape(c);
  Expr is_max = eq(x, reshape_to(c.y(), kept));
  Expr ties = sum(cast(is_max, x.dtype()), c.attrs().ints("axes"), /*keepdims=*/true);
  Expr share = reshape_to(c.dy(), kept) / ties;
  return {where(is_max, share, c.builder.scalar(0.0, x.dtype()))};
}

std::vector<Expr> prod_gradient(const GradContext& c) {
  const Expr& x = c.x();
  Builder& b = c.builder;
  const std::vector<int64_t>& axes = c.attrs().ints("axes");
  Shape kept = kept_shape(c);
  Expr zero = b.scalar(0.0, x.dtype()), one = b.scalar(1.0, x.dtype());
  Expr is_zero = eq(x, zero);
  Expr zeros = sum(cast(is_zero, x.dtype()), axes, /*keepdims=*/true);
  // The product of the line's non-zero elements: the others' product at its only zero, and
  // y / x = others / x everywhere when it has none (never a division by 0).
  Expr nonzero = where(is_zero, one, x);
  Expr rest = b.apply1(Op::kProd, {nonzero}, {{"axes", axes}, {"keepdims", true}});
  Expr others = where(eq(zeros, zero), rest / nonzero,
                      where(is_zero, where(eq(zeros, one), rest, zero), zero));
  return {broadcast_back(reshape_to(c.dy(), kept), x.shape()) * others};
}

void prod_reference(const KernelArgs& k) {
  const Tensor& x = k.inputs[0];
  Tensor& out = k.outputs[0];
  std::vector<bool> reduced = reduced_axes(x.type(), k.attrs.ints("axes"));
  if (is_integer(x.dtype())) {
    std::vector<uint64_t> acc(out.numel(), 1);  // unsigned: products wrap modulo 2^64
    for_each_reduced(x.shape(), reduced, [&](int64_t i, int64_t o) {
      acc[o] *= static_cast<uint64_t>(x.get_int(i));
    });
    for (int64_t o = 0; o < out.numel(); ++o) out.set_int(o, static_cast<int64_t>(acc[o]));
  } else {
    std::vector<double> acc(out.numel(), 1.0);
    for_each_reduced(x.shape(), reduced, [&](int64_t i, int64_t o) { acc[o] *= x.get(i); });
    for (int64_t o = 0; o < out.numel(); ++o) out.set(o, acc[o]);
  }
}

GradFn reduce_gradient(Reduce kind) {
  switch (kind) {
    case Reduce::kSum: return sum_gradient;
    case Reduce::kMean: return mean_gradient;
    case Reduce::kMax: return max_gradient;
  }
  return nullptr;
}

// A row op over exactly the last axis; sum and mean over every axis but the last (rank >= 2)
// are column reductions: a bias gradient.
GroupRole reduce_role(Reduce kind, const Graph& graph, const Node& node) {
  const TensorType& x = graph.type(node.inputs[0]);
  const size_t rank = static_cast<size_t>(x.rank());
  if (rank == 0) return GroupRole::kOther;
  const std::vector<bool> reduced = reduced_axes(x, node.attrs.ints("axes"));
  const auto count = static_cast<size_t>(std::count(reduced.begin(), reduced.end(), true));
  if (reduced.back() && count == 1) return GroupRole::kRowOp;
  if (rank >= 2 && !reduced.back() && count == rank - 1 && kind != Reduce::kMax)
    return GroupRole::kColumnReduction;
  return GroupRole::kOther;
}

void define_reduce(OpRegistry& registry, Op op, Reduce kind) {
  InferFn infer = [kind](std::span<const TensorType> in, const Attributes& a) {
    return infer_reduce(kind, in[0], a);
  };
  KernelFn kernel = [kind](const KernelArgs& k) { reduce_reference(kind, k); };
  registry.define(
      op, OpDef{{with_default("axes", std::vector<int64_t>{}), with_default("keepdims", false)},
                std::move(infer),
                std::move(kernel),
                reduce_gradient(kind)})
      .traits = {.row_op = true,
                 .precision = Precision::kF32,
                 .fusion_role = [kind](const Graph& graph, const Node& node) {
                   return reduce_role(kind, graph, node);
                 }};
}

std::vector<TensorType> infer_argmax(std::span<const TensorType> in, const Attributes& a) {
  const TensorType& x = in[0];
  KILN_CHECK(x.rank() > 0, "needs a tensor of rank >= 1, got {}", to_string(x));
  std::vector<bool> reduced = reduced_axes(x, {a.i("axis")});
  check_not_empty(x, reduced, "argmax");
  return {{DType::kI64, reduced_shape(x.shape, reduced, a.b("keepdims"))}};
}

void argmax_reference(const KernelArgs& k) {
  const Tensor& x = k.inputs[0];
  Tensor& out = k.outputs[0];
  int axis = normalize_axis(k.attrs.i("axis"), x.rank());
  std::vector<bool> reduced(x.rank(), false);
  reduced[axis] = true;
  int64_t stride = strides_of(x.shape())[axis];
  // Elements along the axis arrive in increasing index order, so a strict > keeps the first
  // maximum; once the best is NaN nothing replaces it.
  // Integers compare exactly as int64 (two i64 values above 2^53 may be one double).
  const bool integers = !is_float(x.dtype());
  std::vector<double> best(out.numel(), -INFINITY);
  std::vector<int64_t> best_int(out.numel(), 0);
  std::vector<int64_t> best_index(out.numel(), -1);
  for_each_reduced(x.shape(), reduced, [&](int64_t i, int64_t o) {
    bool better;
    if (integers) {
      const int64_t v = x.get_int(i);
      better = best_index[o] < 0 || v > best_int[o];
      if (better) best_int[o] = v;
    } else {
      const double v = x.get(i);
      better = best_index[o] < 0 || (!std::isnan(best[o]) && (std::isnan(v) || v > best[o]));
      if (better) best[o] = v;
    }
    if (better) best_index[o] = (i / stride) % x.shape()[axis];
  });
  for (int64_t o = 0; o < out.numel(); ++o) out.set_int(o, best_index[o]);
}

void define_argmax(OpRegistry& registry) {
  registry.define(Op::kArgmax,
                  OpDef{{with_default("axis", int64_t{-1}), with_default("keepdims", false)},
                        infer_argmax,
                        argmax_reference,
                        /*gradient=*/nullptr,
                        /*differentiable=*/false})
      .traits = {.precision = Precision::kF32};
}

}  // namespace

void define_reduction_ops(OpRegistry& registry) {
  define_reduce(registry, Op::kSum, Reduce::kSum);
  define_reduce(registry, Op::kMean, Reduce::kMean);
  define_reduce(registry, Op::kMax, Reduce::kMax);
  define_argmax(registry);
  registry.define(
      Op::kProd,
      OpDef{{with_default("axes", std::vector<int64_t>{}), with_default("keepdims", false)},
            [](std::span<const TensorType> in, const Attributes& a) {
              return infer_reduce(Reduce::kSum, in[0], a);  // sum's rules: any axes, empty ones too
            },
            prod_reference, prod_gradient});
}

}  // namespace kiln::ops

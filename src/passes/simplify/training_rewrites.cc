#include "passes/simplify/training_rewrites.h"

#include <array>
#include <numeric>

#include "support/error.h"

namespace kiln {
namespace {

using Ints = std::vector<int64_t>;

bool is_f32_or_f64(DType dtype) { return dtype == DType::kF32 || dtype == DType::kF64; }

// True when a cross_entropy of (logits, labels) with this ignore_index is already in the graph.
bool has_forward_cross_entropy(Rewriter& rw, ValueId logits, ValueId labels, int64_t ignore) {
  for (const Node& node : rw.graph().nodes)
    if (node.op == Op::kCrossEntropy && node.inputs[0] == logits && node.inputs[1] == labels &&
        node.attrs.i("ignore_index") == ignore)
      return true;
  return false;
}

Replacement cross_entropy_grad(Rewriter& rw, const Node& n) {
  if (n.op != Op::kCrossEntropyGrad) return {};
  const ValueId logits = n.inputs[0], labels = n.inputs[1], dloss = n.inputs[2];
  const DType dtype = rw.type(logits).dtype;
  const int64_t ignore = n.attrs.i("ignore_index");
  const std::string reduction = n.attrs.s("reduction");
  if (!is_f32_or_f64(dtype) || !has_forward_cross_entropy(rw, logits, labels, ignore)) return {};
  const Shape rows = rw.type(labels).shape;
  Shape rows_kept = rows;  // (..., 1): broadcasts a per-row value over the classes
  rows_kept.push_back(1);
  const int64_t vocab = rw.type(logits).shape.back();

  std::optional<IntRange> range = integer_range(rw, labels);
  const bool may_ignore = range && range->low <= static_cast<double>(ignore) &&
                          static_cast<double>(ignore) <= range->high;

  const ValueId probs = rw.emit(Op::kSoftmax, {logits}, {{"axis", int64_t{-1}}});
  const ValueId target = rw.emit(Op::kOneHot, {labels}, {{"depth", vocab}, {"dtype", dtype}});
  const ValueId diff = rw.emit(Op::kSub, {probs, target});
  ValueId valid = -1;
  if (may_ignore) {
    const ValueId ignored = rw.full({}, static_cast<double>(ignore), rw.type(labels).dtype);
    valid = rw.emit(Op::kNe, {labels, ignored});
  }
  ValueId scale;
  if (reduction == "mean") {
    const ValueId count =
        may_ignore ? rw.emit(Op::kSum, {rw.emit(Op::kCast, {valid}, {{"dtype", dtype}})})
                   : rw.full({}, static_cast<double>(numel(rows)), dtype);
    scale = rw.emit(Op::kDiv, {dloss, count});
  } else if (reduction == "sum") {
    scale = dloss;
  } else {
    KILN_CHECK(reduction == "none", "cross_entropy_grad: unknown reduction \"{}\"", reduction);
    scale = rw.emit(Op::kReshape, {dloss}, {{"shape", rows_kept}});
  }
  ValueId grad = rw.emit(Op::kMul, {diff, scale});
  if (may_ignore) {
    const ValueId valid_rows = rw.emit(Op::kReshape, {valid}, {{"shape", rows_kept}});
    grad = rw.emit(Op::kWhere, {valid_rows, grad, rw.full({}, 0.0, dtype)});
  }
  return {grad};
}

Replacement layer_norm_grad(Rewriter& rw, const Node& n) {
  if (n.op != Op::kLayerNormGrad) return {};
  const ValueId x = n.inputs[0], gamma = n.inputs[1], dy = n.inputs[2];
  const TensorType& type = rw.type(x);
  if (!is_f32_or_f64(type.dtype)) return {};
  const DType dtype = type.dtype;
  const int rank = type.rank();
  const double epsilon = n.attrs.f("epsilon");
  auto row_mean = [&](ValueId v) {
    return rw.emit(Op::kMean, {v}, {{"axes", Ints{-1}}, {"keepdims", true}});
  };
  // xhat = (x - mean) * inv_std, inv_std = rsqrt(var + epsilon), biased variance: the forward's.
  const ValueId centered = rw.emit(Op::kSub, {x, row_mean(x)});
  const ValueId variance = row_mean(rw.emit(Op::kSquare, {centered}));
  const ValueId inv_std =
      rw.emit(Op::kRsqrt, {rw.emit(Op::kAdd, {variance, rw.full({}, epsilon, dtype)})});
  const ValueId xhat = rw.emit(Op::kMul, {centered, inv_std});
  // dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma.
  const ValueId g = rw.emit(Op::kMul, {dy, gamma});
  const ValueId mean_g = row_mean(g);
  const ValueId mean_g_xhat = row_mean(rw.emit(Op::kMul, {g, xhat}));
  const ValueId dx = rw.emit(
      Op::kMul,
      {inv_std, rw.emit(Op::kSub, {rw.emit(Op::kSub, {g, mean_g}),
                                   rw.emit(Op::kMul, {xhat, mean_g_xhat})})});
  // Column sums over every leading axis (none for a single row of rank 1: `axes = []` would
  // mean all axes).
  const ValueId dy_xhat = rw.emit(Op::kMul, {dy, xhat});
  if (rank == 1) return {dx, dy_xhat, dy};
  Ints leading(rank - 1);
  std::iota(leading.begin(), leading.end(), 0);
  const ValueId dgamma = rw.emit(Op::kSum, {dy_xhat}, {{"axes", leading}});
  const ValueId dbeta = rw.emit(Op::kSum, {dy}, {{"axes", leading}});
  return {dx, dgamma, dbeta};
}

const std::array kRules = {
    // cross_entropy_grad -> softmax + elementwise (see the header for the exact form).
    RewriteRule{"cross-entropy-grad-decompose", cross_entropy_grad},
    // layer_norm_grad -> row means for dx, column sums for dgamma and dbeta.
    RewriteRule{"layer-norm-grad-decompose", layer_norm_grad},
};

}  // namespace

std::span<const RewriteRule> training_rewrite_rules() { return kRules; }

bool TrainingRewrites::run(Graph& graph) {
  fired_ = apply_rules(graph, kRules);
  return !fired_.empty();
}

}  // namespace kiln

// Gradients of the reductions (src/ops/reduction.cc): sum, mean and max against float64 central
// differences over axes/keepdims variants, hand-checked broadcast-back values, max's tie rule
// (equal shares) and NaN rule (zero), and argmax refusing to carry a gradient.
#include <cmath>

#include "gradcheck.h"
#include "ir/builder.h"
#include "ops/elementwise_test_util.h"
#include "passes/autodiff.h"
#include "runtime/executor.h"

namespace kiln::testing {
namespace {

using Ints = std::vector<int64_t>;

Tensor rand64(Shape shape, uint64_t seed) { return rand(DType::kF64, std::move(shape), seed); }

// d(output 0) / d(graph input 0).
Tensor gradient(const Graph& graph, const std::vector<Tensor>& inputs) {
  AutodiffResult result = autodiff(graph, graph.outputs.at(0), {graph.inputs.at(0).value});
  result.graph.outputs = result.gradients;
  return Executor(result.graph, {Device::kCpu, {"reference"}}).run(inputs).at(0);
}

// Axes variants on a (2, 3, 4) input: all ([]), one, a negative one, two, every axis listed.
const Ints kAxes[] = {{}, {1}, {-1}, {0, 2}, {2, 0}, {0, 1, 2}};

TEST(ReductionGrad, SumMeanMaxAxesAndKeepdims) {
  uint64_t seed = 1;
  for (Op op : {Op::kSum, Op::kMean, Op::kMax}) {
    for (const Ints& axes : kAxes) {
      for (bool keepdims : {false, true}) {
        SCOPED_TRACE(fmt::format("{} axes=[{}] keepdims={}", op_name(op), fmt::join(axes, ","),
                                 keepdims));
        // Independent uniform draws: max has a unique maximum in every group.
        expect_op_gradients(op, {rand64({2, 3, 4}, ++seed)},
                            {{"axes", axes}, {"keepdims", keepdims}});
      }
    }
  }
}

TEST(ReductionGrad, ScalarAndVectorInputs) {
  uint64_t seed = 100;
  for (Op op : {Op::kSum, Op::kMean, Op::kMax}) {
    SCOPED_TRACE(op_name(op));
    expect_op_gradients(op, {rand64({}, ++seed)});
    expect_op_gradients(op, {rand64({}, ++seed)}, {{"keepdims", true}});
    expect_op_gradients(op, {rand64({7}, ++seed)});
    expect_op_gradients(op, {rand64({7}, ++seed)}, {{"axes", Ints{0}}, {"keepdims", true}});
    expect_op_gradients(op, {rand64({5, 1}, ++seed)}, {{"axes", Ints{1}}});  // size-1 axis
  }
}

TEST(ReductionGrad, SumAndMeanBroadcastBackHandValues) {
  // loss = sum(reduce(x) * w): d/dx[i, j] = w at x's reduced position (/ count for mean).
  Tensor xv = rand64({2, 3}, 200);
  {
    Builder b("sum_rows");
    Expr x = b.data("x", {2, 3}, DType::kF64);
    Graph g = b.finish({sum(sum(x, {1}) * b.constant({2}, {2, -1}, DType::kF64))});
    Tensor expected = make(DType::kF64, {2, 3}, {2, 2, 2, -1, -1, -1});
    EXPECT_TRUE(all_close(gradient(g, {xv}), expected, 0, 0));
  }
  {
    Builder b("mean_cols_keepdims");
    Expr x = b.data("x", {2, 3}, DType::kF64);
    Expr y = mean(x, {0}, /*keepdims=*/true);  // (1, 3)
    Graph g = b.finish({sum(y * b.constant({1, 3}, {4, 6, -8}, DType::kF64))});
    Tensor expected = make(DType::kF64, {2, 3}, {2, 3, -4, 2, 3, -4});
    EXPECT_TRUE(all_close(gradient(g, {xv}), expected, 0, 0));
  }
  {
    Builder b("mean_all");
    Expr x = b.data("x", {2, 3}, DType::kF64);
    Graph g = b.finish({mean(x) * 3.0});
    Tensor expected = make(DType::kF64, {2, 3}, std::vector<double>(6, 0.5));
    EXPECT_TRUE(all_close(gradient(g, {xv}), expected, 1e-16, 0));
  }
}

TEST(ReductionGrad, MaxSplitsTiesEqually) {
  // Row 0: maximum 3 twice -> 1/2 each; row 1: all equal -> 1/3 each; weights 1 and 6.
  Builder b("max_ties");
  Expr x = b.data("x", {2, 3}, DType::kF64);
  Graph g = b.finish({sum(max(x, {1}) * b.constant({2}, {1, 6}, DType::kF64))});
  Tensor dx = gradient(g, {make(DType::kF64, {2, 3}, {1, 3, 3, 2, 2, 2})});
  EXPECT_TRUE(all_close(dx, make(DType::kF64, {2, 3}, {0, 0.5, 0.5, 2, 2, 2}), 1e-15, 0));

  // Over all axes with keepdims, ties spread across rows.
  Builder b2("max_all_ties");
  x = b2.data("x", {2, 2}, DType::kF64);
  g = b2.finish({sum(max(x, {}, /*keepdims=*/true) * 8.0)});
  dx = gradient(g, {make(DType::kF64, {2, 2}, {5, -1, 0, 5})});
  EXPECT_TRUE(all_close(dx, make(DType::kF64, {2, 2}, {4, 0, 0, 4}), 0, 0));
}

TEST(ReductionGrad, MaxOverNaNGivesZeroGradient) {
  Builder b("max_nan");
  Expr x = b.data("x", {2, 2}, DType::kF64);
  Graph g = b.finish({sum(max(x, {1}))});
  Tensor dx = gradient(g, {make(DType::kF64, {2, 2}, {NAN, 1, 2, 3})});
  // Row 0's maximum is NaN (no element equals it): no gradient; row 1 as usual.
  EXPECT_TRUE(all_close(dx, make(DType::kF64, {2, 2}, {0, 0, 0, 1}), 0, 0));
}

TEST(ReductionGrad, ArgmaxIsNotDifferentiable) {
  EXPECT_FALSE(op_def(Op::kArgmax).differentiable);
  // A float path through argmax does not exist (its output is i64), so x simply gets no
  // gradient from it, while max, next to it, still gives one.
  Builder b("argmax_and_max");
  Expr x = b.data("x", {2, 3}, DType::kF64);
  Graph g = b.finish({sum(cast(argmax(x), DType::kF64)) + sum(max(x, {1}))});
  Tensor dx = gradient(g, {make(DType::kF64, {2, 3}, {1, 4, 2, 9, 3, 5})});
  EXPECT_TRUE(all_close(dx, make(DType::kF64, {2, 3}, {0, 1, 0, 1, 0, 0}), 0, 0));
}

TEST(ReductionGrad, SoftmaxLikeComposite) {
  // log(sum(exp(x - max(x)))) + max(x) over rows: its gradient is softmax(x), a closed form.
  Builder b("logsumexp");
  Expr x = b.data("x", {3, 5}, DType::kF64);
  Expr m = max(x, {1}, /*keepdims=*/true);
  Expr lse = log(sum(exp(x - m), {1})) + max(x, {1});
  Graph g = b.finish({sum(lse)});
  Tensor xv = rand64({3, 5}, 300);
  Tensor dx = gradient(g, {xv});
  for (int64_t r = 0; r < 3; ++r) {
    double total = 0;
    for (int64_t c = 0; c < 5; ++c) total += std::exp(xv.get(r * 5 + c));
    for (int64_t c = 0; c < 5; ++c)
      EXPECT_NEAR(dx.get(r * 5 + c), std::exp(xv.get(r * 5 + c)) / total, 1e-14);
  }
  expect_graph_gradients(g, 0, {0}, {xv});
}

}  // namespace
}  // namespace kiln::testing

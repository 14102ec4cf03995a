// The autodiff pass itself: fan-out accumulation, broadcast reduction, integer inputs, errors.
// (Each op's gradient rule is checked in tests/ops/*_grad_test.cc.)
#include "gradcheck.h"
#include "ir/builder.h"
#include "passes/autodiff.h"
#include "runtime/executor.h"

namespace kiln {
namespace {

TEST(Autodiff, FanOutAccumulatesAndBroadcastReduces) {
  // loss = sum((x * x + b) * x), b broadcast over rows: d/dx = 3x^2 + b, d/db = column sums of x.
  Builder bld("fanout");
  Expr x = bld.data("x", {3, 4}, DType::kF64);
  Expr b = bld.data("b", {4}, DType::kF64);
  Expr loss = sum((x * x + b) * x);
  Graph g = bld.finish({loss});
  Tensor xv = random_tensor({DType::kF64, {3, 4}}, 1);
  Tensor bv = random_tensor({DType::kF64, {4}}, 2);
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value, g.inputs[1].value});
  r.graph.outputs = r.gradients;
  std::vector<Tensor> grads = Executor(r.graph).run(std::vector<Tensor>{xv, bv});
  for (int64_t i = 0; i < 12; ++i)
    EXPECT_NEAR(grads[0].get(i), 3 * xv.get(i) * xv.get(i) + bv.get(i % 4), 1e-12);
  for (int64_t j = 0; j < 4; ++j)
    EXPECT_NEAR(grads[1].get(j), xv.get(j) + xv.get(4 + j) + xv.get(8 + j), 1e-12);
}

TEST(Autodiff, UnusedParameterGetsZeroGradient) {
  Builder bld("unused");
  Expr x = bld.data("x", {2}, DType::kF64);
  Expr u = bld.data("u", {5}, DType::kF64);
  Graph g = bld.finish({sum(x * x), u});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[1].value});
  r.graph.outputs = r.gradients;
  std::vector<Tensor> grads = Executor(r.graph).run(std::vector<Tensor>{random_tensor({DType::kF64, {2}}, 3), random_tensor({DType::kF64, {5}}, 4)});
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(grads[0].get(i), 0.0);
}

TEST(Autodiff, RejectsNonScalarLossAndIntegerWrt) {
  Builder bld("bad");
  Expr x = bld.data("x", {2}, DType::kF32);
  Expr i = bld.data("i", {2}, DType::kI64);
  Graph g = bld.finish({x * 2.0, i});
  EXPECT_THROW(autodiff(g, g.outputs[0], {g.inputs[0].value}), Error);
  EXPECT_THROW(autodiff(g, g.outputs[0], {g.inputs[1].value}), Error);
}

TEST(Autodiff, IntegerPathCarriesNoGradient) {
  // loss depends on x only through argmax: no gradient exists.
  Builder bld("argmax");
  Expr x = bld.data("x", {3, 4}, DType::kF32);
  Expr loss = sum(cast(argmax(x), DType::kF32));
  Graph g = bld.finish({loss});
  // argmax cuts the float path, so x's gradient is simply zero (nothing flows through ints).
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
  r.graph.outputs = r.gradients;
  std::vector<Tensor> grads = Executor(r.graph).run(std::vector<Tensor>{random_tensor({DType::kF32, {3, 4}}, 5)});
  for (int64_t k = 0; k < 12; ++k) EXPECT_EQ(grads[0].get(k), 0.0);
}

}  // namespace
}  // namespace kiln

// Gradients of the elementwise ops (src/ops/elementwise.cc): gelu_grad's reference kernel on
// closed-form derivatives and against finite differences of gelu; every gradient rule against
// float64 central differences (expect_op_gradients) on random inputs kept away from kinks and
// domain edges, over several broadcasting shapes; the tie rule of maximum/minimum, cast and
// dropout exactly; and autodiff through a small composite expression.
#include <cmath>
#include <numbers>

#include "gradcheck.h"
#include "ir/builder.h"
#include "ops/elementwise_test_util.h"
#include "passes/autodiff.h"
#include "runtime/executor.h"

namespace kiln::testing {
namespace {

Tensor rand64(Shape shape, uint64_t seed, double low = -1.0, double high = 1.0) {
  return rand(DType::kF64, std::move(shape), seed, low, high);
}

// Random values with |x| in [0.2, 1.2]: far (on the scale of the finite-difference step) from
// the kink at 0 of relu and abs.
Tensor away_from_zero(Shape shape, uint64_t seed) {
  Tensor x = rand64(std::move(shape), seed);
  for (int64_t i = 0; i < x.numel(); ++i) {
    double v = x.get(i);
    x.set(i, v < 0 ? v - 0.2 : v + 0.2);
  }
  return x;
}

// Runs `graph` on `inputs` and returns d(output 0) / d(graph input i) for each i in wrt.
std::vector<Tensor> gradients(const Graph& graph, const std::vector<int>& wrt,
                              const std::vector<Tensor>& inputs) {
  std::vector<ValueId> values;
  for (int i : wrt) values.push_back(graph.inputs.at(i).value);
  AutodiffResult result = autodiff(graph, graph.outputs.at(0), values);
  result.graph.outputs = result.gradients;
  return Executor(result.graph, {Device::kCpu, {"reference"}}).run(inputs);
}

const Shape kUnaryShapes[] = {{}, {7}, {2, 3, 4}};

// ---- gelu_grad ----

TEST(GeluGrad, InferenceKeepsXType) {
  for (DType dtype : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16}) {
    EXPECT_EQ(infer(Op::kGeluGrad, {tt(dtype, {2, 3}), tt(dtype, {2, 3})})[0], tt(dtype, {2, 3}));
    EXPECT_EQ(infer(Op::kGeluGrad, {tt(dtype, {}), tt(dtype, {})}, {{"approximate", "tanh"}})[0],
              tt(dtype, {}));
  }
}

TEST(GeluGrad, InferenceErrors) {
  const TensorType f32_3 = tt(DType::kF32, {3});
  EXPECT_TRUE(
      throws_with([] { infer(Op::kGeluGrad, {tt(DType::kI32, {3}), tt(DType::kI32, {3})}); },
                  {"gelu_grad", "needs a float tensor, got i32[3]"}));
  EXPECT_TRUE(throws_with(
      [&] { infer(Op::kGeluGrad, {f32_3, f32_3}, {{"approximate", "erf"}}); },
      {"gelu_grad", "\"erf\"", "\"none\" or \"tanh\""}));
  // dy must match x exactly: no broadcasting, no dtype promotion.
  EXPECT_TRUE(throws_with([&] { infer(Op::kGeluGrad, {tt(DType::kF32, {2, 3}), f32_3}); },
                          {"gelu_grad", "dy must have x's type f32[2,3], got f32[3]"}));
  EXPECT_TRUE(throws_with([&] { infer(Op::kGeluGrad, {f32_3, tt(DType::kF64, {3})}); },
                          {"gelu_grad", "dy must have x's type f32[3], got f64[3]"}));
  EXPECT_TRUE(throws_with([&] { infer(Op::kGeluGrad, {f32_3}); },
                          {"gelu_grad", "got 1 inputs, expected 2"}));
}

TEST(GeluGrad, ExactFormOnTabulatedNormalValues) {
  // gelu'(x) = Phi(x) + x phi(x), with the standard normal table:
  // Phi(1) = 0.841344746068543, phi(1) = 0.241970724519143,
  // Phi(2) = 0.977249868051821, phi(2) = 0.053990966513188, and Phi(-x) = 1 - Phi(x).
  Tensor x = make(DType::kF64, {5}, {0, 1, -1, 2, -2});
  Tensor dy = make(DType::kF64, {5}, {1, 2, 1, -1, 4});
  const double d1 = 0.841344746068543 + 0.241970724519143;
  const double dm1 = (1 - 0.841344746068543) - 0.241970724519143;
  const double d2 = 0.977249868051821 + 2 * 0.053990966513188;
  const double dm2 = (1 - 0.977249868051821) - 2 * 0.053990966513188;
  Tensor expected = make(DType::kF64, {5}, {0.5, 2 * d1, dm1, -d2, 4 * dm2});
  EXPECT_TRUE(all_close(ref1(Op::kGeluGrad, {x, dy}), expected, 1e-14, 1e-13));
  EXPECT_TRUE(all_close(ref1(Op::kGeluGrad, {x, dy}, {{"approximate", "none"}}), expected, 1e-14,
                        1e-13));
}

TEST(GeluGrad, TanhFormClosedForm) {
  // gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3):
  // gelu'(x) = 0.5 (1 + tanh u) + 0.5 x sech^2(u) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
  auto derivative = [](double x) {
    double k = std::sqrt(2 / std::numbers::pi);
    double u = k * (x + 0.044715 * x * x * x);
    double sech = 1 / std::cosh(u);
    return 0.5 * (1 + std::tanh(u)) + 0.5 * x * sech * sech * k * (1 + 0.134145 * x * x);
  };
  std::vector<double> xs{0, 1, -1, 0.5, -2.5, 3}, dys{1, 1, 1, -2, 3, 0.25}, want;
  for (size_t i = 0; i < xs.size(); ++i) want.push_back(dys[i] * derivative(xs[i]));
  Tensor got = ref1(Op::kGeluGrad, {make(DType::kF64, {6}, xs), make(DType::kF64, {6}, dys)},
                    {{"approximate", "tanh"}});
  EXPECT_TRUE(all_close(got, make(DType::kF64, {6}, want), 1e-14, 1e-13));
  EXPECT_DOUBLE_EQ(got.get(0), 0.5);  // at 0 both forms give 1/2
}

TEST(GeluGrad, MatchesFiniteDifferencesOfGelu) {
  const double h = 1e-5;
  Tensor x = rand64({4, 5}, 1, -3.0, 3.0);
  Tensor ones = make(DType::kF64, {4, 5}, std::vector<double>(20, 1.0));
  Tensor plus = x.clone(), minus = x.clone();
  for (int64_t i = 0; i < x.numel(); ++i) {
    plus.set(i, x.get(i) + h);
    minus.set(i, x.get(i) - h);
  }
  for (const char* approximate : {"none", "tanh"}) {
    Attributes attrs{{"approximate", approximate}};
    Tensor up = ref1(Op::kGelu, {plus}, attrs), down = ref1(Op::kGelu, {minus}, attrs);
    Tensor numeric(x.type());
    for (int64_t i = 0; i < x.numel(); ++i) numeric.set(i, (up.get(i) - down.get(i)) / (2 * h));
    EXPECT_TRUE(all_close(ref1(Op::kGeluGrad, {x, ones}, attrs), numeric, 1e-9, 1e-8))
        << approximate;
  }
}

TEST(GeluGrad, F32KeepsDtype) {
  Tensor x = make(DType::kF32, {2}, {1, -1});
  Tensor dy = make(DType::kF32, {2}, {1, 1});
  Tensor got = ref1(Op::kGeluGrad, {x, dy});
  EXPECT_EQ(got.dtype(), DType::kF32);
  EXPECT_NEAR(got.get(0), 1.083315470587686, 1e-6);
  EXPECT_NEAR(got.get(1), -0.083315470587686, 1e-6);
}

// ---- unary rules ----

TEST(ElementwiseGrad, SmoothUnaryOnAnyInput) {
  uint64_t seed = 10;
  for (Op op : {Op::kNeg, Op::kErf, Op::kExp, Op::kTanh, Op::kSigmoid, Op::kSilu, Op::kSquare, Op::kSin,
                Op::kCos}) {
    for (const Shape& shape : kUnaryShapes) {
      SCOPED_TRACE(std::string(op_name(op)) + " " + to_string(shape));
      expect_op_gradients(op, {rand64(shape, ++seed, -2.0, 2.0)});
    }
  }
}

TEST(ElementwiseGrad, PositiveDomainUnary) {
  uint64_t seed = 30;
  for (Op op : {Op::kLog, Op::kSqrt, Op::kRsqrt, Op::kReciprocal}) {
    for (const Shape& shape : kUnaryShapes) {
      SCOPED_TRACE(std::string(op_name(op)) + " " + to_string(shape));
      expect_op_gradients(op, {rand64(shape, ++seed, 0.3, 3.0)});
    }
  }
  // reciprocal is also smooth for negative inputs.
  expect_op_gradients(Op::kReciprocal, {rand64({5}, 40, -3.0, -0.3)});
}

TEST(ElementwiseGrad, KinkedUnaryAwayFromZero) {
  uint64_t seed = 50;
  for (Op op : {Op::kRelu, Op::kAbs}) {
    for (const Shape& shape : kUnaryShapes) {
      SCOPED_TRACE(std::string(op_name(op)) + " " + to_string(shape));
      expect_op_gradients(op, {away_from_zero(shape, ++seed)});
    }
  }
}

TEST(ElementwiseGrad, ReluAndAbsAtZeroGiveZero) {
  // The documented subgradient choice at the kink.
  Builder b("kink");
  Expr x = b.data("x", {3}, DType::kF64);
  Graph g = b.finish({sum(relu(x) + abs(x))});
  std::vector<Tensor> dx = gradients(g, {0}, {make(DType::kF64, {3}, {-2, 0, 3})});
  EXPECT_TRUE(all_close(dx[0], make(DType::kF64, {3}, {-1, 0, 2}), 0, 0));
}

TEST(ElementwiseGrad, Gelu) {
  for (const char* approximate : {"none", "tanh"}) {
    for (const Shape& shape : kUnaryShapes) {
      SCOPED_TRACE(std::string(approximate) + " " + to_string(shape));
      expect_op_gradients(Op::kGelu, {rand64(shape, 60, -3.0, 3.0)},
                          {{"approximate", approximate}});
    }
  }
}

TEST(ElementwiseGrad, GeluEmitsGeluGradWithItsAttribute) {
  Builder b("gelu");
  Expr x = b.data("x", {4}, DType::kF64);
  Graph g = b.finish({sum(gelu(x, "tanh"))});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
  int found = 0;
  for (const Node& node : r.graph.nodes) {
    if (node.op != Op::kGeluGrad) continue;
    ++found;
    EXPECT_EQ(node.attrs.s("approximate"), "tanh");
  }
  EXPECT_EQ(found, 1);
}

// ---- binary rules ----

// (a shape, b shape): equal, b broadcast, a broadcast, both broadcast, scalar on either side.
const std::pair<Shape, Shape> kBinaryShapes[] = {
    {{2, 3}, {2, 3}}, {{2, 3}, {3}},    {{3}, {2, 3}},    {{2, 1, 4}, {3, 1}},
    {{4, 1}, {1, 5}}, {{}, {2, 3}},     {{2, 3}, {}},     {{}, {}},
};

TEST(ElementwiseGrad, AddSubMulAllShapes) {
  uint64_t seed = 100;
  for (Op op : {Op::kAdd, Op::kSub, Op::kMul}) {
    for (const auto& [sa, sb] : kBinaryShapes) {
      SCOPED_TRACE(std::string(op_name(op)) + " " + to_string(sa) + " " + to_string(sb));
      expect_op_gradients(op, {rand64(sa, ++seed), rand64(sb, ++seed)});
    }
  }
}

TEST(ElementwiseGrad, DivWithDivisorAwayFromZero) {
  uint64_t seed = 200;
  for (const auto& [sa, sb] : kBinaryShapes) {
    SCOPED_TRACE(to_string(sa) + " / " + to_string(sb));
    expect_op_gradients(Op::kDiv, {rand64(sa, ++seed), away_from_zero(sb, ++seed)});
  }
}

TEST(ElementwiseGrad, PowPositiveBase) {
  uint64_t seed = 300;
  for (const auto& [sa, sb] : kBinaryShapes) {
    SCOPED_TRACE(to_string(sa) + " ^ " + to_string(sb));
    expect_op_gradients(Op::kPow, {rand64(sa, ++seed, 0.3, 2.5), rand64(sb, ++seed, -1.5, 2.5)});
  }
}

TEST(ElementwiseGrad, PowWithConstantExponentTakesNoLogOfTheBase) {
  // x^2 with x < 0: the base gradient 2x is fine; the exponent gradient (log x = NaN) must not
  // be built, since the exponent is a constant.
  Builder b("square_by_pow");
  Expr x = b.data("x", {3}, DType::kF64);
  Graph g = b.finish({sum(pow(x, 2.0))});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
  for (const Node& node : r.graph.nodes) EXPECT_NE(node.op, Op::kLog);
  std::vector<Tensor> dx = gradients(g, {0}, {make(DType::kF64, {3}, {-1.5, 2, -3})});
  EXPECT_TRUE(all_close(dx[0], make(DType::kF64, {3}, {-3, 4, -6}), 1e-15, 0));
}

TEST(ElementwiseGrad, PowExponentGradientHandValues) {
  // d/da a^b = b a^(b-1), d/db a^b = a^b ln a: at a = 4, b = 0.5: 0.25 and 2 ln 4.
  Builder b("pow");
  Expr a = b.data("a", {}, DType::kF64);
  Expr e = b.data("b", {}, DType::kF64);
  Graph g = b.finish({pow(a, e)});
  std::vector<Tensor> d =
      gradients(g, {0, 1}, {make(DType::kF64, {}, {4}), make(DType::kF64, {}, {0.5})});
  EXPECT_NEAR(d[0].get(0), 0.25, 1e-15);
  EXPECT_NEAR(d[1].get(0), 2 * std::log(4.0), 1e-15);
}

TEST(ElementwiseGrad, MaximumMinimumDistinctValues) {
  uint64_t seed = 400;
  for (Op op : {Op::kMaximum, Op::kMinimum}) {
    for (const auto& [sa, sb] : kBinaryShapes) {
      SCOPED_TRACE(std::string(op_name(op)) + " " + to_string(sa) + " " + to_string(sb));
      // Independent uniform draws: ties (or near-ties within the step) do not happen.
      expect_op_gradients(op, {rand64(sa, ++seed), rand64(sb, ++seed)});
    }
  }
}

TEST(ElementwiseGrad, MaximumMinimumSplitTies) {
  // a (2, 2) against b (2,) broadcast over rows; ties at (0,0), (1,0), (1,1).
  Builder b("ties");
  Expr a = b.data("a", {2, 2}, DType::kF64);
  Expr c = b.data("b", {2}, DType::kF64);
  Expr w = b.data("w", {2, 2}, DType::kF64);
  Graph gmax = b.finish({sum(maximum(a, c) * w)});
  Tensor av = make(DType::kF64, {2, 2}, {1, 3, 1, 0});
  Tensor bv = make(DType::kF64, {2}, {1, 0});
  Tensor wv = make(DType::kF64, {2, 2}, {2, 4, 8, 16});
  std::vector<Tensor> d = gradients(gmax, {0, 1}, {av, bv, wv});
  // maximum: (0,0) tie -> 1 each; (0,1) a wins -> 4 to a; (1,0) tie -> 4 each; (1,1) tie -> 8 each.
  EXPECT_TRUE(all_close(d[0], make(DType::kF64, {2, 2}, {1, 4, 4, 8}), 0, 0));
  EXPECT_TRUE(all_close(d[1], make(DType::kF64, {2}, {1 + 4, 0 + 8}), 0, 0));

  Builder b2("ties_min");
  a = b2.data("a", {2, 2}, DType::kF64);
  c = b2.data("b", {2}, DType::kF64);
  w = b2.data("w", {2, 2}, DType::kF64);
  Graph gmin = b2.finish({sum(minimum(a, c) * w)});
  d = gradients(gmin, {0, 1}, {av, bv, wv});
  // minimum: (0,1) b wins -> 4 to b; the ties split as before.
  EXPECT_TRUE(all_close(d[0], make(DType::kF64, {2, 2}, {1, 0, 4, 8}), 0, 0));
  EXPECT_TRUE(all_close(d[1], make(DType::kF64, {2}, {1 + 4, 4 + 8}), 0, 0));
}

// ---- where, cast, dropout ----

Tensor random_condition(Shape shape, uint64_t seed) {
  Tensor u = rand64(shape, seed);
  std::vector<double> bits;
  for (int64_t i = 0; i < u.numel(); ++i) bits.push_back(u.get(i) > 0 ? 1.0 : 0.0);
  return make(DType::kBool, std::move(shape), bits);
}

TEST(ElementwiseGrad, WhereBroadcastsEitherWay) {
  // (condition, a, b) shapes.
  const Shape shapes[][3] = {{{2, 3}, {2, 3}, {2, 3}},
                             {{2, 3}, {3}, {2, 1}},
                             {{3}, {2, 3}, {}},
                             {{2, 1}, {}, {1, 4}},
                             {{}, {2, 2}, {2, 2}}};
  uint64_t seed = 500;
  for (const auto& s : shapes) {
    SCOPED_TRACE(to_string(s[0]) + " " + to_string(s[1]) + " " + to_string(s[2]));
    Tensor condition = random_condition(s[0], ++seed);
    expect_op_gradients(Op::kWhere, {condition, rand64(s[1], ++seed), rand64(s[2], ++seed)});
  }
}

TEST(ElementwiseGrad, WhereRoutesExactly) {
  Builder b("where");
  Expr cond = b.data("c", {4}, DType::kBool);
  Expr x = b.data("x", {4}, DType::kF64);
  Expr y = b.data("y", {}, DType::kF64);
  Graph g = b.finish({sum(where(cond, x, y) * b.constant({4}, {1, 2, 3, 4}, DType::kF64))});
  std::vector<Tensor> d = gradients(
      g, {1, 2},
      {make(DType::kBool, {4}, {1, 0, 0, 1}), rand64({4}, 1), make(DType::kF64, {}, {0.5})});
  EXPECT_TRUE(all_close(d[0], make(DType::kF64, {4}, {1, 0, 0, 4}), 0, 0));
  EXPECT_EQ(d[1].get(0), 2.0 + 3.0);  // y was broadcast to the two unselected positions
}

TEST(ElementwiseGrad, CastSameDtypeAndBack) {
  expect_op_gradients(Op::kCast, {rand64({2, 3}, 600)}, {{"dtype", DType::kF64}});
  // f64 -> f32: the f32 gradient comes back cast to f64, exactly.
  Builder b("cast");
  Expr x = b.data("x", {3}, DType::kF64);
  Expr w = b.data("w", {3}, DType::kF32);
  Graph g = b.finish({sum(cast(x, DType::kF32) * w)});
  Tensor wv = make(DType::kF32, {3}, {0.5, -1.25, 3});
  std::vector<Tensor> d = gradients(g, {0}, {rand64({3}, 601), wv});
  EXPECT_EQ(d[0].dtype(), DType::kF64);
  EXPECT_TRUE(all_close(d[0], make(DType::kF64, {3}, {0.5, -1.25, 3}), 0, 0));
  // f32 -> f64, differentiated with respect to the f32 input.
  Builder b2("cast_up");
  Expr h = b2.data("h", {2}, DType::kF32);
  Graph g2 = b2.finish({sum(cast(h, DType::kF64) * b2.constant({2}, {2, -4}, DType::kF64))});
  d = gradients(g2, {0}, {make(DType::kF32, {2}, {1, 1})});
  EXPECT_EQ(d[0].dtype(), DType::kF32);
  EXPECT_TRUE(all_close(d[0], make(DType::kF32, {2}, {2, -4}), 0, 0));
}

TEST(ElementwiseGrad, CastFromIntegerHasNoGradient) {
  // Called directly: autodiff never asks, since an integer value has no gradient to receive.
  Builder b("cast_int");
  Expr i = b.data("i", {3}, DType::kI64);
  Expr y = cast(i, DType::kF32);
  Expr dy = b.full({3}, 1.0, DType::kF32);
  const Node node = b.graph().nodes.at(0);
  ASSERT_EQ(node.op, Op::kCast);
  GradContext context{b, node, {i}, {y}, {dy}};
  std::vector<Expr> grads = op_def(Op::kCast).gradient(context);
  ASSERT_EQ(grads.size(), 1u);
  EXPECT_LT(grads[0].id(), 0);
}

TEST(ElementwiseGrad, DropoutReusesTheMask) {
  const double p = 0.3;
  Tensor xv = away_from_zero({8, 16}, 700);  // never 0, so a 0 output means dropped
  Tensor offset = make(DType::kI64, {}, {12});
  Tensor wv = rand64({8, 16}, 701);
  Tensor y = ref1(Op::kDropout, {xv, offset}, {{"p", p}, {"seed", int64_t{9}}});
  Builder b("dropout");
  Expr x = b.data("x", {8, 16}, DType::kF64);
  Expr o = b.data("o", {}, DType::kI64);
  Expr w = b.data("w", {8, 16}, DType::kF64);
  Graph g = b.finish({sum(dropout(x, p, 9, o) * w)});
  std::vector<Tensor> d = gradients(g, {0}, {xv, offset, wv});
  int64_t dropped = 0;
  for (int64_t i = 0; i < xv.numel(); ++i) {
    bool was_dropped = y.get(i) == 0.0;
    dropped += was_dropped;
    EXPECT_EQ(d[0].get(i), was_dropped ? 0.0 : wv.get(i) / (1 - p)) << i;
  }
  EXPECT_GT(dropped, 0);  // the mask is not trivial
  EXPECT_LT(dropped, xv.numel());

  // Through the gradient checker too, with and without the offset input.
  expect_op_gradients(Op::kDropout, {rand64({5, 6}, 702), offset},
                      {{"p", 0.5}, {"seed", int64_t{3}}});
  expect_op_gradients(Op::kDropout, {rand64({5, 6}, 703)}, {{"p", 0.2}, {"seed", int64_t{4}}});
}

// ---- what is not differentiable ----

TEST(ElementwiseGrad, EveryDifferentiableOpHasARuleAndTheRestSaySo) {
  for (Op op : {Op::kEq, Op::kNe, Op::kLt, Op::kLe, Op::kGt, Op::kGe, Op::kArgmax, Op::kIota,
                Op::kFull, Op::kConstant, Op::kGeluGrad}) {
    EXPECT_FALSE(op_def(op).differentiable) << op_name(op);
    EXPECT_FALSE(op_def(op).gradient) << op_name(op);
  }
  for (Op op : {Op::kAbs, Op::kAdd, Op::kCast, Op::kDiv, Op::kDropout, Op::kErf, Op::kExp, Op::kGelu,
                Op::kLog, Op::kMax, Op::kMaximum, Op::kMean, Op::kMinimum, Op::kMul, Op::kNeg,
                Op::kPow, Op::kReciprocal, Op::kRelu, Op::kRsqrt, Op::kSigmoid, Op::kSilu,
                Op::kSqrt, Op::kSquare, Op::kSub, Op::kSum, Op::kTanh, Op::kWhere, Op::kSin, Op::kCos}) {
    EXPECT_TRUE(op_def(op).differentiable) << op_name(op);
    EXPECT_TRUE(op_def(op).gradient) << op_name(op);
  }
}

TEST(ElementwiseGrad, AutodiffRefusesGeluGrad) {
  Builder b("second_order");
  Expr x = b.data("x", {3}, DType::kF64);
  Graph g = b.finish({sum(gelu_grad(x, x))});
  EXPECT_TRUE(throws_with([&] { autodiff(g, g.outputs[0], {g.inputs[0].value}); },
                          {"gelu_grad", "not differentiable"}));
}

// ---- composite ----

TEST(ElementwiseGrad, CompositeExpressionClosedForm) {
  // f(x) = e^x s(x) / (1 + x^2); ln f = x + ln s(x) - ln(1 + x^2), so
  // f'(x) = f(x) (1 + (1 - s(x)) - 2x / (1 + x^2)).
  Builder b("composite");
  Expr x = b.data("x", {3, 4}, DType::kF64);
  Graph g = b.finish({sum(exp(x) * sigmoid(x) / (1.0 + square(x)))});
  Tensor xv = rand64({3, 4}, 800, -2.0, 2.0);
  std::vector<Tensor> d = gradients(g, {0}, {xv});
  for (int64_t i = 0; i < xv.numel(); ++i) {
    double v = xv.get(i), s = 1 / (1 + std::exp(-v));
    double f = std::exp(v) * s / (1 + v * v);
    EXPECT_NEAR(d[0].get(i), f * (2 - s - 2 * v / (1 + v * v)), 1e-13) << i;
  }
  expect_graph_gradients(g, 0, {0}, {xv});
}

TEST(ElementwiseGrad, CompositeWithBroadcastingAndFanOut) {
  // Every input reaches the loss along several broadcast paths.
  Builder b("mixed");
  Expr x = b.data("x", {3, 4}, DType::kF64);
  Expr v = b.data("v", {4}, DType::kF64);
  Expr s = b.data("s", {}, DType::kF64);
  Expr h = tanh(x * v + s) - sqrt(square(x) + 1.0) / (v * v + s * s + 0.5);
  Expr k = maximum(h, x * 0.5) + where(gt(x, v), silu(x - v), gelu(x, "tanh") * s);
  Graph g = b.finish({mean(k * pow(exp(v) + 1.0, s)) + sum(rsqrt(exp(x) + v * v))});
  expect_graph_gradients(g, 0, {0, 1, 2},
                         {rand64({3, 4}, 900), rand64({4}, 901), rand64({}, 902)});
}

TEST(ElementwiseGrad, BertStyleGeluWrittenWithErf) {
  // 0.5 x (1 + erf(x / sqrt 2)), as BERT-style models and ONNX exports write the exact gelu:
  // the same values as gelu (approximate "none") and the same gradient.
  Builder b("bert_gelu");
  Expr x = b.data("x", {3, 5}, DType::kF64);
  Expr written = x * 0.5 * (erf(x * (1 / std::numbers::sqrt2)) + 1.0);
  Graph g = b.finish({sum(written * written), written, gelu(x)});
  const Tensor xv = rand64({3, 5}, 950, -3.0, 3.0);
  const std::vector<Tensor> inputs{xv};
  const std::vector<Tensor> out = Executor(g, {Device::kCpu, {"reference"}}).run(inputs);
  EXPECT_TRUE(all_close(out[1], out[2], 1e-15, 1e-14));
  expect_graph_gradients(g, 0, {0}, {xv});
}

}  // namespace
}  // namespace kiln::testing

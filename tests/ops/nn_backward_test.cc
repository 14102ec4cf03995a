// The NN backward ops (softmax_grad, log_softmax_grad, layer_norm_grad, rms_norm_grad,
// cross_entropy_grad, attention_grad, attention_qkv_grad): reference kernels on hand-worked
// cases, the same kernels against central differences of their forward op's reference kernel (no
// autodiff involved), attention_qkv_grad against attention_grad{bthd} on the split parts, and
// every inference error with its message.
#include <cmath>
#include <functional>

#include "ir/builder.h"
#include "runtime/executor.h"
#include "test_util.h"

namespace kiln {
namespace {

using testing::all_close;
using testing::error_of;
using testing::infer;
using testing::make;
using testing::run_reference;
using Ints = std::vector<int64_t>;



Tensor f64(Shape shape, std::vector<double> values) {
  return make(DType::kF64, std::move(shape), std::move(values));
}
Tensor rand64(Shape shape, uint64_t seed, double low = -1.0, double high = 1.0) {
  return testing::rand(DType::kF64, std::move(shape), seed, low, high);
}
TensorType f32(Shape shape) { return {DType::kF32, std::move(shape)}; }
TensorType of(DType dtype, Shape shape) { return {dtype, std::move(shape)}; }

// d/d inputs[wrt] of sum_k sum(forward_k(inputs) * weights[k]) by central differences of the
// forward op's reference kernel: the vector-Jacobian product a backward op must compute.
Tensor numeric_vjp(Op forward, const std::vector<Tensor>& inputs, const Attributes& attrs,
                   size_t wrt, const std::vector<Tensor>& weights, double epsilon = 1e-6) {
  std::vector<Tensor> perturbed = inputs;
  Tensor& x = perturbed[wrt];
  x = x.clone();
  auto loss = [&] {
    std::vector<Tensor> outs = run_reference(forward, perturbed, attrs);
    double total = 0.0;
    for (size_t k = 0; k < weights.size(); ++k)
      for (int64_t i = 0; i < outs[k].numel(); ++i) total += outs[k].get(i) * weights[k].get(i);
    return total;
  };
  Tensor grad(x.type());
  for (int64_t j = 0; j < x.numel(); ++j) {
    const double original = x.get(j);
    x.set(j, original + epsilon);
    const double plus = loss();
    x.set(j, original - epsilon);
    const double minus = loss();
    x.set(j, original);
    grad.set(j, (plus - minus) / (2 * epsilon));
  }
  return grad;
}

constexpr double kAtol = 1e-8, kRtol = 1e-6;  // finite differences in f64 with step 1e-6

// ---------------------------------------------------------------- softmax_grad

TEST(NnBackwardSoftmax, HandWorked) {
  // y = (1/4, 3/4), dy = (1, 3): sum(dy * y) = 5/2, dx = y * (dy - 5/2) = (-3/8, 3/8).
  EXPECT_TRUE(
      all_close(run_reference(Op::kSoftmaxGrad, {f64({2}, {0.25, 0.75}), f64({2}, {1, 3})})[0],
                f64({2}, {-0.375, 0.375}), 1e-15, 0));
  // Along axis 0: column 0 as above; column 1 has y = (1/2, 1/2), dy = (2, -2), sum 0.
  EXPECT_TRUE(
      all_close(run_reference(Op::kSoftmaxGrad,
                              {f64({2, 2}, {0.25, 0.5, 0.75, 0.5}), f64({2, 2}, {1, 2, 3, -2})},
                              {{"axis", int64_t{0}}})[0],
                f64({2, 2}, {-0.375, 1, 0.375, -1}), 1e-15, 0));
}

TEST(NnBackwardSoftmax, MatchesForwardDifferences) {
  for (int64_t axis : {-1, 0, 1}) {
    SCOPED_TRACE(axis);
    Attributes attrs{{"axis", axis}};
    Tensor x = rand64({2, 3, 4}, 1, -2, 2), dy = rand64({2, 3, 4}, 2);
    Tensor y = run_reference(Op::kSoftmax, {x}, attrs)[0];
    Tensor dx = run_reference(Op::kSoftmaxGrad, {y, dy}, attrs)[0];
    EXPECT_TRUE(all_close(dx, numeric_vjp(Op::kSoftmax, {x}, attrs, 0, {dy}), kAtol, kRtol));
  }
}

TEST(NnBackwardSoftmax, KeepsDtype) {
  Tensor y = run_reference(Op::kSoftmax, {testing::rand(DType::kF32, {3, 4}, 3)})[0];
  Tensor dx = run_reference(Op::kSoftmaxGrad, {y, testing::rand(DType::kF32, {3, 4}, 4)})[0];
  EXPECT_EQ(dx.type(), f32({3, 4}));
  EXPECT_EQ(infer(Op::kSoftmaxGrad, {of(DType::kBF16, {2, 5}), of(DType::kBF16, {2, 5})})[0],
            of(DType::kBF16, {2, 5}));
}

TEST(NnBackwardSoftmax, Errors) {
  for (Op op : {Op::kSoftmaxGrad, Op::kLogSoftmaxGrad}) {
    SCOPED_TRACE(op_name(op));
    const std::string name(op_name(op));
    EXPECT_KILN_ERROR(infer(op, {of(DType::kI32, {2, 3}), of(DType::kI32, {2, 3})}),
                      name + ": y is i32", "float");
    EXPECT_KILN_ERROR(infer(op, {f32({2, 3}), of(DType::kF64, {2, 3})}), "dy is f64",
                      "expected f32 like y");
    EXPECT_KILN_ERROR(infer(op, {f32({2, 3}), f32({3, 2})}),
                      "dy has shape (3, 2), expected (2, 3) like y");
    EXPECT_KILN_ERROR(infer(op, {f32({}), f32({})}), "y has shape ()", "rank >= 1");
    EXPECT_KILN_ERROR(infer(op, {f32({2, 3}), f32({2, 3})}, {{"axis", int64_t{2}}}),
                      "axis 2 is out of range for rank 2");
    EXPECT_KILN_ERROR(infer(op, {f32({2, 3})}), "got 1 inputs, expected 2");
  }
}

// ---------------------------------------------------------------- log_softmax_grad

TEST(NnBackwardLogSoftmax, HandWorked) {
  // dx = dy - exp(y) * sum(dy). Row 0: p = (1/4, 3/4), dy = (2, -1), sum 1: (7/4, -7/4).
  // Row 1: p = (1/10, 9/10), dy = (3, 0), sum 3: (3 - 3/10, -27/10).
  Tensor y = f64({2, 2}, {std::log(0.25), std::log(0.75), std::log(0.1), std::log(0.9)});
  EXPECT_TRUE(all_close(run_reference(Op::kLogSoftmaxGrad, {y, f64({2, 2}, {2, -1, 3, 0})})[0],
                        f64({2, 2}, {1.75, -1.75, 2.7, -2.7}), 1e-14, 0));
}

TEST(NnBackwardLogSoftmax, MatchesForwardDifferences) {
  for (int64_t axis : {-1, 0, -2}) {
    SCOPED_TRACE(axis);
    Attributes attrs{{"axis", axis}};
    Tensor x = rand64({3, 2, 4}, 5, -2, 2), dy = rand64({3, 2, 4}, 6);
    Tensor y = run_reference(Op::kLogSoftmax, {x}, attrs)[0];
    Tensor dx = run_reference(Op::kLogSoftmaxGrad, {y, dy}, attrs)[0];
    EXPECT_TRUE(all_close(dx, numeric_vjp(Op::kLogSoftmax, {x}, attrs, 0, {dy}), kAtol, kRtol));
  }
}

// ---------------------------------------------------------------- layer_norm_grad

TEST(NnBackwardLayerNorm, HandWorked) {
  // epsilon 0, C = 4, two rows with mean m and variance 1 so x_hat = x - m.
  // Row 0: x = (-1, -1, 1, 1), dy = (1, 0, 0, 0); g = dy * gamma = (1, 0, 0, 0),
  //   mean(g) = 1/4, mean(g * x_hat) = -1/4: dx = g - 1/4 + x_hat / 4 = (1/2, -1/2, 0, 0).
  // Row 1: x = (2, 0, 0, 2) (x_hat = (1, -1, -1, 1)), dy = (0, 0, 1, 1); g = (0, 0, 3, 4),
  //   mean(g) = 7/4, mean(g * x_hat) = 1/4: dx = g - 7/4 - x_hat / 4 = (-2, -3/2, 3/2, 2).
  // dgamma = sum dy * x_hat = (-1, 0, 0, 0) + (0, 0, -1, 1); dbeta = sum dy.
  Tensor x = f64({2, 4}, {-1, -1, 1, 1, 2, 0, 0, 2});
  Tensor gamma = f64({4}, {1, 2, 3, 4});
  Tensor dy = f64({2, 4}, {1, 0, 0, 0, 0, 0, 1, 1});
  std::vector<Tensor> out = run_reference(Op::kLayerNormGrad, {x, gamma, dy}, {{"epsilon", 0.0}});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(all_close(out[0], f64({2, 4}, {0.5, -0.5, 0, 0, -2, -1.5, 1.5, 2}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[1], f64({4}, {-1, 0, -1, 1}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[2], f64({4}, {1, 0, 1, 1}), 1e-14, 0));
}

TEST(NnBackwardLayerNorm, MatchesForwardDifferences) {
  for (Shape shape : {Shape{6}, Shape{3, 5}, Shape{2, 3, 4}}) {
    SCOPED_TRACE(to_string(shape));
    const int64_t c = shape.back();
    Attributes attrs{{"epsilon", 1e-5}};
    std::vector<Tensor> in{rand64(shape, 10), rand64({c}, 11), rand64({c}, 12)};
    Tensor dy = rand64(shape, 13);
    std::vector<Tensor> out = run_reference(Op::kLayerNormGrad, {in[0], in[1], dy}, attrs);
    for (size_t i = 0; i < 3; ++i)
      EXPECT_TRUE(all_close(out[i], numeric_vjp(Op::kLayerNorm, in, attrs, i, {dy}), kAtol, kRtol))
          << "input " << i;
  }
}

TEST(NnBackwardLayerNorm, Errors) {
  EXPECT_EQ(infer(Op::kLayerNormGrad, {f32({2, 3, 4}), f32({4}), f32({2, 3, 4})}),
            (std::vector<TensorType>{f32({2, 3, 4}), f32({4}), f32({4})}));
  EXPECT_KILN_ERROR(infer(Op::kLayerNormGrad, {f32({2, 4}), f32({3}), f32({2, 4})}),
                    "layer_norm_grad: gamma has shape (3,), expected (4,)", "(2, 4)");
  EXPECT_KILN_ERROR(infer(Op::kLayerNormGrad, {f32({2, 4}), f32({4}), f32({4, 2})}),
                    "dy has shape (4, 2), expected (2, 4) like x");
  EXPECT_KILN_ERROR(infer(Op::kLayerNormGrad, {f32({2, 4}), f32({4}), of(DType::kBF16, {2, 4})}),
                    "dy is bf16, expected f32 like x");
  EXPECT_KILN_ERROR(infer(Op::kLayerNormGrad,
                          {of(DType::kI64, {2, 4}), of(DType::kI64, {4}), of(DType::kI64, {2, 4})}),
                    "x is i64", "float");
  EXPECT_KILN_ERROR(infer(Op::kLayerNormGrad, {f32({}), f32({}), f32({})}), "x has shape ()");
  EXPECT_KILN_ERROR(infer(Op::kLayerNormGrad, {f32({2, 4}), f32({4})}), "got 2 inputs, expected 3");
}

// ---------------------------------------------------------------- rms_norm_grad

TEST(NnBackwardRmsNorm, HandWorked) {
  // epsilon 0, r = 1 / rms(x), dx = r * g - r^3 * x * sum(g * x) / C with g = dy * gamma.
  // Row 0: x = (1, 1, 1, 1), r = 1, dy = (1, 0, 0, 0): g = (1, 0, 0, 0), sum(g x) = 1:
  //   dx = g - x / 4 = (3/4, -1/4, -1/4, -1/4); dgamma += dy * x * r = (1, 0, 0, 0).
  // Row 1: x = (2, -2, 2, -2), r = 1/2, dy = (0, 1, 0, 1): g = (0, 2, 0, 4), sum(g x) = -12:
  //   dx = g / 2 + (1/8) * x * 12 / 4 = g / 2 + 3x/8 = (3/4, 1/4, 3/4, 5/4);
  //   dgamma += (0, -1, 0, -1).
  Tensor x = f64({2, 4}, {1, 1, 1, 1, 2, -2, 2, -2});
  Tensor gamma = f64({4}, {1, 2, 3, 4});
  Tensor dy = f64({2, 4}, {1, 0, 0, 0, 0, 1, 0, 1});
  std::vector<Tensor> out = run_reference(Op::kRmsNormGrad, {x, gamma, dy}, {{"epsilon", 0.0}});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(all_close(out[0], f64({2, 4}, {0.75, -0.25, -0.25, -0.25, 0.75, 0.25, 0.75, 1.25}),
                        1e-14, 0));
  EXPECT_TRUE(all_close(out[1], f64({4}, {1, -1, 0, -1}), 1e-14, 0));
}

TEST(NnBackwardRmsNorm, MatchesForwardDifferences) {
  for (Shape shape : {Shape{5}, Shape{3, 4}, Shape{2, 2, 3}}) {
    SCOPED_TRACE(to_string(shape));
    Attributes attrs{{"epsilon", 1e-6}};
    std::vector<Tensor> in{rand64(shape, 20), rand64({shape.back()}, 21)};
    Tensor dy = rand64(shape, 22);
    std::vector<Tensor> out = run_reference(Op::kRmsNormGrad, {in[0], in[1], dy}, attrs);
    for (size_t i = 0; i < 2; ++i)
      EXPECT_TRUE(all_close(out[i], numeric_vjp(Op::kRmsNorm, in, attrs, i, {dy}), kAtol, kRtol))
          << "input " << i;
  }
}

TEST(NnBackwardRmsNorm, Errors) {
  EXPECT_EQ(infer(Op::kRmsNormGrad, {f32({3, 4}), f32({4}), f32({3, 4})}),
            (std::vector<TensorType>{f32({3, 4}), f32({4})}));
  EXPECT_KILN_ERROR(infer(Op::kRmsNormGrad, {f32({3, 4}), of(DType::kF64, {4}), f32({3, 4})}),
                    "rms_norm_grad: gamma is f64, expected f32 like x");
  EXPECT_KILN_ERROR(infer(Op::kRmsNormGrad, {f32({3, 4}), f32({4, 1}), f32({3, 4})}),
                    "gamma has shape (4, 1), expected (4,)");
  EXPECT_KILN_ERROR(infer(Op::kRmsNormGrad, {f32({3, 4}), f32({4}), f32({3, 5})}),
                    "dy has shape (3, 5), expected (3, 4) like x");
}

// ---------------------------------------------------------------- cross_entropy_grad

TEST(NnBackwardCrossEntropy, HandWorked) {
  // Row 0: logits (0, 0) -> p = (1/2, 1/2), label 1: p - onehot = (1/2, -1/2).
  // Row 1: logits (ln 3, 0) -> p = (3/4, 1/4), label 0: (-1/4, 1/4).
  Tensor logits = f64({2, 2}, {0, 0, std::log(3.0), 0});
  Tensor labels = make(DType::kI64, {2}, {1, 0});
  auto grad = [&](const Tensor& l, const Tensor& dloss, const std::string& reduction,
                  int64_t ignore_index = -100) {
    return run_reference(Op::kCrossEntropyGrad, {logits, l, dloss},
                         {{"reduction", reduction}, {"ignore_index", ignore_index}})[0];
  };
  // mean over 2 rows, dloss 2: scale 1.
  EXPECT_TRUE(all_close(grad(labels, f64({}, {2}), "mean"), f64({2, 2}, {0.5, -0.5, -0.25, 0.25}),
                        1e-15, 0));
  // sum, dloss 3.
  EXPECT_TRUE(all_close(grad(labels, f64({}, {3}), "sum"), f64({2, 2}, {1.5, -1.5, -0.75, 0.75}),
                        1e-15, 0));
  // none, dloss per row (2, -1).
  EXPECT_TRUE(all_close(grad(labels, f64({2}, {2, -1}), "none"), f64({2, 2}, {1, -1, 0.25, -0.25}),
                        1e-15, 0));
  // Row 1 ignored: mean over 1 row, dloss 2 -> row 0 doubled, row 1 zero.
  Tensor one_ignored = make(DType::kI64, {2}, {1, -100});
  EXPECT_TRUE(
      all_close(grad(one_ignored, f64({}, {2}), "mean"), f64({2, 2}, {1, -1, 0, 0}), 1e-15, 0));
  EXPECT_TRUE(
      all_close(grad(one_ignored, f64({}, {2}), "sum"), f64({2, 2}, {1, -1, 0, 0}), 1e-15, 0));
  EXPECT_TRUE(
      all_close(grad(one_ignored, f64({2}, {2, 5}), "none"), f64({2, 2}, {1, -1, 0, 0}), 1e-15, 0));
  // ignore_index 0 ignores row 1 the same way.
  EXPECT_TRUE(
      all_close(grad(labels, f64({}, {2}), "mean", 0), f64({2, 2}, {1, -1, 0, 0}), 1e-15, 0));
  // Every row ignored: all zeros (no 0/0).
  EXPECT_TRUE(all_close(grad(make(DType::kI64, {2}, {-100, -100}), f64({}, {2}), "mean"),
                        f64({2, 2}, {0, 0, 0, 0}), 0, 0));
}

TEST(NnBackwardCrossEntropy, MatchesForwardDifferences) {
  struct Case {
    Shape logits;
    std::vector<double> labels;
    int64_t ignore_index;
  };
  const std::vector<Case> cases{
      {{4, 5}, {0, 4, 2, 2}, -100},
      {{4, 3}, {2, -100, 0, -100}, -100},
      {{2, 3, 4}, {3, 0, 1, 1, 2, 3}, 1},
      {{2, 3}, {-100, -100}, -100},
  };
  for (const Case& c : cases)
    for (const char* reduction : {"mean", "sum", "none"}) {
      SCOPED_TRACE(::testing::Message() << to_string(c.logits) << " " << reduction);
      Attributes attrs{{"reduction", std::string(reduction)}, {"ignore_index", c.ignore_index}};
      Shape rows(c.logits.begin(), c.logits.end() - 1);
      std::vector<Tensor> in{rand64(c.logits, 30, -2, 2), make(DType::kI64, rows, c.labels)};
      Tensor dloss = std::string(reduction) == "none" ? rand64(rows, 31) : f64({}, {0.7});
      Tensor dlogits = run_reference(Op::kCrossEntropyGrad, {in[0], in[1], dloss}, attrs)[0];
      EXPECT_TRUE(
          all_close(dlogits, numeric_vjp(Op::kCrossEntropy, in, attrs, 0, {dloss}), kAtol, kRtol));
    }
}

TEST(NnBackwardCrossEntropy, Errors) {
  const TensorType logits = f32({4, 5}), labels = of(DType::kI64, {4});
  EXPECT_EQ(infer(Op::kCrossEntropyGrad, {logits, labels, f32({})})[0], logits);
  EXPECT_EQ(infer(Op::kCrossEntropyGrad, {logits, labels, f32({4})},
                  {{"reduction", std::string("none")}})[0],
            logits);
  EXPECT_KILN_ERROR(infer(Op::kCrossEntropyGrad, {logits, labels, f32({4})}),
                    "cross_entropy_grad: dloss has shape (4,), expected ()", "\"mean\"");
  EXPECT_KILN_ERROR(
      infer(Op::kCrossEntropyGrad, {logits, labels, f32({})}, {{"reduction", std::string("none")}}),
      "dloss has shape (), expected (4,)", "\"none\"");
  EXPECT_KILN_ERROR(infer(Op::kCrossEntropyGrad, {logits, labels, of(DType::kF64, {})}),
                    "dloss is f64, expected f32 like logits");
  EXPECT_KILN_ERROR(infer(Op::kCrossEntropyGrad, {logits, f32({4}), f32({})}), "labels are f32",
                    "i32 or i64");
  EXPECT_KILN_ERROR(infer(Op::kCrossEntropyGrad, {logits, of(DType::kI64, {5}), f32({})}),
                    "labels have shape (5,), expected (4,)");
  EXPECT_KILN_ERROR(infer(Op::kCrossEntropyGrad, {of(DType::kI32, {4, 5}), labels, f32({})}),
                    "logits is i32", "float");
  EXPECT_KILN_ERROR(
      infer(Op::kCrossEntropyGrad, {logits, labels, f32({})}, {{"reduction", std::string("avg")}}),
      "reduction is \"avg\"", "\"mean\", \"sum\", \"none\"");
  // Kernel-time: a label outside [0, V) that is not ignore_index.
  EXPECT_KILN_ERROR(
      run_reference(Op::kCrossEntropyGrad,
                    {rand64({2, 3}, 32), make(DType::kI64, {2}, {0, 3}), f64({}, {1})}),
      "cross_entropy_grad: label 3 (row 1) is out of range [0, 3)", "not ignore_index -100");
}

// ---------------------------------------------------------------- attention_grad

TEST(NnBackwardAttention, HandWorked) {
  // One query, two keys, D = Dv = 1, scale 1 (= 1/sqrt(1)). q = 1, k = (0, ln 3): scores
  // (0, ln 3), lse = ln(1 + 3) = ln 4, P = (1/4, 3/4). v = (1, 3): out = 1/4 + 9/4 = 5/2.
  // dout = 2.
  //   dv_j = P_j * dout = (1/2, 3/2); dP_j = dout * v_j = (2, 6); D = dout * out = 5;
  //   dS = P * (dP - 5) = (-3/4, 3/4); dq = sum_j dS_j k_j = (3/4) ln 3; dk_j = dS_j q.
  const double ln3 = std::log(3.0), ln4 = std::log(4.0);
  std::vector<Tensor> out = run_reference(
      Op::kAttentionGrad, {f64({1, 1}, {1}), f64({2, 1}, {0, ln3}), f64({2, 1}, {1, 3}),
                           f64({1, 1}, {2.5}), f64({1, 1}, {2}), f64({1}, {ln4})});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(all_close(out[0], f64({1, 1}, {0.75 * ln3}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[1], f64({2, 1}, {-0.75, 0.75}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[2], f64({2, 1}, {0.5, 1.5}), 1e-14, 0));
}

TEST(NnBackwardAttention, HandWorkedCausal) {
  // Two queries, two keys, causal. Query 0 sees only key 0 (score 0, lse 0, P = (1, 0), out =
  // v_0 = 1): its dS is 0, so it adds dout_0 = 5 to dv_0 and nothing to dq_0 or dk. Query 1 is
  // the case above (q_1 = 1, dout_1 = 2, lse ln 4, out 5/2), so dv = (5 + 1/2, 3/2),
  // dq = (0, (3/4) ln 3), dk = (-3/4, 3/4) * q_1.
  const double ln3 = std::log(3.0), ln4 = std::log(4.0);
  std::vector<Tensor> out = run_reference(
      Op::kAttentionGrad,
      {f64({2, 1}, {7, 1}), f64({2, 1}, {0, ln3}), f64({2, 1}, {1, 3}), f64({2, 1}, {1, 2.5}),
       f64({2, 1}, {5, 2}), f64({2}, {0, ln4})},
      {{"causal", true}});
  EXPECT_TRUE(all_close(out[0], f64({2, 1}, {0, 0.75 * ln3}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[1], f64({2, 1}, {-0.75, 0.75}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[2], f64({2, 1}, {5.5, 1.5}), 1e-14, 0));
}

TEST(NnBackwardAttention, ScaleMultipliesTheScores) {
  // scale 2 with q = 1/2 gives the scores of the first hand case: P = (1/4, 3/4), dS as there;
  // dq = scale * sum_j dS_j k_j = 2 * (3/4) ln 3, dk_j = scale * dS_j * q = dS_j.
  const double ln3 = std::log(3.0), ln4 = std::log(4.0);
  std::vector<Tensor> out = run_reference(
      Op::kAttentionGrad,
      {f64({1, 1}, {0.5}), f64({2, 1}, {0, ln3}), f64({2, 1}, {1, 3}), f64({1, 1}, {2.5}),
       f64({1, 1}, {2}), f64({1}, {ln4})},
      {{"scale", 2.0}});
  EXPECT_TRUE(all_close(out[0], f64({1, 1}, {1.5 * ln3}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[1], f64({2, 1}, {-0.75, 0.75}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[2], f64({2, 1}, {0.5, 1.5}), 1e-14, 0));
}

TEST(NnBackwardAttention, UsesTheGivenOutAndLse) {
  // The op is defined on the out and lse it is given (what the kernels use; autodiff's rule for
  // a loss on lse relies on it). The first hand case (q = 1, k = (0, ln 3), v = (1, 3),
  // dout = 2) with lse = ln 8 instead of ln 4: P = exp(s - ln 8) = (1/8, 3/8), so
  // dv = 2 P = (1/4, 3/4); D = dout * out = 5 as before, dS = P * ((2, 6) - 5) = (-3/8, 3/8),
  // dq = (3/8) ln 3, dk = dS.
  const double ln3 = std::log(3.0), ln4 = std::log(4.0), ln8 = std::log(8.0);
  const Tensor q = f64({1, 1}, {1}), k = f64({2, 1}, {0, ln3}), v = f64({2, 1}, {1, 3});
  std::vector<Tensor> out = run_reference(
      Op::kAttentionGrad, {q, k, v, f64({1, 1}, {2.5}), f64({1, 1}, {2}), f64({1}, {ln8})});
  EXPECT_TRUE(all_close(out[0], f64({1, 1}, {0.375 * ln3}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[1], f64({2, 1}, {-0.375, 0.375}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[2], f64({2, 1}, {0.25, 0.75}), 1e-14, 0));
  // out = 0 given (lse ln 4 again): D = 0, dS = P * dP = (1/2, 9/2), dq = (9/2) ln 3, dk = dS,
  // dv unchanged (1/2, 3/2).
  out = run_reference(Op::kAttentionGrad,
                      {q, k, v, f64({1, 1}, {0}), f64({1, 1}, {2}), f64({1}, {ln4})});
  EXPECT_TRUE(all_close(out[0], f64({1, 1}, {4.5 * ln3}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[1], f64({2, 1}, {0.5, 4.5}), 1e-14, 0));
  EXPECT_TRUE(all_close(out[2], f64({2, 1}, {0.5, 1.5}), 1e-14, 0));
}

TEST(NnBackwardAttention, MatchesForwardDifferences) {
  struct Case {
    Shape q, k, v;
    Attributes attrs;
  };
  const std::vector<Case> cases{
      {{3, 4}, {3, 4}, {3, 4}, {}},
      {{2, 3, 2}, {2, 5, 2}, {2, 5, 3}, {{"scale", 0.8}}},
      {{4, 3}, {4, 3}, {4, 2}, {{"causal", true}}},
      {{2, 2, 3, 2}, {2, 2, 4, 2}, {2, 2, 4, 2}, {{"causal", true}, {"scale", 1.3}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << to_string(c.q) << " " << to_string(c.k) << " " << to_string(c.v));
    std::vector<Tensor> in{rand64(c.q, 40), rand64(c.k, 41), rand64(c.v, 42)};
    Shape out_shape = c.q;
    out_shape.back() = c.v.back();
    Tensor dout = rand64(out_shape, 43);
    std::vector<Tensor> fwd = run_reference(Op::kAttention, in, c.attrs);
    std::vector<Tensor> out =
        run_reference(Op::kAttentionGrad, {in[0], in[1], in[2], fwd[0], dout, fwd[1]}, c.attrs);
    for (size_t i = 0; i < 3; ++i)
      EXPECT_TRUE(
          all_close(out[i], numeric_vjp(Op::kAttention, in, c.attrs, i, {dout}), kAtol, kRtol))
          << "input " << i;
  }
}

TEST(NnBackwardAttention, Errors) {
  const TensorType q = f32({2, 3, 4}), k = f32({2, 5, 4}), v = f32({2, 5, 6});
  const TensorType out = f32({2, 3, 6}), lse = f32({2, 3});
  EXPECT_EQ(infer(Op::kAttentionGrad, {q, k, v, out, out, lse}),
            (std::vector<TensorType>{q, k, v}));
  EXPECT_KILN_ERROR(
      infer(Op::kAttentionGrad, {q, k, v, out, f32({2, 3, 4}), lse}),
      "attention_grad: dout has shape (2, 3, 4), expected (2, 3, 6) like attention's output");
  EXPECT_KILN_ERROR(
      infer(Op::kAttentionGrad, {q, k, v, f32({2, 3, 5}), out, lse}),
      "attention_grad: out has shape (2, 3, 5), expected (2, 3, 6) like attention's output");
  EXPECT_KILN_ERROR(infer(Op::kAttentionGrad, {q, k, v, of(DType::kBF16, {2, 3, 6}), out, lse}),
                    "out is bf16, expected f32");
  EXPECT_KILN_ERROR(infer(Op::kAttentionGrad, {q, k, v, out, out, f32({2, 5})}),
                    "lse is f32[2,5]", "expected f32[2,3]", "attention's lse");
  // 16-bit attention keeps an f32 lse; f64 has an f64 one.
  const TensorType h = of(DType::kBF16, {3, 4});
  EXPECT_NO_THROW(infer(Op::kAttentionGrad, {h, h, h, h, h, f32({3})}));
  EXPECT_KILN_ERROR(infer(Op::kAttentionGrad, {h, h, h, h, h, of(DType::kBF16, {3})}),
                    "lse is bf16[3]", "expected f32[3]");
  const TensorType d = of(DType::kF64, {3, 4});
  EXPECT_KILN_ERROR(infer(Op::kAttentionGrad, {d, d, d, d, d, f32({3})}), "lse is f32[3]",
                    "expected f64[3]");
  const TensorType s = f32({3, 4}), s_lse = f32({3});
  EXPECT_KILN_ERROR(
      infer(Op::kAttentionGrad, {s, s, s, s, of(DType::kF16, {3, 4}), s_lse}),
      "dout is f16, expected f32");
  EXPECT_KILN_ERROR(infer(Op::kAttentionGrad, {s, f32({3, 2}), s, s, s, s_lse}),
                    "head dims differ: q is (3, 4), k is (3, 2)");
  EXPECT_KILN_ERROR(infer(Op::kAttentionGrad, {s, s, f32({5, 4}), s, s, s_lse}),
                    "key lengths differ");
  EXPECT_KILN_ERROR(infer(Op::kAttentionGrad,
                          {q, f32({3, 3, 4}), f32({3, 3, 4}), f32({2, 3, 4}), f32({2, 3, 4}), lse}),
                    "head counts differ");  // q's 2 heads are not a multiple of k's 3
  EXPECT_KILN_ERROR(
      infer(Op::kAttentionGrad, {f32({4}), f32({4}), f32({4}), f32({4}), f32({4}), f32({})}),
      "q has shape (4,)", "rank >= 2");
  EXPECT_KILN_ERROR(infer(Op::kAttentionGrad, {s, s, s, s}), "got 4 inputs, expected 6");
}

// ---------------------------------------------------------------- attention_qkv_grad

// (..., T, 3, H, D) -> (..., T, H, D).
Shape unpacked(Shape qkv) {
  qkv.erase(qkv.end() - 3);
  return qkv;
}

struct QkvCase {
  Shape qkv;
  Attributes attrs;
};
const std::vector<QkvCase> kQkvCases{
    {{2, 4, 3, 3, 2}, {}},
    {{2, 4, 3, 3, 2}, {{"causal", true}}},
    {{5, 3, 2, 3}, {{"causal", true}, {"scale", 0.7}}},  // rank 4
    {{2, 2, 3, 3, 2, 2}, {{"scale", 1.4}}},              // rank 6
};

TEST(NnBackwardAttentionQkv, MatchesForwardDifferences) {
  for (const QkvCase& c : kQkvCases) {
    SCOPED_TRACE(to_string(c.qkv));
    const Tensor qkv = rand64(c.qkv, 50);
    const Tensor dout = rand64(unpacked(c.qkv), 51);
    std::vector<Tensor> fwd = run_reference(Op::kAttentionQkv, {qkv}, c.attrs);
    const Tensor dqkv =
        run_reference(Op::kAttentionQkvGrad, {qkv, fwd[0], dout, fwd[1]}, c.attrs)[0];
    EXPECT_TRUE(all_close(dqkv, numeric_vjp(Op::kAttentionQkv, {qkv}, c.attrs, 0, {dout}), kAtol,
                          kRtol));
  }
}

// attention_grad{bthd} on qkv's three parts, the gradients stacked back along axis -3: the
// graph attention_qkv_grad replaces.
Graph split_attention_grad_graph(const Shape& qkv_shape, const Attributes& attrs) {
  Builder b("split_attention_grad");
  const Shape part = unpacked(qkv_shape);
  Shape slot = qkv_shape;
  slot[slot.size() - 3] = 1;
  Expr qkv = b.data("qkv", qkv_shape, DType::kF64);
  Expr out = b.data("out", part, DType::kF64), dout = b.data("dout", part, DType::kF64);
  Expr lse = b.data("lse", Shape(part.begin(), part.end() - 1), DType::kF64);
  std::vector<Expr> in = split(qkv, {1, 1, 1}, -3);
  for (Expr& p : in) p = reshape(p, part);
  in.insert(in.end(), {out, dout, lse});
  Attributes bthd = attrs;
  bthd.set("layout", std::string("bthd"));
  std::vector<Expr> grads = b.apply(Op::kAttentionGrad, in, bthd);
  for (Expr& g : grads) g = reshape(g, slot);
  return b.finish({concat(grads, -3)});
}

TEST(NnBackwardAttentionQkv, EqualsBthdAttentionGradPacked) {
  // The same reference arithmetic on the same elements: equal exactly. out and lse given as
  // arbitrary tensors (the op uses them as given, like attention_grad).
  uint64_t seed = 60;
  for (const QkvCase& c : kQkvCases) {
    SCOPED_TRACE(to_string(c.qkv));
    const Shape part = unpacked(c.qkv);
    const std::vector<Tensor> in{rand64(c.qkv, ++seed), rand64(part, ++seed),
                                 rand64(part, ++seed),
                                 rand64(Shape(part.begin(), part.end() - 1), ++seed, 0.5, 2)};
    const Tensor packed = run_reference(Op::kAttentionQkvGrad, in, c.attrs)[0];
    const Graph g = split_attention_grad_graph(c.qkv, c.attrs);
    const Tensor split = Executor(g, ExecutorOptions{Device::kCpu, {"reference"}}).run(in)[0];
    EXPECT_TRUE(all_close(packed, split, 0, 0));
  }
}

TEST(NnBackwardAttentionQkv, HandWorked) {
  // T = 2, H = 1, D = 1: q = (1, 1), k = (0, 0), v = (1, 3) (every score 0), not causal.
  // P = 1/2 everywhere, out = (2, 2), lse = ln 2. dout = (1, 2):
  //   dv_j = sum_i P_ij dout_i = 3/2 for both keys.
  //   dP_ij = dout_i v_j: row 0 (1, 3), row 1 (2, 6); D_i = dout_i out_i = (2, 4).
  //   dS_ij = P_ij (dP_ij - D_i) = row 0 (-1/2, 1/2), row 1 (-1, 1).
  //   dq_i = sum_j dS_ij k_j = 0; dk_j = sum_i dS_ij q_i = (-3/2, 3/2).
  const Tensor qkv = make(DType::kF64, {2, 3, 1, 1}, {1, 0, 1, 1, 0, 3});
  const Tensor out = make(DType::kF64, {2, 1, 1}, {2, 2});
  const Tensor dout = make(DType::kF64, {2, 1, 1}, {1, 2});
  const Tensor lse = make(DType::kF64, {2, 1}, {std::log(2.0), std::log(2.0)});
  const Tensor dqkv =
      run_reference(Op::kAttentionQkvGrad, {qkv, out, dout, lse}, {{"scale", 1.0}})[0];
  // Per token: (dq, dk, dv).
  EXPECT_TRUE(all_close(dqkv, f64({2, 3, 1, 1}, {0, -1.5, 1.5, 0, 1.5, 1.5}), 1e-15, 1e-15));
}

TEST(NnBackwardAttentionQkv, Errors) {
  const TensorType qkv = f32({2, 5, 3, 4, 8}), out = f32({2, 5, 4, 8}), lse = f32({2, 5, 4});
  EXPECT_EQ(infer(Op::kAttentionQkvGrad, {qkv, out, out, lse}), (std::vector<TensorType>{qkv}));
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkvGrad, {f32({2, 5, 2, 4, 8}), out, out, lse}),
                    "attention_qkv_grad", "qkv has shape (2, 5, 2, 4, 8)",
                    "expected (..., T, 3, H, D)");
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkvGrad, {f32({3, 4, 8}), out, out, lse}),
                    "qkv has shape (3, 4, 8)");
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkvGrad, {of(DType::kI64, {2, 5, 3, 4, 8}), out, out,
                                                  lse}),
                    "qkv is i64", "expected a float dtype");
  EXPECT_KILN_ERROR(
      infer(Op::kAttentionQkvGrad, {qkv, f32({2, 5, 4, 7}), out, lse}),
      "out has shape (2, 5, 4, 7), expected (2, 5, 4, 8) like attention_qkv's output");
  EXPECT_KILN_ERROR(
      infer(Op::kAttentionQkvGrad, {qkv, out, f32({2, 4, 5, 8}), lse}),
      "dout has shape (2, 4, 5, 8), expected (2, 5, 4, 8) like attention_qkv's output");
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkvGrad, {qkv, out, of(DType::kBF16, {2, 5, 4, 8}), lse}),
                    "dout is bf16, expected f32");
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkvGrad, {qkv, of(DType::kF64, {2, 5, 4, 8}), out, lse}),
                    "out is f64, expected f32");
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkvGrad, {qkv, out, out, f32({2, 4, 5})}),
                    "lse is f32[2,4,5]", "expected f32[2,5,4]", "attention_qkv's lse");
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkvGrad, {qkv, out, out, of(DType::kBF16, {2, 5, 4})}),
                    "lse is bf16[2,5,4]", "expected f32[2,5,4]");
  // 16-bit qkv keeps an f32 lse, as attention does.
  const TensorType h = of(DType::kBF16, {5, 3, 2, 4}), h_out = of(DType::kBF16, {5, 2, 4});
  EXPECT_NO_THROW(infer(Op::kAttentionQkvGrad, {h, h_out, h_out, f32({5, 2})}));
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkvGrad, {qkv, out, out}), "got 3 inputs, expected 4");
}

}  // namespace
}  // namespace kiln

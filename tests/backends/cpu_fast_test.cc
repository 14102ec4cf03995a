// The CPU fast paths (dialects "cpu" and "openblas") against the reference kernels, the oracle:
// random inputs (never zeros), odd sizes (1, 7, 129: not multiples of the vector width), sizes
// large enough to be split across threads, each supported broadcast layout, per-op tolerances
// (f32 kernels against an f64 reference rounded to f32), and a case for every math line
// (ops/elementwise_math.h) that has a fast kernel. Also that supports() refuses what the fast
// kernels do not handle, so the reference serves it, and an Executor run with and without the
// fast dialects.
#include <cmath>
#include <set>

#include "ops/elementwise.h"
#include "runtime/executor.h"
#include "test_util.h"

namespace kiln {
namespace {

using testing::all_close;
using testing::expect_matches_reference;
using testing::selected_dialect;
using testing::Tolerance;
using testing::make;
using testing::rand;
using testing::run_dialect;
using testing::run_reference;

// Sizes: tiny, odd, not a multiple of 4 or 8 lanes, and one that parallel_for splits.
const std::vector<Shape> kUnaryShapes = {{1}, {7}, {129}, {3, 5, 33}, {301, 517}};

// ---- unary ----

struct UnaryCase {
  Op op;
  double low, high;  // input range
  Tolerance tol;
  Attributes attrs = {};
};

const std::vector<UnaryCase>& unary_cases() {
  static const std::vector<UnaryCase> cases = {
      {Op::kErf, -0.6, 0.6, {1e-9, 2e-6}},  // around the polynomial / erfc switch at 0.5
      {Op::kErf, -6, 6, {1e-9, 2e-6}},
      {Op::kExp, -10, 10, {1e-30, 2e-6}},
      {Op::kExp, -95, 95, {1e-37, 2e-6}},  // underflow to 0 / overflow to inf at the ends
      {Op::kLog, 0.01, 50, {1e-7, 1e-6}},
      {Op::kTanh, -0.6, 0.6, {1e-9, 2e-6}},  // around the polynomial / exp switch at 0.5
      {Op::kTanh, -12, 12, {1e-9, 2e-6}},
      {Op::kSigmoid, -30, 30, {1e-12, 2e-6}},
      {Op::kRelu, -1, 1, {0, 0}},
      {Op::kGelu, -6, 6, {1e-9, 1e-5}, {{"approximate", std::string("none")}}},
      {Op::kGelu, -0.5, 0.5, {1e-9, 2e-6}, {{"approximate", std::string("none")}}},
      {Op::kGelu, -6, 6, {1e-9, 1e-5}, {{"approximate", std::string("tanh")}}},
      {Op::kSilu, -30, 30, {1e-9, 2e-6}},
      {Op::kNeg, -1, 1, {0, 0}},
      {Op::kAbs, -1, 1, {0, 0}},
      {Op::kSqrt, 0.01, 100, {0, 1e-6}},
      {Op::kRsqrt, 0.01, 100, {0, 1e-6}},
      {Op::kReciprocal, 0.01, 100, {0, 1e-6}},
      {Op::kReciprocal, -100, -0.01, {0, 1e-6}},
      {Op::kSquare, -3, 3, {0, 1e-6}},
  };
  return cases;
}

TEST(CpuFastUnary, MatchesReference) {
  uint64_t seed = 1;
  for (const UnaryCase& c : unary_cases())
    for (const Shape& shape : kUnaryShapes)
      expect_matches_reference("cpu", c.op, {rand(DType::kF32, shape, seed++, c.low, c.high)},
                               c.attrs, c.tol);
}

TEST(CpuFastUnary, HandCheckedValues) {
  // exp(0) = 1, exp(1) = e, exp(-1) = 1/e; tanh(0.25) = 0.2449186624037092 (closed form
  // (e^0.5 - 1)/(e^0.5 + 1)); gelu(1) = Phi(1) = 0.8413447460685429; sigmoid(0) = 0.5.
  Tensor x = make(DType::kF32, {3}, {0.0, 1.0, -1.0});
  Tensor e = run_dialect("cpu", Op::kExp, {x})[0];
  EXPECT_EQ(e.get(0), 1.0);
  EXPECT_NEAR(e.get(1), 2.718281828459045, 3e-7);
  EXPECT_NEAR(e.get(2), 0.36787944117144233, 5e-8);
  EXPECT_NEAR(run_dialect("cpu", Op::kTanh, {make(DType::kF32, {1}, {0.25})})[0].get(0),
              0.2449186624037092, 3e-8);
  EXPECT_NEAR(run_dialect("cpu", Op::kGelu, {make(DType::kF32, {1}, {1.0})})[0].get(0),
              0.8413447460685429, 2e-7);
  EXPECT_EQ(run_dialect("cpu", Op::kSigmoid, {make(DType::kF32, {1}, {0.0})})[0].get(0), 0.5);
}

// ---- binary ----

struct BinaryLayoutCase {
  Shape a, b;
};

const Op kLayoutOps[] = {Op::kAdd, Op::kSub, Op::kMul, Op::kDiv, Op::kMaximum, Op::kMinimum};

TEST(CpuFastBinary, MatchesReferenceOnEachSupportedLayout) {
  const std::vector<BinaryLayoutCase> layouts = {
      {{7}, {7}},                       // same shape
      {{3, 129}, {3, 129}},
      {{1, 3, 5}, {3, 5}},              // same up to leading 1s
      {{301, 517}, {301, 517}},         // split across threads
      {{4, 33}, {1}},                   // scalar b
      {{}, {4, 33}},                    // scalar a (rank 0)
      {{301, 517}, {1, 1}},             // scalar b, split across threads
      {{2, 3, 7}, {7}},                 // row b: (B, T, C) op (C,)
      {{2, 3, 7}, {3, 7}},              // row b: (B, T, C) op (T, C)
      {{2, 3, 129}, {1, 1, 129}},       // row b with leading 1s
      {{129}, {5, 3, 129}},             // row a: (C,) op (B, T, C)
      {{1000, 129}, {129}},             // row b, split across threads
      {{600, 1}, {1}},                  // row of one element
  };
  uint64_t seed = 100;
  for (Op op : kLayoutOps) {
    for (const BinaryLayoutCase& layout : layouts) {
      Tensor a = rand(DType::kF32, layout.a, seed++, -2.0, 2.0);
      // Divisors away from 0, of both signs.
      Tensor b = op == Op::kDiv ? rand(DType::kF32, layout.b, seed++, 0.5, 2.0)
                                : rand(DType::kF32, layout.b, seed++, -2.0, 2.0);
      expect_matches_reference("cpu", op, {a, b}, {}, {1e-7, 1e-6});
      if (op == Op::kDiv) expect_matches_reference("cpu", op, {b, a}, {}, {1e-7, 1e-6});
    }
  }
}

TEST(CpuFastBinary, PowMatchesReference) {
  uint64_t seed = 200;
  for (const Shape& shape : kUnaryShapes) {
    Tensor a = rand(DType::kF32, shape, seed++, 0.1, 4.0);  // a^b is NaN for a < 0
    Tensor b = rand(DType::kF32, shape, seed++, -3.0, 3.0);
    expect_matches_reference("cpu", Op::kPow, {a, b}, {}, {1e-7, 2e-6});
    expect_matches_reference("cpu", Op::kPow, {a, make(DType::kF32, {}, {2.0})}, {}, {1e-7, 2e-6});
  }
}

// gelu_grad(x, dy): rtol 1e-5 as gelu's fast kernel; atol 1e-7 for the zero of gelu' near
// x = -0.75, where Phi(x) and x phi(x) (about 0.23 each) cancel.
TEST(CpuFastBinary, GeluGradMatchesReference) {
  uint64_t seed = 300;
  for (const std::string approximate : {"none", "tanh"}) {
    const Attributes attrs{{"approximate", approximate}};
    for (const Shape& shape : kUnaryShapes) {
      for (const auto& [low, high] : {std::pair{-6.0, 6.0}, {-0.6, 0.6}, {-40.0, 40.0}}) {
        const Tensor x = rand(DType::kF32, shape, ++seed, low, high);
        const Tensor dy = rand(DType::kF32, shape, ++seed, -1, 1);
        expect_matches_reference("cpu", Op::kGeluGrad, {x, dy}, attrs, {1e-7, 1e-5});
      }
    }
  }
  EXPECT_EQ(selected_dialect(Op::kGeluGrad, {{DType::kF32, {4}}, {DType::kF32, {4}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kGeluGrad, {{DType::kF64, {4}}, {DType::kF64, {4}}}),
            "reference");
}

// gelu'(0) = 1/2 in both forms; exact gelu'(1) = Phi(1) + phi(1) = 0.8413447461 + 0.2419707245;
// tanh form at 1 (the closed form evaluated on a calculator): u = sqrt(2/pi) 1.044715 =
// 0.83356197, t = tanh(u) = 0.68238398, 0.5 (1 + t) + 0.5 (1 - t^2) sqrt(2/pi) (1 + 0.134145)
// = 0.84119199 + 0.24177209 = 1.08296408.
TEST(CpuFastBinary, GeluGradHandChecked) {
  const Tensor x = make(DType::kF32, {2}, {0.0, 1.0});
  const Tensor dy = make(DType::kF32, {2}, {3.0, 2.0});
  EXPECT_TRUE(all_close(
      run_dialect("cpu", Op::kGeluGrad, {x, dy}, {{"approximate", std::string("none")}})[0],
      make(DType::kF32, {2}, {1.5, 2.0 * 1.0833154706}), 0, 2e-6));
  EXPECT_TRUE(all_close(
      run_dialect("cpu", Op::kGeluGrad, {x, dy}, {{"approximate", std::string("tanh")}})[0],
      make(DType::kF32, {2}, {1.5, 2.0 * 1.08296408}), 0, 2e-6));
}

// Every math line with float outputs (ops/elementwise_math.h) runs through the "cpu" dialect, so
// each needs a case above: the unary cases, the layout ops, pow and gelu_grad.
TEST(CpuFast, EveryMathLineHasACase) {
  std::set<Op> covered = {std::begin(kLayoutOps), std::end(kLayoutOps)};
  covered.insert({Op::kPow, Op::kGeluGrad});
  for (const UnaryCase& c : unary_cases()) covered.insert(c.op);
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    if (!ops::is_math_op(op)) continue;
    const std::vector<TensorType> in(op_info(op).min_inputs, TensorType{DType::kF32, {4}});
    if (infer_types(op, in, normalize_attributes(op, {}))[0].dtype != DType::kF32) continue;
    EXPECT_EQ(selected_dialect(op, in), "cpu") << op_name(op);
    EXPECT_TRUE(covered.count(op)) << op_name(op) << " has no case in cpu_fast_test.cc";
  }
}

TEST(CpuFastBinary, MaximumAndMinimumPropagateNan) {
  Tensor a = make(DType::kF32, {3}, {NAN, 1.0, 2.0});
  Tensor b = make(DType::kF32, {3}, {1.0, NAN, 3.0});
  for (Op op : {Op::kMaximum, Op::kMinimum}) {
    Tensor out = run_dialect("cpu", op, {a, b})[0];
    EXPECT_TRUE(std::isnan(out.get(0))) << op_name(op);
    EXPECT_TRUE(std::isnan(out.get(1))) << op_name(op);
  }
  EXPECT_EQ(run_dialect("cpu", Op::kMaximum, {a, b})[0].get(2), 3.0);
  EXPECT_EQ(run_dialect("cpu", Op::kMinimum, {a, b})[0].get(2), 2.0);
}

TEST(CpuFastBinary, RefusesOtherBroadcastsAndDtypes) {
  const TensorType f32_btc{DType::kF32, {2, 3, 4}};
  // A column broadcast, an outer-product broadcast, a middle-dim broadcast: the reference's.
  EXPECT_EQ(selected_dialect(Op::kAdd, {f32_btc, {DType::kF32, {2, 3, 1}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kMul, {{DType::kF32, {3, 1}}, {DType::kF32, {1, 4}}}),
            "reference");
  EXPECT_EQ(selected_dialect(Op::kSub, {f32_btc, {DType::kF32, {2, 1, 4}}}), "reference");
  // Other dtypes.
  EXPECT_EQ(selected_dialect(Op::kAdd, {{DType::kF64, {4}}, {DType::kF64, {4}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kExp, {{DType::kF64, {4}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kRelu, {{DType::kBF16, {4}}}), "reference");
  // What it does support.
  EXPECT_EQ(selected_dialect(Op::kAdd, {f32_btc, {DType::kF32, {4}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kAdd, {{DType::kF32, {4}}, f32_btc}), "cpu");
  // Restricted to "cpu", a refused node has no kernel at all.
  Tensor a = rand(DType::kF32, {2, 3, 4}, 7), b = rand(DType::kF32, {2, 3, 1}, 8);
  EXPECT_THROW(run_dialect("cpu", Op::kAdd, {a, b}), Error);
  // The refused layout still runs, through the reference.
  Tensor out = run_reference(Op::kAdd, {a, b})[0];
  EXPECT_NEAR(out.get(5), a.get(5) + b.get(1), 1e-6);
}

// ---- reductions ----

TEST(CpuFastReduction, MatchesReferenceOverSuffixAxes) {
  struct Case {
    Shape shape;
    std::vector<int64_t> axes;
  };
  const std::vector<Case> cases = {
      {{7}, {}},              {{7}, {0}},         {{129}, {-1}},       {{3, 129}, {1}},
      {{3, 129}, {-1}},       {{3, 129}, {}},     {{3, 129}, {0, 1}},  {{2, 3, 7}, {1, 2}},
      {{2, 3, 7}, {-1, -2}},  {{1000, 129}, {1}},  // rows split across threads
      {{1, 1}, {}},           {{70001}, {}},       // one long row split across threads
      {{2, 70001}, {-1}},
      // Prefix axes (column reductions): bias gradients, one long column split over threads.
      {{3, 129}, {0}},        {{2, 3, 7}, {0, 1}},  {{2, 3, 7}, {-3}},   {{4096, 33}, {0}},
      {{70001, 2}, {0}},
  };
  uint64_t seed = 300;
  for (Op op : {Op::kSum, Op::kMean, Op::kMax}) {
    for (const Case& c : cases) {
      for (bool keepdims : {false, true}) {
        Attributes attrs{{"axes", c.axes}, {"keepdims", keepdims}};
        // Positive inputs keep sums away from cancellation, so rtol means something; signed
        // inputs check the max of negatives.
        Tolerance tol{1e-5, 1e-5};
        expect_matches_reference("cpu", op, {rand(DType::kF32, c.shape, seed++, 0.5, 1.5)}, attrs,
                                 tol);
        expect_matches_reference("cpu", op, {rand(DType::kF32, c.shape, seed++, -3.0, -1.0)},
                                 attrs, tol);
      }
    }
  }
}

TEST(CpuFastReduction, LongSumStaysCloseToTheF64Reference) {
  // 2^22 + 3 values in [0.5, 1.5): a naive f32 running sum would drift by ~1e-3 relative.
  Tensor x = rand(DType::kF32, {(1 << 22) + 3}, 11, 0.5, 1.5);
  expect_matches_reference("cpu", Op::kSum, {x}, {}, {0, 2e-7});
  expect_matches_reference("cpu", Op::kMean, {x}, {}, {0, 2e-7});
}

TEST(CpuFastReduction, MaxPropagatesNanAndKeepsInfinities) {
  Tensor x = make(DType::kF32, {4, 3},
                  {1.0, NAN, 3.0, 4.0, 5.0, 6.0, -INFINITY, INFINITY, 2.0, -INFINITY, -7.0, -8.0});
  Tensor out = run_dialect("cpu", Op::kMax, {x}, {{"axes", std::vector<int64_t>{-1}}})[0];
  EXPECT_TRUE(std::isnan(out.get(0)));
  EXPECT_EQ(out.get(1), 6.0);
  EXPECT_EQ(out.get(2), INFINITY);
  EXPECT_EQ(out.get(3), -7.0);
  // A NaN among 40 values, past the vectorized part's first 16 and 32.
  std::vector<double> values(40, 1.5);
  values[37] = NAN;
  EXPECT_TRUE(std::isnan(run_dialect("cpu", Op::kMax, {make(DType::kF32, {40}, values)})[0].get(0)));
}

TEST(CpuFastReduction, RefusesScatteredAxesAndOtherDtypes) {
  const TensorType x{DType::kF32, {3, 4, 5}};
  EXPECT_EQ(selected_dialect(Op::kSum, {x}, {{"axes", std::vector<int64_t>{0}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kSum, {x}, {{"axes", std::vector<int64_t>{0, 1}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kMean, {x}, {{"axes", std::vector<int64_t>{0, 2}}}),
            "reference");
  EXPECT_EQ(selected_dialect(Op::kMax, {x}, {{"axes", std::vector<int64_t>{1}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kSum, {{DType::kF64, {3, 4}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kSum, {{DType::kI32, {3, 4}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kSum, {x}, {{"axes", std::vector<int64_t>{1, 2}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kSum, {x}), "cpu");
}

// ---- softmax, log_softmax, layer_norm ----

const std::vector<Shape> kRowShapes = {{1}, {7}, {4, 129}, {3, 5, 33}, {2, 70001}, {700, 65}};

TEST(CpuFastNn, SoftmaxAndLogSoftmaxMatchReference) {
  uint64_t seed = 500;
  for (const Shape& shape : kRowShapes) {
    Tensor x = rand(DType::kF32, shape, seed++, -8.0, 8.0);
    expect_matches_reference("cpu", Op::kSoftmax, {x}, {}, {1e-9, 1e-5});
    expect_matches_reference("cpu", Op::kLogSoftmax, {x}, {}, {1e-5, 1e-6});
    Attributes last{{"axis", int64_t(shape.size()) - 1}};
    expect_matches_reference("cpu", Op::kSoftmax, {x}, last, {1e-9, 1e-5});
  }
  // Far from 0: the max shift matters.
  Tensor big = rand(DType::kF32, {3, 17}, 9, 80.0, 120.0);
  expect_matches_reference("cpu", Op::kSoftmax, {big}, {}, {1e-9, 1e-5});
  expect_matches_reference("cpu", Op::kLogSoftmax, {big}, {}, {2e-5, 1e-6});
}

TEST(CpuFastNn, SoftmaxHandChecked) {
  // softmax([0, ln 3]) = [1/4, 3/4].
  Tensor y = run_dialect("cpu", Op::kSoftmax, {make(DType::kF32, {1, 2}, {0.0, std::log(3.0)})})[0];
  EXPECT_NEAR(y.get(0), 0.25, 1e-7);
  EXPECT_NEAR(y.get(1), 0.75, 1e-7);
}

TEST(CpuFastNn, LayerNormMatchesReference) {
  uint64_t seed = 600;
  for (const Shape& shape : std::vector<Shape>{{1}, {5, 1}, {7}, {4, 129}, {3, 5, 33}, {2, 70001},
                                               {700, 65}}) {
    const Shape row{shape.back()};
    Tensor x = rand(DType::kF32, shape, seed++, -3.0, 3.0);
    Tensor gamma = rand(DType::kF32, row, seed++, 0.5, 1.5);
    Tensor beta = rand(DType::kF32, row, seed++, -1.0, 1.0);
    expect_matches_reference("cpu", Op::kLayerNorm, {x, gamma, beta}, {}, {2e-5, 1e-5});
    expect_matches_reference("cpu", Op::kLayerNorm, {x, gamma, beta}, {{"epsilon", 0.1}},
                             {2e-5, 1e-5});
  }
  // Rows with a large mean and a small spread: the variance must be taken about the mean.
  Tensor x = rand(DType::kF32, {6, 100}, 1, 99.0, 101.0);
  Tensor gamma = rand(DType::kF32, {100}, 2, 0.5, 1.5);
  Tensor beta = rand(DType::kF32, {100}, 3, -1.0, 1.0);
  expect_matches_reference("cpu", Op::kLayerNorm, {x, gamma, beta}, {}, {1e-4, 1e-5});
}

TEST(CpuFastNn, RefusesOtherAxesAndDtypes) {
  const TensorType x{DType::kF32, {3, 4}};
  EXPECT_EQ(selected_dialect(Op::kSoftmax, {x}, {{"axis", int64_t{0}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kLogSoftmax, {x}, {{"axis", int64_t{0}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kSoftmax, {x}, {{"axis", int64_t{1}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kSoftmax, {{DType::kF64, {3, 4}}}), "reference");
  const TensorType row64{DType::kF64, {4}};
  EXPECT_EQ(selected_dialect(Op::kLayerNorm, {{DType::kF64, {3, 4}}, row64, row64}), "reference");
  const TensorType row{DType::kF32, {4}};
  EXPECT_EQ(selected_dialect(Op::kLayerNorm, {x, row, row}), "cpu");
}

// ---- cross_entropy ----

// Labels (r * 7 + 3) % vocab, every `ignore_every`-th row set to `ignore`.
Tensor labels_for(DType dtype, const Shape& shape, int64_t vocab, int ignore_every, int64_t ignore) {
  std::vector<double> values;
  for (int64_t r = 0; r < numel(shape); ++r)
    values.push_back(ignore_every > 0 && r % ignore_every == 2 ? static_cast<double>(ignore)
                                                               : static_cast<double>((r * 7 + 3) % vocab));
  return make(dtype, shape, values);
}

TEST(CpuFastNn, CrossEntropyMatchesReference) {
  struct Case {
    Shape logits;
    DType label_dtype;
  };
  const std::vector<Case> cases = {{{1, 1}, DType::kI64},     {{7, 11}, DType::kI64},
                                   {{2, 3, 129}, DType::kI32}, {{4, 50001}, DType::kI64},
                                   {{600, 33}, DType::kI32},   {{5}, DType::kI64}};
  uint64_t seed = 700;
  for (const Case& c : cases) {
    Tensor logits = rand(DType::kF32, c.logits, seed++, -6.0, 6.0);
    const Shape label_shape(c.logits.begin(), c.logits.end() - 1);
    for (std::string reduction : {"mean", "sum", "none"}) {
      Tensor labels = labels_for(c.label_dtype, label_shape, c.logits.back(), 5, -100);
      expect_matches_reference("cpu", Op::kCrossEntropy, {logits, labels},
                               {{"reduction", reduction}}, {1e-5, 1e-5});
      // A custom ignore_index that some labels hit.
      Tensor labels3 = labels_for(c.label_dtype, label_shape, c.logits.back(), 0, 0);
      expect_matches_reference("cpu", Op::kCrossEntropy, {logits, labels3},
                               {{"reduction", reduction}, {"ignore_index", int64_t{3}}},
                               {1e-5, 1e-5});
    }
  }
}

TEST(CpuFastNn, CrossEntropyHandCheckedAndEdgeCases) {
  // Uniform logits over 4 classes: loss ln 4 per row, whatever the label.
  Tensor logits = make(DType::kF32, {2, 4}, {0.5, 0.5, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0});
  Tensor labels = make(DType::kI64, {2}, {1, 3});
  EXPECT_NEAR(run_dialect("cpu", Op::kCrossEntropy, {logits, labels})[0].get(0), std::log(4.0),
              1e-6);
  // Every row ignored: mean is 0 (no tokens, no loss), like the reference.
  Tensor ignored = make(DType::kI64, {2}, {-100, -100});
  EXPECT_EQ(run_dialect("cpu", Op::kCrossEntropy, {logits, ignored})[0].get(0), 0.0);
  // A label out of range is a kiln::Error naming the label and the range.
  Tensor bad = make(DType::kI32, {2}, {1, 4});
  try {
    run_dialect("cpu", Op::kCrossEntropy, {logits, bad});
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("label 4"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[0, 4)"), std::string::npos) << e.what();
  }
  // Also when the bad label is in a chunk run by another thread.
  Tensor many_logits = rand(DType::kF32, {4096, 8}, 5);
  std::vector<double> many(4096, 1.0);
  many[4000] = -1;
  EXPECT_THROW(run_dialect("cpu", Op::kCrossEntropy, {many_logits, make(DType::kI64, {4096}, many)}),
               Error);
}

// ---- matmul (openblas) ----

struct MatmulCase {
  Shape a, b;
  bool transpose_a = false, transpose_b = false;
};

TEST(CpuFastMatmul, MatchesReferenceF32AndF64) {
  const std::vector<MatmulCase> cases = {
      {{1, 1}, {1, 1}},
      {{7, 5}, {5, 3}},
      {{129, 65}, {65, 33}},
      {{5, 7}, {5, 3}, true, false},
      {{7, 5}, {3, 5}, false, true},
      {{5, 7}, {3, 5}, true, true},
      {{2, 3, 4, 5}, {5, 6}},              // batch folded into M
      {{2, 3, 4, 5}, {6, 5}, false, true},  // folded, b transposed
      {{2, 3, 5, 4}, {5, 6}, true, false},  // a transposed: one GEMM per batch
      {{3, 5}, {2, 5, 4}},                  // a broadcast over b's batch
      {{2, 1, 4, 5}, {3, 5, 6}},            // both broadcast: (2, 3, 4, 6)
      {{2, 1, 5, 4}, {1, 3, 6, 5}, true, true},
      {{1, 7, 5}, {4, 5, 129}},
  };
  uint64_t seed = 800;
  for (const MatmulCase& c : cases) {
    Attributes attrs{{"transpose_a", c.transpose_a}, {"transpose_b", c.transpose_b}};
    expect_matches_reference("openblas", Op::kMatmul,
                             {rand(DType::kF32, c.a, seed), rand(DType::kF32, c.b, seed + 1)},
                             attrs, {1e-5, 1e-5});
    expect_matches_reference("openblas", Op::kMatmul,
                             {rand(DType::kF64, c.a, seed), rand(DType::kF64, c.b, seed + 1)},
                             attrs, {1e-13, 1e-12});
    seed += 2;
  }
}

TEST(CpuFastMatmul, LargeKAndEmptyK) {
  // K = 1000 in f32: rounding grows with K (about sqrt(K) ulps of the sum of |terms|).
  expect_matches_reference("openblas", Op::kMatmul,
                           {rand(DType::kF32, {16, 1000}, 1), rand(DType::kF32, {1000, 9}, 2)}, {},
                           {2e-4, 1e-4});
  // K = 0: an empty sum, all zeros.
  Tensor out = run_dialect("openblas", Op::kMatmul,
                           {Tensor(TensorType{DType::kF32, {3, 0}}),
                            Tensor(TensorType{DType::kF32, {0, 4}})})[0];
  ASSERT_EQ(out.shape(), (Shape{3, 4}));
  for (int64_t i = 0; i < out.numel(); ++i) EXPECT_EQ(out.get(i), 0.0);
}

TEST(CpuFastMatmul, HandChecked) {
  // [[1, 2], [3, 4]] @ [[5, 6], [7, 8]] = [[19, 22], [43, 50]]; with transpose_b, b^T = [[5, 7],
  // [6, 8]] gives [[17, 23], [39, 53]].
  Tensor a = make(DType::kF32, {2, 2}, {1, 2, 3, 4});
  Tensor b = make(DType::kF32, {2, 2}, {5, 6, 7, 8});
  Tensor c = run_dialect("openblas", Op::kMatmul, {a, b})[0];
  EXPECT_EQ(c.to_f64(), (std::vector<double>{19, 22, 43, 50}));
  Tensor ct = run_dialect("openblas", Op::kMatmul, {a, b}, {{"transpose_b", true}})[0];
  EXPECT_EQ(ct.to_f64(), (std::vector<double>{17, 23, 39, 53}));
}

TEST(CpuFastMatmul, RefusesOtherDtypes) {
  EXPECT_EQ(selected_dialect(Op::kMatmul, {{DType::kF32, {2, 3}}, {DType::kF32, {3, 4}}}),
            "openblas");
  EXPECT_EQ(selected_dialect(Op::kMatmul, {{DType::kF64, {2, 3}}, {DType::kF64, {3, 4}}}),
            "openblas");
  EXPECT_EQ(selected_dialect(Op::kMatmul, {{DType::kBF16, {2, 3}}, {DType::kBF16, {3, 4}}}),
            "reference");
  EXPECT_EQ(selected_dialect(Op::kMatmul, {{DType::kF16, {2, 3}}, {DType::kF16, {3, 4}}}),
            "reference");
}

// ---- executor ----

TEST(CpuFastExecutor, AllDialectsAgreeWithReferenceOnly) {
  // A small MLP block: layer_norm(gelu(x @ w + bias)) then softmax, x (B, T, C) = (2, 5, 16).
  Graph g;
  ValueId x = g.add_input("x", {DType::kF32, {2, 5, 16}}, Role::kData);
  ValueId w = g.add_input("w", {DType::kF32, {16, 24}}, Role::kParam);
  ValueId bias = g.add_input("bias", {DType::kF32, {24}}, Role::kParam);
  ValueId gamma = g.add_input("gamma", {DType::kF32, {24}}, Role::kParam);
  ValueId beta = g.add_input("beta", {DType::kF32, {24}}, Role::kParam);
  ValueId h = g.add(Op::kMatmul, {x, w});
  h = g.add(Op::kAdd, {h, bias});
  h = g.add(Op::kGelu, {h});
  h = g.add(Op::kLayerNorm, {h, gamma, beta});
  ValueId y = g.add(Op::kSoftmax, {h});
  // A column broadcast the fast kernels refuse: falls back to the reference in the same run.
  ValueId col = g.add(Op::kMax, {y}, {{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}});
  ValueId z = g.add(Op::kSub, {y, col});
  g.outputs = {y, z};

  std::vector<Tensor> inputs = {
      rand(DType::kF32, {2, 5, 16}, 1), rand(DType::kF32, {16, 24}, 2, -0.5, 0.5),
      rand(DType::kF32, {24}, 3), rand(DType::kF32, {24}, 4, 0.5, 1.5), rand(DType::kF32, {24}, 5)};

  Executor fast(g);
  Executor reference(g, ExecutorOptions{Device::kCpu, {"reference"}});
  EXPECT_EQ(fast.node_dialects(),
            (std::vector<std::string>{"openblas", "cpu", "cpu", "cpu", "cpu", "cpu", "reference"}));
  EXPECT_EQ(reference.node_dialects(), std::vector<std::string>(7, "reference"));
  std::vector<Tensor> got = fast.run(inputs);
  std::vector<Tensor> want = reference.run(inputs);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_TRUE(all_close(got[0], want[0], 1e-6, 1e-4));
  EXPECT_TRUE(all_close(got[1], want[1], 1e-6, 1e-4));
}

}  // namespace
}  // namespace kiln

// The CPU fast paths (dialects "cpu" and "openblas") beyond the conformance sweep (which runs
// them against the reference kernels on random inputs of every geometry they have: odd sizes,
// sizes split across threads, each broadcast layout; tests/conformance_cases.cc): hand-checked
// values, NaN and infinity propagation, a 4M-element sum against the f64 reference, that
// supports() refuses what the fast kernels do not handle, so the reference serves it, and an
// Executor run with and without the fast dialects.
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

// ---- unary ----

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
  // An outer-product broadcast, a middle-dim broadcast: the reference's.
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
  // A column and a per-channel (block) broadcast; comparisons into bool.
  EXPECT_EQ(selected_dialect(Op::kAdd, {f32_btc, {DType::kF32, {2, 3, 1}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kMul, {{DType::kF32, {2, 3, 4, 5}}, {DType::kF32, {1, 3, 1, 1}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kGt, {f32_btc, {DType::kF32, {}}}), "cpu");
  // Restricted to "cpu", a refused node has no kernel at all.
  Tensor a = rand(DType::kF32, {2, 3, 4}, 7), b = rand(DType::kF32, {2, 1, 4}, 8);
  EXPECT_THROW(run_dialect("cpu", Op::kAdd, {a, b}), Error);
  // The refused layout still runs, through the reference: element (0, 1, 1) adds b (0, 0, 1).
  Tensor out = run_reference(Op::kAdd, {a, b})[0];
  EXPECT_NEAR(out.get(5), a.get(5) + b.get(1), 1e-6);
}

// ---- reductions ----

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
  // A prefix and a suffix around kept axes (BatchNorm's statistics) are the cpu dialect's; axes
  // that leave two kept blocks, or a reduced block between kept ones, are not.
  EXPECT_EQ(selected_dialect(Op::kMean, {x}, {{"axes", std::vector<int64_t>{0, 2}}}), "cpu");
  const TensorType x4{DType::kF32, {2, 3, 4, 5}};
  EXPECT_EQ(selected_dialect(Op::kMean, {x4}, {{"axes", std::vector<int64_t>{0, 2, 3}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kMean, {x4}, {{"axes", std::vector<int64_t>{0, 2}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kMax, {x}, {{"axes", std::vector<int64_t>{1}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kSum, {{DType::kF64, {3, 4}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kSum, {{DType::kI32, {3, 4}}}), "reference");
  EXPECT_EQ(selected_dialect(Op::kSum, {x}, {{"axes", std::vector<int64_t>{1, 2}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kSum, {x}), "cpu");
}

// ---- softmax, log_softmax, layer_norm ----

TEST(CpuFastNn, SoftmaxHandChecked) {
  // softmax([0, ln 3]) = [1/4, 3/4].
  Tensor y = run_dialect("cpu", Op::kSoftmax, {make(DType::kF32, {1, 2}, {0.0, std::log(3.0)})})[0];
  EXPECT_NEAR(y.get(0), 0.25, 1e-7);
  EXPECT_NEAR(y.get(1), 0.75, 1e-7);
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
  // An outer-product broadcast the fast kernels refuse, (2, 5, 1) against (24,): falls back to
  // the reference in the same run.
  ValueId col = g.add(Op::kMax, {y}, {{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}});
  ValueId z = g.add(Op::kSub, {col, bias});
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

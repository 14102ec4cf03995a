// NN ops (src/ops/nn.cc): inference on good inputs, every error with its message, the reference
// kernels on small hand-worked cases, and property checks on random inputs (matmul's transpose
// flags against explicit transposes, attention against matmul + softmax, attention_qkv against
// attention{bthd} on the split of its packed input).
#include <cmath>
#include <functional>
#include <limits>

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



TensorType f32(Shape shape) { return {DType::kF32, std::move(shape)}; }
TensorType of(DType dtype, Shape shape) { return {dtype, std::move(shape)}; }

// ---------------------------------------------------------------- matmul

TEST(NnMatmul, InfersShapes) {
  EXPECT_EQ(infer(Op::kMatmul, {f32({4, 3}), f32({3, 2})})[0], f32({4, 2}));
  // (B, T, C) @ (C, D): the weight broadcasts over the batch.
  EXPECT_EQ(infer(Op::kMatmul, {f32({2, 4, 3}), f32({3, 5})})[0], f32({2, 4, 5}));
  EXPECT_EQ(infer(Op::kMatmul, {f32({3, 1, 4, 3}), f32({2, 3, 5})})[0], f32({3, 2, 4, 5}));
  EXPECT_EQ(infer(Op::kMatmul, {f32({4, 3}), f32({6, 3, 5})})[0], f32({6, 4, 5}));
  // transpose_a: a is (K, M); transpose_b: b is (N, K).
  EXPECT_EQ(infer(Op::kMatmul, {f32({3, 4}), f32({3, 2})}, {{"transpose_a", true}})[0],
            f32({4, 2}));
  EXPECT_EQ(infer(Op::kMatmul, {f32({4, 3}), f32({2, 3})}, {{"transpose_b", true}})[0],
            f32({4, 2}));
  EXPECT_EQ(infer(Op::kMatmul, {f32({7, 3, 4}), f32({2, 3})},
                  {{"transpose_a", true}, {"transpose_b", true}})[0],
            f32({7, 4, 2}));
  EXPECT_EQ(infer(Op::kMatmul, {of(DType::kBF16, {4, 3}), of(DType::kBF16, {3, 2})})[0],
            of(DType::kBF16, {4, 2}));
}

TEST(NnMatmul, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kMatmul, {f32({4, 3}), f32({5, 2})}),
                    "matmul: inner dims differ: a is (4, 3), b is (5, 2)");
  EXPECT_KILN_ERROR(infer(Op::kMatmul, {f32({4, 3}), f32({2, 5})}, {{"transpose_b", true}}),
                    "inner dims differ", "(4, 3)", "(2, 5)", "transpose_b");
  EXPECT_KILN_ERROR(infer(Op::kMatmul, {f32({3}), f32({3, 5})}), "a has shape (3,)",
                    "rank >= 2", "reshape");
  EXPECT_KILN_ERROR(infer(Op::kMatmul, {f32({4, 3}), f32({3})}), "b has shape (3,)",
                    "rank >= 2");
  EXPECT_KILN_ERROR(infer(Op::kMatmul, {of(DType::kI32, {4, 3}), of(DType::kI32, {3, 2})}),
                    "a is i32", "float");
  EXPECT_KILN_ERROR(infer(Op::kMatmul, {f32({4, 3}), of(DType::kF64, {3, 2})}),
                    "b is f64, expected f32");
  EXPECT_KILN_ERROR(infer(Op::kMatmul, {f32({2, 4, 3}), f32({3, 3, 5})}),
                    "batch dims do not broadcast", "(2, 4, 3)", "(3, 3, 5)");
  EXPECT_KILN_ERROR(infer(Op::kMatmul, {f32({4, 3}), f32({3, 2})}, {{"transpose_a", int64_t{1}}}),
                    "transpose_a", "bool");
}

TEST(NnMatmul, Kernel2x3Times3x2) {
  // [[1,2,3],[4,5,6]] @ [[7,8],[9,10],[11,12]]:
  //   1*7+2*9+3*11 = 58, 1*8+2*10+3*12 = 64, 4*7+5*9+6*11 = 139, 4*8+5*10+6*12 = 154.
  Tensor a = make(DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor b = make(DType::kF32, {3, 2}, {7, 8, 9, 10, 11, 12});
  EXPECT_TRUE(all_close(run_reference(Op::kMatmul, {a, b})[0],
                        make(DType::kF32, {2, 2}, {58, 64, 139, 154}), 0, 0));
  // The same product in bf16: small integers are exact.
  Tensor a16 = make(DType::kBF16, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor b16 = make(DType::kBF16, {3, 2}, {7, 8, 9, 10, 11, 12});
  EXPECT_TRUE(all_close(run_reference(Op::kMatmul, {a16, b16})[0],
                        make(DType::kBF16, {2, 2}, {58, 64, 139, 154}), 0, 0));
}

TEST(NnMatmul, KernelBroadcastsBatch) {
  // a (2, 1, 2) = [[[1, 2]], [[3, 4]]], b (2, 1) = [[5], [6]]: 1*5+2*6 = 17, 3*5+4*6 = 39.
  Tensor a = make(DType::kF64, {2, 1, 2}, {1, 2, 3, 4});
  Tensor b = make(DType::kF64, {2, 1}, {5, 6});
  EXPECT_TRUE(all_close(run_reference(Op::kMatmul, {a, b})[0],
                        make(DType::kF64, {2, 1, 1}, {17, 39}), 0, 0));
}

TEST(NnMatmul, KernelBroadcastsBothBatchesOnRandomInputs) {
  // a (3, 1, M, K), b (2, K, N) -> (3, 2, M, N); out[i][j] = a[i][0] @ b[j].
  const int64_t m = 4, k = 5, n = 3;
  Tensor a = testing::rand(DType::kF64, {3, 1, m, k}, 21);
  Tensor b = testing::rand(DType::kF64, {2, k, n}, 22);
  Tensor c = run_reference(Op::kMatmul, {a, b})[0];
  ASSERT_EQ(c.shape(), (Shape{3, 2, m, n}));
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t col = 0; col < n; ++col) {
          double expected = 0;
          for (int64_t p = 0; p < k; ++p)
            expected += a.get((i * m + r) * k + p) * b.get((j * k + p) * n + col);
          EXPECT_NEAR(c.get(((i * 2 + j) * m + r) * n + col), expected, 1e-12);
        }
}

TEST(NnMatmul, TransposeFlagsMatchExplicitTransposes) {
  // a_t (2, K, M) and b_t (2, N, K) hold the transposes of a (2, M, K) and b (2, K, N).
  Tensor a_t = testing::rand(DType::kF32, {2, 5, 4}, 31);
  Tensor b_t = testing::rand(DType::kF32, {2, 3, 5}, 32);
  Attributes swap_last{{"perm", Ints{0, 2, 1}}};
  Tensor a = run_reference(Op::kTranspose, {a_t}, swap_last)[0];
  Tensor b = run_reference(Op::kTranspose, {b_t}, swap_last)[0];
  Tensor plain = run_reference(Op::kMatmul, {a, b})[0];
  EXPECT_TRUE(all_close(run_reference(Op::kMatmul, {a_t, b}, {{"transpose_a", true}})[0], plain,
                        1e-6, 1e-6));
  EXPECT_TRUE(all_close(run_reference(Op::kMatmul, {a, b_t}, {{"transpose_b", true}})[0], plain,
                        1e-6, 1e-6));
  EXPECT_TRUE(all_close(run_reference(Op::kMatmul, {a_t, b_t},
                                      {{"transpose_a", true}, {"transpose_b", true}})[0],
                        plain, 1e-6, 1e-6));
}

// ---------------------------------------------------------------- softmax, log_softmax

TEST(NnSoftmax, InfersShapes) {
  for (Op op : {Op::kSoftmax, Op::kLogSoftmax}) {
    EXPECT_EQ(infer(op, {f32({2, 3, 4})})[0], f32({2, 3, 4}));
    EXPECT_EQ(infer(op, {of(DType::kF16, {5})}, {{"axis", int64_t{0}}})[0], of(DType::kF16, {5}));
  }
}

TEST(NnSoftmax, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kSoftmax, {of(DType::kI64, {3})}), "softmax", "input is i64",
                    "float");
  EXPECT_KILN_ERROR(infer(Op::kLogSoftmax, {f32({2, 3})}, {{"axis", int64_t{2}}}), "log_softmax",
                    "axis 2", "rank 2");
  EXPECT_KILN_ERROR(infer(Op::kSoftmax, {f32({})}), "()", "rank >= 1");
}

TEST(NnSoftmax, KernelOnOneTwoThree) {
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  Tensor x = make(DType::kF64, {3}, {1, 2, 3});
  EXPECT_TRUE(all_close(run_reference(Op::kSoftmax, {x})[0],
                        make(DType::kF64, {3}, {std::exp(1.0) / z, std::exp(2.0) / z,
                                                std::exp(3.0) / z}),
                        1e-15, 1e-13));
  EXPECT_TRUE(all_close(run_reference(Op::kLogSoftmax, {x})[0],
                        make(DType::kF64, {3}, {1 - std::log(z), 2 - std::log(z),
                                                3 - std::log(z)}),
                        1e-15, 1e-13));
}

TEST(NnSoftmax, KernelIsStableForLargeInputs) {
  // Softmax is shift-invariant; without subtracting the max, exp(1002) overflows to inf.
  const double z = 1 + std::exp(1.0) + std::exp(2.0);
  Tensor x = make(DType::kF32, {3}, {1000, 1001, 1002});
  EXPECT_TRUE(all_close(run_reference(Op::kSoftmax, {x})[0],
                        make(DType::kF32, {3}, {1 / z, std::exp(1.0) / z, std::exp(2.0) / z}),
                        1e-7, 1e-6));
  EXPECT_TRUE(all_close(run_reference(Op::kLogSoftmax, {x})[0],
                        make(DType::kF32, {3}, {-std::log(z), 1 - std::log(z), 2 - std::log(z)}),
                        1e-6, 1e-6));
}

TEST(NnSoftmax, KernelAlongAxis0AndWithMinusInfinity) {
  // Columns of [[1, 2], [3, 4]] are [1, 3] and [2, 4]: both softmax to [1, e^2] / (1 + e^2).
  const double lo = 1 / (1 + std::exp(2.0)), hi = std::exp(2.0) / (1 + std::exp(2.0));
  Tensor x = make(DType::kF64, {2, 2}, {1, 2, 3, 4});
  EXPECT_TRUE(all_close(run_reference(Op::kSoftmax, {x}, {{"axis", int64_t{0}}})[0],
                        make(DType::kF64, {2, 2}, {lo, lo, hi, hi}), 1e-15, 1e-13));
  // A -inf logit (a masked position) gets weight exactly 0.
  const double inf = std::numeric_limits<double>::infinity();
  Tensor masked = make(DType::kF64, {2}, {-inf, 0.5});
  EXPECT_TRUE(all_close(run_reference(Op::kSoftmax, {masked})[0], make(DType::kF64, {2}, {0, 1}),
                        0, 0));
}

TEST(NnSoftmax, RowsSumToOneOnRandomInput) {
  Tensor x = testing::rand(DType::kF32, {3, 4, 5}, 41, -4, 4);
  Tensor y = run_reference(Op::kSoftmax, {x}, {{"axis", int64_t{1}}})[0];
  for (int64_t o = 0; o < 3; ++o)
    for (int64_t i = 0; i < 5; ++i) {
      double sum = 0;
      for (int64_t j = 0; j < 4; ++j) sum += y.get((o * 4 + j) * 5 + i);
      EXPECT_NEAR(sum, 1.0, 1e-6);
    }
  // log_softmax == log(softmax).
  Tensor log_y = run_reference(Op::kLogSoftmax, {x}, {{"axis", int64_t{1}}})[0];
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_NEAR(log_y.get(i), std::log(y.get(i)), 1e-5);
}

// ---------------------------------------------------------------- layer_norm, rms_norm

TEST(NnLayerNorm, InfersShapes) {
  EXPECT_EQ(infer(Op::kLayerNorm, {f32({2, 3, 4}), f32({4}), f32({4})})[0], f32({2, 3, 4}));
  EXPECT_EQ(infer(Op::kLayerNorm, {of(DType::kBF16, {4}), of(DType::kBF16, {4}),
                                   of(DType::kBF16, {4})})[0],
            of(DType::kBF16, {4}));
}

TEST(NnLayerNorm, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kLayerNorm, {f32({2, 4}), f32({3}), f32({4})}), "layer_norm",
                    "gamma has shape (3,), expected (4,)");
  EXPECT_KILN_ERROR(infer(Op::kLayerNorm, {f32({2, 4}), f32({4}), f32({1, 4})}),
                    "beta has shape (1, 4), expected (4,)");
  EXPECT_KILN_ERROR(infer(Op::kLayerNorm, {f32({2, 4}), f32({4}), of(DType::kF16, {4})}),
                    "beta is f16, expected f32");
  EXPECT_KILN_ERROR(infer(Op::kLayerNorm, {of(DType::kI32, {2, 4}), of(DType::kI32, {4}),
                                           of(DType::kI32, {4})}),
                    "x is i32", "float");
  EXPECT_KILN_ERROR(infer(Op::kLayerNorm, {f32({}), f32({1}), f32({1})}), "()", "rank >= 1");
  EXPECT_KILN_ERROR(infer(Op::kLayerNorm, {f32({2, 4}), f32({4}), f32({4})},
                          {{"epsilon", std::string("small")}}),
                    "epsilon", "float");
}

TEST(NnLayerNorm, KernelOnAWorkedRow) {
  // Row [1, 2, 3, 4]: mean 2.5, biased variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25, so with
  // epsilon 0 the normalized row is [-1.5, -0.5, 0.5, 1.5] / sqrt(5/4) = [-3, -1, 1, 3] / sqrt(5).
  const double s = std::sqrt(5.0);
  Tensor x = make(DType::kF64, {1, 4}, {1, 2, 3, 4});
  Tensor gamma = make(DType::kF64, {4}, {2, 1, 1, -1});
  Tensor beta = make(DType::kF64, {4}, {0.5, 0, -1, 0});
  Tensor y = run_reference(Op::kLayerNorm, {x, gamma, beta}, {{"epsilon", 0.0}})[0];
  EXPECT_TRUE(all_close(y, make(DType::kF64, {1, 4}, {-6 / s + 0.5, -1 / s, 1 / s - 1, -3 / s}),
                        1e-14, 1e-13));
}

TEST(NnLayerNorm, KernelConstantRowGivesBetaThanksToEpsilon) {
  // Zero variance: (x - mean) is 0 and the default epsilon keeps 0 / sqrt(0 + eps) finite.
  Tensor x = make(DType::kF32, {2, 3}, {2, 2, 2, -7, -7, -7});
  Tensor gamma = make(DType::kF32, {3}, {3, 4, 5});
  Tensor beta = make(DType::kF32, {3}, {0.25, -1, 2});
  EXPECT_TRUE(all_close(run_reference(Op::kLayerNorm, {x, gamma, beta})[0],
                        make(DType::kF32, {2, 3}, {0.25, -1, 2, 0.25, -1, 2}), 0, 0));
}

TEST(NnLayerNorm, KernelRowsHaveZeroMeanUnitVarianceOnRandomInput) {
  Tensor x = testing::rand(DType::kF64, {3, 8}, 51, -3, 5);
  Tensor ones = make(DType::kF64, {8}, std::vector<double>(8, 1.0));
  Tensor zeros = make(DType::kF64, {8}, std::vector<double>(8, 0.0));
  Tensor y = run_reference(Op::kLayerNorm, {x, ones, zeros}, {{"epsilon", 0.0}})[0];
  for (int64_t r = 0; r < 3; ++r) {
    double mean = 0, square = 0;
    for (int64_t c = 0; c < 8; ++c) mean += y.get(r * 8 + c) / 8;
    for (int64_t c = 0; c < 8; ++c) square += y.get(r * 8 + c) * y.get(r * 8 + c) / 8;
    EXPECT_NEAR(mean, 0.0, 1e-12);
    EXPECT_NEAR(square, 1.0, 1e-12);  // biased variance 1
  }
}

TEST(NnRmsNorm, InfersShapesAndErrors) {
  EXPECT_EQ(infer(Op::kRmsNorm, {f32({2, 3, 4}), f32({4})})[0], f32({2, 3, 4}));
  EXPECT_KILN_ERROR(infer(Op::kRmsNorm, {f32({2, 4}), f32({2})}), "rms_norm",
                    "gamma has shape (2,), expected (4,)");
  EXPECT_KILN_ERROR(infer(Op::kRmsNorm, {f32({2, 4}), of(DType::kBF16, {4})}),
                    "gamma is bf16, expected f32");
  EXPECT_KILN_ERROR(infer(Op::kRmsNorm, {of(DType::kU8, {2, 4}), of(DType::kU8, {4})}),
                    "x is u8", "float");
}

TEST(NnRmsNorm, KernelOnWorkedRows) {
  // Row [3, 4]: mean square (9 + 16) / 2 = 12.5. Row [1, 1]: mean square 1, default eps 1e-6.
  Tensor x = make(DType::kF64, {2, 2}, {3, 4, 1, 1});
  Tensor gamma = make(DType::kF64, {2}, {1, 2});
  Tensor y = run_reference(Op::kRmsNorm, {x, gamma})[0];
  const double r0 = std::sqrt(12.5 + 1e-6), r1 = std::sqrt(1 + 1e-6);
  EXPECT_TRUE(all_close(y, make(DType::kF64, {2, 2}, {3 / r0, 8 / r0, 1 / r1, 2 / r1}), 1e-15,
                        1e-13));
  Tensor y0 = run_reference(Op::kRmsNorm, {x, gamma}, {{"epsilon", 0.0}})[0];
  EXPECT_TRUE(all_close(y0, make(DType::kF64, {2, 2}, {3 / std::sqrt(12.5), 8 / std::sqrt(12.5),
                                                       1, 2}),
                        1e-15, 1e-13));
}

// ---------------------------------------------------------------- rotary_embedding

TEST(NnRotaryEmbedding, InfersShapesAndErrors) {
  EXPECT_EQ(infer(Op::kRotaryEmbedding, {f32({2, 3, 4, 8})})[0], f32({2, 3, 4, 8}));
  EXPECT_EQ(infer(Op::kRotaryEmbedding, {of(DType::kBF16, {5, 2, 6})},
                  {{"layout", std::string("bthd")}})[0],
            of(DType::kBF16, {5, 2, 6}));
  EXPECT_KILN_ERROR(infer(Op::kRotaryEmbedding, {f32({2, 3, 5})}), "rotary_embedding",
                    "(2, 3, 5)", "even last dim");
  EXPECT_KILN_ERROR(infer(Op::kRotaryEmbedding, {f32({3, 4})}, {{"layout", std::string("bthd")}}),
                    "(3, 4)", "(..., T, H, D)");
  EXPECT_KILN_ERROR(infer(Op::kRotaryEmbedding, {of(DType::kI32, {3, 4})}), "x is i32", "float");
  EXPECT_KILN_ERROR(infer(Op::kRotaryEmbedding, {f32({3, 4})}, {{"base", -1.0}}), "base is -1");
}

TEST(NnRotaryEmbedding, KernelOnWorkedRows) {
  // T = 2, D = 4 ("bhtd"): position 0 is the identity; position 1 rotates pair (x0, x2) by
  // 1 rad and pair (x1, x3) by base^(-1/2) = 0.01 rad.
  const Tensor x = make(DType::kF64, {2, 4}, {1, 2, 3, 4, 1, 2, 3, 4});
  const Tensor y = run_reference(Op::kRotaryEmbedding, {x})[0];
  const double c0 = std::cos(1.0), s0 = std::sin(1.0), c1 = std::cos(0.01), s1 = std::sin(0.01);
  EXPECT_TRUE(all_close(y, make(DType::kF64, {2, 4},
                                {1, 2, 3, 4, 1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0,
                                 4 * c1 + 2 * s1}),
                        1e-15, 1e-14));
}

TEST(NnRotaryEmbedding, InverseUndoesAndLayoutsAgree) {
  const Tensor x = testing::rand(DType::kF64, {2, 7, 3, 6}, 5);  // (B, T, H, D)
  const Attributes bthd{{"layout", std::string("bthd")}};
  Attributes inverse = bthd;
  inverse.set("inverse", true);
  const Tensor y = run_reference(Op::kRotaryEmbedding, {x}, bthd)[0];
  EXPECT_TRUE(all_close(run_reference(Op::kRotaryEmbedding, {y}, inverse)[0], x, 1e-14, 1e-13));
  // Rotations keep each pair's norm; the "bhtd" kernel on the heads-first transpose agrees.
  const Attributes swap{{"perm", std::vector<int64_t>{0, 2, 1, 3}}};
  auto t = [&](const Tensor& a) { return run_reference(Op::kTranspose, {a}, swap)[0]; };
  EXPECT_TRUE(all_close(t(run_reference(Op::kRotaryEmbedding, {t(x)})[0]), y, 1e-15, 1e-15));
  for (int64_t r = 0; r < x.numel() / 6; ++r)
    for (int64_t i = 0; i < 3; ++i) {
      auto norm = [&](const Tensor& a) {
        return std::hypot(a.get(r * 6 + i), a.get(r * 6 + i + 3));
      };
      EXPECT_NEAR(norm(y), norm(x), 1e-14);
    }
}

// ---------------------------------------------------------------- cross_entropy

Attributes reduction(const std::string& r) { return {{"reduction", r}}; }

TEST(NnCrossEntropy, InfersShapes) {
  EXPECT_EQ(infer(Op::kCrossEntropy, {f32({4, 10}), of(DType::kI64, {4})})[0], f32({}));
  EXPECT_EQ(infer(Op::kCrossEntropy, {f32({2, 3, 10}), of(DType::kI32, {2, 3})},
                  reduction("sum"))[0],
            f32({}));
  EXPECT_EQ(infer(Op::kCrossEntropy, {of(DType::kBF16, {2, 3, 10}), of(DType::kI32, {2, 3})},
                  reduction("none"))[0],
            of(DType::kBF16, {2, 3}));
  EXPECT_EQ(infer(Op::kCrossEntropy, {f32({10}), of(DType::kI32, {})})[0], f32({}));
}

TEST(NnCrossEntropy, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kCrossEntropy, {f32({4, 10}), f32({4})}), "cross_entropy",
                    "labels are f32, expected i32 or i64");
  EXPECT_KILN_ERROR(infer(Op::kCrossEntropy, {f32({4, 10}), of(DType::kI64, {4, 10})}),
                    "labels have shape (4, 10), expected (4,)");
  EXPECT_KILN_ERROR(infer(Op::kCrossEntropy, {of(DType::kI32, {4, 10}), of(DType::kI64, {4})}),
                    "logits is i32", "float");
  EXPECT_KILN_ERROR(infer(Op::kCrossEntropy, {f32({}), of(DType::kI64, {})}), "()", "V >= 1");
  EXPECT_KILN_ERROR(infer(Op::kCrossEntropy, {f32({4, 10}), of(DType::kI64, {4})},
                          reduction("avg")),
                    "\"avg\"", "mean", "sum", "none");
}

TEST(NnCrossEntropy, KernelWithAnIgnoredRow) {
  // Row 0: logits [1, 2, 3], label 2: log(e + e^2 + e^3) - 3. Row 1: [1, 1, 1], label 0:
  // log(3e) - 1 = log 3. Row 2 is ignored (-100): contributes 0 and is not counted.
  const double row0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3;
  const double row1 = std::log(3.0);
  Tensor logits = make(DType::kF64, {3, 3}, {1, 2, 3, 1, 1, 1, 5, -2, 0.5});
  Tensor labels = make(DType::kI64, {3}, {2, 0, -100});
  EXPECT_NEAR(run_reference(Op::kCrossEntropy, {logits, labels})[0].get(0), (row0 + row1) / 2,
              1e-14);
  EXPECT_NEAR(run_reference(Op::kCrossEntropy, {logits, labels}, reduction("sum"))[0].get(0),
              row0 + row1, 1e-14);
  Tensor none = run_reference(Op::kCrossEntropy, {logits, labels}, reduction("none"))[0];
  EXPECT_TRUE(all_close(none, make(DType::kF64, {3}, {row0, row1, 0}), 1e-14, 1e-13));
}

TEST(NnCrossEntropy, KernelCustomIgnoreIndexAndBatchedShape) {
  // (2, 2, 2) logits with uniform rows: every counted row's loss is log 2. ignore_index 1
  // drops the two rows labelled 1, leaving two counted rows.
  Tensor logits = make(DType::kF32, {2, 2, 2}, {0, 0, 3, 3, -1, -1, 7, 7});
  Tensor labels = make(DType::kI32, {2, 2}, {0, 1, 1, 0});
  Attributes attrs{{"ignore_index", int64_t{1}}};
  Tensor mean = run_reference(Op::kCrossEntropy, {logits, labels}, attrs)[0];
  EXPECT_EQ(mean.type(), f32({}));
  EXPECT_NEAR(mean.get(0), std::log(2.0), 1e-6);
  attrs.set("reduction", std::string("none"));
  EXPECT_TRUE(all_close(run_reference(Op::kCrossEntropy, {logits, labels}, attrs)[0],
                        make(DType::kF32, {2, 2}, {std::log(2.0), 0, 0, std::log(2.0)}), 1e-7,
                        1e-6));
}

TEST(NnCrossEntropy, KernelAllIgnoredMeanIsZero) {
  Tensor logits = make(DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor labels = make(DType::kI64, {2}, {-100, -100});
  EXPECT_EQ(run_reference(Op::kCrossEntropy, {logits, labels})[0].get(0), 0.0);
  EXPECT_EQ(run_reference(Op::kCrossEntropy, {logits, labels}, reduction("sum"))[0].get(0), 0.0);
}

TEST(NnCrossEntropy, KernelIsStableForLargeLogits) {
  // [1000, 1001, 1002] with label 0: logsumexp = 1000 + log(1 + e + e^2), minus the label's 1000.
  Tensor logits = make(DType::kF64, {1, 3}, {1000, 1001, 1002});
  Tensor labels = make(DType::kI32, {1}, {0});
  EXPECT_NEAR(run_reference(Op::kCrossEntropy, {logits, labels})[0].get(0),
              std::log(1 + std::exp(1.0) + std::exp(2.0)), 1e-12);
}

TEST(NnCrossEntropy, KernelLabelOutOfRangeThrows) {
  Tensor logits = make(DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_KILN_ERROR(run_reference(Op::kCrossEntropy, {logits, make(DType::kI64, {2}, {0, 3})}),
                    "cross_entropy", "label 3", "row 1", "[0, 3)");
  EXPECT_KILN_ERROR(run_reference(Op::kCrossEntropy, {logits, make(DType::kI32, {2}, {-1, 0})}),
                    "label -1", "row 0", "-100");
}

// ---------------------------------------------------------------- attention

TEST(NnAttention, InfersShapes) {
  EXPECT_EQ(infer(Op::kAttention, {f32({2, 4, 3, 8}), f32({2, 4, 5, 8}), f32({2, 4, 5, 6})})[0],
            f32({2, 4, 3, 6}));
  EXPECT_EQ(infer(Op::kAttention, {f32({3, 8}), f32({5, 8}), f32({5, 2})},
                  {{"causal", true}, {"scale", 0.5}})[0],
            f32({3, 2}));
  EXPECT_EQ(infer(Op::kAttention, {of(DType::kF16, {1, 3, 8}), of(DType::kF16, {1, 3, 8}),
                                   of(DType::kF16, {1, 3, 8})})[0],
            of(DType::kF16, {1, 3, 8}));
}

TEST(NnAttention, InfersTheLseOutput) {
  // lse (..., Tq): q's shape without the head dim; f32 for 32- and 16-bit inputs, f64 for f64.
  EXPECT_EQ(infer(Op::kAttention, {f32({2, 4, 3, 8}), f32({2, 4, 5, 8}), f32({2, 4, 5, 6})}),
            (std::vector<TensorType>{f32({2, 4, 3, 6}), f32({2, 4, 3})}));
  EXPECT_EQ(infer(Op::kAttention, {f32({3, 8}), f32({5, 8}), f32({5, 2})})[1], f32({3}));
  for (DType half : {DType::kBF16, DType::kF16}) {
    const TensorType t = of(half, {1, 3, 8});
    EXPECT_EQ(infer(Op::kAttention, {t, t, t})[1], f32({1, 3}));
  }
  const TensorType t64 = of(DType::kF64, {2, 3, 8});
  EXPECT_EQ(infer(Op::kAttention, {t64, t64, t64})[1], of(DType::kF64, {2, 3}));
}

TEST(NnAttention, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({2, 4, 3, 8}), f32({1, 4, 5, 8}), f32({1, 4, 5, 8})}),
                    "attention", "leading dims differ", "(2, 4, 3, 8)", "(1, 4, 5, 8)");
  // The dim before T ("bhtd"'s heads) may be fewer in k and v only if it divides q's.
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({2, 3, 8}), f32({3, 5, 8}), f32({3, 5, 8})}),
                    "attention", "head counts differ", "(2, 3, 8)", "(3, 5, 8)");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({4, 3, 8}), f32({2, 5, 8}), f32({1, 5, 8})}),
                    "head counts differ");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({2, 3, 8}), f32({2, 5, 4}), f32({2, 5, 8})}),
                    "head dims differ", "(2, 3, 8)", "(2, 5, 4)");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({2, 3, 8}), f32({2, 5, 8}), f32({2, 6, 8})}),
                    "key lengths differ", "(2, 5, 8)", "(2, 6, 8)");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({2, 3, 8}), f32({5, 8}), f32({5, 8})}),
                    "(2, 3, 8)", "(5, 8)", "one rank");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({8}), f32({8}), f32({8})}), "q has shape (8,)",
                    "rank >= 2");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {of(DType::kI32, {3, 8}), of(DType::kI32, {3, 8}),
                                           of(DType::kI32, {3, 8})}),
                    "q is i32", "float");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({3, 8}), f32({3, 8}), of(DType::kBF16, {3, 8})}),
                    "v is bf16, expected f32");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({3, 8}), f32({3, 8}), f32({3, 8})},
                          {{"scale", std::string("big")}}),
                    "scale", "float");
}

TEST(NnAttention, KeyBiasShapesAndErrors) {
  // key_bias: q's leading dims without the heads axis, then Tk; q's dtype.
  EXPECT_EQ(infer(Op::kAttention, {f32({2, 4, 3, 8}), f32({2, 4, 5, 8}), f32({2, 4, 5, 6}), f32({2, 5})})[0],
            f32({2, 4, 3, 6}));
  EXPECT_EQ(infer(Op::kAttention, {f32({2, 3, 4, 8}), f32({2, 5, 2, 8}), f32({2, 5, 2, 8}), f32({2, 5})},
                  {{"layout", std::string("bthd")}})[0],
            f32({2, 3, 4, 8}));
  EXPECT_EQ(infer(Op::kAttention, {f32({3, 8}), f32({5, 8}), f32({5, 2}), f32({5})})[0], f32({3, 2}));
  EXPECT_EQ(infer(Op::kAttention, {f32({4, 3, 8}), f32({4, 5, 8}), f32({4, 5, 2}), f32({5})})[0], f32({4, 3, 2}));
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({2, 4, 3, 8}), f32({2, 4, 5, 8}), f32({2, 4, 5, 6}), f32({2, 1, 1, 5})}),
                    "attention", "key_bias has shape (2, 1, 1, 5), expected (2, 5)", "one row per batch entry");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({2, 4, 3, 8}), f32({2, 4, 5, 8}), f32({2, 4, 5, 6}), f32({2, 3})}),
                    "key_bias has shape (2, 3), expected (2, 5)");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({3, 8}), f32({5, 8}), f32({5, 2}), of(DType::kBF16, {5})}),
                    "key_bias is bf16, expected f32");
  const TensorType q = f32({2, 4, 3, 8}), k = f32({2, 4, 5, 8}), out = f32({2, 4, 3, 8}), lse = f32({2, 4, 3});
  EXPECT_EQ(infer(Op::kAttentionGrad, {q, k, k, out, out, lse, f32({2, 5})}).size(), 3u);
  EXPECT_KILN_ERROR(infer(Op::kAttentionGrad, {q, k, k, out, out, lse, f32({2, 4})}),
                    "attention_grad", "key_bias has shape (2, 4), expected (2, 5)");
}

TEST(NnAttention, KeyBiasByHand) {
  // q = 0: every score is 0 but for the bias. Batch row 0's bias (0, ln 2, -inf): weights
  // (1/3, 2/3, 0) in both heads and every query, lse ln 3; row 1's (-10000, 0, 0): (0, 1/2, 1/2).
  // Row 2 masks every key with -inf: its out is NaN, as softmax over nothing is (torch's too),
  // and its lse -inf.
  const double inf = std::numeric_limits<double>::infinity();
  Tensor q = make(DType::kF64, {3, 2, 2, 1}, std::vector<double>(12, 0.0));
  Tensor k = testing::rand(DType::kF64, {3, 2, 3, 1}, 5);
  Tensor v = make(DType::kF64, {3, 2, 3, 1}, {3, 6, 9, 1, 2, 4, 3, 6, 9, 1, 2, 4, 1, 1, 1, 1, 1, 1});
  Tensor bias = make(DType::kF64, {3, 3}, {0, std::log(2.0), -inf, -10000, 0, 0, -inf, -inf, -inf});
  std::vector<Tensor> r = run_reference(Op::kAttention, {q, k, v, bias});
  const std::vector<double> want = {5, 5, 5. / 3, 5. / 3, 7.5, 7.5, 3, 3};
  for (int64_t i = 0; i < 8; ++i) EXPECT_NEAR(r[0].get(i), want[static_cast<size_t>(i)], 1e-12) << i;
  for (int64_t i = 8; i < 12; ++i) EXPECT_TRUE(std::isnan(r[0].get(i))) << i;
  for (int64_t i = 0; i < 4; ++i) EXPECT_NEAR(r[1].get(i), std::log(3.0), 1e-14) << i;
  for (int64_t i = 4; i < 8; ++i) EXPECT_NEAR(r[1].get(i), std::log(2.0), 1e-14) << i;
  for (int64_t i = 8; i < 12; ++i) EXPECT_EQ(r[1].get(i), -inf) << i;
  // The gradient gives a masked key nothing: batch 0's key 2 (its v row) and every key of batch 2.
  Tensor dout = testing::rand(DType::kF64, {3, 2, 2, 1}, 6);
  std::vector<Tensor> g = run_reference(Op::kAttentionGrad, {q, k, v, r[0], dout, r[1], bias});
  for (int64_t i = 0; i < 8; ++i) EXPECT_TRUE(std::isfinite(g[0].get(i))) << i;
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_EQ(g[2].get(h * 3 + 2), 0.0);
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(g[2].get(12 + h * 3 + j), 0.0);
  }
}

TEST(NnAttention, KernelCausalWithEqualScores) {
  // q = 0, so every score is 0 and the weights are uniform over the visible keys: causal query
  // i averages v[0..i]; query 0 sees only key 0 and returns v[0] exactly.
  Tensor q = make(DType::kF64, {3, 1}, {0, 0, 0});
  Tensor k = make(DType::kF64, {3, 1}, {0.3, -2, 1.5});
  Tensor v = make(DType::kF64, {3, 2}, {1, 10, 4, 20, 7, 60});
  Tensor causal = run_reference(Op::kAttention, {q, k, v}, {{"causal", true}})[0];
  EXPECT_TRUE(all_close(causal, make(DType::kF64, {3, 2}, {1, 10, 2.5, 15, 4, 30}), 1e-15,
                        1e-14));
  Tensor full = run_reference(Op::kAttention, {q, k, v})[0];
  EXPECT_TRUE(all_close(full, make(DType::kF64, {3, 2}, {4, 30, 4, 30, 4, 30}), 1e-15, 1e-14));
}

TEST(NnAttention, KernelCausalFirstQueryEqualsFirstValue) {
  // With arbitrary q and k, causal query 0 sees only key 0: its output is v[0].
  Tensor q = testing::rand(DType::kF32, {2, 3, 4}, 61);
  Tensor k = testing::rand(DType::kF32, {2, 3, 4}, 62);
  Tensor v = testing::rand(DType::kF32, {2, 3, 5}, 63);
  Tensor out = run_reference(Op::kAttention, {q, k, v}, {{"causal", true}})[0];
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t c = 0; c < 5; ++c) EXPECT_EQ(out.get(b * 15 + c), v.get(b * 15 + c));
}

TEST(NnAttention, KernelCausalIsTopLeftAlignedWhenTqDiffersFromTk) {
  // Tq = 2, Tk = 3: query 0 sees key 0, query 1 sees keys 0 and 1 (never key 2).
  Tensor q = make(DType::kF64, {2, 1}, {0, 0});
  Tensor k = make(DType::kF64, {3, 1}, {1, 2, 3});
  Tensor v = make(DType::kF64, {3, 1}, {2, 4, 100});
  EXPECT_TRUE(all_close(run_reference(Op::kAttention, {q, k, v}, {{"causal", true}})[0],
                        make(DType::kF64, {2, 1}, {2, 3}), 1e-15, 1e-14));
}

TEST(NnAttention, KernelExplicitAndDefaultScale) {
  // Explicit scale 1: scores [0, ln 2] -> weights [1/3, 2/3]; v = [3, 6] -> 1 + 4 = 5.
  Tensor q = make(DType::kF64, {1, 1}, {1});
  Tensor k = make(DType::kF64, {2, 1}, {0, std::log(2.0)});
  Tensor v = make(DType::kF64, {2, 1}, {3, 6});
  EXPECT_NEAR(run_reference(Op::kAttention, {q, k, v}, {{"scale", 1.0}})[0].get(0), 5.0, 1e-14);
  // Default scale 1/sqrt(D) = 1/2 for D = 4: q . k1 = 4x with x = ln(3)/2 gives a score of ln 3,
  // so the weights are [1/4, 3/4]; v = [4, 8] -> 1 + 6 = 7.
  const double x = std::log(3.0) / 2;
  Tensor q4 = make(DType::kF64, {1, 4}, {1, 1, 1, 1});
  Tensor k4 = make(DType::kF64, {2, 4}, {0, 0, 0, 0, x, x, x, x});
  Tensor v4 = make(DType::kF64, {2, 1}, {4, 8});
  EXPECT_NEAR(run_reference(Op::kAttention, {q4, k4, v4})[0].get(0), 7.0, 1e-14);
}

// softmax(q k^T * scale + mask) v built from the matmul, transpose and softmax references.
Tensor attention_by_composition(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                double scale) {
  Tensor scores = run_reference(Op::kMatmul, {q, k}, {{"transpose_b", true}})[0];
  const int64_t tq = q.shape()[q.rank() - 2], tk = k.shape()[k.rank() - 2];
  for (int64_t i = 0; i < scores.numel(); ++i) {
    const int64_t row = (i / tk) % tq, col = i % tk;
    scores.set(i, causal && col > row ? -std::numeric_limits<double>::infinity()
                                      : scores.get(i) * scale);
  }
  Tensor weights = run_reference(Op::kSoftmax, {scores})[0];
  return run_reference(Op::kMatmul, {weights, v})[0];
}

TEST(NnAttention, LseOfEqualScoresIsLogCountPlusScore) {
  // Every key equal to k0: each visible score is the same s = scale * q . k0, so
  // lse = log(n * e^s) = log(n) + s over the n visible keys. q = (1, 2), k0 = (0.5, -1.5),
  // scale 0.4: s = 0.4 * (0.5 - 3) = -1. Non-causal, Tk = 3: lse = ln 3 - 1 for both queries;
  // causal: query 0 sees 1 key (lse = -1), query 1 sees 2 (ln 2 - 1).
  Tensor q = make(DType::kF64, {2, 2}, {1, 2, 1, 2});
  Tensor k = make(DType::kF64, {3, 2}, {0.5, -1.5, 0.5, -1.5, 0.5, -1.5});
  Tensor v = make(DType::kF64, {3, 1}, {1, 2, 3});
  std::vector<Tensor> full = run_reference(Op::kAttention, {q, k, v}, {{"scale", 0.4}});
  ASSERT_EQ(full.size(), 2u);
  EXPECT_EQ(full[1].type(), of(DType::kF64, {2}));
  EXPECT_TRUE(all_close(full[1], make(DType::kF64, {2}, {std::log(3.0) - 1, std::log(3.0) - 1}),
                        1e-15, 1e-14));
  std::vector<Tensor> causal =
      run_reference(Op::kAttention, {q, k, v}, {{"scale", 0.4}, {"causal", true}});
  EXPECT_TRUE(all_close(causal[1], make(DType::kF64, {2}, {-1, std::log(2.0) - 1}), 1e-15,
                        1e-14));
  // f32 inputs: lse is f32 (computed in double, rounded once).
  std::vector<Tensor> f = run_reference(
      Op::kAttention, {make(DType::kF32, {1, 2}, {1, 2}), make(DType::kF32, {3, 2},
                                                               {0.5, -1.5, 0.5, -1.5, 0.5, -1.5}),
                       make(DType::kF32, {3, 1}, {1, 2, 3})},
      {{"scale", 0.4}});
  EXPECT_EQ(f[1].type(), f32({1}));
  EXPECT_NEAR(f[1].get(0), std::log(3.0) - 1, 1e-7);
}

TEST(NnAttention, LseOfDistinctScoresByHand) {
  // Scale 1, q = 1, k = (0, ln 2, ln 5): scores (0, ln 2, ln 5), sum of exps 1 + 2 + 5 = 8, so
  // lse = ln 8; the weights are (1/8, 2/8, 5/8), and P = exp(s - lse) reproduces them.
  Tensor q = make(DType::kF64, {1, 1}, {1});
  Tensor k = make(DType::kF64, {3, 1}, {0, std::log(2.0), std::log(5.0)});
  Tensor v = make(DType::kF64, {3, 1}, {8, 16, 24});  // out = 1 + 4 + 15 = 20
  std::vector<Tensor> r = run_reference(Op::kAttention, {q, k, v}, {{"scale", 1.0}});
  EXPECT_NEAR(r[0].get(0), 20.0, 1e-13);
  EXPECT_NEAR(r[1].get(0), std::log(8.0), 1e-15);
}

TEST(NnAttention, LseWithoutKeysIsMinusInfinity) {
  // Tk = 0: an empty sum, log(0) = -inf (and out = 0).
  std::vector<Tensor> r = run_reference(
      Op::kAttention, {make(DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6}), make(DType::kF32, {0, 3}, {}),
                       make(DType::kF32, {0, 2}, {})});
  ASSERT_EQ(r[1].numel(), 2);
  EXPECT_EQ(r[1].get(0), -std::numeric_limits<double>::infinity());
  EXPECT_EQ(r[1].get(1), -std::numeric_limits<double>::infinity());
}

TEST(NnAttention, KernelMatchesMatmulSoftmaxCompositionOnRandomInputs) {
  Tensor q = testing::rand(DType::kF64, {2, 3, 4, 8}, 71, -2, 2);
  Tensor k = testing::rand(DType::kF64, {2, 3, 6, 8}, 72, -2, 2);
  Tensor v = testing::rand(DType::kF64, {2, 3, 6, 5}, 73);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    Tensor out = run_reference(Op::kAttention, {q, k, v}, {{"causal", causal}})[0];
    EXPECT_TRUE(all_close(out, attention_by_composition(q, k, v, causal, 1 / std::sqrt(8.0)),
                          1e-13, 1e-12));
    Tensor scaled = run_reference(Op::kAttention, {q, k, v},
                                  {{"causal", causal}, {"scale", 0.3}})[0];
    EXPECT_TRUE(all_close(scaled, attention_by_composition(q, k, v, causal, 0.3), 1e-13, 1e-12));
  }
}

// Grouped-query attention is attention with each key/value head repeated for the query heads
// of its group (PyTorch's repeat_interleave), and its dk, dv are the repeated ones' summed over
// the group. Both layouts, causal and not.
TEST(NnAttention, GroupedQueryIsAttentionOnRepeatedKeyValueHeads) {
  for (bool bthd : {false, true}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(::testing::Message() << (bthd ? "bthd" : "bhtd") << (causal ? " causal" : ""));
      const int64_t B = 2, H = 6, Hkv = 2, Tq = 5, Tk = 7, D = 4, Dv = 3, group = H / Hkv;
      auto shape = [&](int64_t heads, int64_t t, int64_t d) {
        return bthd ? Shape{B, t, heads, d} : Shape{B, heads, t, d};
      };
      const Tensor q = testing::rand(DType::kF64, shape(H, Tq, D), 11);
      const Tensor k = testing::rand(DType::kF64, shape(Hkv, Tk, D), 12);
      const Tensor v = testing::rand(DType::kF64, shape(Hkv, Tk, Dv), 13);
      const Tensor dout = testing::rand(DType::kF64, shape(H, Tq, Dv), 14);
      // Head h of the repeated tensor is head h / group of x.
      auto repeat = [&](const Tensor& x, int64_t t, int64_t d) {
        Tensor r(TensorType{DType::kF64, shape(H, t, d)});
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < t; ++i)
              for (int64_t c = 0; c < d; ++c) {
                auto at = [&](int64_t heads, int64_t head) {
                  return bthd ? ((b * t + i) * heads + head) * d + c : ((b * heads + head) * t + i) * d + c;
                };
                r.set(at(H, h), x.get(at(Hkv, h / group)));
              }
        return r;
      };
      // The group's sum of a repeated gradient.
      auto fold = [&](const Tensor& x, int64_t t, int64_t d) {
        Tensor r(TensorType{DType::kF64, shape(Hkv, t, d)});
        for (int64_t i = 0; i < r.numel(); ++i) r.set(i, 0.0);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < t; ++i)
              for (int64_t c = 0; c < d; ++c) {
                auto at = [&](int64_t heads, int64_t head) {
                  return bthd ? ((b * t + i) * heads + head) * d + c : ((b * heads + head) * t + i) * d + c;
                };
                r.set(at(Hkv, h / group), r.get(at(Hkv, h / group)) + x.get(at(H, h)));
              }
        return r;
      };
      Attributes attrs{{"causal", causal}};
      if (bthd) attrs.set("layout", std::string("bthd"));
      const std::vector<Tensor> got = run_reference(Op::kAttention, {q, k, v}, attrs);
      const std::vector<Tensor> want =
          run_reference(Op::kAttention, {q, repeat(k, Tk, D), repeat(v, Tk, Dv)}, attrs);
      EXPECT_TRUE(all_close(got[0], want[0], 1e-13, 1e-13));
      EXPECT_TRUE(all_close(got[1], want[1], 1e-13, 1e-13));
      const std::vector<Tensor> dgot =
          run_reference(Op::kAttentionGrad, {q, k, v, got[0], dout, got[1]}, attrs);
      const std::vector<Tensor> dwant = run_reference(
          Op::kAttentionGrad, {q, repeat(k, Tk, D), repeat(v, Tk, Dv), want[0], dout, want[1]}, attrs);
      EXPECT_TRUE(all_close(dgot[0], dwant[0], 1e-13, 1e-13));
      EXPECT_TRUE(all_close(dgot[1], fold(dwant[1], Tk, D), 1e-13, 1e-13));
      EXPECT_TRUE(all_close(dgot[2], fold(dwant[2], Tk, Dv), 1e-13, 1e-13));
    }
  }
}

TEST(NnAttention, LayoutBthdIsHeadsFirstAttentionOnTransposes) {
  // q, k, v (B=2, T, H=3, D) in "bthd" against the default layout on (B, H, T, D) transposes:
  // out transposed back, lse (B, T, H) against (B, H, T); and the gradients the same way.
  const Attributes swap{{"perm", std::vector<int64_t>{0, 2, 1, 3}}};
  const Attributes swap_lse{{"perm", std::vector<int64_t>{0, 2, 1}}};
  auto t = [&](const Tensor& x) { return run_reference(Op::kTranspose, {x}, swap)[0]; };
  for (bool causal : {false, true}) {
    Tensor q = testing::rand(DType::kF64, {2, 5, 3, 4}, 1);
    Tensor k = testing::rand(DType::kF64, {2, 6, 3, 4}, 2);
    Tensor v = testing::rand(DType::kF64, {2, 6, 3, 7}, 3);
    Tensor dout = testing::rand(DType::kF64, {2, 5, 3, 7}, 4);
    Attributes bthd{{"causal", causal}, {"layout", std::string("bthd")}};
    Attributes bhtd{{"causal", causal}};
    std::vector<Tensor> got = run_reference(Op::kAttention, {q, k, v}, bthd);
    std::vector<Tensor> want = run_reference(Op::kAttention, {t(q), t(k), t(v)}, bhtd);
    ASSERT_EQ(got[1].shape(), (Shape{2, 5, 3}));
    EXPECT_TRUE(all_close(got[0], t(want[0]), 1e-13, 1e-13));
    EXPECT_TRUE(all_close(got[1], run_reference(Op::kTranspose, {want[1]}, swap_lse)[0], 1e-13,
                          1e-13));
    std::vector<Tensor> dgot =
        run_reference(Op::kAttentionGrad, {q, k, v, got[0], dout, got[1]}, bthd);
    std::vector<Tensor> dwant = run_reference(
        Op::kAttentionGrad, {t(q), t(k), t(v), want[0], t(dout), want[1]}, bhtd);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(all_close(dgot[i], t(dwant[i]), 1e-13, 1e-13)) << i;
  }
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({2, 5, 3, 4}), f32({2, 6, 2, 4}), f32({2, 6, 3, 4})},
                          {{"layout", std::string("bthd")}}),
                    "head counts differ", "(2, 5, 3, 4)", "(2, 6, 2, 4)");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({5, 4}), f32({5, 4}), f32({5, 4})},
                          {{"layout", std::string("bthd")}}),
                    "rank >= 3");
  EXPECT_KILN_ERROR(infer(Op::kAttention, {f32({5, 4}), f32({5, 4}), f32({5, 4})},
                          {{"layout", std::string("tbhd")}}),
                    "layout is \"tbhd\"", "bthd");
}

TEST(NnAttention, KernelInBf16IsCloseToF64) {
  Tensor q = testing::rand(DType::kF64, {2, 5, 8}, 81);
  Tensor k = testing::rand(DType::kF64, {2, 5, 8}, 82);
  Tensor v = testing::rand(DType::kF64, {2, 5, 4}, 83);
  auto to_bf16 = [](const Tensor& t) {
    return make(DType::kBF16, t.shape(), t.to_f64());
  };
  Tensor low = run_reference(Op::kAttention, {to_bf16(q), to_bf16(k), to_bf16(v)},
                             {{"causal", true}})[0];
  Tensor high = run_reference(Op::kAttention, {q, k, v}, {{"causal", true}})[0];
  EXPECT_LT(max_scaled_error(low, high, 2e-2, 2e-2), 1.0);
}

// ---------------------------------------------------------------- attention_qkv

TEST(NnAttentionQkv, InfersShapes) {
  // (..., T, 3, H, D) -> out (..., T, H, D) in qkv's dtype, lse (..., T, H) as attention's.
  std::vector<TensorType> t = infer(Op::kAttentionQkv, {f32({2, 5, 3, 4, 8})});
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0], f32({2, 5, 4, 8}));
  EXPECT_EQ(t[1], f32({2, 5, 4}));
  t = infer(Op::kAttentionQkv, {f32({7, 3, 1, 2})}, {{"causal", true}});  // rank 4: no batch
  EXPECT_EQ(t[0], f32({7, 1, 2}));
  EXPECT_EQ(t[1], f32({7, 1}));
  t = infer(Op::kAttentionQkv, {of(DType::kBF16, {2, 3, 4, 3, 2, 8})});  // rank 6
  EXPECT_EQ(t[0], of(DType::kBF16, {2, 3, 4, 2, 8}));
  EXPECT_EQ(t[1], f32({2, 3, 4, 2}));  // 16-bit attention keeps an f32 lse
  t = infer(Op::kAttentionQkv, {of(DType::kF64, {4, 3, 2, 8})});
  EXPECT_EQ(t[1], of(DType::kF64, {4, 2}));
}

TEST(NnAttentionQkv, Errors) {
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkv, {f32({2, 5, 4, 2, 8})}),
                    "attention_qkv", "qkv has shape (2, 5, 4, 2, 8)", "expected (..., T, 3, H, D)");
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkv, {f32({2, 5, 2, 3})}), "qkv has shape (2, 5, 2, 3)",
                    "(..., T, 3, H, D)");  // the 3 on axis -2, not -3
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkv, {f32({3, 2, 8})}), "qkv has shape (3, 2, 8)",
                    "expected (..., T, 3, H, D)");  // rank 3
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkv, {f32({})}), "qkv has shape ()");
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkv, {of(DType::kI32, {2, 5, 3, 4, 8})}),
                    "qkv is i32", "expected a float dtype");
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkv, {f32({5, 3, 4, 8}), f32({5}), f32({5})}),
                    "got 3 inputs, expected 1 to 2");
  // key_bias: (..., T), q's dtype.
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkv, {f32({5, 3, 4, 8}), f32({5, 3, 4, 8})}),
                    "key_bias has shape (5, 3, 4, 8), expected (5,) for q (5, 4, 8)");
  EXPECT_KILN_ERROR(infer(Op::kAttentionQkv, {f32({2, 5, 3, 4, 8}), of(DType::kF16, {2, 5})}), "key_bias",
                    "f16");
}

TEST(NnAttentionQkv, KernelHandWorked) {
  // T = 2, H = 2, D = 1. Head 0: q = 1, k = 0 at both tokens (every score 0: equal weights),
  // v = (1, 3). Head 1: q = 0, k = (3, -2) (scores 0 again), v = (5, 7). Rows of qkv are
  // [q_h0, q_h1, k_h0, k_h1, v_h0, v_h1] per token.
  const Tensor qkv = make(DType::kF64, {2, 3, 2, 1}, {1, 0, 0, 3, 1, 5, 1, 0, 0, -2, 3, 7});
  const double ln2 = std::log(2.0);
  std::vector<Tensor> full = run_reference(Op::kAttentionQkv, {qkv});
  // Both tokens see both keys: out = the mean of v, lse = log(e^0 + e^0).
  EXPECT_TRUE(all_close(full[0], make(DType::kF64, {2, 2, 1}, {2, 6, 2, 6}), 1e-15, 0));
  EXPECT_TRUE(all_close(full[1], make(DType::kF64, {2, 2}, {ln2, ln2, ln2, ln2}), 1e-15, 0));
  std::vector<Tensor> causal = run_reference(Op::kAttentionQkv, {qkv}, {{"causal", true}});
  // Token 0 sees only itself: out = v_0, lse = 0.
  EXPECT_TRUE(all_close(causal[0], make(DType::kF64, {2, 2, 1}, {1, 5, 2, 6}), 1e-15, 0));
  EXPECT_TRUE(all_close(causal[1], make(DType::kF64, {2, 2}, {0, 0, ln2, ln2}), 1e-15, 0));
  // The scale multiplies the scores. One head, D = 1: q = (1, 1), k = (0, 1), v = (10, 20);
  // with scale 2 both queries score (0, 2), weights (1, e^2) / (1 + e^2).
  const Tensor one = make(DType::kF64, {2, 3, 1, 1}, {1, 0, 10, 1, 1, 20});
  std::vector<Tensor> scaled = run_reference(Op::kAttentionQkv, {one}, {{"scale", 2.0}});
  const double w1 = std::exp(2.0) / (1 + std::exp(2.0));
  const double o = 10 * (1 - w1) + 20 * w1, lse = std::log(1 + std::exp(2.0));
  EXPECT_TRUE(all_close(scaled[0], make(DType::kF64, {2, 1, 1}, {o, o}), 1e-14, 1e-14));
  EXPECT_TRUE(all_close(scaled[1], make(DType::kF64, {2, 1}, {lse, lse}), 1e-14, 1e-14));
}

// The graph attention_qkv replaces: qkv split along axis -3, each part reshaped to
// (..., T, H, D), attention{layout "bthd"} on the three.
Graph split_attention_graph(const Shape& qkv_shape, DType dtype, const Attributes& attrs) {
  Builder b("split_attention");
  Expr qkv = b.data("qkv", qkv_shape, dtype);
  Shape part = qkv_shape;
  part.erase(part.end() - 3);
  std::vector<Expr> parts = split(qkv, {1, 1, 1}, -3);
  for (Expr& p : parts) p = reshape(p, part);
  Attributes bthd = attrs;
  bthd.set("layout", std::string("bthd"));
  return b.finish(b.apply(Op::kAttention, parts, bthd));
}

Graph packed_attention_graph(const Shape& qkv_shape, DType dtype, const Attributes& attrs) {
  Builder b("packed_attention");
  Expr qkv = b.data("qkv", qkv_shape, dtype);
  return b.finish(b.apply(Op::kAttentionQkv, {qkv}, attrs));
}

std::vector<Tensor> run_graph(const Graph& g, const std::vector<Tensor>& inputs) {
  return Executor(g, ExecutorOptions{Device::kCpu, {"reference"}}).run(inputs);
}

TEST(NnAttentionQkv, EqualsBthdAttentionOnTheSplit) {
  // The same reference arithmetic on the same elements: equal exactly (f64 and bf16, whose
  // outputs round the same double once).
  struct Case {
    Shape qkv;
    Attributes attrs;
  };
  const std::vector<Case> cases{
      {{2, 5, 3, 3, 4}, {}},
      {{2, 5, 3, 3, 4}, {{"causal", true}}},
      {{7, 3, 2, 3}, {{"causal", true}, {"scale", 0.6}}},   // rank 4
      {{2, 2, 6, 3, 2, 5}, {{"causal", true}}},             // rank 6
      {{1, 9, 3, 1, 7}, {{"scale", 1.9}}},
  };
  uint64_t seed = 90;
  for (const Case& c : cases) {
    for (DType dtype : {DType::kF64, DType::kBF16}) {
      SCOPED_TRACE(to_string(TensorType{dtype, c.qkv}));
      const std::vector<Tensor> in{testing::rand(dtype, c.qkv, ++seed, -2, 2)};
      const std::vector<Tensor> packed = run_graph(packed_attention_graph(c.qkv, dtype, c.attrs),
                                                   in);
      const std::vector<Tensor> split = run_graph(split_attention_graph(c.qkv, dtype, c.attrs),
                                                  in);
      ASSERT_EQ(packed.size(), 2u);
      EXPECT_TRUE(all_close(packed[0], split[0], 0, 0));
      EXPECT_TRUE(all_close(packed[1], split[1], 0, 0));
    }
  }
}

}  // namespace
}  // namespace kiln

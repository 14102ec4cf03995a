// The CPU fast paths of conv2d and its gradients (dialect "openblas"; depthwise ones "cpu") and
// of the pools (dialect "cpu") beyond the conformance sweep (which runs them against the
// reference kernels on odd sizes, strides, paddings, unequal per-dim attributes, 1x1 kernels,
// groups, depthwise convolutions, a single image and a CNN batch: tests/conformance_cases.cc):
// a batch large enough to be split into several GEMM chunks of images (with a last chunk of one
// image), grouped too, pools with tied maxima, which dialect the registry picks, and that
// supports() leaves f64 and empty tensors to the reference.
#include <cmath>

#include "test_util.h"

namespace kiln {
namespace {

using testing::all_close;
using testing::expect_matches_reference;
using testing::selected_dialect;
using testing::Tolerance;
using testing::rand;
using testing::run_dialect;
using testing::run_reference;
using Ints = std::vector<int64_t>;

// f32 against the f64-accumulated reference: GEMM sums of up to ~800 products of O(1) values.
constexpr Tolerance kConvTolerance{2e-4, 2e-4};

struct ConvCase {
  Shape x, w;
  Ints stride, padding;
  int64_t groups = 1;
};

// Forward, grad_input and grad_weight of one conv geometry.
void check_conv(const ConvCase& c, uint64_t seed) {
  Attributes attrs{{"stride", c.stride}, {"padding", c.padding}, {"groups", c.groups}};
  Tensor x = rand(DType::kF32, c.x, seed), w = rand(DType::kF32, c.w, seed + 1);
  expect_matches_reference("openblas", Op::kConv2d, {x, w}, attrs, kConvTolerance);
  const Shape y = run_reference(Op::kConv2d, {x, w}, attrs)[0].shape();
  Tensor dy = rand(DType::kF32, y, seed + 2);
  Attributes input_attrs = attrs;
  input_attrs.set("input_shape", c.x);
  expect_matches_reference("openblas", Op::kConv2dGradInput, {dy, w}, input_attrs, kConvTolerance);
  Attributes weight_attrs = attrs;
  weight_attrs.set("weight_shape", c.w);
  expect_matches_reference("openblas", Op::kConv2dGradWeight, {x, dy}, weight_attrs,
                           kConvTolerance);
}

TEST(CpuConv, SplitsLargeBatchesIntoChunks) {
  // 32 * 5 * 5 = 800 column rows times 40 * 41 = 1640 positions: 1.3M floats per image, so a
  // chunk holds 3 images under the 4M-float budget and 4 images run as 3 + 1.
  check_conv({{4, 32, 40, 41}, {4, 32, 5, 5}, {1, 1}, {2, 2}}, 7);
  // The same chunks with 4 groups: each chunk's GEMMs per group at their offsets, the weight
  // gradient of the second chunk added to each group's block.
  check_conv({{4, 32, 40, 41}, {8, 8, 5, 5}, {1, 1}, {2, 2}, 4}, 8);
}

struct PoolCase {
  Shape x;
  Ints kernel, stride, padding;
};

const std::vector<PoolCase> kPoolCases = {
    {{2, 3, 7, 9}, {2, 2}, {}, {0, 0}},      // default stride, odd sizes (the edge dropped)
    {{2, 3, 7, 9}, {3, 3}, {2, 2}, {1, 1}},  // overlapping windows, padding 1
    {{1, 2, 6, 7}, {2, 3}, {1, 2}, {1, 1}},  // unequal per-dim attributes
    {{3, 2, 5, 5}, {1, 1}, {1, 1}, {0, 0}},  // identity
    {{32, 16, 28, 28}, {2, 2}, {}, {0, 0}},  // a CNN batch: split across threads
};

void check_pool(Op forward, Op backward, const PoolCase& c, const Tensor& x) {
  Attributes attrs{{"kernel", c.kernel}, {"stride", c.stride}, {"padding", c.padding}};
  expect_matches_reference("cpu", forward, {x}, attrs, {1e-6, 1e-6});
  const Shape y = run_reference(forward, {x}, attrs)[0].shape();
  Tensor dy = rand(DType::kF32, y, 77);
  if (backward == Op::kMaxPool2dGrad) {
    expect_matches_reference("cpu", backward, {x, dy}, attrs, {1e-6, 1e-6});
  } else {
    attrs.set("input_shape", c.x);
    expect_matches_reference("cpu", backward, {dy}, attrs, {1e-6, 1e-6});
  }
}

TEST(CpuPool, MaxWithTiesSendsGradientToTheSameElement) {
  // Values in {-2, -1, 0, 1, 2}: most windows have a tied max; fast and reference must pick the
  // same (first) element.
  uint64_t seed = 300;
  for (const PoolCase& c : kPoolCases) {
    Tensor x = rand(DType::kF32, c.x, ++seed, -2.0, 3.0);
    for (int64_t i = 0; i < x.numel(); ++i) x.set(i, std::floor(x.get(i)));
    check_pool(Op::kMaxPool2d, Op::kMaxPool2dGrad, c, x);
  }
}

TEST(CpuConv, DialectSelection) {
  const TensorType x{DType::kF32, {2, 3, 8, 8}}, w{DType::kF32, {4, 3, 3, 3}};
  EXPECT_EQ(selected_dialect(Op::kConv2d, {x, w}), "openblas");
  EXPECT_EQ(selected_dialect(Op::kConv2dGradInput, {{DType::kF32, {2, 4, 6, 6}}, w},
                             {{"input_shape", Ints{2, 3, 8, 8}}}),
            "openblas");
  EXPECT_EQ(selected_dialect(Op::kConv2dGradWeight, {x, {DType::kF32, {2, 4, 6, 6}}},
                             {{"weight_shape", Ints{4, 3, 3, 3}}}),
            "openblas");
  // Grouped: per-group GEMMs; depthwise (groups = C > 1): the direct loops.
  const TensorType x6{DType::kF32, {2, 6, 8, 8}};
  EXPECT_EQ(selected_dialect(Op::kConv2d, {x6, {DType::kF32, {4, 3, 3, 3}}}, {{"groups", int64_t{2}}}),
            "openblas");
  const TensorType depthwise_w{DType::kF32, {12, 1, 3, 3}}, depthwise_dy{DType::kF32, {2, 12, 6, 6}};
  EXPECT_EQ(selected_dialect(Op::kConv2d, {x6, depthwise_w}, {{"groups", int64_t{6}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kConv2dGradInput, {depthwise_dy, depthwise_w},
                             {{"groups", int64_t{6}}, {"input_shape", Ints{2, 6, 8, 8}}}),
            "cpu");
  EXPECT_EQ(selected_dialect(Op::kConv2dGradWeight, {x6, depthwise_dy},
                             {{"groups", int64_t{6}}, {"weight_shape", Ints{12, 1, 3, 3}}}),
            "cpu");
  EXPECT_EQ(selected_dialect(Op::kMaxPool2d, {x}, {{"kernel", Ints{2, 2}}}), "cpu");
  EXPECT_EQ(selected_dialect(Op::kAvgPool2d, {x}, {{"kernel", Ints{2, 2}}}), "cpu");
  // Other dtypes and empty tensors go to the reference.
  const TensorType x64{DType::kF64, {2, 3, 8, 8}}, w64{DType::kF64, {4, 3, 3, 3}};
  EXPECT_EQ(selected_dialect(Op::kConv2d, {x64, w64}), "reference");
  EXPECT_EQ(
      selected_dialect(Op::kMaxPool2d, {{DType::kBF16, {2, 3, 8, 8}}}, {{"kernel", Ints{2, 2}}}),
      "reference");
  EXPECT_EQ(selected_dialect(Op::kConv2d, {{DType::kF32, {0, 3, 8, 8}}, w}), "reference");
  EXPECT_EQ(
      selected_dialect(Op::kConv2d, {{DType::kF32, {2, 0, 8, 8}}, {DType::kF32, {4, 0, 3, 3}}}),
      "reference");
}

TEST(CpuConv, EmptyChannelsGiveZerosThroughTheReference) {
  // C = 0: every output is an empty sum.
  std::vector<Tensor> y = run_reference(
      Op::kConv2d, {Tensor({DType::kF32, {2, 0, 4, 4}}), Tensor({DType::kF32, {3, 0, 3, 3}})});
  ASSERT_EQ(y[0].shape(), (Shape{2, 3, 2, 2}));
  for (int64_t i = 0; i < y[0].numel(); ++i) EXPECT_EQ(y[0].get(i), 0.0);
}

}  // namespace
}  // namespace kiln

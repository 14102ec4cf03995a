// The "cuda-conv" dialect (backends/cuda/conv/conv.{cu,cc}) against the CPU reference kernels
// (ops/conv.cc); whole CNN steps are cnn_test.cc's:
//   - every op of the family (conv2d, its input and weight gradients, max/avg pooling and their
//     gradients) at every float dtype, over a sweep of geometries: strides below, at and above
//     the kernel (inputs no window covers), paddings up to and past the kernel's reach, unequal
//     per-dim attributes, odd sizes, 1x1 kernels with and without the im2col shortcut, a kernel
//     as large as the input, single images and 1x1 planes;
//   - batches larger than the scratch bound (conv::kScratchBytes): chunks of several images,
//     dy regrouped per channel, the weight gradient accumulated over chunks (in f32 for bf16);
//   - groups (one product per group on offsets of the same buffers, with and without im2col,
//     several chunks) and depthwise convolutions (groups = C: the direct kernels, one or several
//     filters per channel, strides and paddings, a weight gradient over many positions);
//   - max pooling's ties (the first maximum takes the gradient), NaNs and windows of -inf (the
//     ONNX importer's ceil-mode padding).
// Tolerances (max_scaled_error <= 1 with atol scaled by the output's largest element, as the
// sums' rounding is): f32 1e-4 (TF32 off, cublaslt.h; the chunked weight gradient sums 120000
// products in f32), f64 1e-12, f16 2e-3, bf16 1e-2 (one rounding of an f32 sum, against the
// reference's one rounding of an f64 sum). A wrong tap or image is off by the order of the
// values themselves. Outputs are
// poisoned first (conformance::run_kernel), so an element the kernels forget shows as NaN.
#include <cmath>
#include <limits>

#include "backends/cuda/conv/conv.cuh"
#include "conformance.h"
#include "gpu_test_util.h"

namespace kiln {
namespace {

namespace conformance = testing::conformance;
using Ints = std::vector<int64_t>;
using testing::rand;

constexpr DType kFloatTypes[] = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16};

// Runs `op` through cuda-conv (it must take the node) as the conformance sweep runs a kernel.
std::vector<Tensor> run_cuda_conv(Op op, const std::vector<Tensor>& inputs, const Attributes& attrs) {
  const conformance::Instance node = conformance::instance_of(op, inputs, attrs);
  const KernelImpl& impl = kernel_registry().select(node.view(), Device::kCuda, {"cuda-conv"});
  EXPECT_EQ(impl.dialect, "cuda-conv");
  return conformance::run_kernel(Device::kCuda, impl, node);
}

testing::Tolerance tolerance(DType t) {
  switch (t) {
    case DType::kF64: return {1e-12, 1e-12};
    case DType::kF16: return {2e-3, 2e-3};
    case DType::kBF16: return {1e-2, 1e-2};
    default: return {1e-4, 1e-4};
  }
}

// The op on the GPU against its reference kernel; atol scaled by the reference's largest
// element (at least 1).
void expect_matches_reference(Op op, const std::vector<Tensor>& inputs, const Attributes& attrs) {
  SCOPED_TRACE(fmt::format("{} on {}", op_name(op), to_string(inputs[0].type())));
  const std::vector<Tensor> want = testing::run_reference(op, inputs, attrs);
  const std::vector<Tensor> got = run_cuda_conv(op, inputs, attrs);
  ASSERT_EQ(got.size(), want.size());
  for (size_t o = 0; o < want.size(); ++o) {
    double scale = 1.0;
    for (double v : want[o].to_f64())
      if (std::isfinite(v)) scale = std::max(scale, std::abs(v));
    const testing::Tolerance tol = tolerance(want[o].dtype());
    EXPECT_LE(max_scaled_error(got[o], want[o], tol.atol * scale, tol.rtol), 1.0)
        << "output " << o << "\n  cuda-conv: " << summarize(got[o])
        << "\n  reference: " << summarize(want[o]);
  }
}

// ---- convolution -----------------------------------------------------------------------------

struct ConvCase {
  Shape x, w;
  Ints stride, padding;
  int64_t groups = 1;
};

const std::vector<ConvCase> kConvCases = {
    {{2, 3, 7, 9}, {5, 3, 3, 3}, {1, 1}, {1, 1}},
    {{2, 3, 7, 9}, {5, 3, 3, 3}, {2, 2}, {1, 1}},      // stride 2, odd sizes
    {{3, 2, 8, 6}, {4, 2, 3, 3}, {2, 2}, {1, 1}},      // even sizes: the last row unused
    {{2, 3, 9, 7}, {4, 3, 2, 3}, {2, 1}, {0, 1}},      // unequal per-dim attributes, even kernel
    {{2, 3, 10, 9}, {3, 3, 2, 2}, {3, 4}, {1, 0}},     // stride > kernel: inputs no window reads
    {{2, 4, 6, 6}, {8, 4, 3, 3}, {3, 3}, {0, 0}},      // stride = kernel: no overlap
    {{3, 4, 5, 5}, {6, 4, 1, 1}, {1, 1}, {0, 0}},      // 1x1: x is its own column matrix
    {{2, 3, 7, 6}, {4, 3, 1, 1}, {2, 2}, {0, 0}},      // 1x1 with a stride: im2col
    {{2, 2, 4, 5}, {3, 2, 1, 1}, {1, 1}, {1, 1}},      // 1x1 with padding: im2col
    {{1, 3, 11, 13}, {7, 3, 5, 5}, {3, 2}, {2, 2}},    // one image, a 5x5 kernel
    {{2, 1, 4, 4}, {2, 1, 3, 3}, {1, 1}, {3, 3}},      // padding past the kernel's reach
    {{2, 3, 5, 5}, {4, 3, 5, 5}, {1, 1}, {0, 0}},      // kernel = input: a 1x1 output
    {{2, 5, 3, 17}, {3, 5, 3, 1}, {1, 3}, {1, 0}},     // a wide, flat plane
    {{1, 1, 1, 1}, {1, 1, 1, 1}, {1, 1}, {0, 0}},      // one element
    {{4, 16, 14, 14}, {32, 16, 3, 3}, {1, 1}, {1, 1}}, // the cnn's second layer (K = 144)
    // Groups: products per group.
    {{2, 4, 7, 6}, {6, 2, 3, 3}, {1, 1}, {1, 1}, 2},
    {{3, 6, 8, 7}, {3, 2, 3, 2}, {2, 1}, {1, 0}, 3},   // one output channel per group
    {{2, 8, 5, 5}, {8, 2, 1, 1}, {1, 1}, {0, 0}, 4},   // grouped 1x1: x is its own column matrix
    {{2, 8, 5, 5}, {4, 4, 1, 1}, {2, 2}, {0, 0}, 2},   // grouped 1x1 with a stride: im2col
    // Depthwise: the direct kernels.
    {{2, 5, 9, 8}, {5, 1, 3, 3}, {1, 1}, {1, 1}, 5},
    {{3, 4, 9, 9}, {4, 1, 3, 3}, {2, 2}, {1, 1}, 4},     // stride 2
    {{2, 3, 7, 10}, {6, 1, 3, 5}, {1, 2}, {2, 1}, 3},    // two filters per channel, unequal
    {{1, 4, 4, 4}, {8, 1, 5, 5}, {1, 1}, {3, 3}, 4},     // padding past the kernel's reach
    {{2, 3, 10, 9}, {3, 1, 2, 2}, {3, 4}, {1, 0}, 3},    // stride > kernel: inputs no window reads
    {{8, 32, 28, 28}, {32, 1, 3, 3}, {1, 1}, {1, 1}, 32},  // weight gradient: 6272 positions a tap
};

Attributes conv_attrs(const ConvCase& c) {
  return {{"stride", c.stride}, {"padding", c.padding}, {"groups", c.groups}};
}

// The three ops of one case at one dtype, on random inputs.
void check_conv(const ConvCase& c, DType t, uint64_t seed) {
  SCOPED_TRACE(fmt::format("x {} w {} stride {} padding {} groups {} {}", to_string(c.x),
                           to_string(c.w), fmt::join(c.stride, "x"), fmt::join(c.padding, "x"),
                           c.groups, dtype_name(t)));
  const Attributes attrs = conv_attrs(c);
  const Shape y = testing::infer(Op::kConv2d, {{t, c.x}, {t, c.w}}, attrs)[0].shape;
  const Tensor x = rand(t, c.x, seed), w = rand(t, c.w, seed + 1), dy = rand(t, y, seed + 2);
  expect_matches_reference(Op::kConv2d, {x, w}, attrs);
  Attributes input_attrs = attrs;
  input_attrs.set("input_shape", c.x);
  expect_matches_reference(Op::kConv2dGradInput, {dy, w}, input_attrs);
  Attributes weight_attrs = attrs;
  weight_attrs.set("weight_shape", c.w);
  expect_matches_reference(Op::kConv2dGradWeight, {x, dy}, weight_attrs);
}

TEST(CudaConv, EveryGeometryAndDtypeMatchesTheReference) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 1;
  for (const ConvCase& c : kConvCases)
    for (DType t : kFloatTypes) check_conv(c, t, seed += 10);
}

// Batches whose column matrices exceed conv::kScratchBytes run in chunks of images: f32 in
// chunks of 2 of 3 images (dy regrouped per channel for the weight gradient, which the second
// chunk adds to through cuBLASLt's C), bf16 likewise for the forward and the weight gradient
// (summed over the chunks in f32, then rounded), its input gradient one image at a time (the f32
// column gradient of one image is over the bound's half).
TEST(CudaConv, BatchesLargerThanTheScratchRunInChunks) {
  KILN_REQUIRE_GPU();
  for (auto [t, channels] : {std::pair{DType::kF32, int64_t{16}}, std::pair{DType::kBF16, int64_t{32}}}) {
    const ConvCase c{{3, channels, 200, 200}, {2, channels, 3, 3}, {1, 1}, {1, 1}};
    const int64_t k = channels * 9, plane = 200 * 200, e = static_cast<int64_t>(dtype_size(t));
    // The premise: two images per chunk for the forward and the weight gradient (so a second,
    // smaller chunk follows), as conv.cc sizes them.
    ASSERT_EQ(cuda::conv::images_per_chunk(k * plane * e, 3), 2);
    ASSERT_EQ(cuda::conv::images_per_chunk((k + 2) * plane * e, 3), 2);
    check_conv(c, t, 7);
  }
}

// Grouped products over several chunks of images (the weight gradient adds each chunk through
// cuBLASLt's C, per group at its offset).
TEST(CudaConv, GroupedBatchesLargerThanTheScratchRunInChunks) {
  KILN_REQUIRE_GPU();
  const ConvCase c{{3, 16, 200, 200}, {4, 8, 3, 3}, {1, 1}, {1, 1}, 2};
  ASSERT_EQ(cuda::conv::images_per_chunk(16 * 9 * 200 * 200 * 4, 3), 2);
  check_conv(c, DType::kF32, 11);
}

// 16-bit operands accumulate in f32: sums of 2304 products (a bf16 accumulator would be off by
// several of the result's ulps).
TEST(CudaConv, HalfPrecisionSumsAccumulateInF32) {
  KILN_REQUIRE_GPU();
  const ConvCase c{{2, 256, 6, 6}, {2, 256, 3, 3}, {1, 1}, {0, 0}};
  check_conv(c, DType::kBF16, 3);
  check_conv(c, DType::kF16, 4);
}

// ---- pooling ---------------------------------------------------------------------------------

struct PoolCase {
  Shape x;
  Ints kernel, stride, padding;
};

const std::vector<PoolCase> kPoolCases = {
    {{2, 3, 7, 9}, {2, 2}, {}, {0, 0}},        // default stride, odd sizes (the edge dropped)
    {{2, 3, 7, 9}, {3, 3}, {2, 2}, {1, 1}},    // overlapping windows, padding 1
    {{2, 3, 8, 8}, {3, 3}, {1, 1}, {1, 1}},    // stride 1: every input in 9 windows
    {{1, 2, 6, 7}, {2, 3}, {1, 2}, {1, 1}},    // unequal per-dim attributes
    {{2, 3, 10, 11}, {4, 2}, {3, 1}, {2, 1}},  // padding = kernel / 2
    {{2, 2, 9, 9}, {2, 2}, {3, 3}, {0, 0}},    // stride > kernel: inputs no window covers
    {{3, 2, 5, 5}, {1, 1}, {1, 1}, {0, 0}},    // identity
    {{2, 2, 5, 5}, {5, 5}, {}, {0, 0}},        // one window over the whole plane
    {{1, 1, 1, 1}, {1, 1}, {}, {0, 0}},        // one element
    {{8, 16, 28, 28}, {2, 2}, {}, {0, 0}},     // the cnn's
};

Attributes pool_attrs(const PoolCase& p) {
  return {{"kernel", p.kernel}, {"stride", p.stride}, {"padding", p.padding}};
}

void check_pools(const PoolCase& p, const Tensor& x, uint64_t seed) {
  SCOPED_TRACE(fmt::format("x {} kernel {} stride {} padding {}", to_string(x.type()),
                           fmt::join(p.kernel, "x"), fmt::join(p.stride, "x"),
                           fmt::join(p.padding, "x")));
  const Attributes attrs = pool_attrs(p);
  const Shape y = testing::infer(Op::kMaxPool2d, {x.type()}, attrs)[0].shape;
  const Tensor dy = rand(x.dtype(), y, seed);
  expect_matches_reference(Op::kMaxPool2d, {x}, attrs);
  expect_matches_reference(Op::kMaxPool2dGrad, {x, dy}, attrs);
  expect_matches_reference(Op::kAvgPool2d, {x}, attrs);
  Attributes grad_attrs = attrs;
  grad_attrs.set("input_shape", p.x);
  expect_matches_reference(Op::kAvgPool2dGrad, {dy}, grad_attrs);
}

TEST(CudaPool, EveryGeometryAndDtypeMatchesTheReference) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 100;
  for (const PoolCase& p : kPoolCases)
    for (DType t : kFloatTypes) {
      check_pools(p, rand(t, p.x, seed), seed + 1);
      seed += 10;
    }
}

// Values from {0, 1, 2}: most windows hold their maximum twice or more, and the gradient goes to
// the first (row-major) one only, as the reference's. Exact: each dx is one dy or a sum of few.
TEST(CudaPool, TiedMaximaGiveTheGradientToTheFirst) {
  KILN_REQUIRE_GPU();
  for (const PoolCase& p : {PoolCase{{2, 3, 7, 9}, {3, 3}, {2, 2}, {1, 1}},
                            PoolCase{{2, 3, 8, 8}, {3, 3}, {1, 1}, {1, 1}}}) {
    for (DType t : kFloatTypes) {
      Tensor x(TensorType{t, p.x});
      for (int64_t i = 0; i < x.numel(); ++i) x.set(i, static_cast<double>((i * 7 + i / 5) % 3));
      check_pools(p, x, 5);
    }
  }
}

// A NaN in a window is its maximum (the reference's rule) and takes its gradient; windows of
// -inf only (what the ONNX importer pads ceil-mode pools with) give -inf and pass the gradient
// to their first element.
TEST(CudaPool, NanWinsAndWindowsOfMinusInfinityPassTheirGradient) {
  KILN_REQUIRE_GPU();
  const PoolCase p{{1, 2, 6, 6}, {2, 2}, {}, {0, 0}};
  for (DType t : kFloatTypes) {
    Tensor x = rand(t, p.x, 9);
    x.set(7, std::numeric_limits<double>::quiet_NaN());  // plane 0, row 1, column 1
    for (int64_t r = 0; r < 6; ++r)                       // plane 1: the last two columns
      for (int64_t c = 4; c < 6; ++c) x.set(36 + r * 6 + c, -std::numeric_limits<double>::infinity());
    const Attributes attrs = pool_attrs(p);
    const Tensor dy = rand(t, {1, 2, 3, 3}, 10);
    expect_matches_reference(Op::kMaxPool2d, {x}, attrs);
    expect_matches_reference(Op::kMaxPool2dGrad, {x, dy}, attrs);
    const Tensor y = run_cuda_conv(Op::kMaxPool2d, {x}, attrs)[0];
    EXPECT_TRUE(std::isnan(y.get(0)));
    EXPECT_EQ(y.get(9 + 2), -std::numeric_limits<double>::infinity());
  }
}

}  // namespace
}  // namespace kiln

// Convolution and pooling ops (src/ops/conv.cc): inference on good inputs, every error with its
// message, and the reference kernels on small cases worked out by hand (the expected values in
// the comments, not computed by kiln).
#include <functional>
#include <limits>

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

Attributes conv_attrs(Ints stride, Ints padding) {
  return {{"stride", stride}, {"padding", padding}};
}
Attributes pool_attrs(Ints kernel, Ints stride = {}, Ints padding = {0, 0}) {
  return {{"kernel", kernel}, {"stride", stride}, {"padding", padding}};
}

// x = [[1, 2, 3], [4, 5, 6], [7, 8, 9]] as (1, 1, 3, 3); the hand-worked cases use it.
Tensor x3x3(DType dtype = DType::kF64) {
  return make(dtype, {1, 1, 3, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9});
}
// w = [[1, 2], [3, 4]] as (1, 1, 2, 2).
Tensor w2x2(DType dtype = DType::kF64) { return make(dtype, {1, 1, 2, 2}, {1, 2, 3, 4}); }

// ---------------------------------------------------------------- inference

TEST(Conv2d, InfersShapes) {
  // 3x3 padding 1 keeps the size.
  EXPECT_EQ(
      infer(Op::kConv2d, {f32({2, 3, 28, 28}), f32({16, 3, 3, 3})}, conv_attrs({1, 1}, {1, 1}))[0],
      f32({2, 16, 28, 28}));
  // Defaults: stride 1, no padding: 5 - 3 + 1 = 3, 6 - 2 + 1 = 5.
  EXPECT_EQ(infer(Op::kConv2d, {f32({1, 1, 5, 6}), f32({2, 1, 3, 2})})[0], f32({1, 2, 3, 5}));
  // Stride 2, padding 1: (7 + 2 - 3) / 2 + 1 = 4.
  EXPECT_EQ(
      infer(Op::kConv2d, {f32({1, 1, 7, 7}), f32({4, 1, 3, 3})}, conv_attrs({2, 2}, {1, 1}))[0],
      f32({1, 4, 4, 4}));
  // Per-dim attributes: H (3 - 1) / 2 + 1 = 2, W (4 + 2 - 2) / 1 + 1 = 5.
  EXPECT_EQ(
      infer(Op::kConv2d, {f32({1, 1, 3, 4}), f32({1, 1, 1, 2})}, conv_attrs({2, 1}, {0, 1}))[0],
      f32({1, 1, 2, 5}));
  EXPECT_EQ(infer(Op::kConv2d, {of(DType::kBF16, {1, 2, 4, 4}), of(DType::kBF16, {3, 2, 2, 2})})[0],
            of(DType::kBF16, {1, 3, 3, 3}));
}

TEST(Conv2d, InfersGradientShapes) {
  EXPECT_EQ(infer(Op::kConv2dGradInput, {f32({2, 16, 28, 28}), f32({16, 3, 3, 3})},
                  {{"padding", Ints{1, 1}}, {"input_shape", Ints{2, 3, 28, 28}}})[0],
            f32({2, 3, 28, 28}));
  // With stride 2 both 7 and 8 give 4 outputs: input_shape says which.
  for (int64_t size : {7, 8})
    EXPECT_EQ(infer(Op::kConv2dGradInput, {f32({1, 4, 4, 4}), f32({4, 1, 3, 3})},
                    {{"stride", Ints{2, 2}},
                     {"padding", Ints{1, 1}},
                     {"input_shape", Ints{1, 1, size, size}}})[0],
              f32({1, 1, size, size}));
  EXPECT_EQ(infer(Op::kConv2dGradWeight, {f32({2, 3, 28, 28}), f32({2, 16, 28, 28})},
                  {{"padding", Ints{1, 1}}, {"weight_shape", Ints{16, 3, 3, 3}}})[0],
            f32({16, 3, 3, 3}));
}

TEST(Conv2d, InfersGroupedShapes) {
  // groups = 2: w (O, C / 2, KH, KW).
  EXPECT_EQ(infer(Op::kConv2d, {f32({2, 4, 6, 6}), f32({6, 2, 3, 3})},
                  {{"padding", Ints{1, 1}}, {"groups", int64_t{2}}})[0],
            f32({2, 6, 6, 6}));
  // Depthwise, two filters per channel: w (2 C, 1, KH, KW).
  EXPECT_EQ(infer(Op::kConv2d, {f32({1, 3, 5, 5}), f32({6, 1, 3, 3})},
                  {{"stride", Ints{2, 2}}, {"groups", int64_t{3}}})[0],
            f32({1, 6, 2, 2}));
  EXPECT_EQ(infer(Op::kConv2dGradInput, {f32({1, 6, 2, 2}), f32({6, 1, 3, 3})},
                  {{"stride", Ints{2, 2}}, {"groups", int64_t{3}}, {"input_shape", Ints{1, 3, 5, 5}}})[0],
            f32({1, 3, 5, 5}));
  EXPECT_EQ(infer(Op::kConv2dGradWeight, {f32({1, 3, 5, 5}), f32({1, 6, 2, 2})},
                  {{"stride", Ints{2, 2}}, {"groups", int64_t{3}}, {"weight_shape", Ints{6, 1, 3, 3}}})[0],
            f32({6, 1, 3, 3}));
}

TEST(Conv2d, RejectsBadGroups) {
  // 3 groups do not divide 4 input channels, nor 2 groups 3 output channels.
  EXPECT_KILN_ERROR(infer(Op::kConv2d, {f32({1, 4, 5, 5}), f32({6, 1, 3, 3})}, {{"groups", int64_t{3}}}),
                    "groups = 3 does not divide the channels", "(C = 4)", "(O = 6)");
  EXPECT_KILN_ERROR(infer(Op::kConv2d, {f32({1, 4, 5, 5}), f32({3, 2, 3, 3})}, {{"groups", int64_t{2}}}),
                    "groups = 2 does not divide the channels", "(O = 3)");
  // The weight must hold C / groups channels: 4 / 2 = 2, not 4.
  EXPECT_KILN_ERROR(infer(Op::kConv2d, {f32({1, 4, 5, 5}), f32({4, 4, 3, 3})}, {{"groups", int64_t{2}}}),
                    "channels differ", "(C / groups = 4)", "C = 4 and groups = 2");
  EXPECT_KILN_ERROR(infer(Op::kConv2d, {f32({1, 4, 5, 5}), f32({4, 4, 3, 3})}, {{"groups", int64_t{0}}}),
                    "attribute 'groups' is 0, expected at least 1");
  EXPECT_KILN_ERROR(infer(Op::kConv2dGradInput, {f32({1, 4, 3, 3}), f32({4, 2, 3, 3})},
                          {{"groups", int64_t{3}}, {"input_shape", Ints{1, 6, 5, 5}}}),
                    "conv2d_grad_input", "groups = 3 does not divide the channels");
  EXPECT_KILN_ERROR(infer(Op::kConv2dGradWeight, {f32({1, 6, 5, 5}), f32({1, 4, 3, 3})},
                          {{"groups", int64_t{2}}, {"weight_shape", Ints{4, 2, 3, 3}}}),
                    "conv2d_grad_weight", "channels differ", "(C / groups = 2)");
}

TEST(Pool2d, InfersShapes) {
  for (Op op : {Op::kMaxPool2d, Op::kAvgPool2d}) {
    SCOPED_TRACE(op_name(op));
    // Stride defaults to the kernel.
    EXPECT_EQ(infer(op, {f32({2, 3, 28, 28})}, {{"kernel", Ints{2, 2}}})[0], f32({2, 3, 14, 14}));
    EXPECT_EQ(infer(op, {f32({1, 2, 7, 5})}, {{"kernel", Ints{2, 2}}})[0], f32({1, 2, 3, 2}));
    // Kernel 3 stride 2 padding 1: (7 + 2 - 3) / 2 + 1 = 4.
    EXPECT_EQ(infer(op, {f32({1, 1, 7, 7})}, pool_attrs({3, 3}, {2, 2}, {1, 1}))[0],
              f32({1, 1, 4, 4}));
    // Kernel 2 stride 1: 4 - 2 + 1 = 3, kernel 1: 5.
    EXPECT_EQ(infer(op, {of(DType::kF64, {1, 1, 4, 5})}, pool_attrs({2, 1}, {1, 1}))[0],
              of(DType::kF64, {1, 1, 3, 5}));
  }
  EXPECT_EQ(
      infer(Op::kMaxPool2dGrad, {f32({1, 2, 7, 5}), f32({1, 2, 3, 2})}, pool_attrs({2, 2}))[0],
      f32({1, 2, 7, 5}));
  Attributes attrs = pool_attrs({2, 2});
  attrs.set("input_shape", Ints{1, 2, 7, 5});
  EXPECT_EQ(infer(Op::kAvgPool2dGrad, {f32({1, 2, 3, 2})}, attrs)[0], f32({1, 2, 7, 5}));
}

// ---------------------------------------------------------------- errors

TEST(Conv2d, RejectsBadInputs) {
  EXPECT_KILN_ERROR(infer(Op::kConv2d, {f32({1, 3, 3}), f32({1, 3, 2, 2})}), "conv2d",
                    "x has shape (1, 3, 3) (rank 3), expected rank 4");
  EXPECT_KILN_ERROR(infer(Op::kConv2d, {f32({1, 3, 3, 3}), f32({3, 2, 2})}),
                    "w has shape (3, 2, 2) (rank 3), expected rank 4 (O, C / groups, KH, KW)");
  EXPECT_KILN_ERROR(infer(Op::kConv2d, {f32({1, 3, 5, 5}), f32({4, 2, 3, 3})}), "channels differ",
                    "(1, 3, 5, 5)", "(4, 2, 3, 3)");
  EXPECT_KILN_ERROR(infer(Op::kConv2d, {f32({1, 1, 2, 4}), f32({1, 1, 3, 3})}),
                    "x is (1, 1, 2, 4), w is (1, 1, 3, 3)", "padded input is 2x4",
                    "smaller than the kernel 3x3");
  // Padding makes it fit: (2 + 2 - 3) / 1 + 1 = 2.
  EXPECT_EQ(
      infer(Op::kConv2d, {f32({1, 1, 2, 2}), f32({1, 1, 3, 3})}, conv_attrs({1, 1}, {1, 1}))[0],
      f32({1, 1, 2, 2}));
  EXPECT_KILN_ERROR(infer(Op::kConv2d, {f32({1, 1, 3, 3}), f32({1, 1, 0, 2})}),
                    "w has shape (1, 1, 0, 2), expected a kernel of at least 1x1");
  EXPECT_KILN_ERROR(
      infer(Op::kConv2d, {of(DType::kI32, {1, 1, 3, 3}), of(DType::kI32, {1, 1, 2, 2})}),
      "x is i32, expected a float dtype");
  EXPECT_KILN_ERROR(infer(Op::kConv2d, {f32({1, 1, 3, 3}), of(DType::kF64, {1, 1, 2, 2})}),
                    "w is f64, expected f32 like x");
  EXPECT_KILN_ERROR(
      infer(Op::kConv2d, {f32({1, 1, 3, 3}), f32({1, 1, 2, 2})}, conv_attrs({0, 1}, {0, 0})),
      "attribute 'stride' is [0, 1], expected values >= 1");
  EXPECT_KILN_ERROR(
      infer(Op::kConv2d, {f32({1, 1, 3, 3}), f32({1, 1, 2, 2})}, conv_attrs({2}, {0, 0})),
      "attribute 'stride' is [2], expected two values (height, width)");
  EXPECT_KILN_ERROR(
      infer(Op::kConv2d, {f32({1, 1, 3, 3}), f32({1, 1, 2, 2})}, conv_attrs({1, 1}, {0, -1})),
      "attribute 'padding' is [0, -1], expected values >= 0");
  EXPECT_KILN_ERROR(
      infer(Op::kConv2d, {f32({1, 1, 3, 3}), f32({1, 1, 2, 2})}, {{"dilation", Ints{2, 2}}}),
      "unknown attribute 'dilation'");
}

TEST(Conv2d, GradientOpsRejectBadInputs) {
  Attributes attrs{{"padding", Ints{1, 1}}, {"input_shape", Ints{2, 3, 8, 8}}};
  // The forward output for (2, 3, 8, 8) and (4, 3, 3, 3) with padding 1 is (2, 4, 8, 8).
  EXPECT_KILN_ERROR(infer(Op::kConv2dGradInput, {f32({2, 4, 7, 8}), f32({4, 3, 3, 3})}, attrs),
                    "conv2d_grad_input", "dy has shape (2, 4, 7, 8), expected (2, 4, 8, 8)",
                    "input_shape (2, 3, 8, 8)");
  EXPECT_KILN_ERROR(
      infer(Op::kConv2dGradInput, {of(DType::kF64, {2, 4, 8, 8}), f32({4, 3, 3, 3})}, attrs),
      "dy is f64, expected f32 like w");
  EXPECT_KILN_ERROR(infer(Op::kConv2dGradInput, {f32({2, 4, 8, 8}), f32({4, 2, 3, 3})}, attrs),
                    "channels differ");
  EXPECT_KILN_ERROR(infer(Op::kConv2dGradInput, {f32({2, 4, 8, 8}), f32({4, 3, 3, 3})},
                          {{"input_shape", Ints{3, 8, 8}}}),
                    "attribute 'input_shape' is (3, 8, 8), expected 4 dims");
  EXPECT_KILN_ERROR(infer(Op::kConv2dGradInput, {f32({2, 4, 8, 8}), f32({4, 3, 3, 3})}),
                    "missing required attribute 'input_shape'");

  Attributes weight_attrs{{"stride", Ints{2, 2}}, {"weight_shape", Ints{4, 3, 3, 3}}};
  // (9 - 3) / 2 + 1 = 4.
  EXPECT_KILN_ERROR(
      infer(Op::kConv2dGradWeight, {f32({2, 3, 9, 9}), f32({2, 4, 3, 4})}, weight_attrs),
      "conv2d_grad_weight", "dy has shape (2, 4, 3, 4), expected (2, 4, 4, 4)");
  EXPECT_KILN_ERROR(
      infer(Op::kConv2dGradWeight, {f32({2, 2, 9, 9}), f32({2, 4, 4, 4})}, weight_attrs),
      "channels differ", "(2, 2, 9, 9)", "(4, 3, 3, 3)");
  EXPECT_KILN_ERROR(infer(Op::kConv2dGradWeight, {f32({2, 3, 9, 9}), f32({2, 4, 4, 4})},
                          {{"weight_shape", Ints{4, 3, -3, 3}}}),
                    "negative dimension");
}

TEST(Pool2d, RejectsBadInputs) {
  for (Op op : {Op::kMaxPool2d, Op::kAvgPool2d}) {
    SCOPED_TRACE(op_name(op));
    EXPECT_KILN_ERROR(infer(op, {f32({1, 1, 4, 4})}), "missing required attribute 'kernel'");
    EXPECT_KILN_ERROR(infer(op, {f32({1, 4, 4})}, pool_attrs({2, 2})),
                      "x has shape (1, 4, 4) (rank 3), expected rank 4");
    EXPECT_KILN_ERROR(infer(op, {of(DType::kI64, {1, 1, 4, 4})}, pool_attrs({2, 2})),
                      "x is i64, expected a float dtype");
    EXPECT_KILN_ERROR(infer(op, {f32({1, 1, 4, 4})}, pool_attrs({2, 2}, {1, 1}, {2, 0})),
                      "padding is [2, 0] for kernel [2, 2], expected padding <= kernel / 2");
    EXPECT_KILN_ERROR(infer(op, {f32({1, 1, 4, 2})}, pool_attrs({3, 3})), "x is (1, 1, 4, 2)",
                      "padded input is 4x2", "smaller than the kernel 3x3");
    EXPECT_KILN_ERROR(infer(op, {f32({1, 1, 0, 4})}, pool_attrs({1, 1})),
                      "x is (1, 1, 0, 4), expected H >= 1 and W >= 1");
    EXPECT_KILN_ERROR(infer(op, {f32({1, 1, 4, 4})}, pool_attrs({0, 2})),
                      "attribute 'kernel' is [0, 2], expected values >= 1");
    EXPECT_KILN_ERROR(infer(op, {f32({1, 1, 4, 4})}, pool_attrs({2, 2}, {1})),
                      "attribute 'stride' is [1], expected two values");
  }
  EXPECT_KILN_ERROR(
      infer(Op::kMaxPool2dGrad, {f32({1, 2, 7, 5}), f32({1, 2, 3, 3})}, pool_attrs({2, 2})),
      "max_pool2d_grad", "dy has shape (1, 2, 3, 3), expected (1, 2, 3, 2)");
  EXPECT_KILN_ERROR(infer(Op::kMaxPool2dGrad, {f32({1, 2, 7, 5}), of(DType::kF64, {1, 2, 3, 2})},
                          pool_attrs({2, 2})),
                    "dy is f64, expected f32 like x");
  Attributes attrs = pool_attrs({2, 2});
  attrs.set("input_shape", Ints{1, 2, 8, 5});
  EXPECT_KILN_ERROR(infer(Op::kAvgPool2dGrad, {f32({1, 2, 3, 2})}, attrs), "avg_pool2d_grad",
                    "dy has shape (1, 2, 3, 2), expected (1, 2, 4, 2)", "input_shape (1, 2, 8, 5)");
  EXPECT_KILN_ERROR(infer(Op::kAvgPool2dGrad, {f32({1, 2, 3, 2})}, pool_attrs({2, 2})),
                    "missing required attribute 'input_shape'");
}

// ---------------------------------------------------------------- reference kernels

TEST(Conv2d, ReferenceSmallCases) {
  // Stride 1, no padding: y[i, j] = sum w[p, q] * x[i + p, j + q].
  //   y00 = 1*1 + 2*2 + 3*4 + 4*5 = 37, y01 = 1*2 + 2*3 + 3*5 + 4*6 = 47,
  //   y10 = 1*4 + 2*5 + 3*7 + 4*8 = 67, y11 = 1*5 + 2*6 + 3*8 + 4*9 = 77.
  EXPECT_TRUE(all_close(run_reference(Op::kConv2d, {x3x3(), w2x2()})[0],
                        make(DType::kF64, {1, 1, 2, 2}, {37, 47, 67, 77}), 0, 0));
  // Stride 2, padding 1: windows start at (2i - 1, 2j - 1); taps on padding add nothing.
  //   y00 = 4*x00 = 4, y01 = 3*x01 + 4*x02 = 6 + 12 = 18,
  //   y10 = 2*x10 + 4*x20 = 8 + 28 = 36, y11 = 1*5 + 2*6 + 3*8 + 4*9 = 77.
  EXPECT_TRUE(all_close(run_reference(Op::kConv2d, {x3x3(), w2x2()}, conv_attrs({2, 2}, {1, 1}))[0],
                        make(DType::kF64, {1, 1, 2, 2}, {4, 18, 36, 77}), 0, 0));
  // Per-dim attributes: x (1, 1, 3, 4) = 1..12, w (1, 1, 1, 2) = [1, -1], stride [2, 1], padding
  // [0, 1]: y[i, j] = x[2i, j - 1] - x[2i, j]. Row 0 (1 2 3 4): -1 -1 -1 -1 4; row 2 (9 10 11 12):
  // -9 -1 -1 -1 12.
  EXPECT_TRUE(all_close(
      run_reference(Op::kConv2d,
                    {make(DType::kF64, {1, 1, 3, 4}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}),
                     make(DType::kF64, {1, 1, 1, 2}, {1, -1})},
                    conv_attrs({2, 1}, {0, 1}))[0],
      make(DType::kF64, {1, 1, 2, 5}, {-1, -1, -1, -1, 4, -9, -1, -1, -1, 12}), 0, 0));
}

TEST(Conv2d, ReferenceMixesChannelsPerImage) {
  // Two images, two input channels, a 1x1 kernel: out0 = x0 + 0.5 x1, out1 = -x0 + 2 x1.
  Tensor x = make(DType::kF32, {2, 2, 1, 2}, {1, 2, 10, 20, /* image 1 */ 3, 4, 30, 40});
  Tensor w = make(DType::kF32, {2, 2, 1, 1}, {1, 0.5, -1, 2});
  // Image 0: out0 = (6, 12), out1 = (19, 38); image 1: out0 = (18, 24), out1 = (57, 76).
  EXPECT_TRUE(all_close(run_reference(Op::kConv2d, {x, w})[0],
                        make(DType::kF32, {2, 2, 1, 2}, {6, 12, 19, 38, 18, 24, 57, 76}), 0, 0));
}

TEST(Conv2d, ReferenceGroupsSeeOnlyTheirChannels) {
  // Two images, 4 channels in 2 groups, a 1x1 kernel, one output per group:
  //   out0 = x0 + 2 x1 (group 0: channels 0, 1), out1 = 3 x2 - x3 (group 1: channels 2, 3).
  Tensor x = make(DType::kF64, {2, 4, 1, 1}, {1, 10, 100, 1000, /* image 1 */ 2, 20, 200, 2000});
  Tensor w = make(DType::kF64, {2, 2, 1, 1}, {1, 2, 3, -1});
  // Image 0: 1 + 20 = 21, 300 - 1000 = -700; image 1: 2 + 40 = 42, 600 - 2000 = -1400.
  EXPECT_TRUE(all_close(run_reference(Op::kConv2d, {x, w}, {{"groups", int64_t{2}}})[0],
                        make(DType::kF64, {2, 2, 1, 1}, {21, -700, 42, -1400}), 0, 0));
  // The input gradient: dx0 = dy0, dx1 = 2 dy0, dx2 = 3 dy1, dx3 = -dy1.
  Tensor dy = make(DType::kF64, {2, 2, 1, 1}, {1, 5, -2, 4});
  EXPECT_TRUE(all_close(run_reference(Op::kConv2dGradInput, {dy, w},
                                      {{"groups", int64_t{2}}, {"input_shape", Ints{2, 4, 1, 1}}})[0],
                        make(DType::kF64, {2, 4, 1, 1}, {1, 2, 15, -5, -2, -4, 12, -4}), 0, 0));
  // The weight gradient: dw[o, k] = sum over images of dy[o] * x[group's channel k]:
  //   dw00 = 1*1 + -2*2 = -3, dw01 = 1*10 + -2*20 = -30,
  //   dw10 = 5*100 + 4*200 = 1300, dw11 = 5*1000 + 4*2000 = 13000.
  EXPECT_TRUE(all_close(run_reference(Op::kConv2dGradWeight, {x, dy},
                                      {{"groups", int64_t{2}}, {"weight_shape", Ints{2, 2, 1, 1}}})[0],
                        make(DType::kF64, {2, 2, 1, 1}, {-3, -30, 1300, 13000}), 0, 0));
  // Depthwise with two filters per channel: x3x3 as channel 0, 10 x3x3 as channel 1; filters
  // w2x2 and -w2x2 on channel 0, w2x2 and 2 w2x2 on channel 1. Channel 0's outputs are
  // (37, 47, 67, 77) and its negation (ReferenceSmallCases), channel 1's ten and twenty times
  // them.
  Tensor x2 = make(DType::kF64, {1, 2, 3, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 30, 40, 50, 60, 70, 80, 90});
  Tensor w4 = make(DType::kF64, {4, 1, 2, 2}, {1, 2, 3, 4, -1, -2, -3, -4, 1, 2, 3, 4, 2, 4, 6, 8});
  EXPECT_TRUE(all_close(run_reference(Op::kConv2d, {x2, w4}, {{"groups", int64_t{2}}})[0],
                        make(DType::kF64, {1, 4, 2, 2},
                             {37, 47, 67, 77, -37, -47, -67, -77, 370, 470, 670, 770, 740, 940, 1340, 1540}),
                        0, 0));
}

TEST(Conv2d, ReferenceGradientsSmallCases) {
  Tensor dy = make(DType::kF64, {1, 1, 2, 2}, {1, 2, 3, 4});
  // Stride 1: dx[h, w] = sum over outputs (i, j) covering (h, w) of dy[i, j] * w[h - i, w - j].
  //   dx00 = 1*1 = 1; dx01 = 1*2 + 2*1 = 4; dx02 = 2*2 = 4; dx10 = 1*3 + 3*1 = 6;
  //   dx11 = 1*4 + 2*3 + 3*2 + 4*1 = 20; dx12 = 2*4 + 4*2 = 16; dx20 = 3*3 = 9;
  //   dx21 = 3*4 + 4*3 = 24; dx22 = 4*4 = 16.
  EXPECT_TRUE(all_close(
      run_reference(Op::kConv2dGradInput, {dy, w2x2()}, {{"input_shape", Ints{1, 1, 3, 3}}})[0],
      make(DType::kF64, {1, 1, 3, 3}, {1, 4, 4, 6, 20, 16, 9, 24, 16}), 0, 0));
  // Stride 2, padding 1 (forward above: y00 = 4 x00, y01 = 3 x01 + 4 x02, y10 = 2 x10 + 4 x20,
  // y11 = x11 + 2 x12 + 3 x21 + 4 x22), so dx = (4*1, 3*2, 4*2; 2*3, 1*4, 2*4; 4*3, 3*4, 4*4).
  EXPECT_TRUE(all_close(
      run_reference(
          Op::kConv2dGradInput, {dy, w2x2()},
          {{"stride", Ints{2, 2}}, {"padding", Ints{1, 1}}, {"input_shape", Ints{1, 1, 3, 3}}})[0],
      make(DType::kF64, {1, 1, 3, 3}, {4, 6, 8, 6, 4, 8, 12, 12, 16}), 0, 0));
  // dw[p, q] = sum dy[i, j] * x[i + p, j + q]:
  //   dw00 = 1*1 + 2*2 + 3*4 + 4*5 = 37, dw01 = 1*2 + 2*3 + 3*5 + 4*6 = 47,
  //   dw10 = 1*4 + 2*5 + 3*7 + 4*8 = 67, dw11 = 1*5 + 2*6 + 3*8 + 4*9 = 77.
  EXPECT_TRUE(all_close(
      run_reference(Op::kConv2dGradWeight, {x3x3(), dy}, {{"weight_shape", Ints{1, 1, 2, 2}}})[0],
      make(DType::kF64, {1, 1, 2, 2}, {37, 47, 67, 77}), 0, 0));
  // Stride 2, padding 1: dw00 = dy11*x00... each tap sees the x it multiplied above:
  //   dw00 = dy11 * x11 = 4*5 = 20; dw01 = dy10 * x10 + dy11 * x12 = 3*4 + 4*6 = 36;
  //   dw10 = dy01 * x01 + dy11 * x21 = 2*2 + 4*8 = 36;
  //   dw11 = dy00 * x00 + dy01 * x02 + dy10 * x20 + dy11 * x22 = 1 + 6 + 21 + 36 = 64.
  EXPECT_TRUE(all_close(
      run_reference(
          Op::kConv2dGradWeight, {x3x3(), dy},
          {{"stride", Ints{2, 2}}, {"padding", Ints{1, 1}}, {"weight_shape", Ints{1, 1, 2, 2}}})[0],
      make(DType::kF64, {1, 1, 2, 2}, {20, 36, 36, 64}), 0, 0));
}

TEST(MaxPool2d, ReferenceSmallCases) {
  // x = [[1, 5, 2], [7, 3, 9], [4, 8, 6]], kernel 2 stride 1:
  //   y = [max(1, 5, 7, 3), max(5, 2, 3, 9); max(7, 3, 4, 8), max(3, 9, 8, 6)] = [7, 9; 8, 9].
  Tensor x = make(DType::kF64, {1, 1, 3, 3}, {1, 5, 2, 7, 3, 9, 4, 8, 6});
  EXPECT_TRUE(all_close(run_reference(Op::kMaxPool2d, {x}, pool_attrs({2, 2}, {1, 1}))[0],
                        make(DType::kF64, {1, 1, 2, 2}, {7, 9, 8, 9}), 0, 0));
  // Default stride = kernel on 4x4: the four 2x2 blocks.
  Tensor x4 =
      make(DType::kF32, {1, 1, 4, 4}, {1, 2, 3, 4, 5, 6, 7, 8, 16, 15, 14, 13, 12, 11, 10, 9});
  EXPECT_TRUE(all_close(run_reference(Op::kMaxPool2d, {x4}, pool_attrs({2, 2}))[0],
                        make(DType::kF32, {1, 1, 2, 2}, {6, 8, 16, 14}), 0, 0));
  // Padding counts as -inf, not 0: with all-negative input, kernel 2 stride 2 padding 1 on 2x2,
  // every window holds one real element, so y = x.
  Tensor negative = make(DType::kF64, {1, 1, 2, 2}, {-1, -2, -3, -4});
  EXPECT_TRUE(
      all_close(run_reference(Op::kMaxPool2d, {negative}, pool_attrs({2, 2}, {2, 2}, {1, 1}))[0],
                negative, 0, 0));
  // A NaN in a window wins.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor with_nan = make(DType::kF64, {1, 1, 1, 4}, {1, nan, 3, 4});
  Tensor y = run_reference(Op::kMaxPool2d, {with_nan}, pool_attrs({1, 2}))[0];
  EXPECT_TRUE(std::isnan(y.get(0)));
  EXPECT_EQ(y.get(1), 4);
}

TEST(MaxPool2d, ReferenceGradientGoesToTheFirstMax) {
  // Same x, kernel 2 stride 1, dy = [1, 2; 3, 4]: the max 7 (index 3) gets 1, the 9 (index 5)
  // is the max of two windows and gets 2 + 4 = 6, the 8 (index 7) gets 3.
  Tensor x = make(DType::kF64, {1, 1, 3, 3}, {1, 5, 2, 7, 3, 9, 4, 8, 6});
  Tensor dy = make(DType::kF64, {1, 1, 2, 2}, {1, 2, 3, 4});
  EXPECT_TRUE(all_close(run_reference(Op::kMaxPool2dGrad, {x, dy}, pool_attrs({2, 2}, {1, 1}))[0],
                        make(DType::kF64, {1, 1, 3, 3}, {0, 0, 0, 1, 0, 6, 0, 3, 0}), 0, 0));
  // Ties: the first position (row-major in the window) takes all of it.
  Tensor ties = make(DType::kF64, {1, 1, 2, 4}, {2, 2, 5, 1, 2, 2, 1, 5});
  EXPECT_TRUE(
      all_close(run_reference(Op::kMaxPool2dGrad, {ties, make(DType::kF64, {1, 1, 1, 2}, {3, 7})},
                              pool_attrs({2, 2}))[0],
                make(DType::kF64, {1, 1, 2, 4}, {3, 0, 7, 0, 0, 0, 0, 0}), 0, 0));
}

TEST(AvgPool2d, ReferenceSmallCases) {
  // Kernel 2 stride 1 on 1..9: (1+2+4+5)/4 = 3, (2+3+5+6)/4 = 4, (4+5+7+8)/4 = 6, (5+6+8+9)/4 = 7.
  EXPECT_TRUE(all_close(run_reference(Op::kAvgPool2d, {x3x3()}, pool_attrs({2, 2}, {1, 1}))[0],
                        make(DType::kF64, {1, 1, 2, 2}, {3, 4, 6, 7}), 0, 0));
  // Kernel 2 stride 2 padding 1: the divisor stays 4. 1/4, (2+3)/4, (4+7)/4, (5+6+8+9)/4.
  EXPECT_TRUE(
      all_close(run_reference(Op::kAvgPool2d, {x3x3()}, pool_attrs({2, 2}, {2, 2}, {1, 1}))[0],
                make(DType::kF64, {1, 1, 2, 2}, {0.25, 1.25, 2.75, 7}), 0, 0));
}

TEST(AvgPool2d, ReferenceGradient) {
  Tensor dy = make(DType::kF64, {1, 1, 2, 2}, {1, 2, 3, 4});
  // Kernel 2 stride 1: each dy spreads dy/4 over its window. dx00 = 1/4, dx01 = (1+2)/4,
  // dx02 = 2/4, dx10 = (1+3)/4, dx11 = (1+2+3+4)/4, dx12 = (2+4)/4, dx20 = 3/4, dx21 = (3+4)/4,
  // dx22 = 4/4.
  Attributes attrs = pool_attrs({2, 2}, {1, 1});
  attrs.set("input_shape", Ints{1, 1, 3, 3});
  EXPECT_TRUE(all_close(
      run_reference(Op::kAvgPool2dGrad, {dy}, attrs)[0],
      make(DType::kF64, {1, 1, 3, 3}, {0.25, 0.75, 0.5, 1, 2.5, 1.5, 0.75, 1.75, 1}), 0, 0));
  // Stride 2 padding 1: windows are disjoint; each real element gets its window's dy / 4.
  attrs = pool_attrs({2, 2}, {2, 2}, {1, 1});
  attrs.set("input_shape", Ints{1, 1, 3, 3});
  EXPECT_TRUE(all_close(run_reference(Op::kAvgPool2dGrad, {dy}, attrs)[0],
                        make(DType::kF64, {1, 1, 3, 3}, {0.25, 0.5, 0.5, 0.75, 1, 1, 0.75, 1, 1}),
                        0, 0));
}

}  // namespace
}  // namespace kiln

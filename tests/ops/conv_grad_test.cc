// Gradient rules of conv2d, conv2d_grad_input (the transposed convolution), max_pool2d and
// avg_pool2d (src/ops/conv.cc), each checked against float64 central differences of the
// reference kernels on small random inputs: default attributes, stride 2, padding 1, unequal
// per-dim attributes, groups and depthwise, several images and channels. Also that the other
// backward ops are marked not differentiable.
#include "gradcheck.h"

namespace kiln {
namespace {

using testing::expect_op_gradients;
using Ints = std::vector<int64_t>;

Tensor rand64(Shape shape, uint64_t seed) {
  return testing::rand(DType::kF64, std::move(shape), seed, -1.0, 1.0);
}

Attributes conv_attrs(Ints stride, Ints padding) {
  return {{"stride", stride}, {"padding", padding}};
}
Attributes pool_attrs(Ints kernel, Ints stride = {}, Ints padding = {0, 0}) {
  return {{"kernel", kernel}, {"stride", stride}, {"padding", padding}};
}

TEST(ConvGrad, Conv2dDefaults) {
  expect_op_gradients(Op::kConv2d, {rand64({2, 3, 5, 4}, 1), rand64({4, 3, 2, 3}, 2)});
}

TEST(ConvGrad, Conv2dPadding) {
  expect_op_gradients(Op::kConv2d, {rand64({2, 2, 5, 5}, 3), rand64({3, 2, 3, 3}, 4)},
                      conv_attrs({1, 1}, {1, 1}));
}

TEST(ConvGrad, Conv2dStride2Padding1) {
  // Odd and even sizes: with stride 2 the last row/column of an even input may be unused.
  expect_op_gradients(Op::kConv2d, {rand64({2, 2, 7, 6}, 5), rand64({3, 2, 3, 3}, 6)},
                      conv_attrs({2, 2}, {1, 1}));
  expect_op_gradients(Op::kConv2d, {rand64({1, 3, 6, 6}, 7), rand64({2, 3, 2, 2}, 8)},
                      conv_attrs({2, 2}, {1, 1}));
}

TEST(ConvGrad, Conv2dUnequalAttributes) {
  expect_op_gradients(Op::kConv2d, {rand64({2, 2, 7, 5}, 9), rand64({2, 2, 3, 2}, 10)},
                      conv_attrs({2, 1}, {0, 1}));
}

TEST(ConvGrad, Conv2dGroups) {
  // 2 groups of 2 input channels, 3 outputs each; stride 2 and padding 1.
  Attributes attrs = conv_attrs({2, 2}, {1, 1});
  attrs.set("groups", int64_t{2});
  expect_op_gradients(Op::kConv2d, {rand64({2, 4, 5, 6}, 11), rand64({6, 2, 3, 3}, 12)}, attrs);
}

TEST(ConvGrad, Conv2dDepthwise) {
  // groups = C: one filter per channel, and two per channel (a multiplier of 2), unequal
  // attributes.
  Attributes attrs = conv_attrs({1, 1}, {1, 1});
  attrs.set("groups", int64_t{3});
  expect_op_gradients(Op::kConv2d, {rand64({2, 3, 5, 4}, 13), rand64({3, 1, 3, 3}, 14)}, attrs);
  attrs = conv_attrs({2, 1}, {1, 0});
  attrs.set("groups", int64_t{2});
  expect_op_gradients(Op::kConv2d, {rand64({2, 2, 6, 5}, 15), rand64({4, 1, 3, 2}, 16)}, attrs);
}

// conv2d_grad_input is the transposed convolution (ONNX's ConvTranspose), which trains.
TEST(ConvGrad, Conv2dGradInput) {
  Attributes attrs = conv_attrs({2, 2}, {1, 1});
  attrs.set("input_shape", Ints{2, 2, 6, 7});
  expect_op_gradients(Op::kConv2dGradInput, {rand64({2, 3, 3, 4}, 17), rand64({3, 2, 3, 3}, 18)},
                      attrs);
  attrs = conv_attrs({1, 2}, {0, 1});
  attrs.set("groups", int64_t{2});
  attrs.set("input_shape", Ints{1, 4, 5, 5});
  expect_op_gradients(Op::kConv2dGradInput, {rand64({1, 2, 4, 3}, 19), rand64({2, 2, 2, 2}, 20)},
                      attrs);
}

TEST(ConvGrad, MaxPool2d) {
  // Random values: ties (where the max is not differentiable) have probability 0.
  expect_op_gradients(Op::kMaxPool2d, {rand64({2, 3, 4, 6}, 20)}, pool_attrs({2, 2}));
  expect_op_gradients(Op::kMaxPool2d, {rand64({2, 2, 5, 5}, 21)}, pool_attrs({2, 2}));
}

TEST(ConvGrad, MaxPool2dStride2Padding1OverlappingWindows) {
  expect_op_gradients(Op::kMaxPool2d, {rand64({2, 2, 7, 7}, 22)},
                      pool_attrs({3, 3}, {2, 2}, {1, 1}));
  expect_op_gradients(Op::kMaxPool2d, {rand64({1, 2, 5, 6}, 23)},
                      pool_attrs({2, 3}, {1, 2}, {1, 1}));
}

TEST(ConvGrad, AvgPool2d) {
  expect_op_gradients(Op::kAvgPool2d, {rand64({2, 3, 4, 6}, 30)}, pool_attrs({2, 2}));
  expect_op_gradients(Op::kAvgPool2d, {rand64({2, 2, 7, 7}, 31)},
                      pool_attrs({3, 3}, {2, 2}, {1, 1}));
  expect_op_gradients(Op::kAvgPool2d, {rand64({1, 2, 5, 6}, 32)},
                      pool_attrs({2, 3}, {1, 2}, {1, 1}));
}

TEST(ConvGrad, BackwardOpsAreNotDifferentiable) {
  for (Op op : {Op::kConv2dGradWeight, Op::kMaxPool2dGrad, Op::kAvgPool2dGrad}) {
    EXPECT_FALSE(op_def(op).differentiable) << op_name(op);
    EXPECT_FALSE(op_def(op).gradient) << op_name(op);
  }
  for (Op op : {Op::kConv2d, Op::kConv2dGradInput, Op::kMaxPool2d, Op::kAvgPool2d}) {
    EXPECT_TRUE(op_def(op).differentiable) << op_name(op);
    EXPECT_TRUE(op_def(op).gradient) << op_name(op);
  }
}

}  // namespace
}  // namespace kiln

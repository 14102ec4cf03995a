// Gradient rules of the shape ops (src/ops/shape.cc), each checked against float64 central
// differences of the reference kernels on small random inputs, plus the structure of the
// backward graphs where it matters (a strided slice scatters, a plain one pads).
#include <map>
#include <tuple>

#include "gradcheck.h"
#include "ir/builder.h"
#include "passes/autodiff.h"
#include "runtime/executor.h"

namespace kiln {
namespace {

using testing::expect_op_gradients;
using testing::make;
using Ints = std::vector<int64_t>;

Tensor rand64(Shape shape, uint64_t seed) {
  return testing::rand(DType::kF64, std::move(shape), seed);
}

TEST(ShapeGrad, Reshape) {
  expect_op_gradients(Op::kReshape, {rand64({2, 3, 4}, 1)}, {{"shape", Ints{4, 6}}});
  expect_op_gradients(Op::kReshape, {rand64({6}, 2)}, {{"shape", Ints{3, -1}}});
  expect_op_gradients(Op::kReshape, {rand64({1}, 3)}, {{"shape", Ints{}}});
}

TEST(ShapeGrad, Transpose) {
  expect_op_gradients(Op::kTranspose, {rand64({2, 3}, 4)});  // default: reverse
  // A permutation that is not its own inverse: checks that the rule inverts it.
  expect_op_gradients(Op::kTranspose, {rand64({2, 3, 4}, 5)}, {{"perm", Ints{1, 2, 0}}});
  expect_op_gradients(Op::kTranspose, {rand64({2, 3, 4, 2}, 6)}, {{"perm", Ints{-1, 0, 2, 1}}});
}

TEST(ShapeGrad, BroadcastTo) {
  expect_op_gradients(Op::kBroadcastTo, {rand64({3}, 7)}, {{"shape", Ints{2, 3}}});
  expect_op_gradients(Op::kBroadcastTo, {rand64({2, 1, 3}, 8)}, {{"shape", Ints{4, 2, 5, 3}}});
  expect_op_gradients(Op::kBroadcastTo, {rand64({}, 9)}, {{"shape", Ints{2, 2}}});
  expect_op_gradients(Op::kBroadcastTo, {rand64({2, 3}, 10)}, {{"shape", Ints{2, 3}}});
}

TEST(ShapeGrad, SliceUnitSteps) {
  expect_op_gradients(Op::kSlice, {rand64({5, 4}, 11)},
                      {{"starts", Ints{1, 0}}, {"ends", Ints{4, 4}}});
  // Negative bounds, every axis cut on both sides.
  expect_op_gradients(Op::kSlice, {rand64({4, 5, 3}, 12)},
                      {{"starts", Ints{-3, 1, 0}}, {"ends", Ints{-1, 5, 2}}});
  // Whole tensor: the gradient passes through.
  expect_op_gradients(Op::kSlice, {rand64({2, 3}, 13)},
                      {{"starts", Ints{0, 0}}, {"ends", Ints{2, 3}}});
}

TEST(ShapeGrad, SliceStrided) {
  expect_op_gradients(Op::kSlice, {rand64({7}, 14)},
                      {{"starts", Ints{1}}, {"ends", Ints{7}}, {"steps", Ints{2}}});
  expect_op_gradients(Op::kSlice, {rand64({6, 5}, 15)},
                      {{"starts", Ints{0, 1}}, {"ends", Ints{6, 5}}, {"steps", Ints{3, 2}}});
  // Mixed: one strided axis, one padded axis, one untouched axis; a step longer than the range.
  expect_op_gradients(
      Op::kSlice, {rand64({5, 4, 2}, 16)},
      {{"starts", Ints{0, 1, 0}}, {"ends", Ints{5, 3, 2}}, {"steps", Ints{2, 1, 1}}});
  expect_op_gradients(Op::kSlice, {rand64({5, 3}, 17)},
                      {{"starts", Ints{2, 0}}, {"ends", Ints{5, 3}}, {"steps", Ints{7, 1}}});
}

TEST(ShapeGrad, SliceGradientIsZeroOutsideTheSlice) {
  // x (7,) sliced [1:7:3] = x[1], x[4]: with loss = sum(slice), dx is 1 at 1 and 4, 0 elsewhere.
  Builder b("slice");
  Expr x = b.data("x", {7}, DType::kF64);
  Graph g = b.finish({sum(slice(x, {1}, {7}, {3}))});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
  r.graph.outputs = r.gradients;
  Tensor dx = Executor(r.graph).run(std::vector<Tensor>{rand64({7}, 18)})[0];
  EXPECT_TRUE(testing::all_close(dx, make(DType::kF64, {7}, {0, 1, 0, 0, 1, 0, 0}), 0, 0));
}

// Ops of the backward part of d sum(slice(x)) / dx.
std::map<Op, int> slice_backward_ops(Shape shape, Ints starts, Ints ends, Ints steps) {
  Builder b("slice");
  Expr x = b.data("x", shape, DType::kF64);
  Graph g = b.finish({sum(slice(x, starts, ends, steps))});
  const size_t forward_nodes = g.nodes.size();
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
  std::map<Op, int> counts;
  for (size_t n = forward_nodes; n < r.graph.nodes.size(); ++n) ++counts[r.graph.nodes[n].op];
  return counts;
}

TEST(ShapeGrad, SlicePadsUnitStepsAndScattersStrides) {
  // Unit steps: zeros concatenated around dy, one concat per cut axis, no scatter.
  std::map<Op, int> plain = slice_backward_ops({4, 5, 3}, {1, 0, 0}, {3, 4, 3}, {});
  EXPECT_EQ(plain[Op::kConcat], 2);
  EXPECT_EQ(plain[Op::kScatterAdd], 0);
  // A strided axis scatters; the untouched axis costs nothing.
  std::map<Op, int> strided = slice_backward_ops({6, 3}, {0, 0}, {6, 3}, {2, 1});
  EXPECT_EQ(strided[Op::kScatterAdd], 1);
  EXPECT_EQ(strided[Op::kConcat], 0);
}

TEST(ShapeGrad, EmptySliceGivesZeros) {
  // Nothing read: the gradient is all zeros (no scatter of an empty tensor).
  Builder b("empty");
  Expr x = b.data("x", {3, 2}, DType::kF64);
  Expr s = slice(x, {1, 0}, {1, 2});
  Graph g = b.finish({sum(s) + sum(x)});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
  r.graph.outputs = r.gradients;
  Tensor dx = Executor(r.graph).run(std::vector<Tensor>{rand64({3, 2}, 19)})[0];
  EXPECT_TRUE(testing::all_close(dx, make(DType::kF64, {3, 2}, {1, 1, 1, 1, 1, 1}), 0, 0));
}

TEST(ShapeGrad, Concat) {
  expect_op_gradients(Op::kConcat, {rand64({2, 3}, 20), rand64({1, 3}, 21), rand64({3, 3}, 22)});
  expect_op_gradients(Op::kConcat, {rand64({2, 3, 2}, 23), rand64({2, 1, 2}, 24)},
                      {{"axis", int64_t{-2}}});
  expect_op_gradients(Op::kConcat, {rand64({4}, 25)});
}

TEST(ShapeGrad, Split) {
  expect_op_gradients(Op::kSplit, {rand64({5, 2}, 26)}, {{"sizes", Ints{2, 3}}});
  expect_op_gradients(Op::kSplit, {rand64({2, 6}, 27)},
                      {{"axis", int64_t{-1}}, {"sizes", Ints{1, 0, 3, 2}}});
}

TEST(ShapeGrad, SplitWithAnUnusedOutput) {
  // Only the second piece reaches the loss: the first piece's gradient is zeros.
  Builder b("split");
  Expr x = b.data("x", {5}, DType::kF64);
  std::vector<Expr> parts = split(x, {2, 3});
  Graph g = b.finish({sum(parts[1] * parts[1])});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
  r.graph.outputs = r.gradients;
  Tensor xv = make(DType::kF64, {5}, {1, 2, 3, -4, 0.5});
  Tensor dx = Executor(r.graph).run(std::vector<Tensor>{xv})[0];
  EXPECT_TRUE(testing::all_close(dx, make(DType::kF64, {5}, {0, 0, 6, -8, 1}), 0, 0));
}

TEST(ShapeGrad, Gather) {
  // Repeated indices: their gradients must add up in the table.
  expect_op_gradients(Op::kGather, {rand64({5, 3}, 28), make(DType::kI64, {4}, {3, 0, 3, 1})});
  expect_op_gradients(Op::kGather, {rand64({2, 4, 3}, 29), make(DType::kI32, {2, 2}, {1, 3, 3, 0})},
                      {{"axis", int64_t{1}}});
  expect_op_gradients(Op::kGather, {rand64({3, 4}, 30), make(DType::kI64, {}, {2})},
                      {{"axis", int64_t{-1}}});
}

TEST(ShapeGrad, GatherTableGradientCountsRepeats) {
  // loss = sum(gather(table, [2, 0, 2])): row 2 is read twice, row 1 never.
  Builder b("embed");
  Expr table = b.data("table", {3, 2}, DType::kF64);
  Expr idx = b.data("idx", {3}, DType::kI64);
  Graph g = b.finish({sum(gather(table, idx))});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
  r.graph.outputs = r.gradients;
  Tensor dt = Executor(r.graph).run(
      std::vector<Tensor>{rand64({3, 2}, 31), make(DType::kI64, {3}, {2, 0, 2})})[0];
  EXPECT_TRUE(testing::all_close(dt, make(DType::kF64, {3, 2}, {1, 1, 0, 0, 2, 2}), 0, 0));
}

TEST(ShapeGrad, GatherPaddingIndexRowGetsNoGradient) {
  // torch's embedding padding_idx: rows read at padding_index are read, not trained. Along axis 0
  // (an embedding) and axis 1 (columns): d sum(gather) counts the reads of every other index.
  for (const auto& [axis, table_shape, indices, want] :
       std::vector<std::tuple<int64_t, Shape, std::vector<double>, std::vector<double>>>{
           {0, {3, 2}, {2, 0, 2, 1}, {1, 1, 1, 1, 0, 0}},
           {1, {2, 4}, {1, 3, 1, 0}, {1, 2, 0, 0, 1, 2, 0, 0}}}) {
    Builder b("embed");
    Expr table = b.data("table", table_shape, DType::kF64);
    Expr idx = b.data("idx", {4}, DType::kI64);
    const int64_t padding = axis == 0 ? 2 : 3;
    Graph g = b.finish({sum(b.apply1(Op::kGather, {table, idx}, {{"axis", axis}, {"padding_index", padding}}))});
    AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
    r.graph.outputs = r.gradients;
    Tensor dt = Executor(r.graph).run(
        std::vector<Tensor>{rand64(table_shape, 36), make(DType::kI64, {4}, indices)})[0];
    EXPECT_TRUE(testing::all_close(dt, make(DType::kF64, table_shape, want), 0, 0)) << "axis " << axis;
  }
}

TEST(ShapeGrad, ScatterAdd) {
  expect_op_gradients(Op::kScatterAdd,
                      {rand64({4, 3}, 32), make(DType::kI64, {3}, {1, 1, 3}), rand64({3, 3}, 33)});
  expect_op_gradients(Op::kScatterAdd,
                      {rand64({2, 5}, 34), make(DType::kI32, {2}, {4, 0}), rand64({2, 2}, 35)},
                      {{"axis", int64_t{1}}});
}

TEST(ShapeGrad, OneHotIsNotDifferentiable) {
  EXPECT_FALSE(op_def(Op::kOneHot).differentiable);
  EXPECT_FALSE(static_cast<bool>(op_def(Op::kOneHot).gradient));
}

TEST(ShapeGrad, EveryOtherShapeOpHasARule) {
  for (Op op : {Op::kReshape, Op::kTranspose, Op::kBroadcastTo, Op::kSlice, Op::kConcat, Op::kSplit,
                Op::kGather, Op::kScatterAdd}) {
    EXPECT_TRUE(op_def(op).differentiable) << op_name(op);
    EXPECT_TRUE(static_cast<bool>(op_def(op).gradient)) << op_name(op);
  }
}

}  // namespace
}  // namespace kiln

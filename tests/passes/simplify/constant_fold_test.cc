// constant-fold: small all-constant nodes become full/constant nodes holding what the reference
// kernel computes; large results, run-time errors, i64 values a double cannot hold and
// anything reading data stay.
#include "passes/simplify/constant_fold.h"

#include <cmath>

#include "simplify_test_util.h"

namespace kiln {
namespace {

using testing::expect_unchanged;
using testing::run_on_text;

TEST(ConstantFold, FoldsAChainIntoOneFull) {
  ConstantFolding pass;
  testing::PassOnText r = run_on_text(pass,
      "graph @g(%x: f32[3] data) {\n"
      "  %0 = full() {dtype=f32, shape=[], value=2.0} : f32[]\n"
      "  %1 = full() {dtype=f32, shape=[], value=3.0} : f32[]\n"
      "  %2 = add(%0, %1) : f32[]\n"
      "  %3 = mul(%2, %2) : f32[]\n"
      "  %4 = mul(%x, %3) : f32[3]\n"
      "  return %4\n"
      "}\n");
  EXPECT_TRUE(r.changed);
  // (2 + 3)^2 = 25; the dead inputs of the folds are left to dead-code.
  EXPECT_EQ(r.text,
            "graph @g(%x: f32[3] data) {\n"
            "  %0 = full() {dtype=f32, shape=[], value=2.0} : f32[]\n"
            "  %1 = full() {dtype=f32, shape=[], value=3.0} : f32[]\n"
            "  %2 = full() {dtype=f32, shape=[], value=5.0} : f32[]\n"
            "  %3 = full() {dtype=f32, shape=[], value=25.0} : f32[]\n"
            "  %4 = mul(%x, %3) : f32[3]\n"
            "  return %4\n"
            "}\n");
}

TEST(ConstantFold, DistinctValuesBecomeAConstantAndNamesStay) {
  ConstantFolding pass;
  testing::PassOnText r = run_on_text(pass,
      "graph @g() {\n"
      "  %0 = iota() {dtype=i64, shape=[2, 3], axis=1} : i64[2,3]\n"
      "  %1 = full() {dtype=i64, shape=[], value=10.0} : i64[]\n"
      "  %row = mul(%0, %1) : i64[2,3]\n"
      "  return %row\n"
      "}\n");
  EXPECT_TRUE(testing::contains(
      r.text, "%row = constant() {dtype=i64, shape=[2, 3], values=[0, 10, 20, 0, 10, 20]} : i64[2,3]\n"));
}

// Integers fold in int64: 2^62 + 1 (which a double rounds to 2^62) stays itself through add and
// sub, and the result is a constant of ints.
TEST(ConstantFold, Int64AboveTwoToThe53FoldsExactly) {
  ConstantFolding pass;
  testing::PassOnText r = run_on_text(pass,
      "graph @g() {\n"
      "  %0 = constant() {dtype=i64, shape=[2], values=[4611686018427387905, 3]} : i64[2]\n"
      "  %1 = full() {dtype=i64, shape=[], value=4.0} : i64[]\n"
      "  %2 = add(%0, %1) : i64[2]\n"
      "  %3 = full() {dtype=i64, shape=[], value=3.0} : i64[]\n"
      "  %out = sub(%2, %3) : i64[2]\n"
      "  return %out\n"
      "}\n");
  EXPECT_TRUE(testing::contains(
      r.text, "%out = constant() {dtype=i64, shape=[2], values=[4611686018427387906, 4]} : i64[2]\n"));
}

TEST(ConstantFold, RoundsLikeTheReferenceKernel) {
  // 0.1f * 3 in f32: the product of two floats is exact in double, so rounding it once to f32
  // is what float multiplication gives.
  ConstantFolding pass;
  Graph g = parse(
      "graph @g() {\n"
      "  %0 = full() {dtype=f32, shape=[], value=0.1} : f32[]\n"
      "  %1 = full() {dtype=f32, shape=[], value=3.0} : f32[]\n"
      "  %2 = mul(%0, %1) : f32[]\n"
      "  return %2\n"
      "}\n");
  ASSERT_TRUE(pass.run(g));
  const Node& folded = g.nodes.back();
  ASSERT_EQ(folded.op, Op::kFull);
  EXPECT_EQ(folded.attrs.f("value"), static_cast<double>(0.1f * 3.0f));
}

TEST(ConstantFold, FoldsMultiOutputNodes) {
  ConstantFolding pass;
  testing::PassOnText r = run_on_text(pass,
      "graph @g() {\n"
      "  %0 = iota() {dtype=f32, shape=[4]} : f32[4]\n"
      "  %1, %2 = split(%0) {sizes=[1, 3]} : f32[1], f32[3]\n"
      "  return %1, %2\n"
      "}\n");
  EXPECT_TRUE(
      testing::contains(r.text, "%1 = full() {dtype=f32, shape=[1], value=0.0} : f32[1]\n"));
  EXPECT_TRUE(testing::contains(
      r.text, "%2 = constant() {dtype=f32, shape=[3], values=[1.0, 2.0, 3.0]} : f32[3]\n"));
}

TEST(ConstantFold, NoFoldWhenAnInputIsData) {
  ConstantFolding pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[] data) {\n"
      "  %0 = full() {dtype=f32, shape=[], value=2.0} : f32[]\n"
      "  %1 = add(%0, %x) : f32[]\n"
      "  return %1\n"
      "}\n");
}

TEST(ConstantFold, NoFoldWhenTheResultIsLarge) {
  // 64 * 65 = 4160 elements > 4096: the IR would carry a big literal.
  ConstantFolding pass;
  expect_unchanged(pass,
      "graph @g() {\n"
      "  %0 = iota() {dtype=f32, shape=[64, 65]} : f32[64,65]\n"
      "  %1 = exp(%0) : f32[64,65]\n"
      "  return %1\n"
      "}\n");
}

TEST(ConstantFold, NoFoldWhenTheKernelThrows) {
  // Integer division by zero is a run-time error; folding must not turn it into a compile-time
  // one (the node may never run on this path in a later design) nor hide it.
  ConstantFolding pass;
  expect_unchanged(pass,
      "graph @g() {\n"
      "  %0 = full() {dtype=i32, shape=[], value=7.0} : i32[]\n"
      "  %1 = full() {dtype=i32, shape=[], value=0.0} : i32[]\n"
      "  %2 = div(%0, %1) : i32[]\n"
      "  return %2\n"
      "}\n");
}

TEST(ConstantFold, I64ResultAboveDoublePrecisionFoldsToAConstantNotAFull) {
  // 2^62 + 1 is an exact i64 but not a double: a full's value would round it, a constant of
  // ints holds it.
  ConstantFolding pass;
  testing::PassOnText r = run_on_text(pass,
      "graph @g() {\n"
      "  %0 = full() {dtype=i64, shape=[], value=4.611686018427388e+18} : i64[]\n"
      "  %1 = full() {dtype=i64, shape=[], value=1.0} : i64[]\n"
      "  %2 = add(%0, %1) : i64[]\n"
      "  return %2\n"
      "}\n");
  EXPECT_TRUE(testing::contains(
      r.text, "%2 = constant() {dtype=i64, shape=[], values=[4611686018427387905]} : i64[]\n"));
}

TEST(ConstantFold, FoldedGraphComputesTheSame) {
  Graph g = parse(
      "graph @g(%x: f32[4] data) {\n"
      "  %0 = iota() {dtype=f32, shape=[4]} : f32[4]\n"
      "  %1 = full() {dtype=f32, shape=[], value=0.7} : f32[]\n"
      "  %2 = mul(%0, %1) : f32[4]\n"
      "  %3 = exp(%2) : f32[4]\n"
      "  %4 = sum(%3) : f32[]\n"
      "  %5 = div(%3, %4) : f32[4]\n"
      "  %6 = mul(%x, %5) : f32[4]\n"
      "  return %6\n"
      "}\n");
  std::vector<Tensor> inputs = testing::random_inputs(g, 3, 0, 1);
  std::vector<Tensor> before = testing::run_step(g, inputs);
  ConstantFolding pass;
  ASSERT_TRUE(pass.run(g));
  EXPECT_EQ(g.nodes.back().op, Op::kMul);
  EXPECT_EQ(g.nodes[g.nodes.size() - 2].op, Op::kConstant);
  EXPECT_TRUE(testing::bitwise_equal(testing::run_step(g, inputs), before));
}

}  // namespace
}  // namespace kiln

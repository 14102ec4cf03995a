// cse: duplicates merge (chains of them in one sweep, commuted add/mul too, dropout with the same
// seed and offset); nodes that differ in an attribute bit, an operand order that matters, or
// the RNG seed stay apart.
#include "passes/simplify/cse.h"

#include "simplify_test_util.h"

namespace kiln {
namespace {

using testing::expect_unchanged;
using testing::run_on_text;

TEST(Cse, MergesDuplicatesAndTheirUsers) {
  CommonSubexpressionElimination pass;
  testing::PassOnText r = run_on_text(pass,
      "graph @g(%x: f32[2,3] data) {\n"
      "  %0 = transpose(%x) : f32[3,2]\n"
      "  %1 = transpose(%x) : f32[3,2]\n"
      "  %2 = exp(%0) : f32[3,2]\n"
      "  %3 = exp(%1) : f32[3,2]\n"  // a duplicate only once %1 is merged into %0
      "  %4 = add(%2, %3) : f32[3,2]\n"
      "  return %4\n"
      "}\n");
  EXPECT_TRUE(r.changed);
  EXPECT_EQ(r.text,
            "graph @g(%x: f32[2,3] data) {\n"
            "  %0 = transpose(%x) : f32[3,2]\n"
            "  %1 = exp(%0) : f32[3,2]\n"
            "  %2 = add(%1, %1) : f32[3,2]\n"
            "  return %2\n"
            "}\n");
}

TEST(Cse, MergesCommutedAddAndKeepsTheName) {
  CommonSubexpressionElimination pass;
  testing::PassOnText r = run_on_text(pass,
      "graph @g(%x: f32[3] data, %y: f32[3] data) {\n"
      "  %0 = add(%x, %y) : f32[3]\n"
      "  %sum = add(%y, %x) : f32[3]\n"
      "  %1 = mul(%0, %sum) : f32[3]\n"
      "  return %1, %sum\n"
      "}\n");
  EXPECT_EQ(r.text,
            "graph @g(%x: f32[3] data, %y: f32[3] data) {\n"
            "  %sum = add(%x, %y) : f32[3]\n"
            "  %0 = mul(%sum, %sum) : f32[3]\n"
            "  return %0, %sum\n"
            "}\n");
}

TEST(Cse, MergesSourcesAndRedirectsUpdates) {
  CommonSubexpressionElimination pass;
  testing::PassOnText r = run_on_text(pass,
      "graph @g(%w: f32[2] param) {\n"
      "  %0 = full() {dtype=f32, shape=[2], value=0.5} : f32[2]\n"
      "  %1 = full() {dtype=f32, shape=[2], value=0.5} : f32[2]\n"
      "  %2 = mul(%w, %0) : f32[2]\n"
      "  %3 = mul(%w, %1) : f32[2]\n"
      "  update %w = %3\n"
      "  return %2\n"
      "}\n");
  EXPECT_EQ(r.text,
            "graph @g(%w: f32[2] param) {\n"
            "  %0 = full() {dtype=f32, shape=[2], value=0.5} : f32[2]\n"
            "  %1 = mul(%w, %0) : f32[2]\n"
            "  update %w = %1\n"
            "  return %1\n"
            "}\n");
}

TEST(Cse, MergesDropoutWithTheSameSeedAndOffset) {
  // Counter-based RNG: same input, p, seed and offset give the same mask, so this is exact.
  CommonSubexpressionElimination pass;
  testing::PassOnText r = run_on_text(pass,
      "graph @g(%x: f32[8] data, %step: i64[] data) {\n"
      "  %0 = dropout(%x, %step) {p=0.5, seed=7} : f32[8]\n"
      "  %1 = dropout(%x, %step) {p=0.5, seed=7} : f32[8]\n"
      "  return %0, %1\n"
      "}\n");
  EXPECT_TRUE(r.changed);
  EXPECT_TRUE(testing::contains(r.text, "return %0, %0\n"));
}

TEST(Cse, NoMergeDropoutWithDifferentSeeds) {
  CommonSubexpressionElimination pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[8] data, %step: i64[] data) {\n"
      "  %0 = dropout(%x, %step) {p=0.5, seed=7} : f32[8]\n"
      "  %1 = dropout(%x, %step) {p=0.5, seed=8} : f32[8]\n"
      "  return %0, %1\n"
      "}\n");
}

TEST(Cse, NoMergeWhenZerosDifferInSign) {
  // 0.0 == -0.0 numerically, but 1 / x tells them apart: attributes compare by bits.
  CommonSubexpressionElimination pass;
  expect_unchanged(pass,
      "graph @g() {\n"
      "  %0 = full() {dtype=f32, shape=[], value=0.0} : f32[]\n"
      "  %1 = full() {dtype=f32, shape=[], value=-0.0} : f32[]\n"
      "  return %0, %1\n"
      "}\n");
}

TEST(Cse, NoMergeMaximumWithSwappedOperands) {
  // maximum(+0, -0) is +0 but maximum(-0, +0) is -0: its operand order matters.
  CommonSubexpressionElimination pass;
  const char* text =
      "graph @g(%x: f32[2] data, %y: f32[2] data) {\n"
      "  %0 = maximum(%x, %y) : f32[2]\n"
      "  %1 = maximum(%y, %x) : f32[2]\n"
      "  return %0, %1\n"
      "}\n";
  expect_unchanged(pass, text);
  Graph g = parse(text);
  std::vector<Tensor> inputs = {testing::make(DType::kF32, {2}, {0.0, -0.0}),
                                testing::make(DType::kF32, {2}, {-0.0, 0.0})};
  std::vector<Tensor> out = testing::run_step(g, inputs);
  EXPECT_FALSE(testing::bitwise_equal({out[0]}, {out[1]}));
}

TEST(Cse, NoMergeDifferentOps) {
  CommonSubexpressionElimination pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[2] data, %y: f32[2] data) {\n"
      "  %0 = sub(%x, %y) : f32[2]\n"
      "  %1 = sub(%y, %x) : f32[2]\n"
      "  %2 = add(%x, %y) : f32[2]\n"
      "  return %0, %1, %2\n"
      "}\n");
}

}  // namespace
}  // namespace kiln

// dead-code and the compact() helper: unused chains go, values are renumbered without orphans,
// and everything that reaches an output or an update stays.
#include "passes/simplify/dead_code.h"

#include "passes/simplify/compact.h"
#include "simplify_test_util.h"

namespace kiln {
namespace {

using testing::expect_unchanged;
using testing::run_on_text;

TEST(DeadCode, RemovesChainsThatReachNoOutput) {
  DeadCodeElimination pass;
  testing::PassOnText r = run_on_text(pass,
      "graph @g(%x: f32[4] data) {\n"
      "  %0 = exp(%x) : f32[4]\n"
      "  %1 = neg(%0) : f32[4]\n"  // dead, and so is %0 through it
      "  %2 = abs(%x) : f32[4]\n"
      "  return %2\n"
      "}\n");
  EXPECT_TRUE(r.changed);
  EXPECT_EQ(r.text,
            "graph @g(%x: f32[4] data) {\n"
            "  %0 = abs(%x) : f32[4]\n"
            "  return %0\n"
            "}\n");
}

TEST(DeadCode, LeavesNoOrphanValues) {
  Graph g = parse(
      "graph @g(%x: f32[4] data, %y: f32[4] data) {\n"
      "  %0 = exp(%x) : f32[4]\n"
      "  %1 = abs(%y) : f32[4]\n"
      "  %2 = neg(%1) : f32[4]\n"
      "  return %2\n"
      "}\n");
  ASSERT_EQ(g.values.size(), 5u);
  DeadCodeElimination pass;
  EXPECT_TRUE(pass.run(g));
  // Two inputs (kept: they are the interface, used or not) and the two live node outputs.
  ASSERT_EQ(g.values.size(), 4u);
  EXPECT_EQ(g.nodes.size(), 2u);
  EXPECT_EQ(g.nodes[0].outputs[0], 2);
  EXPECT_EQ(g.nodes[1].inputs[0], 2);
  EXPECT_EQ(g.nodes[1].outputs[0], 3);
  EXPECT_EQ(g.outputs[0], 3);
  verify(g);
}

TEST(DeadCode, NoRemoveWhenValueFeedsAnUpdate) {
  // The update is the only use of %1 (and of %0 through it): a root like the outputs.
  DeadCodeElimination pass;
  expect_unchanged(pass,
      "graph @g(%w: f32[4] param, %x: f32[4] data) {\n"
      "  %0 = mul(%w, %x) : f32[4]\n"
      "  %1 = sub(%w, %0) : f32[4]\n"
      "  update %w = %1\n"
      "  return\n"
      "}\n");
}

TEST(DeadCode, NoRemoveMultiOutputNodeWhenOneOutputIsUsed) {
  DeadCodeElimination pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[4] data) {\n"
      "  %0, %1 = split(%x) {sizes=[1, 3]} : f32[1], f32[3]\n"
      "  return %1\n"
      "}\n");
}

TEST(DeadCode, NoRemoveUnusedGraphInputs) {
  DeadCodeElimination pass;
  expect_unchanged(pass,
      "graph @g(%x: f32[4] data, %unused: f32[2] data) {\n"
      "  %0 = abs(%x) : f32[4]\n"
      "  return %0\n"
      "}\n");
}

TEST(Compact, DropsUndefinedValuesAndRenumbers) {
  Graph g = parse(
      "graph @g(%x: f32[4] data) {\n"
      "  %0 = exp(%x) : f32[4]\n"
      "  %1 = abs(%x) : f32[4]\n"
      "  return %1\n"
      "}\n");
  g.nodes.erase(g.nodes.begin());  // %0 now has no definition
  EXPECT_TRUE(compact(g));
  EXPECT_EQ(g.values.size(), 2u);
  EXPECT_EQ(g.outputs[0], 1);
  EXPECT_FALSE(compact(g));  // nothing left to drop
  verify(g);
}

TEST(Compact, ThrowsWhenADeletedNodeIsStillUsed) {
  Graph g = parse(
      "graph @g(%x: f32[4] data) {\n"
      "  %0 = exp(%x) : f32[4]\n"
      "  %1 = abs(%0) : f32[4]\n"
      "  return %1\n"
      "}\n");
  g.nodes.erase(g.nodes.begin());
  try {
    compact(g);
    ADD_FAILURE() << "compact accepted a use of a deleted value";
  } catch (const Error& e) {
    EXPECT_TRUE(testing::contains(e.what(), "a node input refers to value 1"));
  }
}

TEST(ReplaceUses, RedirectsInputsOutputsAndUpdateValuesButNotTargets) {
  Graph g = parse(
      "graph @g(%w: f32[4] param) {\n"
      "  %0 = exp(%w) : f32[4]\n"
      "  %1 = abs(%w) : f32[4]\n"
      "  %2 = neg(%0) : f32[4]\n"
      "  update %w = %0\n"
      "  return %0, %2\n"
      "}\n");
  std::vector<ValueId> to = {0, 2, 2, 3};  // %0 (value 1) -> %1 (value 2)
  replace_uses(g, to);
  EXPECT_EQ(g.nodes[2].inputs[0], 2);
  EXPECT_EQ(g.outputs[0], 2);
  EXPECT_EQ(g.updates[0].value, 2);
  EXPECT_EQ(g.updates[0].target, 0);
}

}  // namespace
}  // namespace kiln

// The fusion pass: node classification (ItemKind and row space per op), the partition problem it
// builds, outlining of hand-made partitions (IR text in, IR text out; a cycle refused; groups
// moved after what they read), the per-node report, and the whole pass (greedy and optimal) on
// small graphs and training graphs with results unchanged bit for bit (reference kernels).
#include "passes/fusion/fusion.h"

#include <gtest/gtest.h>

#include "analysis/memory_plan.h"
#include "backends/cpu/fused.h"
#include "models/models.h"
#include "passes/schedule.h"
#include "passes/simplify/algebraic.h"
#include "passes/simplify/constant_fold.h"
#include "passes/simplify/cse.h"
#include "passes/simplify/dead_code.h"
#include "passes/simplify/training_rewrites.h"
#include "simplify/simplify_test_util.h"
#include "compile/training_graph.h"

namespace kiln {
namespace {

using fusion::ItemKind;
using testing::bitwise_equal;
using testing::random_inputs;
using testing::run_step;

struct ClassCase {
  std::string inputs;  // graph inputs
  std::string line;    // one node, output %0
  ItemKind kind;
  int64_t rows = 0, row_length = 0;
};

TEST(FusionClassify, OpsMapToItemKindsAndRowSpaces) {
  const std::vector<ClassCase> cases = {
      // Elementwise: the output's rows; row-friendly broadcasts only.
      {"%x: f32[4,8] data, %b: f32[8] param", "%0 = add(%x, %b)", ItemKind::kElementwise, 4, 8},
      {"%x: f32[2,3,8] data, %r: f32[2,3,1] data", "%0 = mul(%x, %r)", ItemKind::kElementwise, 6, 8},
      {"%x: f32[2,3,8] data, %s: f32[] data", "%0 = sub(%s, %x)", ItemKind::kElementwise, 6, 8},
      {"%x: f32[2,3,8] data, %y: f32[2,1,8] data", "%0 = add(%x, %y)", ItemKind::kOpaque},
      {"%x: bf16[5,7] data", "%0 = gelu(%x)", ItemKind::kElementwise, 5, 7},
      {"%x: f16[7] data", "%0 = exp(%x)", ItemKind::kElementwise, 1, 7},
      {"%x: f32[4,8] data", "%0 = cast(%x) {dtype=bf16}", ItemKind::kElementwise, 4, 8},
      {"%c: bool[4,8] data, %x: f32[4,8] data, %y: f32[] data", "%0 = where(%c, %x, %y)",
       ItemKind::kElementwise, 4, 8},
      // Not fusable dtypes: f64, integer inputs, bool outputs.
      {"%x: f64[4,8] data", "%0 = exp(%x)", ItemKind::kOpaque},
      {"%x: i64[4,8] data", "%0 = cast(%x) {dtype=f32}", ItemKind::kOpaque},
      {"%x: f32[4,8] data, %y: f32[4,8] data", "%0 = gt(%x, %y)", ItemKind::kOpaque},
      {"%x: f32[4,8] data, %o: i64[] state", "%0 = dropout(%x, %o) {p=0.1, seed=3}",
       ItemKind::kOpaque},
      // Row ops: the input's rows.
      {"%x: f32[2,3,8] data", "%0 = softmax(%x)", ItemKind::kRowOp, 6, 8},
      {"%x: f32[2,3,8] data", "%0 = log_softmax(%x) {axis=2}", ItemKind::kRowOp, 6, 8},
      {"%x: f32[2,3,8] data", "%0 = softmax(%x) {axis=1}", ItemKind::kOpaque},
      {"%y: f32[4,8] data, %d: f32[4,8] data", "%0 = softmax_grad(%y, %d)", ItemKind::kRowOp, 4, 8},
      {"%x: f32[4,8] data, %g: f32[8] param, %b: f32[8] param", "%0 = layer_norm(%x, %g, %b)",
       ItemKind::kRowOp, 4, 8},
      {"%x: bf16[4,8] data, %g: bf16[8] param", "%0 = rms_norm(%x, %g)", ItemKind::kRowOp, 4, 8},
      {"%x: f32[4,8] data", "%0 = sum(%x) {axes=[-1], keepdims=true}", ItemKind::kRowOp, 4, 8},
      {"%x: f32[4,8] data", "%0 = max(%x) {axes=[1]}", ItemKind::kRowOp, 4, 8},
      {"%x: f32[8] data", "%0 = mean(%x)", ItemKind::kRowOp, 1, 8},
      {"%l: f32[6,10] data, %t: i64[6] data", "%0 = cross_entropy(%l, %t) {reduction=\"none\"}",
       ItemKind::kRowOp, 6, 10},
      {"%l: f32[6,10] data, %t: i64[6] data", "%0 = cross_entropy(%l, %t)", ItemKind::kOpaque},
      {"%l: f32[6,10] data, %t: i64[6] data, %d: f32[6] data",
       "%0 = cross_entropy_grad(%l, %t, %d) {reduction=\"none\"}", ItemKind::kRowOp, 6, 10},
      // Norm gradients: rows of x (dgamma, dbeta are column values; see the problem test).
      {"%x: f32[2,3,8] data, %g: f32[8] param, %d: f32[2,3,8] data",
       "%0, %1, %2 = layer_norm_grad(%x, %g, %d)", ItemKind::kRowOp, 6, 8},
      {"%x: bf16[5,8] data, %g: bf16[8] param, %d: bf16[5,8] data",
       "%0, %1 = rms_norm_grad(%x, %g, %d)", ItemKind::kRowOp, 5, 8},
      // Column reductions: every axis but the last.
      {"%x: f32[4,8] data", "%0 = sum(%x) {axes=[0]}", ItemKind::kColumnReduction, 4, 8},
      {"%x: f32[2,3,8] data", "%0 = mean(%x) {axes=[0, 1], keepdims=true}",
       ItemKind::kColumnReduction, 6, 8},
      {"%x: f32[4,8] data", "%0 = max(%x) {axes=[0]}", ItemKind::kOpaque},
      {"%x: f32[4,8] data", "%0 = sum(%x)", ItemKind::kOpaque},  // a full reduction
      {"%x: f32[2,3,8] data", "%0 = sum(%x) {axes=[0]}", ItemKind::kOpaque},
      // GEMMs: 2-D, or rows of a sequence times a matrix (the flattened 2-D product).
      {"%a: f32[4,3] data, %b: f32[5,3] param", "%0 = matmul(%a, %b) {transpose_b=true}",
       ItemKind::kGemm, 4, 5},
      {"%a: f32[2,4,3] data, %b: f32[3,5] param", "%0 = matmul(%a, %b)", ItemKind::kGemm, 8, 5},
      {"%a: f32[2,3,4] data, %b: f32[3,5] param", "%0 = matmul(%a, %b) {transpose_a=true}",
       ItemKind::kOpaque},
      {"%a: f32[2,4,3] data, %b: f32[2,3,5] param", "%0 = matmul(%a, %b)", ItemKind::kOpaque},
      // Opaque by nature.
      {"%x: f32[4,8] data", "%0 = transpose(%x)", ItemKind::kOpaque},
      {"%x: f32[4,8] data", "%0 = reshape(%x) {shape=[8, 4]}", ItemKind::kOpaque},
      {"%t: f32[10,4] param, %i: i64[3] data", "%0 = gather(%t, %i)", ItemKind::kOpaque},

      {"%p: f32[5] param, %g: f32[5] data, %b: f32[5] state, %lr: f32[] data",
       "%0, %1 = optimizer_update(%p, %g, %b, %lr, %lr) {optimizer=\"sgd\", momentum=0.9}", ItemKind::kOpaque},
      {"%x: f32[0,8] data", "%0 = exp(%x)", ItemKind::kOpaque},  // empty
  };
  for (const ClassCase& c : cases) {
    SCOPED_TRACE(c.line);
    std::string returns = c.line.substr(0, c.line.find(" ="));
    Graph g = parse("graph @g(" + c.inputs + ") {\n  " + c.line + "\n  return " + returns + "\n}\n");
    fusion::NodeClass got = fusion::classify_node(g, g.nodes[0]);
    EXPECT_EQ(got.kind, c.kind);
    if (c.kind != ItemKind::kOpaque) {
      EXPECT_EQ(got.rows, c.rows);
      EXPECT_EQ(got.row_length, c.row_length);
    }
  }
}

// y = tanh(x + b) * (x + b), with tanh(x + b) also transposed outside.
constexpr const char* kChain =
    "graph @g(%x: f32[4,8] data, %b: f32[8] param) {\n"
    "  %0 = add(%x, %b) : f32[4,8]\n"
    "  %1 = tanh(%0) : f32[4,8]\n"
    "  %2 = transpose(%1) : f32[8,4]\n"
    "  %3 = mul(%1, %0) : f32[4,8]\n"
    "  return %2, %3\n"
    "}\n";

TEST(FusionProblem, ItemsValuesAndSpaces) {
  Graph g = parse(kChain);
  fusion::Problem p = fusion::build_problem(g);
  ASSERT_EQ(p.items.size(), 4u);
  EXPECT_EQ(p.items[0].kind, ItemKind::kElementwise);
  EXPECT_EQ(p.items[1].kind, ItemKind::kElementwise);
  EXPECT_EQ(p.items[2].kind, ItemKind::kOpaque);
  EXPECT_EQ(p.items[3].kind, ItemKind::kElementwise);
  EXPECT_EQ(p.items[0].space, p.items[1].space);
  EXPECT_EQ(p.items[0].space, p.items[3].space);
  ASSERT_EQ(p.values.size(), 4u);
  EXPECT_EQ(p.values[0].producer, 0);
  EXPECT_EQ(p.values[0].consumers, (std::vector<int>{1, 3}));
  EXPECT_EQ(p.values[0].bytes, 4 * 8 * 4);
  EXPECT_FALSE(p.values[0].external);
  EXPECT_EQ(p.values[1].consumers, (std::vector<int>{2, 3}));
  EXPECT_TRUE(p.values[2].external);  // graph outputs
  EXPECT_TRUE(p.values[3].external);
  EXPECT_TRUE(p.values[3].consumers.empty());
}

// Per-row work (one value per row, [R, 1]) takes the space of the rows it belongs to: the
// variance + eps and rsqrt of a decomposed norm can then join the row group (else they are a
// (4, 1) space of their own, and the centered values and the normalized rows they scale must
// be written out).
TEST(FusionProblem, PerRowItemsTakeTheSpaceOfTheirRows) {
  Graph g = parse(
      "graph @g(%x: f32[4,8] data, %e: f32[] data, %c: f32[4,1] data, %y: f32[3,1] data) {\n"
      "  %0 = mean(%x) {axes=[-1], keepdims=true} : f32[4,1]\n"  // row op, space (4, 8)
      "  %1 = add(%0, %e) : f32[4,1]\n"                          // per row: from its producer
      "  %2 = rsqrt(%1) : f32[4,1]\n"                            // per row: through %1
      "  %3 = mul(%x, %2) : f32[4,8]\n"                          // (4, 8)
      "  %4 = neg(%c) : f32[4,1]\n"                              // per row, input from outside:
      "  %5 = sub(%x, %4) : f32[4,8]\n"                          //   from its consumer
      "  %6 = exp(%y) : f32[3,1]\n"                              // nothing with 3 rows: (3, 1)
      "  %7 = transpose(%2) : f32[1,4]\n"                        // opaque
      "  return %3, %5, %6, %7\n"
      "}\n");
  fusion::Problem p = fusion::build_problem(g);
  ASSERT_EQ(p.items.size(), 8u);
  for (int i : {1, 2, 3, 4, 5}) EXPECT_EQ(p.items[i].space, p.items[0].space) << "item " << i;
  EXPECT_EQ(p.items[1].kind, ItemKind::kElementwise);
  EXPECT_NE(p.items[6].space, p.items[0].space);
  EXPECT_EQ(p.items[7].kind, ItemKind::kOpaque);
  // The classification itself is unchanged: per-row items are (4, 1).
  fusion::NodeClass c = fusion::classify_node(g, g.nodes[1]);
  EXPECT_EQ(c.rows, 4);
  EXPECT_EQ(c.row_length, 1);
}

TEST(FusionProblem, UpdatesAreExternalAndRepeatedReadsRepeat) {
  Graph g = parse(
      "graph @g(%w: f32[3] param, %x: f32[3] data) {\n"
      "  %0 = mul(%x, %x) : f32[3]\n"
      "  %1 = add(%0, %0) : f32[3]\n"
      "  update %w = %1\n"
      "  return\n"
      "}\n");
  fusion::Problem p = fusion::build_problem(g);
  EXPECT_EQ(p.values[0].consumers, (std::vector<int>{1, 1}));
  EXPECT_TRUE(p.values[1].external);
}

TEST(FusionOutline, GroupBecomesOneFusedNode) {
  Graph g = parse(kChain);
  std::vector<Tensor> inputs = random_inputs(g, 5, 0, 1);
  std::vector<Tensor> before = run_step(g, inputs);
  EXPECT_EQ(fusion::outline(g, {7, 7, 3, 7}), 1);
  verify(g);
  EXPECT_EQ(print(g),
            "graph @g(%x: f32[4,8] data, %b: f32[8] param) {\n"
            "  %0, %1 = fused(%x, %b) {kind=\"elementwise\"} : f32[4,8], f32[4,8] {\n"
            "    graph @fused_0(%x: f32[4,8] data, %b: f32[8] data) {\n"
            "      %0 = add(%x, %b) : f32[4,8]\n"
            "      %1 = tanh(%0) : f32[4,8]\n"
            "      %2 = mul(%1, %0) : f32[4,8]\n"
            "      return %1, %2\n"
            "    }\n"
            "  }\n"
            "  %2 = transpose(%0) : f32[8,4]\n"
            "  return %2, %1\n"
            "}\n");
  EXPECT_TRUE(bitwise_equal(run_step(g, inputs), before));
  // Only the add's output stays inside: 4 * 8 f32.
  std::vector<fusion::FusedNodeReport> r = fusion::report(g);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].node, 0u);
  EXPECT_EQ(r[0].kind, "elementwise");
  EXPECT_EQ(r[0].ops, (std::vector<std::string>{"add", "tanh", "mul"}));
  EXPECT_EQ(r[0].bytes_kept, 128);
}

TEST(FusionOutline, SingletonsStayAndAllSingletonsChangeNothing) {
  Graph g = parse(kChain);
  EXPECT_EQ(fusion::outline(g, {0, 1, 2, 3}), 0);
  EXPECT_EQ(print(g), print(parse(kChain)));
  EXPECT_KILN_ERROR(fusion::outline(g, {0, 1}), "2 group ids given for 4 nodes");
}

TEST(FusionOutline, RefusesAGroupThatWouldCreateACycle) {
  // exp -> transpose -> add, and exp -> add: {exp, add} without the transpose between them
  // would have to run both before and after the transpose.
  const char* text =
      "graph @g(%x: f32[4,4] data) {\n"
      "  %0 = exp(%x) : f32[4,4]\n"
      "  %1 = transpose(%0) : f32[4,4]\n"
      "  %2 = add(%0, %1) : f32[4,4]\n"
      "  return %2\n"
      "}\n";
  Graph g = parse(text);
  EXPECT_KILN_ERROR(fusion::outline(g, {0, 1, 0}), "would create a cycle", "0 (exp)", "2 (add)");
  std::string why;
  EXPECT_FALSE(fusion::is_legal(fusion::build_problem(g), {0, 1, 0}, &why));
  // The pass never makes such a group: its partitions are legal, and here nothing fuses
  // (the exp's only fusable consumer is on the far side of the transpose).
  for (bool optimal : {false, true}) {
    Graph h = parse(text);
    FusionPass pass(FusionOptions{optimal});
    EXPECT_FALSE(pass.run(h));
    EXPECT_EQ(print(h), print(parse(text)));
  }
}

TEST(FusionOutline, CrossGroupCycleIsRefusedToo) {
  // Each group alone is fine; together {a1, b2} and {b1, a2} form a cycle through
  // a1 -> a2 and b1 -> b2 ... a1 -> b... : A = {0, 3}, B = {1, 2}, with 0 -> 2 and 1 -> 3.
  Graph g = parse(
      "graph @g(%x: f32[4] data, %y: f32[4] data) {\n"
      "  %0 = exp(%x) : f32[4]\n"
      "  %1 = exp(%y) : f32[4]\n"
      "  %2 = mul(%0, %y) : f32[4]\n"
      "  %3 = mul(%1, %x) : f32[4]\n"
      "  return %2, %3\n"
      "}\n");
  // A = {0, 3} needs %1 (in B) before node 3; B = {1, 2} needs %0 (in A) before node 2.
  EXPECT_KILN_ERROR(fusion::outline(g, {0, 1, 1, 0}), "would create a cycle");
}

TEST(FusionOutline, GroupMovesAfterWhatItReads) {
  // The group {neg, add} starts at node 0 but reads the transpose (node 2): it must come after.
  Graph g = parse(
      "graph @g(%x: f32[4,4] data) {\n"
      "  %0 = neg(%x) : f32[4,4]\n"
      "  %1 = exp(%x) : f32[4,4]\n"
      "  %2 = transpose(%1) : f32[4,4]\n"
      "  %3 = add(%0, %2) : f32[4,4]\n"
      "  return %3\n"
      "}\n");
  std::vector<Tensor> inputs = random_inputs(g, 9, 0, 1);
  std::vector<Tensor> before = run_step(g, inputs);
  EXPECT_EQ(fusion::outline(g, {5, 1, 2, 5}), 1);
  verify(g);
  EXPECT_EQ(print(g),
            "graph @g(%x: f32[4,4] data) {\n"
            "  %0 = exp(%x) : f32[4,4]\n"
            "  %1 = transpose(%0) : f32[4,4]\n"
            "  %2 = fused(%x, %1) {kind=\"elementwise\"} : f32[4,4] {\n"
            "    graph @fused_0(%x: f32[4,4] data, %in0: f32[4,4] data) {\n"
            "      %0 = neg(%x) : f32[4,4]\n"
            "      %1 = add(%0, %in0) : f32[4,4]\n"
            "      return %1\n"
            "    }\n"
            "  }\n"
            "  return %2\n"
            "}\n");
  EXPECT_TRUE(bitwise_equal(run_step(g, inputs), before));
}

TEST(FusionOutline, UnreadAndUpdateValuesLeaveTheBody) {
  Graph g = parse(
      "graph @g(%w: f32[4,4] param, %x: f32[4,4] data) {\n"
      "  %0 = mul(%x, %w) : f32[4,4]\n"
      "  %unused = exp(%0) : f32[4,4]\n"
      "  %1 = sub(%w, %0) : f32[4,4]\n"
      "  update %w = %1\n"
      "  return\n"
      "}\n");
  EXPECT_EQ(fusion::outline(g, {0, 0, 0}), 1);
  verify(g);
  EXPECT_EQ(print(g),
            "graph @g(%w: f32[4,4] param, %x: f32[4,4] data) {\n"
            "  %unused, %0 = fused(%x, %w) {kind=\"elementwise\"} : f32[4,4], f32[4,4] {\n"
            "    graph @fused_0(%x: f32[4,4] data, %w: f32[4,4] data) {\n"
            "      %0 = mul(%x, %w) : f32[4,4]\n"
            "      %unused = exp(%0) : f32[4,4]\n"
            "      %1 = sub(%w, %0) : f32[4,4]\n"
            "      return %unused, %1\n"
            "    }\n"
            "  }\n"
            "  update %w = %0\n"
            "  return\n"
            "}\n");
}

TEST(FusionOutline, KindsAndMultipleGroups) {
  // A GEMM with its bias + gelu epilogue, then a row group (softmax of the result, scaled).
  Graph g = parse(
      "graph @g(%x: f32[4,3] data, %w: f32[3,6] param, %b: f32[6] param) {\n"
      "  %0 = matmul(%x, %w) : f32[4,6]\n"
      "  %1 = add(%0, %b) : f32[4,6]\n"
      "  %2 = gelu(%1) : f32[4,6]\n"
      "  %3 = softmax(%2) : f32[4,6]\n"
      "  %4 = mul(%3, %3) : f32[4,6]\n"
      "  return %4\n"
      "}\n");
  std::vector<Tensor> inputs = random_inputs(g, 3, 0, 1);
  std::vector<Tensor> before = run_step(g, inputs);
  EXPECT_EQ(fusion::outline(g, {0, 0, 0, 1, 1}), 2);
  verify(g);
  std::vector<fusion::FusedNodeReport> r = fusion::report(g);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].kind, "gemm-epilogue");
  EXPECT_EQ(r[0].ops, (std::vector<std::string>{"matmul", "add", "gelu"}));
  EXPECT_EQ(r[0].bytes_kept, 2 * 4 * 6 * 4);
  EXPECT_EQ(r[1].kind, "rows");
  EXPECT_EQ(r[1].bytes_kept, 4 * 6 * 4);
  EXPECT_EQ(g.nodes[0].body->name, "fused_0");
  EXPECT_EQ(g.nodes[1].body->name, "fused_1");
  EXPECT_TRUE(bitwise_equal(run_step(g, inputs), before));
}

// The default simplify passes, then fusion (greedy or optimal).
Graph compile(Graph g, bool optimal, bool rewrites) {
  if (rewrites) TrainingRewrites().run(g);
  AlgebraicSimplifier().run(g);
  ConstantFolding().run(g);
  CommonSubexpressionElimination().run(g);
  DeadCodeElimination().run(g);
  verify(g);
  Graph fused = g;
  FusionPass pass(FusionOptions{optimal});
  pass.run(fused);
  verify(fused);
  // Whatever the partition, nothing may change: the pass again finds nothing new to fuse
  // into fused nodes (they are opaque).
  Graph again = fused;
  FusionPass second(FusionOptions{optimal});
  second.run(again);
  verify(again);
  return fused;
}

TEST(FusionPass, EpilogueGraphFusesAndComputesTheSame) {
  Graph g = parse(
      "graph @g(%x: f32[8,16] data, %w: f32[16,32] param, %b: f32[32] param) {\n"
      "  %0 = matmul(%x, %w) : f32[8,32]\n"
      "  %1 = add(%0, %b) : f32[8,32]\n"
      "  %2 = gelu(%1) : f32[8,32]\n"
      "  %3 = sum(%2) {axes=[-1], keepdims=true} : f32[8,1]\n"
      "  %4 = div(%2, %3) : f32[8,32]\n"
      "  return %4\n"
      "}\n");
  std::vector<Tensor> inputs = random_inputs(g, 1, 0, 1);
  std::vector<Tensor> before = run_step(g, inputs);
  for (bool optimal : {false, true}) {
    SCOPED_TRACE(optimal ? "optimal" : "greedy");
    Graph fused = compile(g, optimal, false);
    EXPECT_TRUE(bitwise_equal(run_step(fused, inputs), before));
    for (const Node& node : fused.nodes) EXPECT_TRUE(node.op != Op::kFused || node.body->nodes.size() >= 2);
  }
}

// layer_norm_grad decomposed by training-rewrites (mean, centering, variance + eps, rsqrt, the
// dx formula, the dgamma column sum) fuses into ONE group: it reads x, gamma and dy and writes
// dx and dgamma, nothing full-size in between (before per-row items took their rows' space:
// four groups, with the centered and normalized rows written out and read back; and greedy,
// which large components get, needs its second pass: see FusionPartitionSmall). Same bits as unfused (reference kernels), and the tiled CPU
// kernel takes the body.
TEST(FusionPass, DecomposedLayerNormGradIsOneGroup) {
  Graph g = parse(
      "graph @g(%x: f32[6,16] data, %gamma: f32[16] param, %dy: f32[6,16] data) {\n"
      "  %0, %1, %2 = layer_norm_grad(%x, %gamma, %dy) : f32[6,16], f32[16], f32[16]\n"
      "  return %0, %1, %2\n"
      "}\n");
  std::vector<Tensor> inputs = random_inputs(g, 3, 0, 1);
  Graph plain = g;
  TrainingRewrites().run(plain);
  CommonSubexpressionElimination().run(plain);
  DeadCodeElimination().run(plain);
  std::vector<Tensor> expected = run_step(plain, inputs);
  for (bool optimal : {false, true}) {
    SCOPED_TRACE(optimal ? "optimal" : "greedy");
    Graph fused = compile(g, optimal, true);
    std::vector<const Node*> groups;
    for (const Node& node : fused.nodes)
      if (node.op == Op::kFused) groups.push_back(&node);
    ASSERT_EQ(groups.size(), 1u) << print(fused);
    const Graph& body = *groups[0]->body;
    EXPECT_EQ(groups[0]->attrs.s("kind"), "rows");
    EXPECT_EQ(body.nodes.size(), 17u);
    EXPECT_EQ(body.outputs.size(), 2u);  // dx, dgamma
    // Outside the group: the epsilon constant and dbeta = sum(dy), which shares no value with
    // the group (it would save nothing there).
    EXPECT_EQ(fused.nodes.size(), 3u) << print(fused);
    EXPECT_TRUE(bitwise_equal(run_step(fused, inputs), expected));
    EXPECT_TRUE(cpu::fused_plan_info(body).supported) << cpu::fused_plan_info(body).why_not;
  }
}

// A GEMM whose epilogue adds a value made late keeps the GEMM's operand alive until then:
//   %a = exp(%x) 64 KiB; %g = a @ w 4 KiB; %t = transpose(%a), %u = transpose(%t) 64 KiB each;
//   %s = slice(%u) 4 KiB; %out = g + s (a graph output: not in the arena).
// Unfused (this order; the scheduler keeps it): live a+g+t at %t and g+t+u at %u, 132 KiB;
// planned a@0, t@64K, u@0, g@128K, s@64K: 132 KiB. Fused {g, out} runs after %s, so a lives
// across t and u: a+t+u = 192 KiB at %u (a@0, t@64K, u@128K, s@64K). The partition saves g
// either way (4 KiB); the pass takes the group apart.
constexpr const char* kStretch =
    "graph @g(%x: f32[64,256] data, %w: f32[256,16] param) {\n"
    "  %a = exp(%x) : f32[64,256]\n"
    "  %g = matmul(%a, %w) : f32[64,16]\n"
    "  %t = transpose(%a) : f32[256,64]\n"
    "  %u = transpose(%t) : f32[64,256]\n"
    "  %s = slice(%u) {ends=[64, 16], starts=[0, 0]} : f32[64,16]\n"
    "  %out = add(%g, %s) : f32[64,16]\n"
    "  return %out\n"
    "}\n";

size_t scheduled_arena(Graph g) {
  SchedulePass().run(g);
  return plan_memory(g).arena_bytes;
}

TEST(FusionUnstretch, GroupThatRaisesThePlannedArenaIsTakenApart) {
  const Graph g = parse(kStretch);
  EXPECT_EQ(scheduled_arena(g), 132u * 1024);
  // Without the check: one gemm-epilogue node, and the larger arena.
  FusionOptions unchecked;
  unchecked.max_unstretch_candidates = 0;
  Graph fused = g;
  EXPECT_TRUE(FusionPass(unchecked).run(fused));
  ASSERT_EQ(fused.nodes.back().op, Op::kFused);
  EXPECT_EQ(fused.nodes.back().attrs.s("kind"), "gemm-epilogue");
  EXPECT_EQ(scheduled_arena(fused), 192u * 1024);
  // With it (the default): nothing fused, the graph as it was.
  for (bool optimal : {false, true}) {
    Graph checked = g;
    FusionOptions options;
    options.optimal = optimal;
    FusionPass pass(options);
    EXPECT_FALSE(pass.run(checked));
    EXPECT_EQ(print(checked), print(g));
    EXPECT_EQ(pass.last_partition().groups_dropped, 1);
    EXPECT_EQ(pass.last_partition().saved_bytes, 0);
  }
  // The function on its own: the group ids of the two members become distinct.
  std::vector<int> group_of = {0, 1, 2, 3, 4, 1};
  EXPECT_EQ(fusion::unstretch_groups(g, group_of, 16), 1);
  EXPECT_NE(group_of[1], group_of[5]);
  EXPECT_EQ(group_of[0], 0);
  EXPECT_EQ(group_of[4], 4);
  // No candidates allowed: nothing taken apart.
  group_of = {0, 1, 2, 3, 4, 1};
  EXPECT_EQ(fusion::unstretch_groups(g, group_of, 0), 0);
  EXPECT_EQ(group_of[1], group_of[5]);
}

// The same stretch where it does not matter: a 128 KiB value made and dropped first sets the
// peak (%b + %bs = 132 KiB at %bs); the stretched %a (2 KiB) lives across 2 KiB transposes only
// (a + t + u + bs = 10 KiB). The group stays.
TEST(FusionUnstretch, StretchAwayFromThePeakIsKept) {
  const Graph g = parse(
      "graph @g(%x: f32[64,8] data, %w: f32[8,16] param, %y: f32[64,512] data) {\n"
      "  %b = exp(%y) : f32[64,512]\n"
      "  %bs = slice(%b) {ends=[64, 16], starts=[0, 0]} : f32[64,16]\n"
      "  %a = exp(%x) : f32[64,8]\n"
      "  %g = matmul(%a, %w) : f32[64,16]\n"
      "  %t = transpose(%a) : f32[8,64]\n"
      "  %u = transpose(%t) : f32[64,8]\n"
      "  %s = slice(%u) {ends=[64, 8], starts=[0, 0]} : f32[64,8]\n"
      "  %v = sum(%s) {axes=[-1], keepdims=true} : f32[64,1]\n"
      "  %out = add(%g, %v) : f32[64,16]\n"
      "  %out2 = add(%out, %bs) : f32[64,16]\n"
      "  return %out2\n"
      "}\n");
  Graph fused = g;
  FusionPass pass;
  EXPECT_TRUE(pass.run(fused));
  EXPECT_EQ(pass.last_partition().groups_dropped, 0);
  int gemm_groups = 0;
  for (const Node& node : fused.nodes)
    gemm_groups += node.op == Op::kFused && node.attrs.s("kind") == "gemm-epilogue";
  EXPECT_EQ(gemm_groups, 1) << print(fused);
  EXPECT_EQ(scheduled_arena(fused), 132u * 1024);
}

// The training step of `forward` (autodiff, clipping, optimizer), simplified with and without
// training-rewrites: fusing (greedy and optimal) changes no bit of the outputs and updates.
void check_training_graph(const Graph& forward, uint64_t seed, int64_t int_high) {
  OptimizerConfig config;
  config.grad_clip = 1.0;
  StepProgram program = build_training_graph(forward, config);
  std::vector<Tensor> inputs = random_inputs(program.graph, seed, 0, int_high);
  for (bool rewrites : {false, true}) {
    Graph plain = program.graph;
    if (rewrites) TrainingRewrites().run(plain);
    AlgebraicSimplifier().run(plain);
    ConstantFolding().run(plain);
    CommonSubexpressionElimination().run(plain);
    DeadCodeElimination().run(plain);
    std::vector<Tensor> expected = run_step(plain, inputs);
    for (bool optimal : {false, true}) {
      SCOPED_TRACE(fmt::format("rewrites {} optimal {}", rewrites, optimal));
      Graph fused = compile(program.graph, optimal, rewrites);
      EXPECT_TRUE(bitwise_equal(run_step(fused, inputs), expected));
    }
  }
}

TEST(FusionPass, MlpTrainingGraphUnchangedBitwise) {
  check_training_graph(models::mlp({8, 12, {10}, 4}), 21, 4);
}

TEST(FusionPass, GptTrainingGraphUnchangedBitwise) {
  check_training_graph(models::gpt({2, 8, 16, 1, 2, 8}), 31, 16);
}

}  // namespace
}  // namespace kiln

// The simplifier's "attention-packed-qkv" rule (with "concat-split", passes/simplify/algebraic.cc)
// on attention over the split of a (B, T, 3C) projection, as models/gpt.cc writes it: after the
// pipeline's simplify passes the forward is attention_qkv and the backward attention_qkv_grad,
// with no split before attention nor concat after its gradient, and the training step (loss and
// gradients, reference dialect) is bitwise what the graph computed before (the rule is exact).
// The rule stays away from q, k, v that are not the three equal last-axis parts of one split, in
// order, with the bthd layout.
#include <cmath>
#include <map>
#include <set>

#include "ir/builder.h"
#include "ir/text.h"
#include "models/models.h"
#include "passes/autodiff.h"
#include "passes/pipeline.h"
#include "passes/simplify/algebraic.h"
#include "passes/simplify/dead_code.h"
#include "simplify/simplify_test_util.h"
#include "compile/training_graph.h"

namespace kiln {
namespace {

using testing::bitwise_equal;
using testing::contains;
using testing::lacks;
using testing::run_step;

// The default pipeline's exact simplify passes (the others, training-rewrites' decompositions
// and fusion on, disabled), with `also_disabled` skipped too.
void run_simplify_pipeline(Graph& g, std::set<std::string> also_disabled = {}) {
  const std::set<std::string> keep = {"algebraic", "constant-fold", "cse", "dead-code"};
  PassOptions options;
  options.disabled = std::move(also_disabled);
  for (const std::string& name : default_pipeline().names())
    if (!keep.count(name)) options.disabled.insert(name);
  default_pipeline(options).run(g);
}

std::map<Op, int> op_counts(const Graph& g) {
  std::map<Op, int> counts;
  for (const Node& node : g.nodes) ++counts[node.op];
  return counts;
}

// GPT-2's attention block on x (B, T, C): qkv = x @ w + b split into three (B, T, C), heads
// first (B, H, T, D), causal attention, heads back, loss sum(y * r). The graph returns the loss
// and its gradients with respect to x, w and b (autodiff).
Graph gpt_attention_step(int64_t B, int64_t T, int64_t H, int64_t D, DType dtype) {
  const int64_t C = H * D;
  Builder b("gpt_attention");
  Expr x = b.data("x", {B, T, C}, dtype);
  Expr r = b.data("r", {B, T, C}, dtype);
  Expr w = b.param("w_qkv", {C, 3 * C}, dtype);
  Expr bias = b.param("b_qkv", {3 * C}, dtype);
  auto heads_first = [&](Expr t) { return transpose(reshape(t, {B, T, H, D}), {0, 2, 1, 3}); };
  std::vector<Expr> qkv = split(matmul(x, w) + bias, {C, C, C}, 2);
  Expr y = attention(heads_first(qkv[0]), heads_first(qkv[1]), heads_first(qkv[2]), true);
  y = reshape(transpose(y, {0, 2, 1, 3}), {B, T, C});
  Graph forward = b.finish({sum(y * r)});
  AutodiffResult ad = autodiff(
      forward, forward.outputs[0],
      {forward.inputs[0].value, forward.inputs[2].value, forward.inputs[3].value});
  Graph g = std::move(ad.graph);
  for (ValueId grad : ad.gradients) g.outputs.push_back(grad);
  verify(g);
  return g;
}

TEST(AttentionPacked, GptAttentionStepBecomesPacked) {
  for (DType dtype : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const Graph step = gpt_attention_step(2, 5, 3, 4, dtype);
    ASSERT_EQ(op_counts(step)[Op::kSplit], 1);
    ASSERT_EQ(op_counts(step)[Op::kConcat], 1);  // the split's gradient
    Graph g = step;
    run_simplify_pipeline(g);
    std::map<Op, int> counts = op_counts(g);
    const std::string text = print(g);
    EXPECT_EQ(counts[Op::kAttentionQkv], 1) << text;
    EXPECT_EQ(counts[Op::kAttentionQkvGrad], 1) << text;
    EXPECT_EQ(counts[Op::kAttention], 0) << text;
    EXPECT_EQ(counts[Op::kAttentionGrad], 0) << text;
    EXPECT_EQ(counts[Op::kSplit], 0) << text;
    EXPECT_EQ(counts[Op::kConcat], 0) << text;
    EXPECT_EQ(counts[Op::kTranspose], 0) << text;  // heads-first transposes cancelled too
    // The packed op reads the projection as (B, T, 3, H, D).
    EXPECT_TRUE(contains(text, "attention_qkv(")) << text;
    EXPECT_TRUE(contains(text, "shape=[2, 5, 3, 3, 4]")) << text;

    // Loss and the gradients of x, w and b: bitwise the unsimplified graph's, and the graph
    // simplified without the algebraic pass (so without the rule).
    const std::vector<Tensor> inputs = testing::random_inputs(step, 31, 0, 1);
    const std::vector<Tensor> want = run_step(step, inputs);
    ASSERT_EQ(want.size(), 4u);
    EXPECT_TRUE(bitwise_equal(run_step(g, inputs), want));
    Graph without_rule = step;
    run_simplify_pipeline(without_rule, {"algebraic"});
    EXPECT_EQ(op_counts(without_rule)[Op::kAttentionQkv], 0);
    EXPECT_TRUE(bitwise_equal(run_step(without_rule, inputs), want));
  }
}

TEST(AttentionPacked, AlgebraicFiresOnForwardAndGradient) {
  Graph g = gpt_attention_step(1, 7, 2, 3, DType::kF32);
  const std::vector<Tensor> inputs = testing::random_inputs(g, 41, 0, 1);
  const std::vector<Tensor> want = run_step(g, inputs);
  AlgebraicSimplifier pass;
  ASSERT_TRUE(pass.run(g));
  EXPECT_EQ(pass.fired().at("attention-heads-inside"), 2);
  EXPECT_EQ(pass.fired().at("attention-packed-qkv"), 2);  // attention and attention_grad
  EXPECT_EQ(pass.fired().at("concat-split"), 1);          // dqkv written in place
  DeadCodeElimination dce;
  dce.run(g);
  std::map<Op, int> counts = op_counts(g);
  EXPECT_EQ(counts[Op::kSplit], 0) << print(g);
  EXPECT_EQ(counts[Op::kConcat], 0) << print(g);
  EXPECT_TRUE(bitwise_equal(run_step(g, inputs), want));
}

TEST(AttentionPacked, Gpt2TinyTrainingGraphUsesThePackedOps) {
  // Every layer's attention and its gradient in the full model's training graph (AdamW), the
  // step unchanged.
  models::GptConfig config = models::gpt_config("gpt2-tiny");
  config.batch = 1;
  const StepProgram training =
      build_training_graph(models::gpt(config), OptimizerConfig{});
  Graph g = training.graph;
  run_simplify_pipeline(g);
  std::map<Op, int> counts = op_counts(g);
  EXPECT_EQ(counts[Op::kAttentionQkv], config.layers);
  EXPECT_EQ(counts[Op::kAttentionQkvGrad], config.layers);
  EXPECT_EQ(counts[Op::kAttention], 0);
  EXPECT_EQ(counts[Op::kAttentionGrad], 0);
  EXPECT_EQ(counts[Op::kSplit], 0);
  EXPECT_EQ(counts[Op::kConcat], 0);
  std::vector<Tensor> inputs = testing::random_inputs(training.graph, 51, 0, config.vocab);
  for (int i : training.state_inputs) {  // optimizer moments >= 0 (no square root of < 0)
    const TensorType& t = training.graph.type(training.graph.inputs[i].value);
    if (is_float(t.dtype)) inputs[i] = random_tensor(t, 60 + i, 0.0, 1.0);
  }
  const std::vector<Tensor> want = run_step(training.graph, inputs);
  for (const Tensor& t : want)
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_TRUE(std::isfinite(t.get(i)));
  EXPECT_TRUE(bitwise_equal(run_step(g, inputs), want));
}

// ---- where the rule must not fire ----

// q, k, v from the lines given, attention{bthd} and its gradient on them (dout %g, default
// (2, 5, 3, 4) like q); the algebraic pass must leave both attention nodes alone.
void expect_not_packed(const std::string& params, const std::string& lines,
                       const std::string& dout = "f32[2,5,3,4]") {
  SCOPED_TRACE(lines);
  Graph g = parse("graph @g(" + params + ", %g: " + dout + " data) {\n" + lines +
                  "  %o, %lse = attention(%q, %k, %v) {causal=true, layout=\"bthd\"}\n"
                  "  %dq, %dk, %dv = attention_grad(%q, %k, %v, %o, %g, %lse) "
                  "{causal=true, layout=\"bthd\"}\n"
                  "  return %o, %dq, %dk, %dv\n}\n");
  AlgebraicSimplifier pass;
  pass.run(g);
  EXPECT_FALSE(pass.fired().count("attention-packed-qkv"));
  const std::string text = print(g);
  EXPECT_TRUE(lacks(text, "attention_qkv")) << text;
  EXPECT_TRUE(contains(text, "attention(")) << text;
  EXPECT_TRUE(contains(text, "attention_grad(")) << text;
}

TEST(AttentionPacked, PositiveControlOfTheNegativeCases) {
  // The shape the negative cases below each break: the rule fires on both nodes.
  Graph g = parse(
      "graph @g(%x: f32[2,5,36] data, %g: f32[2,5,3,4] data) {\n"
      "  %a, %b, %c = split(%x) {axis=2, sizes=[12, 12, 12]}\n"
      "  %q = reshape(%a) {shape=[2, 5, 3, 4]}\n"
      "  %k = reshape(%b) {shape=[2, 5, 3, 4]}\n"
      "  %v = reshape(%c) {shape=[2, 5, 3, 4]}\n"
      "  %o, %lse = attention(%q, %k, %v) {causal=true, layout=\"bthd\"}\n"
      "  %dq, %dk, %dv = attention_grad(%q, %k, %v, %o, %g, %lse) {causal=true, "
      "layout=\"bthd\"}\n"
      "  return %o, %dq, %dk, %dv\n}\n");
  const std::vector<Tensor> inputs = testing::random_inputs(g, 61, 0, 1);
  const std::vector<Tensor> want = run_step(g, inputs);
  AlgebraicSimplifier pass;
  ASSERT_TRUE(pass.run(g));
  EXPECT_EQ(pass.fired().at("attention-packed-qkv"), 2);
  EXPECT_TRUE(contains(print(g), "attention_qkv_grad(")) << print(g);
  EXPECT_TRUE(bitwise_equal(run_step(g, inputs), want));
}

TEST(AttentionPacked, NoRuleForPartsOfDifferentSplits) {
  expect_not_packed("%x: f32[2,5,36] data, %y: f32[2,5,36] data",
                    "  %a, %b, %c = split(%x) {axis=2, sizes=[12, 12, 12]}\n"
                    "  %a2, %b2, %c2 = split(%y) {axis=2, sizes=[12, 12, 12]}\n"
                    "  %q = reshape(%a) {shape=[2, 5, 3, 4]}\n"
                    "  %k = reshape(%b2) {shape=[2, 5, 3, 4]}\n"
                    "  %v = reshape(%c) {shape=[2, 5, 3, 4]}\n");
}

TEST(AttentionPacked, NoRuleForPartsOutOfOrder) {
  // q and k swapped: attention_qkv would read q where k is.
  expect_not_packed("%x: f32[2,5,36] data",
                    "  %a, %b, %c = split(%x) {axis=2, sizes=[12, 12, 12]}\n"
                    "  %q = reshape(%b) {shape=[2, 5, 3, 4]}\n"
                    "  %k = reshape(%a) {shape=[2, 5, 3, 4]}\n"
                    "  %v = reshape(%c) {shape=[2, 5, 3, 4]}\n");
}

TEST(AttentionPacked, NoRuleForUnequalSplitSizes) {
  // v wider than q and k (Dv = 6, which attention allows): not a (..., 3, H, D) packing.
  Graph g = parse(
      "graph @g(%x: f32[2,5,42] data) {\n"
      "  %a, %b, %c = split(%x) {axis=2, sizes=[12, 12, 18]}\n"
      "  %q = reshape(%a) {shape=[2, 5, 3, 4]}\n"
      "  %k = reshape(%b) {shape=[2, 5, 3, 4]}\n"
      "  %v = reshape(%c) {shape=[2, 5, 3, 6]}\n"
      "  %o, %lse = attention(%q, %k, %v) {layout=\"bthd\"}\n"
      "  return %o\n}\n");
  AlgebraicSimplifier pass;
  pass.run(g);
  EXPECT_FALSE(pass.fired().count("attention-packed-qkv"));
  EXPECT_TRUE(lacks(print(g), "attention_qkv")) << print(g);
  // Four parts, q, k, v the first three: not a three-way split.
  expect_not_packed("%x: f32[2,5,48] data",
                    "  %a, %b, %c, %d = split(%x) {axis=2, sizes=[12, 12, 12, 12]}\n"
                    "  %q = reshape(%a) {shape=[2, 5, 3, 4]}\n"
                    "  %k = reshape(%b) {shape=[2, 5, 3, 4]}\n"
                    "  %v = reshape(%c) {shape=[2, 5, 3, 4]}\n");
}

TEST(AttentionPacked, NoRuleForASplitNotAlongTheLastAxis) {
  // Split along T (axis 1): the parts are blocks of rows, not columns of each row.
  expect_not_packed("%x: f32[2,15,12] data",
                    "  %a, %b, %c = split(%x) {axis=1, sizes=[5, 5, 5]}\n"
                    "  %q = reshape(%a) {shape=[2, 5, 3, 4]}\n"
                    "  %k = reshape(%b) {shape=[2, 5, 3, 4]}\n"
                    "  %v = reshape(%c) {shape=[2, 5, 3, 4]}\n");
  // x (6, 5, 36) is q's (..., T, 3 H D) for q (6, 5, 3, 4), and each third along axis 0 has
  // q's size: only the split's axis tells this apart from the packed projection.
  expect_not_packed("%x: f32[6,5,36] data",
                    "  %a, %b, %c = split(%x) {axis=0, sizes=[2, 2, 2]}\n"
                    "  %q = reshape(%a) {shape=[6, 5, 3, 4]}\n"
                    "  %k = reshape(%b) {shape=[6, 5, 3, 4]}\n"
                    "  %v = reshape(%c) {shape=[6, 5, 3, 4]}\n",
                    "f32[6,5,3,4]");
}

TEST(AttentionPacked, NoRuleForTheHeadsFirstLayout) {
  // The same reshapes under the default layout are attention over the H axis (T a batch dim):
  // another computation.
  Graph g = parse(
      "graph @g(%x: f32[2,5,36] data) {\n"
      "  %a, %b, %c = split(%x) {axis=2, sizes=[12, 12, 12]}\n"
      "  %q = reshape(%a) {shape=[2, 5, 3, 4]}\n"
      "  %k = reshape(%b) {shape=[2, 5, 3, 4]}\n"
      "  %v = reshape(%c) {shape=[2, 5, 3, 4]}\n"
      "  %o, %lse = attention(%q, %k, %v) {causal=true}\n"
      "  return %o\n}\n");
  AlgebraicSimplifier pass;
  pass.run(g);
  EXPECT_FALSE(pass.fired().count("attention-packed-qkv"));
  EXPECT_TRUE(lacks(print(g), "attention_qkv")) << print(g);
}

}  // namespace
}  // namespace kiln

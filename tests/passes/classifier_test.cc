// The classifier pass (passes/classifier.h): IR text in, the fused "classifier" node out, for
// the mixed-precision form (both casts absorbed), plain f32, logits that are also read elsewhere
// (their cast stays outside) and a gradient read elsewhere (its cast stays outside); the graph
// left alone when labels or attributes differ, there is no gradient or two, the loss is f64, or
// dloss depends on the loss (a cycle). Results are bit for bit those of the unfused graph
// (reference kernels). The fusion pass leaves the classifier node alone. match_classifier_body
// reads the body back. On gpt2-tiny's bf16 training graph the pass fires once.
#include "passes/classifier.h"

#include <gtest/gtest.h>

#include "ir/text.h"
#include "models/models.h"
#include "ops/fused/classifier.h"
#include "passes/fusion/fusion.h"
#include "passes/pipeline.h"
#include "simplify/simplify_test_util.h"
#include "compile/training_graph.h"

namespace kiln {
namespace {

using testing::bitwise_equal;
using testing::expect_unchanged;
using testing::random_inputs;
using testing::run_on_text;
using testing::run_step;

// The text after the pass, results before and after compared (reference kernels, bit for bit).
std::string fused_text(std::string_view text) {
  Graph g = parse(text);
  // Labels in [0, 10): every vocabulary here has at least 10 classes.
  const std::vector<Tensor> inputs = random_inputs(g, 7, 0, 10);
  const std::vector<Tensor> before = run_step(g, inputs);
  ClassifierPass pass;
  EXPECT_TRUE(pass.run(g));
  verify(g);
  EXPECT_TRUE(bitwise_equal(run_step(g, inputs), before));
  return print(g);
}

TEST(ClassifierPass, MixedPrecisionLossBecomesOneNodeWithBothCasts) {
  const std::string after = fused_text(
      "graph @g(%x: bf16[4,10] data, %t: i64[4] data) {\n"
      "  %l = cast(%x) {dtype=f32} : f32[4,10]\n"
      "  %loss = cross_entropy(%l, %t) : f32[]\n"
      "  %d = full() {dtype=f32, shape=[], value=1.0} : f32[]\n"
      "  %g = cross_entropy_grad(%l, %t, %d) : f32[4,10]\n"
      "  %gb = cast(%g) {dtype=bf16} : bf16[4,10]\n"
      "  %y = mul(%gb, %x) : bf16[4,10]\n"
      "  return %loss, %y\n"
      "}\n");
  // The node goes after the full it reads; its outputs keep their names.
  EXPECT_EQ(after, print(parse(
      "graph @g(%x: bf16[4,10] data, %t: i64[4] data) {\n"
      "  %d = full() {dtype=f32, shape=[], value=1.0} : f32[]\n"
      "  %loss, %gb = fused(%x, %t, %d) {kind=\"classifier\"} : f32[], bf16[4,10] {\n"
      "    graph @classifier_0(%x: bf16[4,10] data, %t: i64[4] data, %d: f32[] data) {\n"
      "      %l = cast(%x) {dtype=f32} : f32[4,10]\n"
      "      %loss = cross_entropy(%l, %t) : f32[]\n"
      "      %g = cross_entropy_grad(%l, %t, %d) : f32[4,10]\n"
      "      %gb = cast(%g) {dtype=bf16} : bf16[4,10]\n"
      "      return %loss, %gb\n"
      "    }\n"
      "  }\n"
      "  %y = mul(%gb, %x) : bf16[4,10]\n"
      "  return %loss, %y\n"
      "}\n")));
}

TEST(ClassifierPass, F32LossWithAttributesBecomesOneNode) {
  const std::string after = fused_text(
      "graph @g(%l: f32[2,3,12] data, %t: i32[2,3] data, %d: f32[2,3] data) {\n"
      "  %loss = cross_entropy(%l, %t) {ignore_index=4, reduction=\"none\"} : f32[2,3]\n"
      "  %g = cross_entropy_grad(%l, %t, %d) {ignore_index=4, reduction=\"none\"} : f32[2,3,12]\n"
      "  %s = sum(%g) {axes=[0, 1]} : f32[12]\n"
      "  return %loss, %s\n"
      "}\n");
  EXPECT_EQ(after, print(parse(
      "graph @g(%l: f32[2,3,12] data, %t: i32[2,3] data, %d: f32[2,3] data) {\n"
      "  %loss, %g = fused(%l, %t, %d) {kind=\"classifier\"} : f32[2,3], f32[2,3,12] {\n"
      "    graph @classifier_0(%l: f32[2,3,12] data, %t: i32[2,3] data, %d: f32[2,3] data) {\n"
      "      %loss = cross_entropy(%l, %t) {ignore_index=4, reduction=\"none\"} : f32[2,3]\n"
      "      %g = cross_entropy_grad(%l, %t, %d) {ignore_index=4, reduction=\"none\"} : "
      "f32[2,3,12]\n"
      "      return %loss, %g\n"
      "    }\n"
      "  }\n"
      "  %s = sum(%g) {axes=[0, 1]} : f32[12]\n"
      "  return %loss, %s\n"
      "}\n")));
}

TEST(ClassifierPass, LogitsReadElsewhereKeepTheirCastOutside) {
  // The f32 logits are also a graph output (GPT-2's training graph returns its logits): they
  // are stored anyway, so the node reads them and only the cast back is absorbed.
  const std::string after = fused_text(
      "graph @g(%x: f16[4,10] data, %t: i64[4] data, %d: f32[] data) {\n"
      "  %l = cast(%x) {dtype=f32} : f32[4,10]\n"
      "  %loss = cross_entropy(%l, %t) {reduction=\"sum\"} : f32[]\n"
      "  %g = cross_entropy_grad(%l, %t, %d) {reduction=\"sum\"} : f32[4,10]\n"
      "  %gh = cast(%g) {dtype=f16} : f16[4,10]\n"
      "  return %loss, %gh, %l\n"
      "}\n");
  EXPECT_EQ(after, print(parse(
      "graph @g(%x: f16[4,10] data, %t: i64[4] data, %d: f32[] data) {\n"
      "  %l = cast(%x) {dtype=f32} : f32[4,10]\n"
      "  %loss, %gh = fused(%l, %t, %d) {kind=\"classifier\"} : f32[], f16[4,10] {\n"
      "    graph @classifier_0(%l: f32[4,10] data, %t: i64[4] data, %d: f32[] data) {\n"
      "      %loss = cross_entropy(%l, %t) {reduction=\"sum\"} : f32[]\n"
      "      %g = cross_entropy_grad(%l, %t, %d) {reduction=\"sum\"} : f32[4,10]\n"
      "      %gh = cast(%g) {dtype=f16} : f16[4,10]\n"
      "      return %loss, %gh\n"
      "    }\n"
      "  }\n"
      "  return %loss, %gh, %l\n"
      "}\n")));
  // Another node reading the logits: the same.
  const std::string other_reader = fused_text(
      "graph @g(%x: bf16[4,10] data, %t: i64[4] data, %d: f32[] data) {\n"
      "  %l = cast(%x) {dtype=f32} : f32[4,10]\n"
      "  %loss = cross_entropy(%l, %t) : f32[]\n"
      "  %g = cross_entropy_grad(%l, %t, %d) : f32[4,10]\n"
      "  %gb = cast(%g) {dtype=bf16} : bf16[4,10]\n"
      "  %p = softmax(%l) : f32[4,10]\n"
      "  return %loss, %gb, %p\n"
      "}\n");
  EXPECT_TRUE(testing::contains(other_reader, "  %l = cast(%x) {dtype=f32} : f32[4,10]\n"));
  EXPECT_TRUE(testing::contains(other_reader, "fused(%l, %t, %d) {kind=\"classifier\"}"));
}

TEST(ClassifierPass, GradientReadElsewhereKeepsItsCastOutside) {
  const std::string after = fused_text(
      "graph @g(%x: bf16[4,10] data, %t: i64[4] data, %d: f32[] data) {\n"
      "  %l = cast(%x) {dtype=f32} : f32[4,10]\n"
      "  %loss = cross_entropy(%l, %t) : f32[]\n"
      "  %g = cross_entropy_grad(%l, %t, %d) : f32[4,10]\n"
      "  %gb = cast(%g) {dtype=bf16} : bf16[4,10]\n"
      "  %n = neg(%g) : f32[4,10]\n"
      "  return %loss, %gb, %n\n"
      "}\n");
  EXPECT_TRUE(testing::contains(after, "%loss, %g = fused(%x, %t, %d) {kind=\"classifier\"} : "
                                       "f32[], f32[4,10] {\n"));
  EXPECT_TRUE(testing::contains(after, "  %gb = cast(%g) {dtype=bf16} : bf16[4,10]\n"));
}

TEST(ClassifierPass, NoFuseWhenLabelsDiffer) {
  ClassifierPass pass;
  expect_unchanged(pass,
                   "graph @g(%l: f32[4,10] data, %t: i64[4] data, %u: i64[4] data, %d: f32[] "
                   "data) {\n"
                   "  %loss = cross_entropy(%l, %t) : f32[]\n"
                   "  %g = cross_entropy_grad(%l, %u, %d) : f32[4,10]\n"
                   "  return %loss, %g\n"
                   "}\n");
}

TEST(ClassifierPass, NoFuseWhenAttributesDiffer) {
  ClassifierPass pass;
  expect_unchanged(pass,
                   "graph @g(%l: f32[4,10] data, %t: i64[4] data, %d: f32[] data) {\n"
                   "  %loss = cross_entropy(%l, %t) {ignore_index=0} : f32[]\n"
                   "  %g = cross_entropy_grad(%l, %t, %d) : f32[4,10]\n"
                   "  return %loss, %g\n"
                   "}\n");
  expect_unchanged(pass,
                   "graph @g(%l: f32[4,10] data, %t: i64[4] data, %d: f32[] data) {\n"
                   "  %loss = cross_entropy(%l, %t) {reduction=\"sum\"} : f32[]\n"
                   "  %g = cross_entropy_grad(%l, %t, %d) : f32[4,10]\n"
                   "  return %loss, %g\n"
                   "}\n");
}

TEST(ClassifierPass, NoFuseWithoutExactlyOneGradient) {
  ClassifierPass pass;
  expect_unchanged(pass,
                   "graph @g(%l: f32[4,10] data, %t: i64[4] data) {\n"
                   "  %loss = cross_entropy(%l, %t) : f32[]\n"
                   "  return %loss\n"
                   "}\n");
  // Two gradients of the one loss (different dloss): which one would the node compute?
  expect_unchanged(pass,
                   "graph @g(%l: f32[4,10] data, %t: i64[4] data, %d: f32[] data, %e: f32[] "
                   "data) {\n"
                   "  %loss = cross_entropy(%l, %t) : f32[]\n"
                   "  %g = cross_entropy_grad(%l, %t, %d) : f32[4,10]\n"
                   "  %h = cross_entropy_grad(%l, %t, %e) : f32[4,10]\n"
                   "  return %loss, %g, %h\n"
                   "}\n");
  // A gradient before its loss (no order between them): the body's outputs are (loss, grad).
  expect_unchanged(pass,
                   "graph @g(%l: f32[4,10] data, %t: i64[4] data, %d: f32[] data) {\n"
                   "  %g = cross_entropy_grad(%l, %t, %d) : f32[4,10]\n"
                   "  %loss = cross_entropy(%l, %t) : f32[]\n"
                   "  return %loss, %g\n"
                   "}\n");
}

TEST(ClassifierPass, NoFuseForF64Logits) {
  ClassifierPass pass;
  expect_unchanged(pass,
                   "graph @g(%l: f64[4,10] data, %t: i64[4] data, %d: f64[] data) {\n"
                   "  %loss = cross_entropy(%l, %t) : f64[]\n"
                   "  %g = cross_entropy_grad(%l, %t, %d) : f64[4,10]\n"
                   "  return %loss, %g\n"
                   "}\n");
}

TEST(ClassifierPass, NoFuseWhenDlossDependsOnTheLoss) {
  // One node cannot both produce %loss and read %d computed from it.
  ClassifierPass pass;
  expect_unchanged(pass,
                   "graph @g(%l: f32[4,10] data, %t: i64[4] data) {\n"
                   "  %loss = cross_entropy(%l, %t) : f32[]\n"
                   "  %d = exp(%loss) : f32[]\n"
                   "  %g = cross_entropy_grad(%l, %t, %d) : f32[4,10]\n"
                   "  return %loss, %g\n"
                   "}\n");
}

TEST(ClassifierPass, FusionLeavesTheClassifierNodeAlone) {
  Graph g = parse(
      "graph @g(%x: bf16[4,10] data, %t: i64[4] data, %d: f32[] data, %b: bf16[10] param) {\n"
      "  %a = add(%x, %b) : bf16[4,10]\n"
      "  %l = cast(%a) {dtype=f32} : f32[4,10]\n"
      "  %loss = cross_entropy(%l, %t) : f32[]\n"
      "  %g = cross_entropy_grad(%l, %t, %d) : f32[4,10]\n"
      "  %gb = cast(%g) {dtype=bf16} : bf16[4,10]\n"
      "  %y = mul(%gb, %x) : bf16[4,10]\n"
      "  %z = tanh(%y) : bf16[4,10]\n"
      "  return %loss, %z\n"
      "}\n");
  ASSERT_TRUE(ClassifierPass().run(g));
  const Node* classifier = nullptr;
  for (const Node& node : g.nodes)
    if (node.op == Op::kFused) classifier = &node;
  ASSERT_NE(classifier, nullptr);
  const std::shared_ptr<const Graph> body = classifier->body;
  EXPECT_TRUE(fusion::classify_node(g, *classifier).kind == fusion::ItemKind::kOpaque);
  for (bool optimal : {false, true}) {
    Graph h = g;
    FusionPass(FusionOptions{optimal}).run(h);
    verify(h);
    int classifiers = 0;
    for (const Node& node : h.nodes) {
      if (node.op != Op::kFused || node.attrs.s("kind") != "classifier") continue;
      ++classifiers;
      EXPECT_EQ(node.body, body);  // the very same body: not re-outlined, not nested
    }
    EXPECT_EQ(classifiers, 1);
  }
}

TEST(ClassifierPass, MatchReadsTheBodyBack) {
  Graph g = parse(
      "graph @g(%x: f16[3,5,9] data, %t: i32[3,5] data, %d: f32[3,5] data) {\n"
      "  %l = cast(%x) {dtype=f32} : f32[3,5,9]\n"
      "  %loss = cross_entropy(%l, %t) {ignore_index=-1, reduction=\"none\"} : f32[3,5]\n"
      "  %g = cross_entropy_grad(%l, %t, %d) {ignore_index=-1, reduction=\"none\"} : f32[3,5,9]\n"
      "  %gh = cast(%g) {dtype=bf16} : bf16[3,5,9]\n"
      "  return %loss, %gh\n"
      "}\n");
  ASSERT_TRUE(ClassifierPass().run(g));
  ASSERT_EQ(g.nodes.size(), 1u);
  std::optional<ClassifierBody> m = match_classifier_body(*g.nodes[0].body);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->logits, DType::kF16);
  EXPECT_EQ(m->labels, DType::kI32);
  EXPECT_EQ(m->grad, DType::kBF16);
  EXPECT_EQ(m->ignore_index, -1);
  EXPECT_EQ(m->reduction, "none");
  EXPECT_EQ(m->rows, 15);
  EXPECT_EQ(m->vocab, 9);
  // Another fused body is not a classifier.
  Graph other = parse(
      "graph @b(%x: f32[4,8] data, %y: f32[4,8] data, %z: f32[4,8] data) {\n"
      "  %0 = add(%x, %y) : f32[4,8]\n"
      "  %1 = mul(%0, %z) : f32[4,8]\n"
      "  return %0, %1\n"
      "}\n");
  EXPECT_FALSE(match_classifier_body(other).has_value());
}

int count_classifiers(const Graph& g, size_t* body_nodes) {
  int n = 0;
  for (const Node& node : g.nodes)
    if (node.op == Op::kFused && node.attrs.s("kind") == "classifier") {
      ++n;
      *body_nodes = node.body->nodes.size();
    }
  return n;
}

TEST(ClassifierPass, FiresOnceOnGpt2TinyBf16TrainingGraph) {
  OptimizerConfig config;
  config.amp = "bf16";
  Graph forward = models::gpt(models::gpt_config("gpt2-tiny"));
  // With the logits kept as a step output, the node reads the f32 logits and absorbs only the
  // cast back.
  config.keep_forward_outputs = true;
  Graph g = build_training_graph(forward, config).graph;
  default_pipeline().run(g);
  size_t body_nodes = 0;
  EXPECT_EQ(count_classifiers(g, &body_nodes), 1);
  EXPECT_EQ(body_nodes, 3u);
  // As built by default (the loss the only output), both casts go in: no f32 copy of the logits.
  config.keep_forward_outputs = false;
  g = build_training_graph(forward, config).graph;
  default_pipeline().run(g);
  EXPECT_EQ(count_classifiers(g, &body_nodes), 1);
  EXPECT_EQ(body_nodes, 4u);
  for (const Node& node : g.nodes) {
    EXPECT_NE(node.op, Op::kCrossEntropyGrad);
    EXPECT_NE(node.op, Op::kOneHot);  // training-rewrites found nothing left to decompose
  }
}

}  // namespace
}  // namespace kiln

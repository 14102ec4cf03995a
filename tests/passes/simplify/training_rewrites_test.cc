// training-rewrites: the decomposed cross_entropy_grad and layer_norm_grad compute what the fused
// ops compute (f64, reference kernels, within 1e-10), for every reduction, ignored rows, a batch
// with no counted row, rank 1..3; and the rules stay away from half precision and from a
// cross_entropy_grad whose labels nobody checks.
#include "passes/simplify/training_rewrites.h"

#include "ir/builder.h"
#include "ir/text.h"
#include "simplify_test_util.h"

namespace kiln {
namespace {

using testing::contains;
using testing::lacks;

// Runs the graph on `inputs` before and after the pass; expects the rule to fire once per
// fused node and the results to agree within 1e-10 (relative to each tensor's largest element).
void expect_same_after_rewrite(Graph g, const std::vector<Tensor>& inputs, const std::string& rule,
                               int times = 1) {
  std::vector<Tensor> before = testing::run_step(g, inputs);
  TrainingRewrites pass;
  ASSERT_TRUE(pass.run(g));
  verify(g);
  EXPECT_EQ(pass.fired().at(rule), times);
  std::vector<Tensor> after = testing::run_step(g, inputs);
  EXPECT_TRUE(testing::relatively_close(after, before, 1e-10));
}

struct CrossEntropyCase {
  Graph graph;
  std::vector<Tensor> inputs;
};

// logits (2, 3, 5), labels (2, 3) with the given values, dloss of the reduction's shape.
CrossEntropyCase cross_entropy_case(const std::string& reduction, std::vector<double> labels,
                                    int64_t ignore_index = -100, DType dtype = DType::kF64) {
  Builder b("ce");
  Expr logits = b.data("logits", {2, 3, 5}, dtype);
  Expr label = b.data("labels", {2, 3}, DType::kI64);
  Expr dloss = b.data("dloss", reduction == "none" ? Shape{2, 3} : Shape{}, dtype);
  Expr loss = cross_entropy(logits, label, ignore_index, reduction);
  Expr grad = cross_entropy_grad(logits, label, dloss, ignore_index, reduction);
  CrossEntropyCase c{b.finish({loss, grad}), {}};
  c.inputs = {random_tensor({dtype, {2, 3, 5}}, 1, -3.0, 3.0),
              testing::make(DType::kI64, {2, 3}, std::move(labels)),
              random_tensor({dtype, reduction == "none" ? Shape{2, 3} : Shape{}}, 2, 0.5, 2.0)};
  return c;
}

TEST(TrainingRewrites, CrossEntropyGradMeanWithIgnoredRows) {
  CrossEntropyCase c = cross_entropy_case("mean", {0, 4, -100, 2, -100, 1});
  const std::string before = print(c.graph);
  Graph g = c.graph;
  TrainingRewrites pass;
  ASSERT_TRUE(pass.run(g));
  const std::string text = print(g);
  EXPECT_TRUE(lacks(text, "cross_entropy_grad("));
  EXPECT_TRUE(contains(text, "softmax(%logits)"));
  EXPECT_TRUE(contains(text, "one_hot(%labels) {depth=5, dtype=f64}"));
  EXPECT_TRUE(contains(text, "ne(%labels, "));
  EXPECT_TRUE(contains(text, "where("));
  expect_same_after_rewrite(c.graph, c.inputs, "cross-entropy-grad-decompose");
}

TEST(TrainingRewrites, CrossEntropyGradSumAndNone) {
  for (const char* reduction : {"sum", "none"}) {
    SCOPED_TRACE(reduction);
    CrossEntropyCase c = cross_entropy_case(reduction, {3, -100, 0, 2, 2, 4});
    expect_same_after_rewrite(c.graph, c.inputs, "cross-entropy-grad-decompose");
  }
}

TEST(TrainingRewrites, CrossEntropyGradWithEveryRowIgnoredIsZero) {
  // count = 0: dloss / 0 is inf, but every row is masked, as the op gives 0 (not NaN).
  CrossEntropyCase c = cross_entropy_case("mean", {-100, -100, -100, -100, -100, -100});
  TrainingRewrites pass;
  Graph g = c.graph;
  ASSERT_TRUE(pass.run(g));
  std::vector<Tensor> out = testing::run_step(g, c.inputs);
  for (int64_t i = 0; i < out[1].numel(); ++i) ASSERT_EQ(out[1].get(i), 0.0) << i;
  expect_same_after_rewrite(c.graph, c.inputs, "cross-entropy-grad-decompose");
}

TEST(TrainingRewrites, CrossEntropyGradWithAnIgnoreIndexInsideTheVocabulary) {
  // ignore_index 2 is a class: one_hot marks it, the where must still zero those rows.
  CrossEntropyCase c = cross_entropy_case("mean", {2, 0, 2, 1, 3, 4}, /*ignore_index=*/2);
  expect_same_after_rewrite(c.graph, c.inputs, "cross-entropy-grad-decompose");
}

TEST(TrainingRewrites, CrossEntropyGradUsesTheStaticCountWhenNoLabelCanBeIgnored) {
  // Labels from argmax lie in [0, 5), so -100 never occurs: count = 6 rows, no mask.
  Builder b("ce_static");
  Expr logits = b.data("logits", {2, 3, 5}, DType::kF64);
  Expr scores = b.data("scores", {2, 3, 5}, DType::kF64);
  Expr dloss = b.data("dloss", {}, DType::kF64);
  Expr labels = argmax(scores);
  Graph g = b.finish({cross_entropy(logits, labels), cross_entropy_grad(logits, labels, dloss)});
  Graph rewritten = g;
  TrainingRewrites pass;
  ASSERT_TRUE(pass.run(rewritten));
  const std::string text = print(rewritten);
  EXPECT_TRUE(contains(text, "full() {dtype=f64, shape=[], value=6.0}"));
  EXPECT_TRUE(lacks(text, "where("));
  EXPECT_TRUE(lacks(text, "ne("));
  std::vector<Tensor> inputs = testing::random_inputs(g, 5, 0, 1);
  expect_same_after_rewrite(g, inputs, "cross-entropy-grad-decompose");
}

TEST(TrainingRewrites, NoRewriteCrossEntropyGradWithoutTheForwardLabelCheck) {
  // The fused op rejects a label outside [0, V); one_hot would silently give a zero row. Only
  // the forward cross_entropy of the same labels, kept in the graph, makes the rewrite safe.
  TrainingRewrites pass;
  testing::expect_unchanged(pass,
      "graph @g(%logits: f64[3,4] data, %labels: i64[3] data, %dloss: f64[] data) {\n"
      "  %0 = cross_entropy_grad(%logits, %labels, %dloss) : f64[3,4]\n"
      "  return %0\n"
      "}\n");
}

TEST(TrainingRewrites, NoRewriteInHalfPrecision) {
  // bf16: the fused ops round a double computation once; the decomposition would round at
  // every step (mixed precision keeps these fused).
  TrainingRewrites pass;
  testing::expect_unchanged(pass,
      "graph @g(%logits: bf16[3,4] data, %labels: i64[3] data, %dloss: bf16[] data,\n"
      "         %x: f16[2,4] data, %gamma: f16[4] data, %dy: f16[2,4] data) {\n"
      "  %0 = cross_entropy(%logits, %labels) : bf16[]\n"
      "  %1 = cross_entropy_grad(%logits, %labels, %dloss) : bf16[3,4]\n"
      "  %2, %3, %4 = layer_norm_grad(%x, %gamma, %dy) : f16[2,4], f16[4], f16[4]\n"
      "  return %0, %1, %2, %3, %4\n"
      "}\n");
}

Graph layer_norm_grad_graph(const Shape& shape, DType dtype = DType::kF64) {
  Builder b("ln");
  Expr x = b.data("x", shape, dtype);
  Expr gamma = b.data("gamma", {shape.back()}, dtype);
  Expr dy = b.data("dy", shape, dtype);
  std::vector<Expr> grads = layer_norm_grad(x, gamma, dy, 1e-5);
  return b.finish(grads);
}

TEST(TrainingRewrites, LayerNormGradBecomesRowMeansAndColumnSums) {
  Graph g = layer_norm_grad_graph({2, 3, 8});
  Graph rewritten = g;
  TrainingRewrites pass;
  ASSERT_TRUE(pass.run(rewritten));
  const std::string text = print(rewritten);
  EXPECT_TRUE(lacks(text, "layer_norm_grad("));
  EXPECT_TRUE(contains(text, "sum(%dy) {axes=[0, 1]} : f64[8]"));  // dbeta: column sums
  EXPECT_TRUE(contains(text, "rsqrt("));
  std::vector<Tensor> inputs = {random_tensor({DType::kF64, {2, 3, 8}}, 7, -2.0, 2.0),
                                random_tensor({DType::kF64, {8}}, 8, 0.5, 1.5),
                                random_tensor({DType::kF64, {2, 3, 8}}, 9, -1.0, 1.0)};
  expect_same_after_rewrite(g, inputs, "layer-norm-grad-decompose");
}

TEST(TrainingRewrites, LayerNormGradOfRankOneAndTwo) {
  for (const Shape& shape : {Shape{6}, Shape{4, 6}}) {
    SCOPED_TRACE(to_string(shape));
    Graph g = layer_norm_grad_graph(shape);
    std::vector<Tensor> inputs = testing::random_inputs(g, 13, 0, 1);
    expect_same_after_rewrite(g, inputs, "layer-norm-grad-decompose");
  }
}

TEST(TrainingRewrites, LayerNormGradInF32StaysClose) {
  Graph g = layer_norm_grad_graph({4, 16}, DType::kF32);
  std::vector<Tensor> inputs = testing::random_inputs(g, 17, 0, 1);
  std::vector<Tensor> before = testing::run_step(g, inputs);
  TrainingRewrites pass;
  ASSERT_TRUE(pass.run(g));
  EXPECT_TRUE(testing::relatively_close(testing::run_step(g, inputs), before, 1e-5));
}

}  // namespace
}  // namespace kiln

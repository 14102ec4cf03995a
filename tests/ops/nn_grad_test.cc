// Gradient rules of the NN ops (src/ops/nn.cc), each checked against float64 central
// differences of the reference kernels on small random inputs: matmul with every transpose flag
// and broadcast batch dims, softmax/log_softmax on several axes, the norms, cross_entropy with
// ignored rows and every reduction, causal and non-causal attention and attention_qkv (a loss on
// both outputs, out and lse, and on out alone, the usual case).
#include <map>

#include "gradcheck.h"
#include "ir/builder.h"
#include "passes/autodiff.h"
#include "passes/simplify/dead_code.h"

namespace kiln {
namespace {

using testing::expect_op_gradients;
using testing::GradCheckOptions;
using testing::make;
using Ints = std::vector<int64_t>;

Tensor rand64(Shape shape, uint64_t seed, double low = -1.0, double high = 1.0) {
  return testing::rand(DType::kF64, std::move(shape), seed, low, high);
}

// Runs the check for every combination of the transpose flags; shapes are given untransposed,
// a (..., M, K) and b (..., K, N), and stored transposed where the flag asks.
void check_matmul(Shape a_shape, Shape b_shape, uint64_t seed) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "transpose_a " << ta << ", transpose_b " << tb);
      Shape a = a_shape, b = b_shape;
      if (ta) std::swap(a[a.size() - 1], a[a.size() - 2]);
      if (tb) std::swap(b[b.size() - 1], b[b.size() - 2]);
      expect_op_gradients(Op::kMatmul, {rand64(a, seed), rand64(b, seed + 1)},
                          {{"transpose_a", ta}, {"transpose_b", tb}});
    }
}

TEST(NnGrad, Matmul2d) { check_matmul({3, 4}, {4, 2}, 1); }

TEST(NnGrad, MatmulBatched) { check_matmul({2, 3, 4}, {2, 4, 5}, 3); }

TEST(NnGrad, MatmulWeightSharedOverBatch) {
  // (B, T, C) @ (C, D): the weight's gradient sums over B and T.
  check_matmul({2, 3, 4}, {4, 2}, 5);
  check_matmul({2, 2, 3, 4}, {4, 2}, 7);
}

TEST(NnGrad, SharedWeightGradientIsOneMatmul) {
  // dw of x (B, T, C) @ w (C, D) is one (C, B*T) @ (B*T, D) matmul, not a batched matmul summed.
  Builder b("linear");
  Expr x = b.data("x", {2, 3, 4}, DType::kF64);
  Expr w = b.data("w", {4, 5}, DType::kF64);
  Graph g = b.finish({sum(matmul(x, w))});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[1].value});
  const Node* producer = nullptr;
  for (const Node& node : r.graph.nodes)
    for (ValueId out : node.outputs)
      if (out == r.gradients[0]) producer = &node;
  ASSERT_NE(producer, nullptr);
  EXPECT_EQ(producer->op, Op::kMatmul);
  EXPECT_EQ(r.graph.type(producer->inputs[0]).shape, (Shape{6, 4}));
}

TEST(NnGrad, MatmulBroadcastBatchDims) {
  check_matmul({3, 4}, {2, 4, 5}, 9);         // a broadcast over b's batch
  check_matmul({3, 1, 2, 4}, {2, 4, 3}, 11);  // batch (3, 1) x (2,) -> (3, 2)
  check_matmul({1, 2, 3}, {4, 3, 2}, 13);     // a's batch dim 1 stretched to 4
}

TEST(NnGrad, Softmax) {
  expect_op_gradients(Op::kSoftmax, {rand64({3, 5}, 20, -2, 2)});
  expect_op_gradients(Op::kSoftmax, {rand64({2, 4, 3}, 21, -2, 2)}, {{"axis", int64_t{1}}});
  expect_op_gradients(Op::kSoftmax, {rand64({4, 2}, 22, -2, 2)}, {{"axis", int64_t{0}}});
  expect_op_gradients(Op::kSoftmax, {rand64({6}, 23, -2, 2)});
}

TEST(NnGrad, LogSoftmax) {
  expect_op_gradients(Op::kLogSoftmax, {rand64({3, 5}, 24, -2, 2)});
  expect_op_gradients(Op::kLogSoftmax, {rand64({2, 4, 3}, 25, -2, 2)}, {{"axis", int64_t{-2}}});
  expect_op_gradients(Op::kLogSoftmax, {rand64({4, 2}, 26, -2, 2)}, {{"axis", int64_t{0}}});
}

TEST(NnGrad, LayerNorm) {
  expect_op_gradients(Op::kLayerNorm, {rand64({3, 5}, 30), rand64({5}, 31), rand64({5}, 32)});
  expect_op_gradients(Op::kLayerNorm, {rand64({2, 3, 4}, 33), rand64({4}, 34), rand64({4}, 35)},
                      {{"epsilon", 1e-3}});
  expect_op_gradients(Op::kLayerNorm, {rand64({6}, 36), rand64({6}, 37), rand64({6}, 38)});
}

TEST(NnGrad, RmsNorm) {
  expect_op_gradients(Op::kRmsNorm, {rand64({3, 5}, 40), rand64({5}, 41)});
  expect_op_gradients(Op::kRmsNorm, {rand64({2, 3, 4}, 42), rand64({4}, 43)}, {{"epsilon", 1e-2}});
  expect_op_gradients(Op::kRmsNorm, {rand64({7}, 44), rand64({7}, 45)});
}

TEST(NnGrad, CrossEntropyEveryReduction) {
  for (const char* reduction : {"mean", "sum", "none"}) {
    SCOPED_TRACE(reduction);
    expect_op_gradients(Op::kCrossEntropy,
                        {rand64({4, 5}, 50, -2, 2), make(DType::kI64, {4}, {0, 4, 2, 2})},
                        {{"reduction", std::string(reduction)}});
    expect_op_gradients(
        Op::kCrossEntropy,
        {rand64({2, 3, 4}, 51, -2, 2), make(DType::kI32, {2, 3}, {3, 0, 1, 1, 2, 3})},
        {{"reduction", std::string(reduction)}});
  }
}

TEST(NnGrad, CrossEntropyIgnoredRows) {
  for (const char* reduction : {"mean", "sum", "none"}) {
    SCOPED_TRACE(reduction);
    // Rows 1 and 3 ignored (default -100), so the mean divides by 2.
    expect_op_gradients(Op::kCrossEntropy,
                        {rand64({4, 3}, 52, -2, 2), make(DType::kI64, {4}, {2, -100, 0, -100})},
                        {{"reduction", std::string(reduction)}});
    // A custom ignore_index that is also a valid class.
    expect_op_gradients(Op::kCrossEntropy,
                        {rand64({3, 4}, 53, -2, 2), make(DType::kI64, {3}, {1, 3, 1})},
                        {{"reduction", std::string(reduction)}, {"ignore_index", int64_t{1}}});
    // Every row ignored: loss 0 whatever the logits, gradient 0.
    expect_op_gradients(Op::kCrossEntropy,
                        {rand64({2, 3}, 54, -2, 2), make(DType::kI64, {2}, {-100, -100})},
                        {{"reduction", std::string(reduction)}});
  }
}

TEST(NnGrad, AttentionNonCausal) {
  expect_op_gradients(Op::kAttention, {rand64({3, 4}, 60), rand64({3, 4}, 61), rand64({3, 4}, 62)});
  // Tq != Tk, Dv != D, batch and head dims.
  expect_op_gradients(Op::kAttention, {rand64({2, 2, 3, 4}, 63), rand64({2, 2, 5, 4}, 64),
                                       rand64({2, 2, 5, 2}, 65)});
  expect_op_gradients(Op::kAttention,
                      {rand64({2, 3, 2}, 66), rand64({2, 4, 2}, 67), rand64({2, 4, 3}, 68)},
                      {{"scale", 0.7}});
}

TEST(NnGrad, AttentionCausal) {
  expect_op_gradients(Op::kAttention, {rand64({4, 3}, 70), rand64({4, 3}, 71), rand64({4, 3}, 72)},
                      {{"causal", true}});
  expect_op_gradients(
      Op::kAttention,
      {rand64({2, 2, 4, 3}, 73), rand64({2, 2, 4, 3}, 74), rand64({2, 2, 4, 5}, 75)},
      {{"causal", true}, {"scale", 0.5}});
  // Fewer queries than keys: query i still sees keys 0..i (top-left aligned).
  expect_op_gradients(Op::kAttention, {rand64({2, 2}, 76), rand64({4, 2}, 77), rand64({4, 3}, 78)},
                      {{"causal", true}});
}

TEST(NnGrad, AttentionGroupedQuery) {
  // k and v with fewer heads than q: dk and dv sum over the query heads of their group.
  const Attributes bthd{{"causal", true}, {"layout", std::string("bthd")}};
  expect_op_gradients(Op::kAttention, {rand64({2, 5, 4, 3}, 100), rand64({2, 5, 2, 3}, 101),
                                       rand64({2, 5, 2, 2}, 102)}, bthd);
  expect_op_gradients(Op::kAttention, {rand64({4, 3, 2}, 103), rand64({4, 1, 2}, 104),
                                       rand64({4, 1, 3}, 105)}, bthd);  // one kv head
  expect_op_gradients(Op::kAttention, {rand64({2, 6, 3, 4}, 106), rand64({2, 2, 5, 4}, 107),
                                       rand64({2, 2, 5, 3}, 108)});  // "bhtd", 3 per group
}

TEST(NnGrad, AttentionKeyBias) {
  // A key_bias (B, Tk): its gradient (sum over heads and queries of dS, through a second
  // attention_grad over q and k with a column appended) and q's, k's, v's with it; a loss on out
  // and lse (expect_op_gradients weights both).
  expect_op_gradients(Op::kAttention, {rand64({2, 2, 3, 4}, 120), rand64({2, 2, 5, 4}, 121),
                                       rand64({2, 2, 5, 2}, 122), rand64({2, 5}, 123)});
  expect_op_gradients(Op::kAttention, {rand64({4, 3}, 124), rand64({4, 3}, 125), rand64({4, 3}, 126),
                                       rand64({4}, 127)},
                      {{"causal", true}, {"scale", 0.5}});  // no batch dims: (Tk)
  // "bthd", grouped-query, causal: the kv heads' columns are summed too.
  expect_op_gradients(Op::kAttention, {rand64({2, 5, 4, 3}, 128), rand64({2, 5, 2, 3}, 129),
                                       rand64({2, 5, 2, 2}, 130), rand64({2, 5}, 131)},
                      {{"causal", true}, {"layout", std::string("bthd")}});
  expect_op_gradients(Op::kAttention, {rand64({2, 6, 3, 4}, 132), rand64({2, 2, 5, 4}, 133),
                                       rand64({2, 2, 5, 3}, 134), rand64({2, 5}, 135)});  // "bhtd" GQA
}

TEST(NnGrad, AttentionQkvKeyBias) {
  expect_op_gradients(Op::kAttentionQkv, {rand64({2, 5, 3, 3, 2}, 136), rand64({2, 5}, 137)}, {{"causal", true}});
  expect_op_gradients(Op::kAttentionQkv, {rand64({4, 3, 2, 3}, 138), rand64({4}, 139)});
}

TEST(NnGrad, RotaryEmbedding) {
  // The rule is the inverse rotation; both layouts and directions, an odd D/2.
  expect_op_gradients(Op::kRotaryEmbedding, {rand64({2, 5, 6}, 110)});
  expect_op_gradients(Op::kRotaryEmbedding, {rand64({2, 4, 3, 8}, 111)},
                      {{"layout", std::string("bthd")}, {"base", 100.0}});
  expect_op_gradients(Op::kRotaryEmbedding, {rand64({3, 2, 4}, 112)},
                      {{"layout", std::string("bthd")}, {"inverse", true}});
}

// Gradcheck of a loss sum(attention(q, k, v)[0] * w) that ignores lse: the rule's usual path
// (one attention_grad fed the forward's out and lse).
void check_attention_out_only(Shape q, Shape k, Shape v, Attributes attrs, uint64_t seed) {
  Builder b("attention_out");
  Expr xq = b.data("q", q, DType::kF64), xk = b.data("k", k, DType::kF64);
  Expr xv = b.data("v", v, DType::kF64);
  std::vector<Expr> y = b.apply(Op::kAttention, {xq, xk, xv}, std::move(attrs));
  Expr w = b.data("w", y[0].shape(), DType::kF64);
  Graph g = b.finish({sum(y[0] * w)});
  Shape out_shape = q;
  out_shape.back() = v.back();
  testing::expect_graph_gradients(
      g, 0, {0, 1, 2},
      {rand64(q, seed), rand64(k, seed + 1), rand64(v, seed + 2), rand64(out_shape, seed + 3)});
}

// The same with a key_bias (B, Tk): the rule's usual path, one attention_grad taking the bias,
// and the bias's own gradient.
void check_attention_bias_out_only(Shape q, Shape k, Shape v, Shape bias, Attributes attrs, uint64_t seed) {
  Builder b("attention_bias_out");
  Expr xq = b.data("q", q, DType::kF64), xk = b.data("k", k, DType::kF64);
  Expr xv = b.data("v", v, DType::kF64), xb = b.data("bias", bias, DType::kF64);
  std::vector<Expr> y = b.apply(Op::kAttention, {xq, xk, xv, xb}, std::move(attrs));
  const Shape out_shape = y[0].shape();
  Expr w = b.data("w", out_shape, DType::kF64);
  Graph g = b.finish({sum(y[0] * w)});
  testing::expect_graph_gradients(g, 0, {0, 1, 2, 3},
                                  {rand64(q, seed), rand64(k, seed + 1), rand64(v, seed + 2),
                                   rand64(bias, seed + 3), rand64(out_shape, seed + 4)});
}

TEST(NnGrad, AttentionKeyBiasLossOnOutOnly) {
  check_attention_bias_out_only({2, 2, 3, 4}, {2, 2, 5, 4}, {2, 2, 5, 2}, {2, 5}, {}, 140);
  check_attention_bias_out_only({2, 4, 2, 3}, {2, 4, 1, 3}, {2, 4, 1, 3}, {2, 4},
                                {{"causal", true}, {"layout", std::string("bthd")}}, 145);
}

TEST(NnGrad, AttentionKeyBiasFromDataAddsNoBackwardWork) {
  // A mask from the data needs no gradient: the bias's attention_grad over D + 1 columns is
  // dead, and dead-code leaves one attention_grad, which takes the bias.
  Builder b("mask_from_data");
  Expr q = b.param("q", {2, 2, 3, 4}, DType::kF32);
  Expr mask = b.data("mask", {2, 3}, DType::kF32);
  std::vector<Expr> y = b.apply(Op::kAttention, {q, q, q, mask});
  Graph g = b.finish({sum(y[0])});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
  r.graph.outputs.push_back(r.gradients[0]);
  DeadCodeElimination().run(r.graph);
  int grads = 0;
  for (const Node& node : r.graph.nodes)
    if (node.op == Op::kAttentionGrad) {
      ++grads;
      EXPECT_EQ(node.inputs.size(), 7u);
      EXPECT_EQ(node.inputs[6], g.inputs[1].value);
    }
  EXPECT_EQ(grads, 1);
}

TEST(NnGrad, AttentionLossOnOutOnly) {
  check_attention_out_only({3, 4}, {3, 4}, {3, 4}, {}, 80);
  check_attention_out_only({2, 2, 3, 4}, {2, 2, 5, 4}, {2, 2, 5, 2}, {{"scale", 0.7}}, 84);
  check_attention_out_only({2, 4, 3}, {2, 4, 3}, {2, 4, 5}, {{"causal", true}}, 88);
  check_attention_out_only({2, 2}, {4, 2}, {4, 3}, {{"causal", true}, {"scale", 0.5}}, 92);
}

TEST(NnGrad, AttentionRuleWiresOutAndLse) {
  // The backward gets the forward node's own out and lse (inputs 3 and 5), not recomputed ones;
  // with no loss on lse there is no extra work (no concat).
  Builder b("wiring");
  Expr q = b.data("q", {2, 3, 4}, DType::kF64);
  std::vector<Expr> y = b.apply(Op::kAttention, {q, q, q}, {{"causal", true}});
  Graph g = b.finish({sum(y[0])});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
  const Node* forward = nullptr;
  const Node* backward = nullptr;
  int concats = 0;
  for (const Node& node : r.graph.nodes) {
    if (node.op == Op::kAttention) forward = &node;
    if (node.op == Op::kAttentionGrad) backward = &node;
    if (node.op == Op::kConcat) ++concats;
  }
  ASSERT_NE(forward, nullptr);
  ASSERT_NE(backward, nullptr);
  ASSERT_EQ(backward->inputs.size(), 6u);
  EXPECT_EQ(backward->inputs[3], forward->outputs[0]);
  EXPECT_EQ(backward->inputs[5], forward->outputs[1]);
  EXPECT_EQ(backward->attrs.b("causal"), true);
  EXPECT_EQ(concats, 0);
}

// attention_qkv: a loss on out and lse (the rule's unpacked path: split, attention_grad with the
// extra column, concat) and on out alone (one attention_qkv_grad).
TEST(NnGrad, AttentionQkvLossOnOutAndLse) {
  expect_op_gradients(Op::kAttentionQkv, {rand64({4, 3, 2, 3}, 100)});
  expect_op_gradients(Op::kAttentionQkv, {rand64({2, 5, 3, 3, 2}, 101)}, {{"causal", true}});
  expect_op_gradients(Op::kAttentionQkv, {rand64({2, 2, 3, 3, 1, 4}, 102)},
                      {{"causal", true}, {"scale", 0.6}});
}

void check_attention_qkv_out_only(Shape qkv, Attributes attrs, uint64_t seed) {
  Builder b("attention_qkv_out");
  Expr x = b.data("qkv", qkv, DType::kF64);
  std::vector<Expr> y = b.apply(Op::kAttentionQkv, {x}, std::move(attrs));
  const Shape out_shape = y[0].shape();
  Expr w = b.data("w", out_shape, DType::kF64);
  Graph g = b.finish({sum(y[0] * w)});
  testing::expect_graph_gradients(g, 0, {0}, {rand64(qkv, seed), rand64(out_shape, seed + 1)});
}

TEST(NnGrad, AttentionQkvLossOnOutOnly) {
  check_attention_qkv_out_only({4, 3, 2, 3}, {}, 110);
  check_attention_qkv_out_only({2, 5, 3, 3, 2}, {{"causal", true}}, 112);
  check_attention_qkv_out_only({2, 2, 3, 3, 1, 4}, {{"scale", 0.6}}, 114);
}

TEST(NnGrad, AttentionQkvRuleEmitsOnePackedGrad) {
  // Out only: one attention_qkv_grad fed the forward's out and lse, no split or concat. With a
  // loss on lse too: attention_grad on the split parts, concatenated (no attention_qkv_grad).
  for (bool use_lse : {false, true}) {
    SCOPED_TRACE(use_lse ? "out and lse" : "out only");
    Builder b("wiring");
    Expr qkv = b.data("qkv", {2, 4, 3, 2, 3}, DType::kF64);
    std::vector<Expr> y = attention_qkv(qkv, true);
    Graph g = b.finish({use_lse ? sum(y[0]) + sum(y[1]) : sum(y[0])});
    AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value});
    std::map<Op, int> counts;
    const Node* forward = nullptr;
    const Node* backward = nullptr;
    for (const Node& node : r.graph.nodes) {
      ++counts[node.op];
      if (node.op == Op::kAttentionQkv) forward = &node;
      if (node.op == Op::kAttentionQkvGrad) backward = &node;
    }
    ASSERT_NE(forward, nullptr);
    EXPECT_EQ(counts[Op::kAttentionQkvGrad], use_lse ? 0 : 1);
    EXPECT_EQ(counts[Op::kAttentionGrad], use_lse ? 1 : 0);
    if (use_lse) continue;
    EXPECT_EQ(counts[Op::kSplit], 0);
    EXPECT_EQ(counts[Op::kConcat], 0);
    ASSERT_NE(backward, nullptr);
    EXPECT_EQ(backward->inputs[0], forward->inputs[0]);
    EXPECT_EQ(backward->inputs[1], forward->outputs[0]);
    EXPECT_EQ(backward->inputs[3], forward->outputs[1]);
    EXPECT_EQ(backward->outputs[0], r.gradients[0]);
    EXPECT_TRUE(backward->attrs.b("causal"));
  }
}

TEST(NnGrad, RulesEmitTheBackwardOps) {
  // The rules of softmax, the norms, cross_entropy and attention emit one backward op each,
  // not a decomposition (fusion and kernel selection key on these ops).
  Builder b("rules");
  Expr x = b.data("x", {2, 4}, DType::kF64);
  Expr gamma = b.data("gamma", {4}, DType::kF64), beta = b.data("beta", {4}, DType::kF64);
  Expr labels = b.data("labels", {2}, DType::kI64);
  Expr h = layer_norm(x, gamma, beta);
  h = rms_norm(h, gamma);
  h = softmax(h) + log_softmax(h);
  Expr q = reshape(h, {2, 2, 2});
  h = reshape(attention(q, q, q, true), {2, 4});
  Graph g = b.finish({cross_entropy(h, labels)});
  AutodiffResult r = autodiff(g, g.outputs[0], {g.inputs[0].value, g.inputs[1].value});
  std::map<Op, int> counts;
  for (const Node& node : r.graph.nodes) ++counts[node.op];
  for (Op op : {Op::kLayerNormGrad, Op::kRmsNormGrad, Op::kSoftmaxGrad, Op::kLogSoftmaxGrad,
                Op::kAttentionGrad, Op::kCrossEntropyGrad})
    EXPECT_EQ(counts[op], 1) << op_name(op);
}

TEST(NnGrad, BackwardOpsAreNotDifferentiable) {
  for (Op op : {Op::kSoftmaxGrad, Op::kLogSoftmaxGrad, Op::kLayerNormGrad, Op::kRmsNormGrad,
                Op::kCrossEntropyGrad, Op::kAttentionGrad, Op::kAttentionQkvGrad})
    EXPECT_FALSE(op_def(op).differentiable) << op_name(op);
  for (Op op : {Op::kMatmul, Op::kSoftmax, Op::kLogSoftmax, Op::kLayerNorm, Op::kRmsNorm,
                Op::kCrossEntropy, Op::kAttention, Op::kAttentionQkv}) {
    EXPECT_TRUE(op_def(op).differentiable) << op_name(op);
    EXPECT_TRUE(static_cast<bool>(op_def(op).gradient)) << op_name(op);
  }
}

}  // namespace
}  // namespace kiln

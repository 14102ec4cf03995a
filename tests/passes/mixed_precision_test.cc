// The mixed-precision pass: IR text in, IR text out, for the default policy (matmul/attention
// low, statistics and the loss f32, the rest following its inputs), a policy override, cast
// reuse, outputs keeping their types, and the pass on the GPT model.
#include "passes/mixed_precision.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ir/text.h"
#include "ir/verifier.h"
#include "models/models.h"
#include "runtime/executor.h"
#include "test_util.h"

namespace kiln {
namespace {

// Parses `text`, runs the pass and returns the printed result; `changed` gets the pass's answer.
std::string rewrite(const std::string& text, MixedPrecisionOptions options = {},
                    bool* changed = nullptr) {
  Graph g = parse(text);
  bool c = MixedPrecisionPass(options).run(g);
  verify(g);
  if (changed) *changed = c;
  return print(g);
}

const char* kMlp =
    "graph @mlp(%x: f32[4,8] data, %w: f32[8,3] param, %b: f32[3] param, %labels: i64[4] data) {\n"
    "  %h = matmul(%x, %w) : f32[4,3]\n"
    "  %logits = add(%h, %b) : f32[4,3]\n"
    "  %loss = cross_entropy(%logits, %labels) : f32[]\n"
    "  return %loss, %logits\n"
    "}\n";

TEST(MixedPrecision, MatmulAndItsBiasRunLowLossStaysF32) {
  // The matmul's inputs (data and the f32 master weight) are cast down; its bf16 output plus the
  // 1-D bias is a linear layer's bias add, which runs low (the bias cast down, as under
  // torch.autocast); cross_entropy (f32 by policy) casts the logits back up, and the graph
  // output keeps its f32 type and its name.
  bool changed = false;
  EXPECT_EQ(rewrite(kMlp, {}, &changed),
            "graph @mlp(%x: f32[4,8] data, %w: f32[8,3] param, %b: f32[3] param, %labels: i64[4] "
            "data) {\n"
            "  %x.bf16 = cast(%x) {dtype=bf16} : bf16[4,8]\n"
            "  %w.bf16 = cast(%w) {dtype=bf16} : bf16[8,3]\n"
            "  %h = matmul(%x.bf16, %w.bf16) : bf16[4,3]\n"
            "  %b.bf16 = cast(%b) {dtype=bf16} : bf16[3]\n"
            "  %logits.bf16 = add(%h, %b.bf16) : bf16[4,3]\n"
            "  %logits = cast(%logits.bf16) {dtype=f32} : f32[4,3]\n"
            "  %loss = cross_entropy(%logits, %labels) : f32[]\n"
            "  return %loss, %logits\n"
            "}\n");
  EXPECT_TRUE(changed);
}

TEST(MixedPrecision, BiasAddStaysF32WhenThePolicySaysF32OrTheAddendIsNotABias) {
  // add set to kF32 by the user: the exception for a linear bias does not apply.
  MixedPrecisionOptions options;
  options.policy[Op::kAdd] = Precision::kF32;
  std::string out = rewrite(kMlp, options);
  EXPECT_NE(out.find("  %logits = add(%h.f32, %b) : f32[4,3]\n"), std::string::npos) << out;
  // A 2-D addend (a residual, not a bias) follows promotion: f32.
  const std::string residual =
      "graph @r(%x: f32[4,8] data, %w: f32[8,8] param) {\n"
      "  %h = matmul(%x, %w) : f32[4,8]\n"
      "  %y = add(%h, %x) : f32[4,8]\n"
      "  %loss = sum(%y) {axes=[0, 1]} : f32[]\n"
      "  return %loss\n"
      "}\n";
  out = rewrite(residual, {});
  EXPECT_NE(out.find("  %y = add(%h.f32, %x) : f32[4,8]\n"), std::string::npos) << out;
}

TEST(MixedPrecision, ConvolutionAndItsChannelBiasRunLow) {
  // A convolution's bias, one value per channel ((C, 1, 1), as kiln's cnn has it, or
  // (1, C, 1, 1), as the ONNX importer writes it), is added in bf16 as a linear layer's is: the
  // relu and the pool after it stay bf16 (torch.autocast adds it inside the convolution).
  for (const char* bias : {"f32[3,1,1]", "f32[1,3,1,1]"}) {
    const std::string conv = fmt::format(
        "graph @cnn(%x: f32[2,1,6,6] data, %w: f32[3,1,3,3] param, %b: {} param) {{\n"
        "  %y = conv2d(%x, %w) {{padding=[1, 1]}} : f32[2,3,6,6]\n"
        "  %z = add(%y, %b) : f32[2,3,6,6]\n"
        "  %r = relu(%z) : f32[2,3,6,6]\n"
        "  %p = max_pool2d(%r) {{kernel=[2, 2]}} : f32[2,3,3,3]\n"
        "  %loss = sum(%p) {{axes=[0, 1, 2, 3]}} : f32[]\n"
        "  return %loss\n"
        "}}\n",
        bias);
    const std::string out = rewrite(conv, {});
    EXPECT_NE(out.find("  %z = add(%y, %b.bf16) : bf16[2,3,6,6]\n"), std::string::npos) << out;
    EXPECT_NE(out.find("  %p = max_pool2d(%r) {kernel=[2, 2]} : bf16[2,3,3,3]\n"), std::string::npos)
        << out;
  }
  // Not a per-channel vector (one value per column): promotion, f32.
  const std::string columns =
      "graph @c(%x: f32[2,1,6,6] data, %w: f32[3,1,3,3] param, %b: f32[6,1] param) {\n"
      "  %y = conv2d(%x, %w) {padding=[1, 1]} : f32[2,3,6,6]\n"
      "  %z = add(%y, %b) : f32[2,3,6,6]\n"
      "  %loss = sum(%z) {axes=[0, 1, 2, 3]} : f32[]\n"
      "  return %loss\n"
      "}\n";
  const std::string out = rewrite(columns, {});
  EXPECT_NE(out.find("  %z = add(%y.f32, %b) : f32[2,3,6,6]\n"), std::string::npos) << out;
}

TEST(MixedPrecision, F16IsTheSameRewriteInF16) {
  MixedPrecisionOptions options;
  options.low = DType::kF16;
  std::string out = rewrite(kMlp, options);
  EXPECT_NE(out.find("  %w.f16 = cast(%w) {dtype=f16} : f16[8,3]\n"), std::string::npos) << out;
  EXPECT_NE(out.find("  %h = matmul(%x.f16, %w.f16) : f16[4,3]\n"), std::string::npos) << out;
}

TEST(MixedPrecision, PolicyOverrideMakesTheAddLow) {
  // add set to kLow: its f32 bias is cast down and the add runs in bf16; cross_entropy (kF32)
  // then casts the logits back up, and the graph output keeps its f32 type and its name.
  MixedPrecisionOptions options;
  options.policy[Op::kAdd] = Precision::kLow;
  EXPECT_EQ(rewrite(kMlp, options),
            "graph @mlp(%x: f32[4,8] data, %w: f32[8,3] param, %b: f32[3] param, %labels: i64[4] "
            "data) {\n"
            "  %x.bf16 = cast(%x) {dtype=bf16} : bf16[4,8]\n"
            "  %w.bf16 = cast(%w) {dtype=bf16} : bf16[8,3]\n"
            "  %h = matmul(%x.bf16, %w.bf16) : bf16[4,3]\n"
            "  %b.bf16 = cast(%b) {dtype=bf16} : bf16[3]\n"
            "  %logits.bf16 = add(%h, %b.bf16) : bf16[4,3]\n"
            "  %logits = cast(%logits.bf16) {dtype=f32} : f32[4,3]\n"
            "  %loss = cross_entropy(%logits, %labels) : f32[]\n"
            "  return %loss, %logits\n"
            "}\n");
}

TEST(MixedPrecision, NoChangeWhenThePolicyKeepsMatmulF32) {
  // Nothing else in this graph is low by default: with matmul kept f32 the pass has no work.
  MixedPrecisionOptions options;
  options.policy[Op::kMatmul] = Precision::kF32;
  bool changed = true;
  EXPECT_EQ(rewrite(kMlp, options, &changed), kMlp);
  EXPECT_FALSE(changed);
}

TEST(MixedPrecision, NoChangeWithoutLowPrecisionOps) {
  const char* text =
      "graph @linear(%w: f32[5] param, %x: f32[5] data) {\n"
      "  %0 = mul(%w, %x) : f32[5]\n"
      "  %loss = sum(%0) : f32[]\n"
      "  return %loss\n"
      "}\n";
  bool changed = true;
  EXPECT_EQ(rewrite(text, {}, &changed), text);
  EXPECT_FALSE(changed);
}

TEST(MixedPrecision, StatisticsAreCastUpAndCastsAreReused) {
  // A tied weight used by two matmuls is cast once. The first matmul's output feeds a softmax
  // (kF32: cast up) and, through relu (follows: stays bf16), the second matmul, which takes the
  // bf16 value itself (never a cast down of the cast up). mul promotes to f32.
  const char* text =
      "graph @tied(%x: f32[2,4] data, %w: f32[4,4] param) {\n"
      "  %s = matmul(%x, %w) : f32[2,4]\n"
      "  %p = softmax(%s) : f32[2,4]\n"
      "  %r = relu(%s) : f32[2,4]\n"
      "  %t = matmul(%r, %w) : f32[2,4]\n"
      "  %m = mul(%t, %p) : f32[2,4]\n"
      "  %loss = mean(%m) : f32[]\n"
      "  return %loss\n"
      "}\n";
  EXPECT_EQ(rewrite(text),
            "graph @tied(%x: f32[2,4] data, %w: f32[4,4] param) {\n"
            "  %x.bf16 = cast(%x) {dtype=bf16} : bf16[2,4]\n"
            "  %w.bf16 = cast(%w) {dtype=bf16} : bf16[4,4]\n"
            "  %s = matmul(%x.bf16, %w.bf16) : bf16[2,4]\n"
            "  %s.f32 = cast(%s) {dtype=f32} : f32[2,4]\n"
            "  %p = softmax(%s.f32) : f32[2,4]\n"
            "  %r = relu(%s) : bf16[2,4]\n"
            "  %t = matmul(%r, %w.bf16) : bf16[2,4]\n"
            "  %t.f32 = cast(%t) {dtype=f32} : f32[2,4]\n"
            "  %m = mul(%t.f32, %p) : f32[2,4]\n"
            "  %loss = mean(%m) : f32[]\n"
            "  return %loss\n"
            "}\n");
}

TEST(MixedPrecision, LowOutputIsCastBackForTheCaller) {
  // The graph returns the matmul result itself: the caller still gets f32 under the same name.
  const char* text =
      "graph @proj(%x: f32[2,3] data, %w: f32[3,2] param) {\n"
      "  %y = matmul(%x, %w) : f32[2,2]\n"
      "  return %y\n"
      "}\n";
  std::string out = rewrite(text);
  EXPECT_NE(out.find("  %y.bf16 = matmul(%x.bf16, %w.bf16) : bf16[2,2]\n"), std::string::npos)
      << out;
  EXPECT_NE(out.find("  %y = cast(%y.bf16) {dtype=f32} : f32[2,2]\n  return %y\n"),
            std::string::npos)
      << out;
}

TEST(MixedPrecision, AttentionRunsLowLayerNormStaysF32) {
  const char* text =
      "graph @attn(%x: f32[1,4,8] data, %g: f32[8] param, %b: f32[8] param) {\n"
      "  %h = layer_norm(%x, %g, %b) : f32[1,4,8]\n"
      "  %y, %lse = attention(%h, %h, %h) {causal=true} : f32[1,4,8], f32[1,4]\n"
      "  %z = layer_norm(%y, %g, %b) : f32[1,4,8]\n"
      "  %loss = sum(%z) : f32[]\n"
      "  return %loss\n"
      "}\n";
  EXPECT_EQ(rewrite(text),
            "graph @attn(%x: f32[1,4,8] data, %g: f32[8] param, %b: f32[8] param) {\n"
            "  %h = layer_norm(%x, %g, %b) : f32[1,4,8]\n"
            "  %h.bf16 = cast(%h) {dtype=bf16} : bf16[1,4,8]\n"
            // lse stays f32: the op's own statistic, not a low output (nothing to cast back).
            "  %y, %lse = attention(%h.bf16, %h.bf16, %h.bf16) {causal=true} : bf16[1,4,8], "
            "f32[1,4]\n"
            "  %y.f32 = cast(%y) {dtype=f32} : f32[1,4,8]\n"
            "  %z = layer_norm(%y.f32, %g, %b) : f32[1,4,8]\n"
            "  %loss = sum(%z) : f32[]\n"
            "  return %loss\n"
            "}\n");
}

TEST(MixedPrecision, RejectsANonHalfLowDtype) {
  MixedPrecisionOptions options;
  options.low = DType::kF32;
  try {
    MixedPrecisionPass pass(options);
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bf16 or f16, got f32"), std::string::npos) << e.what();
  }
}

TEST(MixedPrecision, GptUnderThePassManager) {
  // The whole GPT forward: verified after the pass by the pass manager; every matmul and
  // attention reads bf16, every layer_norm and the loss read f32, params keep f32, and the loss
  // stays close to the f32 model's (bf16 keeps 8 significant bits: ~0.4% per rounding).
  models::GptConfig c;  // batch 2, seq 16, vocab 64, 2 layers, d_model 32
  Graph f32_graph = models::gpt(c);
  Graph g = f32_graph;
  PassManager pm;
  pm.add(std::make_unique<MixedPrecisionPass>());
  std::vector<PassRecord> records = pm.run(g);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].name, "mixed-precision");
  EXPECT_TRUE(records[0].changed);
  int low_nodes = 0;
  for (const Node& n : g.nodes) {
    if (n.op == Op::kMatmul || n.op == Op::kAttention) {
      ++low_nodes;
      for (ValueId in : n.inputs) EXPECT_EQ(g.type(in).dtype, DType::kBF16) << op_name(n.op);
    }
    if (n.op == Op::kLayerNorm || n.op == Op::kCrossEntropy) {
      EXPECT_EQ(g.type(n.inputs[0]).dtype, DType::kF32) << op_name(n.op);
    }
  }
  EXPECT_EQ(low_nodes, 2 * 5 + 1);  // per layer: qkv, attention, proj, fc, fc2; the LM head
  for (const GraphInput& in : g.inputs) {
    if (in.role == Role::kParam) {
      EXPECT_EQ(g.type(in.value).dtype, DType::kF32);
    }
  }
  EXPECT_EQ(g.type(g.outputs[0]), (TensorType{DType::kF32, {}}));
  EXPECT_EQ(g.type(g.outputs[1]), (TensorType{DType::kF32, {2, 16, 64}}));
  EXPECT_EQ(g.value(g.outputs[1]).name, "logits");

  std::vector<Tensor> inputs = models::init_params(f32_graph, 3, c.layers);
  inputs.push_back(testing::rand(DType::kI64, {2, 16}, 4, 0, 64));
  inputs.push_back(testing::rand(DType::kI64, {2, 16}, 5, 0, 64));
  double f32_loss = Executor(f32_graph).run(inputs)[0].get(0);
  double bf16_loss = Executor(g).run(inputs)[0].get(0);
  EXPECT_NEAR(bf16_loss, f32_loss, 0.01 * f32_loss);
}

}  // namespace
}  // namespace kiln

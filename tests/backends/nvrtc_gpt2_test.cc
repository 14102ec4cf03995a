// How the nvrtc dialect binds GPT-2's fused nodes when the pipeline targets the GPU (the
// training graph as `kiln bench --device cuda` builds it): the epilogues kiln counts on are
// there and map onto ONE cuBLASLt call each (no product through memory): bias + GELU with the
// pre-activation kept (forward), DGELU (backward; its bias gradient stays a separate sum:
// DGELU_BGRAD measured 3x slower); and each LayerNorm gradient, with the residual-gradient add,
// its cast and the bias-gradient sum, runs as one generated rows kernel over the input gradient
// GEMM's product (dgamma, dbeta and the bias gradient its column sums). The reads phase of the
// partitioner (fusion::absorb_readers) makes these groups. The residual projections (attention
// proj and fc2: x + f32(y W + b) with a bf16 bias and an f32 residual stream) take the next
// LayerNorm: a product + one generated rows kernel each.
// Needs no GPU (binding decisions only). Only in builds with the CUDA backend.
#ifdef KILN_HAVE_CUDA

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "backends/cuda/nvrtc/nvrtc.h"
#include "models/models.h"
#include "passes/pipeline.h"
#include "compile/training_graph.h"

namespace kiln {
namespace {

std::string ops_of(const Graph& body) {
  std::string s;
  for (const Node& n : body.nodes) s += (s.empty() ? "" : " ") + std::string(op_name(n.op));
  return s;
}

TEST(NvrtcGpt2Test, GeluAndBiasGradientsRideOnCublasLtEpilogues) {
  OptimizerConfig config;
  config.amp = "bf16";
  Graph graph = build_training_graph(models::by_name("gpt2-tiny", 2), config).graph;
  PassOptions options;
  options.target = Device::kCuda;
  default_pipeline(options).run(graph);
  std::map<std::string, int> bodies;  // the ops of each fused body -> count
  for (const Node& node : graph.nodes) {
    if (node.op != Op::kFused || !node.body) continue;
    const std::string& kind = node.attrs.s("kind");
    ++bodies[kind + ": " + ops_of(*node.body)];
    const std::string ops = ops_of(*node.body);
    if (ops != "slice matmul add gelu" && ops != "slice matmul add" && ops != "matmul gelu_grad")
      continue;
    std::string why;
    EXPECT_TRUE(cuda::gemm_epilogue_supported(*node.body, &why))
        << ops << ": " << why;
  }
  std::string listing;
  for (const auto& [ops, count] : bodies) listing += fmt::format("  {} x{}\n", ops, count);
  SCOPED_TRACE("fused bodies:\n" + listing);
  // gpt2-tiny has 2 layers: one of each per layer. The fc and qkv products read their
  // LayerNorm's padded output through a prefix slice (passes/ones_column.h): still one call.
  EXPECT_EQ(bodies["gemm-epilogue: slice matmul add gelu"], 2);
  EXPECT_EQ(bodies["gemm-epilogue: slice matmul add"], 2);
  EXPECT_EQ(bodies["gemm-epilogue: matmul gelu_grad"], 2);
  EXPECT_EQ(bodies.count("gemm-epilogue: matmul gelu_grad sum"), 0u);
  EXPECT_EQ(bodies.count("elementwise: add"), 0u);
  // Three of gpt2-tiny's four block LayerNorms have a residual gradient to add (the first's
  // input gradient goes to the embeddings alone): each a product + one rows kernel.
  EXPECT_EQ(bodies["gemm-epilogue: matmul cast layer_norm_grad add cast sum"], 3);
  // Every block's norm gradient is in a product's kernel. The final norm's (under the LM head's
  // input gradient) may stand alone: fusion's unstretch step takes a group apart where that
  // lowers the planned arena by 1% or more, and at gpt2-tiny's sizes this one saves ~1.3%
  // (10 KiB); at GPT-2's it stays fused.
  int unfused_norm_grads = 0;
  for (const Node& node : graph.nodes) {
    unfused_norm_grads += node.op == Op::kLayerNormGrad && graph.value(node.inputs[1]).name != "lnf.weight";
    if (node.op != Op::kFused || !node.body) continue;
    if (ops_of(*node.body).find("layer_norm_grad") == std::string::npos) continue;
    std::string why;
    EXPECT_TRUE(cuda::gemm_split_supported(*node.body, &why)) << ops_of(*node.body) << ": " << why;
  }
  EXPECT_EQ(unfused_norm_grads, 0);
}

// The residual projections' bodies of `model`'s bf16 training graph on the GPU, and how each
// binds. Each is x + f32(y W + b) (bf16 product and bias, the f32 residual stream x) followed by
// the next LayerNorm: the reads phase puts the LayerNorm into the projection's group, since a
// 16-bit product with a wider addend goes through memory to a generated epilogue anyway
// (fusion::absorb_readers). So every one runs as a product + ONE generated rows kernel (residual
// add and LayerNorm: the sum is not read back), with mixed_bias_gemm too (its single cuBLASLt
// call, f32 D = y W + b + x, takes no LayerNorm).
void expect_residual_projections(const std::string& model, int64_t batch, int layers,
                                 bool mixed_bias) {
  SCOPED_TRACE(model + (mixed_bias ? ", mixed_bias_gemm" : ""));
  const bool was = cuda::mixed_bias_gemm();
  cuda::set_mixed_bias_gemm(mixed_bias);
  struct Restore {
    bool was;
    ~Restore() { cuda::set_mixed_bias_gemm(was); }
  } restore{was};
  OptimizerConfig config;
  config.amp = "bf16";
  Graph graph = build_training_graph(models::by_name(model, batch), config).graph;
  PassOptions options;
  options.target = Device::kCuda;
  default_pipeline(options).run(graph);
  int residual = 0, padded_norms = 0;
  for (const Node& node : graph.nodes) {
    if (node.op != Op::kFused || !node.body || node.attrs.s("kind") != "gemm-epilogue") continue;
    const Graph& body = *node.body;
    EXPECT_NE(ops_of(body), "matmul add cast add") << "a residual projection without its LayerNorm";
    // matmul (bf16), + bias (bf16), cast to f32, + the f32 residual stream, LayerNorm, cast;
    // padded with ones where a linear layer with a bias reads it (passes/ones_column.h).
    const bool padded = ops_of(body) == "matmul add cast add layer_norm cast full concat";
    if (ops_of(body) != "matmul add cast add layer_norm cast" && !padded) continue;
    padded_norms += padded;
    ASSERT_EQ(body.type(body.nodes[0].outputs[0]).dtype, DType::kBF16);
    ASSERT_EQ(body.outputs.size(), 2u);
    EXPECT_EQ(body.type(body.outputs[0]).dtype, DType::kF32);  // the residual stream
    ++residual;
    std::string why;
    EXPECT_FALSE(cuda::gemm_epilogue_supported(body, &why));
    EXPECT_TRUE(cuda::gemm_split_supported(body, &why)) << why;
    const std::string listing = cuda::fused_kernel_listing(body, FusedKind::kGemmEpilogue);
    EXPECT_NE(listing.find("runs as a cuBLASLt product into a scratch buffer"), std::string::npos)
        << listing;
    EXPECT_NE(listing.find("bf16->bf16"), std::string::npos) << listing;  // product 16-bit
    EXPECT_NE(listing.find("kiln fused kernel (rows)"), std::string::npos) << listing;
  }
  // proj and fc2 of every layer; all but the last (lnf, read by the classifier: no bias) padded.
  EXPECT_EQ(residual, 2 * layers);
  EXPECT_EQ(padded_norms, 2 * layers - 1);
}

TEST(NvrtcGpt2Test, ResidualProjectionsTakeTheNextLayerNorm) {
  for (bool mixed_bias : {true, false}) {
    expect_residual_projections("gpt2-tiny", 2, 2, mixed_bias);
    expect_residual_projections("gpt2", 1, 12, mixed_bias);
  }
}

}  // namespace
}  // namespace kiln

#endif  // KILN_HAVE_CUDA

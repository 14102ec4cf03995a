// The LLaMA family of the model zoo (src/models/llama.cc, zoo.cc): the graph's params and
// shapes (torch_llama.py's layout, its parameter counts), no transposes (rotary embeddings and
// attention take (B, T, heads, D)), grouped-query attention's head counts, size overrides and
// their errors, and what fusion makes of a block when the pipeline targets the GPU: the
// residual add and RMSNorm in one rows kernel (as GPT-2's residual add and LayerNorm), SwiGLU's
// silu and product in the epilogues of the GEMMs that feed them. (Against PyTorch: tests/train/llama_reference_test.cc.)
#include <map>
#include <string>

#include "compile/training_graph.h"
#include "ir/verifier.h"
#include "models/models.h"
#include "passes/pipeline.h"
#include "test_util.h"

namespace kiln {
namespace {

int64_t param_count(const Graph& g) {
  int64_t n = 0;
  for (const GraphInput& in : g.inputs)
    if (in.role == Role::kParam) n += g.type(in.value).numel();
  return n;
}

int64_t count_ops(const Graph& g, Op op) {
  int64_t n = 0;
  for (const Node& node : g.nodes) n += node.op == op;
  return n;
}

TEST(LlamaModel, GraphHasTorchLlamasParamsAndNoTransposes) {
  const models::LlamaConfig c = models::llama_config("llama-tiny");
  const Graph g = models::llama(c);
  verify(g);
  std::map<std::string, Shape> params;
  for (const GraphInput& in : g.inputs)
    if (in.role == Role::kParam) params[g.value(in.value).name] = g.type(in.value).shape;
  const int64_t C = c.d_model, D = C / c.heads;
  EXPECT_EQ(params.at("emb.weight"), (Shape{c.vocab, C}));
  EXPECT_EQ(params.at("h1.k.weight"), (Shape{C, c.kv_heads * D}));
  EXPECT_EQ(params.at("h0.w2.weight"), (Shape{c.hidden, C}));
  EXPECT_EQ(params.at("head.weight"), (Shape{C, c.vocab}));
  EXPECT_EQ(params.at("norm.weight"), (Shape{C}));
  EXPECT_EQ(params.size(), 3u + 9u * static_cast<size_t>(c.layers));  // no biases
  EXPECT_EQ(count_ops(g, Op::kTranspose), 0);
  EXPECT_EQ(count_ops(g, Op::kRotaryEmbedding), 2 * c.layers);
  EXPECT_EQ(count_ops(g, Op::kRmsNorm), 2 * c.layers + 1);
  for (const Node& n : g.nodes) {
    if (n.op != Op::kAttention) continue;
    EXPECT_EQ(n.attrs.s("layout"), "bthd");
    EXPECT_TRUE(n.attrs.b("causal"));
    EXPECT_EQ(g.type(n.inputs[1]).shape, (Shape{c.batch, c.seq, c.kv_heads, D}));
  }
}

TEST(LlamaModel, ParamCountsAreTorchLlamas) {
  // torch_llama.py: 12 x (2 d + 2 d^2 + 2 d kv hd + 3 d ffn) + 2 V d + d.
  auto expected = [](int64_t L, int64_t d, int64_t h, int64_t kv, int64_t ffn, int64_t V) {
    const int64_t hd = d / h;
    return L * (2 * d + 2 * d * d + 2 * d * kv * hd + 3 * d * ffn) + 2 * V * d + d;
  };
  EXPECT_EQ(param_count(models::by_name("llama-160m", 1, 16)), expected(12, 768, 12, 4, 2048, 32000));
  EXPECT_EQ(param_count(models::by_name("llama-1b", 1, 16)), expected(16, 2048, 32, 8, 8192, 32000));
  // Llama 3 8B's published count.
  EXPECT_EQ(param_count(models::by_name("llama-8b", 1, 16)), 8030261248);
  EXPECT_EQ(models::llama_config("llama-8b").rope_base, 500000.0);
  models::ModelSizes two;
  two.layers = 2;
  EXPECT_EQ(param_count(models::by_name("llama-8b", 1, two)), expected(2, 4096, 32, 8, 14336, 128256));
}

TEST(LlamaModel, SizesOverrideTheConfigAndBadOnesAreClearErrors) {
  models::ModelSizes sizes;
  sizes.layers = 1;
  sizes.d_model = 48;
  sizes.heads = 6;
  sizes.kv_heads = 3;
  sizes.hidden = 40;
  sizes.vocab = 100;
  sizes.seq = 12;
  const Graph g = models::by_name("llama-tiny", 3, sizes);
  EXPECT_EQ(param_count(g), 1 * (2 * 48 + 2 * 48 * 48 + 2 * 48 * 24 + 3 * 48 * 40) + 2 * 100 * 48 + 48);
  EXPECT_EQ(g.type(g.inputs.back().value).shape, (Shape{3, 12}));
  const models::LanguageModelInfo info = models::language_model_info("llama-tiny", sizes);
  EXPECT_EQ(info.vocab, 100);
  EXPECT_EQ(info.layers, 1);
  EXPECT_TRUE(models::is_language_model("llama-1b"));
  EXPECT_FALSE(models::is_language_model("mlp"));
  sizes.kv_heads = 4;
  EXPECT_KILN_ERROR(models::by_name("llama-tiny", 3, sizes), "heads 6", "kv_heads 4");
  models::ModelSizes gpt;
  gpt.kv_heads = 2;
  EXPECT_KILN_ERROR(models::by_name("gpt2-tiny", 2, gpt), "gpt2-tiny has no kv_heads");
  models::ModelSizes rope;
  rope.rope_base = 500000;
  rope.norm_epsilon = 1e-6;
  const models::LlamaConfig c = models::llama_config("llama-tiny", rope);
  EXPECT_EQ(c.rope_base, 500000);
  EXPECT_EQ(c.norm_epsilon, 1e-6);
  EXPECT_EQ(c.d_model, models::llama_config("llama-tiny").d_model);
  EXPECT_KILN_ERROR(models::by_name("gpt2-tiny", 2, rope), "gpt2-tiny has no rotary base");
  rope.rope_base = -1;
  EXPECT_KILN_ERROR(models::by_name("llama-tiny", 2, rope), "rope_theta must be > 0");
  models::ModelSizes mlp;
  mlp.layers = 3;
  EXPECT_KILN_ERROR(models::by_name("mlp", 2, mlp), "mlp takes no size flags");
  EXPECT_KILN_ERROR(models::language_model_info("cnn"), "not a language model");
}

TEST(LlamaModel, InitGivesNormGainsOneAndScaledResidualProjections) {
  const Graph g = models::by_name("llama-tiny", 2, 16);
  const std::vector<Tensor> init = models::init_language_model(g, "llama-tiny", 3);
  size_t p = 0;
  for (const GraphInput& in : g.inputs) {
    if (in.role != Role::kParam) continue;
    const std::string& name = g.value(in.value).name;
    const Tensor& t = init.at(p++);
    double sum_sq = 0;
    for (int64_t i = 0; i < t.numel(); ++i) sum_sq += t.get(i) * t.get(i);
    const double rms = std::sqrt(sum_sq / static_cast<double>(t.numel()));
    if (t.rank() == 1) EXPECT_EQ(rms, 1.0) << name;  // RMSNorm gains
    else if (name.ends_with(".o.weight") || name.ends_with(".w2.weight"))
      EXPECT_NEAR(rms, 0.02 / 2.0, 0.003) << name;  // 0.02 / sqrt(2 * 2 layers)
    else
      EXPECT_NEAR(rms, 0.02, 0.003) << name;
  }
}

// The training step under bf16 as `kiln bench --device cuda` builds it, through the pipeline
// for the GPU (binding no kernel: no GPU needed).
TEST(LlamaModel, FusionJoinsResidualAddsWithRmsNormAndSwiGlu) {
  OptimizerConfig config;
  config.amp = "bf16";
  Graph graph = build_training_graph(models::by_name("llama-tiny", 2, 32), config).graph;
  PassOptions options;
  options.target = Device::kCuda;
  default_pipeline(options).run(graph);
  int64_t add_norm = 0, silu_bodies = 0, outside = 0;
  for (const Node& node : graph.nodes) {
    // RMSNorm and SwiGLU's elementwise ops never run as kernels of their own.
    outside += node.op == Op::kRmsNorm || node.op == Op::kSilu || node.op == Op::kMul ||
               node.op == Op::kSigmoid;
    if (node.op != Op::kFused || !node.body) continue;
    add_norm += count_ops(*node.body, Op::kRmsNorm) > 0 && count_ops(*node.body, Op::kAdd) > 0;
    silu_bodies += count_ops(*node.body, Op::kSilu) > 0;
  }
  // Each block's two residual adds join the RMSNorm that reads them (the last one the final
  // norm's): 2 per layer.
  EXPECT_EQ(add_norm, 4);
  EXPECT_EQ(outside, 0);
  // silu(h W1) in a forward GEMM's epilogue, and again in the backward's (the recompute pass:
  // silu(h W1) is not kept from the forward): two per layer.
  EXPECT_EQ(silu_bodies, 4);
}

}  // namespace
}  // namespace kiln

// LLaMA weights to and from Hugging Face transformers (train/checkpoint/hf_llama.h): kiln's
// llama with random weights, exported, loads in transformers' LlamaForCausalLM and gives kiln's
// logits; a LlamaForCausalLM with random weights, imported, gives its logits in kiln. The
// transformers side is tests/train/hf_llama_check.py, run by the first interpreter that has
// torch, transformers and safetensors (/opt/kiln-venv/bin/python3, then python3); the test skips,
// saying so, without one. Logits within 1e-4 (float32 sums in other orders).
#include "train/checkpoint/hf_llama.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>

#include "models/models.h"
#include "test_util.h"
#include "train/checkpoint/safetensors.h"
#include "train/temp_dir.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

std::optional<std::string> python_with_transformers() {
  for (const char* python : {"/opt/kiln-venv/bin/python3", "python3"}) {
    const std::string probe =
        fmt::format("{} -c 'import torch, transformers, safetensors' >/dev/null 2>&1", python);
    if (std::system(probe.c_str()) == 0) return std::string(python);
  }
  return std::nullopt;
}

void run_check(const std::string& python, const std::string& mode, const std::string& dir, const std::string& idx,
               const std::string& out, const std::string& extra = "") {
  const std::string command = fmt::format("{} {}/tests/train/hf_llama_check.py {} {} {} {} {} 2>&1", python,
                                          KILN_SOURCE_DIR, mode, dir, idx, out, extra);
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
}

// kiln's logits (B, T, V) of `config`'s llama with `params` (by name) on token ids `idx`.
Tensor kiln_logits(models::LlamaConfig config, const std::map<std::string, Tensor>& params, const Tensor& idx) {
  config.batch = idx.shape()[0];
  config.seq = idx.shape()[1];
  const Graph g = models::llama(config);
  std::vector<Tensor> ordered;
  for (const GraphInput& in : g.inputs)
    if (in.role == Role::kParam) ordered.push_back(params.at(g.value(in.value).name));
  Trainer trainer(g, OptimizerConfig{}, ordered);
  return trainer.evaluate({idx, idx})[1];
}

Tensor token_ids(int64_t vocab, uint64_t seed) {
  return random_tensor(TensorType{DType::kI64, {2, 16}}, seed, 0.0, static_cast<double>(vocab));
}

class HfLlama : public ::testing::Test {
 protected:
  void SetUp() override {
    python_ = python_with_transformers();
    if (!python_) GTEST_SKIP() << "no Python with torch, transformers and safetensors (tried /opt/kiln-venv/bin/python3, python3)";
  }
  std::optional<std::string> python_;
  testing::TempDir dir_;
};

// llama-tiny, and llama-tiny with llama-8b's (Llama 3's) rotary base and another norm epsilon:
// transformers reads both from the exported config.json.
class HfLlamaExport : public HfLlama, public ::testing::WithParamInterface<bool> {};

TEST_P(HfLlamaExport, ExportedModelGivesKilnsLogitsInTransformers) {
  models::LlamaConfig config = models::llama_config("llama-tiny");
  config.seq = 16;
  if (GetParam()) {
    config.rope_base = models::llama_config("llama-8b").rope_base;
    config.norm_epsilon = 1e-6;
  }
  const Graph g = models::llama(config);
  // Random weights, norm gains too (init_params makes them 1).
  LlamaWeights weights{config, {}};
  uint64_t seed = 100;
  for (const GraphInput& in : g.inputs) {
    if (in.role != Role::kParam) continue;
    const Value& v = g.value(in.value);
    const bool gain = v.type.rank() == 1;
    weights.params[v.name] = random_tensor(v.type, ++seed, gain ? 0.5 : -0.2, gain ? 1.5 : 0.2);
  }
  const Tensor idx = token_ids(config.vocab, 7);
  const std::string model_dir = dir_.file("exported");
  export_hf_llama(weights, model_dir);
  save_safetensors(dir_.file("idx.safetensors"), {{"idx", idx}});
  run_check(*python_, "logits", model_dir, dir_.file("idx.safetensors"), dir_.file("logits.safetensors"));
  const Tensor theirs = load_safetensors(dir_.file("logits.safetensors")).tensors.at("logits");
  const Tensor ours = kiln_logits(config, weights.params, idx);
  ASSERT_EQ(theirs.shape(), ours.shape());
  EXPECT_LE(max_scaled_error(ours, theirs, 1e-4, 1e-4), 1.0);
  // The files import back to the same weights, bit for bit.
  const LlamaWeights back = import_hf_llama(model_dir);
  EXPECT_EQ(back.config.heads, config.heads);
  EXPECT_EQ(back.config.kv_heads, config.kv_heads);
  EXPECT_EQ(back.config.rope_base, config.rope_base);
  EXPECT_EQ(back.config.norm_epsilon, config.norm_epsilon);
  for (const auto& [name, tensor] : weights.params)
    EXPECT_EQ(max_scaled_error(back.params.at(name), tensor, 0, 0), 0.0) << name;
}
INSTANTIATE_TEST_SUITE_P(RopeBase, HfLlamaExport, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Llama3" : "Default"; });

// A LlamaForCausalLM made by transformers with the default rotary base and norm epsilon, and
// with Llama 3's base and another epsilon: kiln reads both from its config.json.
class HfLlamaImport : public HfLlama, public ::testing::WithParamInterface<bool> {};

TEST_P(HfLlamaImport, ImportedModelGivesTransformersLogitsInKiln) {
  const std::string model_dir = dir_.file("made");
  const Tensor idx = token_ids(96, 8);  // the script's vocab
  save_safetensors(dir_.file("idx.safetensors"), {{"idx", idx}});
  const double rope_base = GetParam() ? 500000.0 : 10000.0, norm_epsilon = GetParam() ? 1e-6 : 1e-5;
  run_check(*python_, "make", model_dir, dir_.file("idx.safetensors"), dir_.file("logits.safetensors"),
            fmt::format("{} {}", rope_base, norm_epsilon));
  const LlamaWeights weights = import_hf_llama(model_dir);
  EXPECT_EQ(weights.config.heads, 6);
  EXPECT_EQ(weights.config.kv_heads, 2);
  EXPECT_EQ(weights.config.layers, 2);
  EXPECT_EQ(weights.config.rope_base, rope_base);
  EXPECT_EQ(weights.config.norm_epsilon, norm_epsilon);
  const Tensor theirs = load_safetensors(dir_.file("logits.safetensors")).tensors.at("logits");
  const Tensor ours = kiln_logits(weights.config, weights.params, idx);
  ASSERT_EQ(theirs.shape(), ours.shape());
  EXPECT_LE(max_scaled_error(ours, theirs, 1e-4, 1e-4), 1.0);
}
INSTANTIATE_TEST_SUITE_P(RopeBase, HfLlamaImport, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Llama3" : "Default"; });

TEST(HfLlamaConfig, RoundTripsAndRefusesWhatKilnsLlamaDoesNotCompute) {
  models::LlamaConfig c = models::llama_config("llama-1b");
  const models::LlamaConfig back = llama_config_from_hf_json(hf_llama_config_json(c), "x");
  EXPECT_EQ(back.vocab, c.vocab);
  EXPECT_EQ(back.d_model, c.d_model);
  EXPECT_EQ(back.hidden, c.hidden);
  EXPECT_EQ(back.layers, c.layers);
  EXPECT_EQ(back.heads, c.heads);
  EXPECT_EQ(back.kv_heads, c.kv_heads);
  EXPECT_EQ(back.seq, c.seq);
  EXPECT_EQ(back.rope_base, c.rope_base);
  EXPECT_EQ(back.norm_epsilon, c.norm_epsilon);
  const std::string base = R"("vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2)";
  EXPECT_KILN_ERROR(llama_config_from_hf_json("{" + base + R"(, "tie_word_embeddings": true})", "c.json"),
                    "c.json: tie_word_embeddings is true");
  EXPECT_KILN_ERROR(llama_config_from_hf_json("{" + base + R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8}})", "c.json"),
                    "rope type 'llama3'");
  EXPECT_KILN_ERROR(llama_config_from_hf_json("{" + base + R"(, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})", "c.json"),
                    "rope type 'yarn'");
  EXPECT_KILN_ERROR(llama_config_from_hf_json("{" + base + R"(, "rope_scaling": {"type": "linear", "factor": 2}})", "c.json"),
                    "rope type 'linear'");
  EXPECT_KILN_ERROR(llama_config_from_hf_json("{" + base + R"(, "model_type": "mistral"})", "c.json"),
                    "model_type is \"mistral\", expected \"llama\"");
  EXPECT_KILN_ERROR(llama_config_from_hf_json(R"({"vocab_size": 8})", "c.json"), "'hidden_size' must be a positive integer");
}

TEST(HfLlamaNames, MissingOrMisshapenTensorsAreNamed) {
  models::LlamaConfig c = models::llama_config("llama-tiny");
  std::map<std::string, Tensor> params;
  EXPECT_KILN_ERROR(to_hf_llama(c, params), "kiln's llama weights have no 'emb.weight'");
  params["emb.weight"] = Tensor(TensorType{DType::kF32, {3, 3}});
  EXPECT_KILN_ERROR(to_hf_llama(c, params), "'emb.weight' is f32[3,3], expected a float tensor of shape [256,64]");
}

}  // namespace
}  // namespace kiln::train

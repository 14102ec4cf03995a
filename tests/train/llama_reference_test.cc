// kiln's llama-tiny against PyTorch: the logits, the loss, every gradient and the losses of 10
// AdamW steps. tests/reference/llama_tiny_reference.py computes them in PyTorch (float32, CPU)
// from kiln's initial weights (init_params seed 1234) and one random batch, which this test
// writes to a temporary file; the script runs under the first interpreter that has torch
// (/usr/bin/python3, Debian's python3-torch, then python3 on PATH), and the test skips, saying
// so, when none has it. Tolerances as tests/train/gpt2_reference_test.cc's (float32 sums in
// different orders): logits and loss atol 1e-5, rtol 1e-4; gradients atol 1e-5 times the
// tensor's largest |gradient|, rtol 1e-4; AdamW step losses atol 1e-5, rtol 2e-5.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include "models/models.h"
#include "passes/autodiff.h"
#include "runtime/executor.h"
#include "test_util.h"
#include "train/checkpoint/safetensors.h"
#include "train/trainer.h"

namespace kiln {
namespace {

constexpr int kAdamwSteps = 10;
constexpr uint64_t kParamSeed = 1234;

// The first of /usr/bin/python3 and python3 that imports torch.
std::optional<std::string> python_with_torch() {
  for (const char* python : {"/usr/bin/python3", "python3"}) {
    const std::string probe = fmt::format("{} -c 'import torch' >/dev/null 2>&1", python);
    if (std::system(probe.c_str()) == 0) return std::string(python);
  }
  return std::nullopt;
}

struct Reference {
  Graph forward;
  std::map<std::string, Tensor> inputs;  // params and data by graph-input name
  train::SafetensorsFile torch;          // what the script computed
};

// Builds llama-tiny, writes its inputs, runs the PyTorch script; nullopt (and why) without torch.
std::optional<Reference> make_reference(std::string* why) {
  const std::optional<std::string> python = python_with_torch();
  if (!python) {
    *why = "no Python with PyTorch (tried /usr/bin/python3 and python3; on Debian: apt-get install "
           "python3-torch)";
    return std::nullopt;
  }
  const models::LlamaConfig config = models::llama_config("llama-tiny");
  Reference r{models::llama(config), {}, {}};
  const std::vector<Tensor> params = models::init_params(r.forward, kParamSeed, config.layers);
  size_t p = 0;
  for (const GraphInput& in : r.forward.inputs) {
    const Value& v = r.forward.value(in.value);
    r.inputs[v.name] = in.role == Role::kParam
                           ? params[p++]
                           : testing::rand(DType::kI64, v.type.shape, 7 + r.inputs.size(), 0,
                                           static_cast<double>(config.vocab));
  }
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("kiln_llama_reference_{}", getpid());
  std::filesystem::create_directories(dir);
  const std::string in_path = (dir / "inputs.safetensors").string();
  const std::string out_path = (dir / "torch.safetensors").string();
  train::save_safetensors(in_path, r.inputs,
                          {{"layers", std::to_string(config.layers)},
                           {"heads", std::to_string(config.heads)},
                           {"kv_heads", std::to_string(config.kv_heads)}});
  const std::string command =
      fmt::format("{} {}/tests/reference/llama_tiny_reference.py {} {}", *python, KILN_SOURCE_DIR,
                  in_path, out_path);
  const int status = std::system(command.c_str());
  if (status == 0) r.torch = train::load_safetensors(out_path);
  std::filesystem::remove_all(dir);
  KILN_CHECK(status == 0, "the PyTorch reference failed (status {}): {}", status, command);
  return r;
}

// Built once for the three tests (the script takes a few seconds, mostly importing torch).
const Reference* reference(std::string* why) {
  static std::string skip_reason;
  static const std::optional<Reference> r = make_reference(&skip_reason);
  *why = skip_reason;
  return r ? &*r : nullptr;
}

const Tensor& torch_tensor(const Reference& r, const std::string& name) {
  auto it = r.torch.tensors.find(name);
  KILN_CHECK(it != r.torch.tensors.end(), "the llama-tiny reference has no tensor '{}'", name);
  return it->second;
}

std::vector<Tensor> inputs_of(const Reference& r, const Graph& graph, std::optional<Role> role = {}) {
  std::vector<Tensor> out;
  for (const GraphInput& in : graph.inputs)
    if (!role || in.role == *role) out.push_back(r.inputs.at(graph.value(in.value).name).clone());
  return out;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.get(i)));
  return m;
}

#define KILN_REFERENCE_OR_SKIP(r)               \
  std::string why;                              \
  const Reference* r = reference(&why);         \
  if (!r) GTEST_SKIP() << why;

TEST(LlamaReference, LogitsAndLossMatchPyTorch) {
  KILN_REFERENCE_OR_SKIP(r);
  std::vector<Tensor> out = Executor(r->forward).run(inputs_of(*r, r->forward));
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(testing::all_close(out[0], torch_tensor(*r, "loss"), 1e-5, 1e-4));
  EXPECT_TRUE(testing::all_close(out[1], torch_tensor(*r, "logits"), 1e-5, 1e-4));
  // An untrained model over 256 tokens has a loss near ln(256).
  EXPECT_NEAR(torch_tensor(*r, "loss").get(0), std::log(256.0), 0.1);
}

TEST(LlamaReference, EveryGradientMatchesPyTorch) {
  KILN_REFERENCE_OR_SKIP(r);
  std::vector<ValueId> params;
  for (const GraphInput& in : r->forward.inputs)
    if (in.role == Role::kParam) params.push_back(in.value);
  AutodiffResult ad = autodiff(r->forward, r->forward.outputs[0], params);
  ad.graph.outputs = ad.gradients;
  std::vector<Tensor> grads = Executor(ad.graph).run(inputs_of(*r, ad.graph));
  ASSERT_EQ(grads.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = r->forward.value(params[i]).name;
    const Tensor& expected = torch_tensor(*r, "grad." + name);
    EXPECT_GT(max_abs(expected), 0.0) << name;
    EXPECT_TRUE(testing::all_close(grads[i], expected, 1e-5 * max_abs(expected), 1e-4))
        << "grad." << name << " (largest |gradient| " << max_abs(expected) << ")";
  }
}

TEST(LlamaReference, AdamwStepLossesMatchPyTorch) {
  KILN_REFERENCE_OR_SKIP(r);
  OptimizerConfig config;
  config.name = "adamw";
  config.lr = 1e-3;
  config.hyper["beta1"] = 0.9;
  config.hyper["beta2"] = 0.999;
  config.hyper["epsilon"] = 1e-8;
  config.hyper["weight_decay"] = 0.0;
  train::Trainer trainer(r->forward, config, inputs_of(*r, r->forward, Role::kParam));
  const std::vector<Tensor> batch = inputs_of(*r, r->forward, Role::kData);  // every step
  const Tensor& expected = torch_tensor(*r, "adamw_losses");
  ASSERT_EQ(expected.numel(), kAdamwSteps);
  for (int s = 0; s < kAdamwSteps; ++s) {
    const double loss = trainer.step(batch)[0].get(0), want = expected.get(s);
    EXPECT_NEAR(loss, want, 1e-5 + 2e-5 * std::abs(want)) << "step " << s;
  }
  EXPECT_LT(expected.get(kAdamwSteps - 1), expected.get(0) - 0.01);
}

}  // namespace
}  // namespace kiln

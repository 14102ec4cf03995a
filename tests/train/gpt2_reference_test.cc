// kiln's gpt2-tiny against PyTorch: the logits, the loss, every gradient and the losses of 10
// AdamW steps, compared with tests/reference/gpt2_tiny_reference.safetensors, which
// tests/reference/make_gpt2_tiny_reference.py computed in PyTorch (float32, CPU) from kiln's
// initial weights (init_params seed 1234) and one fixed batch (the file holds those inputs too).
//
// Tolerances are float32 ones: the two sides sum in different orders (and kiln's fast kernels
// use other algorithms than PyTorch's), so results agree to a few f32 ulps, not bitwise.
//   logits, loss      atol 1e-5, rtol 1e-4 (seen: 3.6e-7 on logits up to 1.1, 4.8e-7 on the loss)
//   gradients         per tensor, scaled by its largest |gradient| g, since their sizes range
//                     over orders of magnitude (a key bias's gradient is zero up to rounding):
//                     atol 1e-5 * g, rtol 1e-4 (seen: at most 6.1e-7 * g)
//   AdamW losses      atol 1e-5, rtol 2e-5, i.e. ~1e-4 at loss 5 (seen: at most 4.8e-7, one ulp)
// so every check has at least 15x room for kernel changes. What they catch (measured by editing
// the PyTorch model): at these small initial weights a dropped causal mask, an attention scale of
// 1/D or a layer-norm epsilon of 1e-6 moves logits by 3e-3 or more and step losses by 5e-4 or
// more; the subtlest, erf-GELU for tanh-GELU, moves logits by only 1.3e-5 and step losses by
// 4e-6, but gradients by up to 5.6e-5 * g, 3.7x past the gradient tolerance.
#include <algorithm>
#include <cmath>
#include <map>
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

const train::SafetensorsFile& reference() {
  static const train::SafetensorsFile file = train::load_safetensors(
      std::string(KILN_SOURCE_DIR) + "/tests/reference/gpt2_tiny_reference.safetensors");
  return file;
}

const Tensor& reference_tensor(const std::string& name) {
  auto it = reference().tensors.find(name);
  KILN_CHECK(it != reference().tensors.end(), "the gpt2-tiny reference has no tensor '{}'", name);
  return it->second;
}

// The reference's tensor for each input of `graph`, by name, in graph-input order.
std::vector<Tensor> inputs_of(const Graph& graph, Role role) {
  std::vector<Tensor> out;
  for (const GraphInput& in : graph.inputs) {
    if (in.role != role) continue;
    const Value& v = graph.value(in.value);
    const Tensor& t = reference_tensor(v.name);
    KILN_CHECK(t.type() == v.type, "reference tensor '{}' is {}, the graph input is {}", v.name,
               to_string(t.type()), to_string(v.type));
    out.push_back(t.clone());
  }
  return out;
}

std::vector<Tensor> all_inputs(const Graph& graph) {
  std::vector<Tensor> out;
  for (const GraphInput& in : graph.inputs)
    out.push_back(reference_tensor(graph.value(in.value).name).clone());
  return out;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.get(i)));
  return m;
}

Graph tiny_gpt() { return models::gpt(models::gpt_config("gpt2-tiny")); }

TEST(Gpt2Reference, LogitsAndLossMatchPyTorch) {
  Graph graph = tiny_gpt();
  std::vector<Tensor> out = Executor(graph).run(all_inputs(graph));
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(testing::all_close(out[0], reference_tensor("loss"), 1e-5, 1e-4));
  EXPECT_TRUE(testing::all_close(out[1], reference_tensor("logits"), 1e-5, 1e-4));
  // Not a trivially small check: an untrained model over 256 tokens has loss near ln(256).
  EXPECT_NEAR(reference_tensor("loss").get(0), std::log(256.0), 0.1);
}

TEST(Gpt2Reference, EveryGradientMatchesPyTorch) {
  Graph forward = tiny_gpt();
  std::vector<ValueId> params;
  for (const GraphInput& in : forward.inputs)
    if (in.role == Role::kParam) params.push_back(in.value);
  AutodiffResult ad = autodiff(forward, forward.outputs[0], params);
  ad.graph.outputs = ad.gradients;
  std::vector<Tensor> grads = Executor(ad.graph).run(all_inputs(ad.graph));
  ASSERT_EQ(grads.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = forward.value(params[i]).name;
    const Tensor& expected = reference_tensor("grad." + name);
    EXPECT_TRUE(testing::all_close(grads[i], expected, 1e-5 * max_abs(expected), 1e-4))
        << "grad." << name << " (largest |gradient| " << max_abs(expected) << ")";
  }
}

TEST(Gpt2Reference, AdamwStepLossesMatchPyTorch) {
  Graph forward = tiny_gpt();
  OptimizerConfig config;
  config.name = "adamw";
  config.lr = 1e-3;
  config.hyper["beta1"] = 0.9;
  config.hyper["beta2"] = 0.999;
  config.hyper["epsilon"] = 1e-8;
  config.hyper["weight_decay"] = 0.0;
  train::Trainer trainer(forward, config, inputs_of(forward, Role::kParam));
  const std::vector<Tensor> batch = inputs_of(forward, Role::kData);  // the same every step
  const Tensor& expected = reference_tensor("adamw_losses");
  ASSERT_EQ(expected.numel(), kAdamwSteps);
  for (int s = 0; s < kAdamwSteps; ++s) {
    double loss = trainer.step(batch)[0].get(0), want = expected.get(s);
    EXPECT_NEAR(loss, want, 1e-5 + 2e-5 * std::abs(want)) << "step " << s;
  }
  // Training on one batch must lower its loss; the reference says by how much.
  EXPECT_LT(expected.get(kAdamwSteps - 1), expected.get(0) - 0.01);
}

}  // namespace
}  // namespace kiln

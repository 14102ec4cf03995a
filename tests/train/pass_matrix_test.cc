// The pass matrix: training steps of the MLP and a small GPT give the same results with every
// pass of the default pipeline on, with each pass disabled in turn, and with none — so no pass
// changes what a step computes, and no later pass depends on an earlier one for correctness.
// Bit for bit, except where training-rewrites or classifier is switched off: the first's
// decompositions reassociate (softmax - one_hot instead of the fused grad op), and the second
// replaces the loss and its gradient by one fused node whose row reductions run in another
// order; both are equal only up to rounding (1 ulp of a param after an update was seen in -O1
// builds, where the unfused path's sums are not contracted the same way).
#include <set>

#include "models/models.h"
#include "passes/pipeline.h"
#include "test_util.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

// Losses of 3 steps and every param/state tensor after them.
std::vector<Tensor> run_steps(const Graph& forward, const std::vector<Tensor>& init,
                              const std::vector<std::vector<Tensor>>& batches, PassOptions passes) {
  OptimizerConfig config;
  config.grad_clip = 1.0;
  Trainer trainer(forward, config, init, {}, std::move(passes));
  std::vector<Tensor> out;
  for (const auto& batch : batches) out.push_back(trainer.step(batch)[0]);
  for (const auto& [name, t] : trainer.named_tensors()) out.push_back(t);
  return out;
}

void check_matrix(const Graph& forward, const std::vector<Tensor>& init,
                  const std::vector<std::vector<Tensor>>& batches) {
  std::vector<std::string> names = default_pipeline().names();
  ASSERT_FALSE(names.empty());
  std::vector<Tensor> all_on = run_steps(forward, init, batches, {});
  std::vector<std::set<std::string>> variants;
  for (const std::string& n : names) variants.push_back({n});
  variants.push_back({names.begin(), names.end()});  // all off
  for (const auto& disabled : variants) {
    PassOptions options;
    options.disabled = disabled;
    std::vector<Tensor> got = run_steps(forward, init, batches, options);
    ASSERT_EQ(got.size(), all_on.size());
    const bool exact = !disabled.count("training-rewrites") && !disabled.count("classifier");
    const double atol = exact ? 0 : 1e-6, rtol = exact ? 0 : 1e-4;
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(testing::all_close(got[i], all_on[i], atol, rtol))
          << "result " << i << " differs with disabled: " << fmt::format("{}", fmt::join(disabled, ","));
  }
}

TEST(PassMatrix, MlpStepsAreIdenticalWithEachPassDisabled) {
  Graph g = models::mlp({8, 12, {10}, 4});
  std::vector<std::vector<Tensor>> batches;
  for (int s = 0; s < 3; ++s)
    batches.push_back({testing::rand(DType::kF32, {8, 12}, 10 + s), testing::rand(DType::kI64, {8}, 20 + s, 0, 4)});
  check_matrix(g, models::init_params_fan_in(g, 1), batches);
}

TEST(PassMatrix, GptStepsAreIdenticalWithEachPassDisabled) {
  Graph g = models::gpt({2, 8, 16, 1, 2, 8});
  std::vector<std::vector<Tensor>> batches;
  for (int s = 0; s < 3; ++s)
    batches.push_back({testing::rand(DType::kI64, {2, 8}, 30 + s, 0, 16), testing::rand(DType::kI64, {2, 8}, 40 + s, 0, 16)});
  check_matrix(g, models::init_params(g, 2, 1), batches);
}

TEST(PassMatrix, LlamaStepsAreIdenticalWithEachPassDisabled) {
  // One block, 4 query heads on 2 key/value heads (rotary embeddings, grouped-query attention,
  // RMSNorm, SwiGLU).
  models::LlamaConfig c{2, 8, 16, 1, 4, 2, 16, 24};
  Graph g = models::llama(c);
  std::vector<std::vector<Tensor>> batches;
  for (int s = 0; s < 3; ++s)
    batches.push_back({testing::rand(DType::kI64, {2, 8}, 50 + s, 0, 16), testing::rand(DType::kI64, {2, 8}, 60 + s, 0, 16)});
  check_matrix(g, models::init_params(g, 2, 1), batches);
}

TEST(PassMatrix, UnknownPassNameIsAClearError) {
  Graph g = models::mlp({2, 3, {}, 2});
  PassOptions options;
  options.disabled = {"no-such-pass"};
  EXPECT_THROW(Trainer(g, OptimizerConfig{}, models::init_params(g, 1), {}, options), Error);
}

TEST(PassMatrix, TheCudaTargetSkipsTrainingRewrites) {
  // Measured slower on the GPU (pipeline.cc): disabled for target cuda, run for the CPU; the
  // name stays known either way (so --disable-pass training-rewrites is no error on cuda).
  Graph g = build_training_graph(models::by_name("gpt2-tiny", 2), OptimizerConfig{}).graph;
  auto ran = [&](Device target) {
    PassOptions options;
    options.target = target;
    options.disabled = {"training-rewrites"};
    EXPECT_NO_THROW(default_pipeline(options));
    options.disabled.clear();
    Graph copy = g;
    for (const PassRecord& r : default_pipeline(options).run(copy))
      if (r.name == "training-rewrites") return r.ran;
    ADD_FAILURE() << "no training-rewrites record";
    return false;
  };
  EXPECT_TRUE(ran(Device::kCpu));
  EXPECT_FALSE(ran(Device::kCuda));
}

}  // namespace
}  // namespace kiln::train

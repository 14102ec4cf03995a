// Offloaded optimizer state (passes/offload.h) through the whole trainer: the moments live in
// host tensors the executor takes as such, and training with them is bit-identical to training
// without (the copies are exact), checkpoints included; kAuto moves state only past its budget,
// the largest first.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "analysis/memory_plan.h"
#include "ir/text.h"
#include "passes/offload.h"

#include "models/models.h"
#include "test_util.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

std::vector<std::vector<Tensor>> gpt_batches(int count) {
  std::vector<std::vector<Tensor>> batches;
  for (int s = 0; s < count; ++s)
    batches.push_back({testing::rand(DType::kI64, {2, 8}, 70 + s, 0, 16), testing::rand(DType::kI64, {2, 8}, 80 + s, 0, 16)});
  return batches;
}

// `device_bytes`: the device's memory, of which kAuto fits the step into 90% (--memory-budget
// would bound the arena too: remat).
PassOptions offload(OffloadMode mode, std::optional<size_t> device_bytes = std::nullopt) {
  PassOptions options;
  options.offload = mode;
  options.device_memory = device_bytes;
  return options;
}

// The losses of `batches`, then every param and state tensor after them.
std::vector<Tensor> train(Trainer& trainer, const std::vector<std::vector<Tensor>>& batches) {
  std::vector<Tensor> out;
  for (const auto& batch : batches) out.push_back(trainer.step(batch)[0]);
  for (const auto& [name, t] : trainer.host_tensors()) out.push_back(t);
  return out;
}

void expect_identical(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(testing::all_close(a[i], b[i], 0, 0)) << "result " << i;
}

// The names of the step's host-resident inputs.
std::set<std::string> host_inputs(const Trainer& trainer) {
  const Executor& executor = trainer.step_executor();
  std::set<std::string> out;
  for (size_t i = 0; i < executor.graph().inputs.size(); ++i)
    if (executor.input_on_host(i)) out.insert(executor.graph().value(executor.graph().inputs[i].value).name);
  return out;
}

TEST(Offload, AdamwMomentsInHostMemoryTrainBitIdentically) {
  const Graph g = models::gpt({2, 8, 16, 1, 2, 8});
  const std::vector<Tensor> init = models::init_params(g, 3, 1);
  const auto batches = gpt_batches(3);
  Trainer plain(g, {}, init), moved(g, {}, init, {}, offload(OffloadMode::kAll));
  // Every param's two moments, nothing else (params, the step counter).
  const std::set<std::string> host = host_inputs(moved);
  EXPECT_EQ(host.size(), 2 * init.size());
  for (const std::string& name : host) EXPECT_TRUE(name.rfind("opt.m.", 0) == 0 || name.rfind("opt.v.", 0) == 0) << name;
  EXPECT_TRUE(host_inputs(plain).empty());
  expect_identical(train(moved, batches), train(plain, batches));
}

TEST(Offload, CheckpointsOfOffloadedStateResumeExactly) {
  const Graph g = models::gpt({2, 8, 16, 1, 2, 8});
  const std::vector<Tensor> init = models::init_params(g, 4, 1);
  const auto batches = gpt_batches(4);
  const std::string path = (std::filesystem::temp_directory_path() / "kiln_offload_test.safetensors").string();
  Trainer straight(g, {}, init, {}, offload(OffloadMode::kAll));
  const std::vector<Tensor> expected = train(straight, batches);
  Trainer first(g, {}, init, {}, offload(OffloadMode::kAll));
  train(first, {batches[0], batches[1]});
  first.save(path);
  // Resumed without offloading: the file holds the same tensors either way.
  Trainer second(g, {}, init);
  second.load(path);
  std::vector<Tensor> got = train(second, {batches[2], batches[3]});
  std::filesystem::remove(path);
  for (size_t i = 2; i < expected.size(); ++i)
    EXPECT_TRUE(testing::all_close(got[i - 2], expected[i], 0, 0)) << "result " << i;
}

TEST(Offload, AutoIsOffWhereEverythingFitsAndMovesAllWhereNothingDoes) {
  const Graph g = models::mlp({2, 64, {64}, 4});
  const std::vector<Tensor> init = models::init_params_fan_in(g, 1);
  Trainer roomy(g, {}, init, {}, offload(OffloadMode::kAuto, size_t{1} << 30));
  EXPECT_TRUE(host_inputs(roomy).empty());
  Trainer none_fits(g, {}, init, {}, offload(OffloadMode::kAuto, size_t{1}));
  EXPECT_EQ(host_inputs(none_fits).size(), 8u);  // every moment of the 4 params
}

// The rule itself on a step of two params: the step's need is its inputs' bytes plus the arena
// planned with the updates written into their inputs; past the budget, the largest moments move
// first, as many as it takes.
TEST(Offload, AutoMovesTheLargestStateUntilTheStepFits) {
  const Graph g = parse(R"(graph @step(%x: f32[2,64] data, %w: f32[64,64] param, %u: f32[64] param,
      %g: f32[64,64] data, %gu: f32[64] data, %m: f32[64,64] state, %v: f32[64,64] state,
      %mu: f32[64] state, %vu: f32[64] state, %lr: f32[] data, %t: f32[] state) {
    %y = matmul(%x, %w)
    %z = add(%y, %u)
    %loss = sum(%z)
    %w2, %m2, %v2 = optimizer_update(%w, %g, %m, %v, %lr, %t) {optimizer="adamw"}
    %u2, %mu2, %vu2 = optimizer_update(%u, %gu, %mu, %vu, %lr, %t) {optimizer="adamw"}
    update %w = %w2
    update %m = %m2
    update %v = %v2
    update %u = %u2
    update %mu = %mu2
    update %vu = %vu2
    return %loss
  })");
  size_t need = 0;
  for (const GraphInput& in : g.inputs) need += g.type(in.value).bytes();
  Graph planned = g;
  planned.updates.clear();
  need += plan_memory(planned).arena_bytes;
  const size_t big = 64 * 64 * 4, small = 64 * 4;
  auto moved = [&](size_t budget) {
    Graph copy = g;
    OffloadPass(OffloadMode::kAuto, budget).run(copy);
    std::multiset<size_t> sizes;
    for (const Node& n : copy.nodes)
      if (n.op == Op::kReload) sizes.insert(copy.type(n.inputs[0]).bytes());
    return sizes;
  };
  EXPECT_EQ(moved(need), std::multiset<size_t>{});
  EXPECT_EQ(moved(need - 1), (std::multiset<size_t>{big}));
  EXPECT_EQ(moved(need - big), (std::multiset<size_t>{big}));
  EXPECT_EQ(moved(need - big - 1), (std::multiset<size_t>{big, big}));
  EXPECT_EQ(moved(need - 2 * big - 1), (std::multiset<size_t>{big, big, small}));
  EXPECT_EQ(moved(0), (std::multiset<size_t>{big, big, small, small}));
}

TEST(Offload, OffIsTheDefault) {
  const Graph g = models::mlp({8, 12, {10}, 4});
  Trainer trainer(g, {}, models::init_params_fan_in(g, 1));
  EXPECT_TRUE(host_inputs(trainer).empty());
}

}  // namespace
}  // namespace kiln::train

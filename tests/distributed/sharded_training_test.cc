// The correctness bar, in CI: with Gloo at 2 and 3 ranks (threads of this process, each
// its own process group), for every --shard mode, 10 AdamW steps of gpt2-tiny, llama-tiny and of
// an MLP give the losses and parameters of one process on the same global batch, within float32
// tolerance (offloaded optimizer state too).
// Also: a rank's checkpoint resumes exactly in a group of the same size; a consolidated one
// resumes in a group of another size (and alone); the rank files of N ranks in one mode resume
// on M ranks in another (Resharding); a rank file that lacks this rank's part is a clear error.
//
// Not bitwise: each rank's loss is the mean over its rows and the ranks' gradients are averaged,
// while one process takes the mean over all rows at once; float32 sums in another order differ
// in the last bits. SGD carries those to the params as they are (1e-5 relative); AdamW divides
// each gradient by its running RMS, so an element whose gradient is within rounding of zero can
// step by up to lr either way: its params are compared to 10% of lr absolute. (Attention's key
// bias is one: its gradient is zero in exact arithmetic, softmax being blind to a constant added
// to every score of a row, so AdamW moves it by normalised rounding noise; measured up to 2.4%
// of lr in the Release build.) AdamW is blind to
// the gradients' scale (a sum over ranks instead of a mean would pass), SGD is not: both run.
#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>

#include "distributed/process_group.h"
#include "models/models.h"
#include "test_util.h"
#include "train/checkpoint/reshard.h"
#include "train/checkpoint/safetensors.h"
#include "train/trainer.h"
#include "distributed/test_ranks.h"

namespace kiln {
namespace {

using testing::env_of;
using testing::kHaveGloo;
using testing::thread_options;
using train::Trainer;

struct Model {
  std::string name;
  int64_t batch = 6;  // global: splits over 1, 2 and 3 ranks
  Graph (*forward)(int64_t batch);
  std::vector<Tensor> (*init)(const Graph& forward);
};

Graph tiny_gpt(int64_t batch) {
  models::GptConfig c = models::gpt_config("gpt2-tiny");
  c.batch = batch;
  c.seq = 16;
  return models::gpt(c);
}
Graph tiny_llama(int64_t batch) {
  models::LlamaConfig c = models::llama_config("llama-tiny");
  c.batch = batch;
  c.seq = 16;
  return models::llama(c);
}
Graph small_mlp(int64_t batch) { return models::mlp(models::MlpConfig{batch, 24, {32}, 10}); }
std::vector<Tensor> gpt_init(const Graph& g) { return models::init_params(g, 7, 2); }
std::vector<Tensor> mlp_init(const Graph& g) { return models::init_params_fan_in(g, 7); }

const Model kGpt{"gpt2-tiny", 6, tiny_gpt, gpt_init};
const Model kMlp{"mlp", 6, small_mlp, mlp_init};
const Model kLlama{"llama-tiny", 6, tiny_llama, gpt_init};

const Model& model_named(const std::string& name) { return name == "mlp" ? kMlp : name == "llama-tiny" ? kLlama : kGpt; }

// Global batch `step` of `model`: random data (never zeros), the same on every rank.
std::vector<Tensor> global_batch(const Model& model, int64_t step) {
  const Graph g = model.forward(model.batch);
  std::vector<Tensor> data;
  for (const GraphInput& in : g.inputs) {
    if (in.role != Role::kData) continue;
    const TensorType& t = g.type(in.value);
    const bool integer = is_integer(t.dtype);
    data.push_back(random_tensor(t, 1000 * static_cast<uint64_t>(step) + data.size() + 1, integer ? 0.0 : -1.0,
                                 integer ? (model.name == "mlp" ? 10.0 : 256.0) : 1.0));
  }
  return data;
}

// Rank `rank`'s rows of a global batch.
std::vector<Tensor> rows_of(const std::vector<Tensor>& global, int rank, int world) {
  std::vector<Tensor> out;
  for (const Tensor& t : global) {
    Shape shape = t.shape();
    shape[0] /= world;
    Tensor part(TensorType{t.dtype(), shape});
    std::memcpy(part.raw(), t.raw() + part.bytes() * static_cast<size_t>(rank), part.bytes());
    out.push_back(part);
  }
  return out;
}

OptimizerConfig adamw() {
  OptimizerConfig c;
  c.lr = 1e-2;
  c.hyper["weight_decay"] = 0.1;
  c.grad_clip = 1.0;  // the global norm: over shards, an all_reduce of the squares
  return c;
}

OptimizerConfig sgd() {
  OptimizerConfig c;
  c.name = "sgd";
  c.lr = 0.1;
  c.hyper["momentum"] = 0.9;
  c.hyper["weight_decay"] = 0.01;
  return c;
}

// The tolerance a run with `config` is compared at (see the top).
double param_tolerance(const OptimizerConfig& config) { return config.name == "adamw" ? 0.1 * config.lr : 2e-5; }

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, Tensor> tensors;  // every param and state tensor, whole (host)
};

std::map<std::string, Tensor> read_all(const std::string& path) { return train::load_safetensors(path).tensors; }

// One process on the global batch.
RunResult single(const Model& model, int64_t steps, const OptimizerConfig& config = adamw()) {
  const Graph g = model.forward(model.batch);
  Trainer trainer(g, config, model.init(g));
  RunResult run;
  for (int64_t s = 0; s < steps; ++s) trainer.step(global_batch(model, s));
  run.losses = trainer.take_losses();
  run.tensors = trainer.host_tensors();
  return run;
}

// `world` ranks as threads: each trains its rows of every global batch; `between(trainer)`, if
// given, runs on every rank after `steps` steps (checkpoints), then `more_steps` follow. Returns
// rank 0's losses and the consolidated tensors (gathered from every rank).
RunResult group(const Model& model, ShardMode mode, int world, int64_t steps, int64_t first_step = 0,
                const std::function<void(Trainer&)>& before = nullptr,
                const std::function<void(Trainer&)>& after = nullptr, const OptimizerConfig& config = adamw(),
                const PassOptions& passes = {}, bool init_as_shards = false) {
  StoreServer server("127.0.0.1", 0, world);
  const std::string consolidated =
      (std::filesystem::temp_directory_path() / fmt::format("kiln_sharded_{}_{}.safetensors", ::getpid(), world)).string();
  RunResult run;
  std::mutex mutex;
  testing::run_ranks(world, [&](int rank) {
    std::unique_ptr<ProcessGroup> pg = init_process_group(env_of(rank, world, server.port()), Device::kCpu, thread_options());
    const Graph g = model.forward(model.batch / world);
    ExecutorOptions options;
    options.communicator = pg->communicator().get();
    // gpt_init's values, drawn as this rank's shards (zero3) or whole.
    std::vector<Tensor> init = init_as_shards ? models::init_param_shards(g, 7, 2, world, rank) : model.init(g);
    Trainer trainer(g, config, std::move(init), options, passes, ShardingOptions{mode, world});
    if (before) before(trainer);
    for (int64_t s = first_step; s < first_step + steps; ++s) trainer.step(rows_of(global_batch(model, s), rank, world));
    std::vector<double> losses = trainer.take_losses();
    if (after) after(trainer);
    trainer.save_consolidated(consolidated);
    pg->barrier();  // rank 0 has written it
    if (rank == 0) {
      std::lock_guard lock(mutex);
      run.losses = losses;
      run.tensors = read_all(consolidated);
    }
  });
  std::filesystem::remove(consolidated);
  return run;
}

// Losses within 1e-5 relative; params and state within `tolerance` absolute plus 1e-5 relative.
void expect_same_run(const RunResult& want, const RunResult& got, double tolerance) {
  ASSERT_EQ(want.losses.size(), got.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * (1 + std::abs(want.losses[i]))) << "step " << i;
  ASSERT_EQ(want.tensors.size(), got.tensors.size());
  for (const auto& [name, tensor] : want.tensors) {
    auto it = got.tensors.find(name);
    ASSERT_NE(it, got.tensors.end()) << name;
    ASSERT_EQ(it->second.type(), tensor.type()) << name;
    EXPECT_LE(max_scaled_error(it->second, tensor, tolerance, 1e-5), 1.0) << name;
  }
}

class ShardedTraining : public ::testing::TestWithParam<std::tuple<std::string, int, ShardMode, std::string>> {
 protected:
  void SetUp() override {
    if (!kHaveGloo) GTEST_SKIP() << "this kiln was built without Gloo";
  }
};

TEST_P(ShardedTraining, MatchesOneProcessOnTheGlobalBatch) {
  const auto& [model_name, world, mode, optimizer] = GetParam();
  const Model& model = model_named(model_name);
  const OptimizerConfig config = optimizer == "sgd" ? sgd() : adamw();
  const RunResult want = single(model, 10, config);
  const RunResult got = group(model, mode, world, 10, 0, nullptr, nullptr, config);
  // The losses move: the comparison is not of a run that did nothing.
  EXPECT_GT(std::abs(want.losses.front() - want.losses.back()), 1e-3);
  expect_same_run(want, got, param_tolerance(config));
}

INSTANTIATE_TEST_SUITE_P(
    Gloo, ShardedTraining,
    ::testing::Combine(::testing::Values("gpt2-tiny", "llama-tiny", "mlp"), ::testing::Values(2, 3),
                       ::testing::Values(ShardMode::kDp, ShardMode::kZero1, ShardMode::kZero2, ShardMode::kZero3),
                       ::testing::Values("adamw", "sgd")),
    [](const auto& info) {
      const std::string& name = std::get<0>(info.param);
      std::string model = name == "mlp" ? "Mlp" : name == "llama-tiny" ? "Llama" : "Gpt";
      return fmt::format("{}{}Ranks{}{}", model, std::get<1>(info.param), shard_mode_name(std::get<2>(info.param)),
                         std::get<3>(info.param));
    });

// The distribution passes (passes/distributed/: bucket-collectives, overlap-collectives) only
// merge and move collectives: with them on and off every mode gives the same losses and params,
// bit for bit (at 2 ranks each reduced element is the one sum a + b, however the buffers are cut;
// tests/passes/distributed_test.cc shows they do change this step's graph).
TEST(DistributionPasses, ChangeNoResultOfAnyMode) {
  if (!kHaveGloo) GTEST_SKIP() << "this kiln was built without Gloo";
  PassOptions off;
  off.disabled = {"bucket-collectives", "overlap-collectives"};
  for (ShardMode mode : {ShardMode::kDp, ShardMode::kZero1, ShardMode::kZero2, ShardMode::kZero3}) {
    SCOPED_TRACE(std::string(shard_mode_name(mode)));
    const RunResult on = group(kGpt, mode, 2, 4);
    const RunResult without = group(kGpt, mode, 2, 4, 0, nullptr, nullptr, adamw(), off);
    EXPECT_EQ(on.losses, without.losses);
    ASSERT_EQ(on.tensors.size(), without.tensors.size());
    for (const auto& [name, tensor] : without.tensors) {
      const Tensor& other = on.tensors.at(name);
      ASSERT_EQ(other.type(), tensor.type()) << name;
      EXPECT_EQ(std::memcmp(other.raw(), tensor.raw(), tensor.bytes()), 0) << name;
    }
  }
}

// Offloading (passes/offload.h) moves each rank's optimizer state, whole (dp) or its shards
// (zero1/2/3), to host memory: the copies change no number, so every mode trains bit for bit as
// on the device, and the consolidated checkpoint (which gathers offloaded shards) is the same.
TEST(DistributionPasses, OffloadedStateTrainsAsOnTheDeviceInEveryMode) {
  if (!kHaveGloo) GTEST_SKIP() << "this kiln was built without Gloo";
  PassOptions offload;
  offload.offload = OffloadMode::kAll;
  for (const Model* model : {&kGpt, &kLlama}) {
    for (ShardMode mode : {ShardMode::kDp, ShardMode::kZero1, ShardMode::kZero2, ShardMode::kZero3}) {
      SCOPED_TRACE(model->name + " " + std::string(shard_mode_name(mode)));
      // Every rank takes its moments (and nothing else) as host tensors.
      std::atomic<int> moments_on_host = 0, others_on_host = 0;
      auto count_host_inputs = [&](Trainer& trainer) {
        const Executor& executor = trainer.step_executor();
        for (size_t i = 0; i < executor.graph().inputs.size(); ++i) {
          if (!executor.input_on_host(i)) continue;
          const std::string& name = executor.graph().value(executor.graph().inputs[i].value).name;
          ++(name.rfind("opt.m.", 0) == 0 || name.rfind("opt.v.", 0) == 0 ? moments_on_host : others_on_host);
        }
      };
      const RunResult device = group(*model, mode, 2, 3);
      const RunResult host = group(*model, mode, 2, 3, 0, count_host_inputs, nullptr, adamw(), offload);
      EXPECT_GT(moments_on_host, 0);
      EXPECT_EQ(others_on_host, 0);
      EXPECT_EQ(device.losses, host.losses);
      ASSERT_EQ(device.tensors.size(), host.tensors.size());
      for (const auto& [name, tensor] : device.tensors) {
        const Tensor& other = host.tensors.at(name);
        ASSERT_EQ(other.type(), tensor.type()) << name;
        EXPECT_EQ(std::memcmp(other.raw(), tensor.raw(), tensor.bytes()), 0) << name;
      }
    }
  }
}

// A zero3 rank may be given its params as its shards (models::init_param_shards, what `kiln
// bench` draws): the same run, bit for bit, as from the whole values.
TEST(ShardedTrainingInit, ZeroThreeTakesItsParamsAsShards) {
  if (!kHaveGloo) GTEST_SKIP() << "this kiln was built without Gloo";
  const RunResult whole = group(kGpt, ShardMode::kZero3, 2, 3);
  const RunResult shards = group(kGpt, ShardMode::kZero3, 2, 3, 0, nullptr, nullptr, adamw(), {}, true);
  EXPECT_EQ(whole.losses, shards.losses);
  for (const auto& [name, tensor] : whole.tensors)
    EXPECT_EQ(std::memcmp(shards.tensors.at(name).raw(), tensor.raw(), tensor.bytes()), 0) << name;
}

class ShardedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kHaveGloo) GTEST_SKIP() << "this kiln was built without Gloo";
    dir_ = std::filesystem::temp_directory_path() / fmt::format("kiln_sharded_ckpt_{}", ::getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string rank_file(int rank) const { return (dir_ / fmt::format("rank{}.safetensors", rank)).string(); }
  std::filesystem::path dir_;
};

TEST_F(ShardedCheckpoint, RankFilesResumeExactlyAndConsolidatedResumesOnAnotherWorldSize) {
  const Model& model = kGpt;
  const ShardMode mode = ShardMode::kZero3;
  // Uninterrupted: 6 steps on 2 ranks.
  const RunResult whole = group(model, mode, 2, 6);
  // 3 steps, each rank saves its shards and all a consolidated file ...
  const std::string consolidated = (dir_ / "consolidated.safetensors").string();
  group(model, mode, 2, 3, 0, nullptr, [&](Trainer& t) {
    t.save(rank_file(t.rank()));
    t.save_consolidated(consolidated);
  });
  // ... and new trainers resume from the rank files: bit for bit the uninterrupted run.
  const RunResult resumed = group(model, mode, 2, 3, 3, [&](Trainer& t) { t.load(rank_file(t.rank())); });
  ASSERT_EQ(resumed.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], whole.losses[3 + i]);
  for (const auto& [name, tensor] : whole.tensors)
    EXPECT_EQ(max_scaled_error(resumed.tensors.at(name), tensor, 0, 0), 0.0) << name;
  // The consolidated file resumes on 3 ranks (zero2) and alone, within float32 tolerance.
  const RunResult three = group(model, ShardMode::kZero2, 3, 3, 3, [&](Trainer& t) { t.load(consolidated); });
  RunResult tail = whole;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 3);
  expect_same_run(tail, three, param_tolerance(adamw()));
  const Graph g = model.forward(model.batch);
  Trainer alone(g, adamw(), model.init(g));
  alone.load(consolidated);
  for (int64_t s = 3; s < 6; ++s) alone.step(global_batch(model, s));
  RunResult one{alone.take_losses(), alone.host_tensors()};
  expect_same_run(tail, one, param_tolerance(adamw()));
  // Rank 0's file of 2 alone does not hold rank 2 of 3's shard: a clear error, before anything is
  // touched (a group of another size reads every rank's file: Resharding below).
  std::string error;
  group(model, mode, 3, 1, 0, [&](Trainer& t) {
    if (t.rank() == 2) error = testing::error_of([&] { t.load(rank_file(0)); });
  });
  EXPECT_NE(error.find("is of a group of 2: this rank's part of"), std::string::npos) << error;
  EXPECT_NE(error.find("is in rank 1's file, not given"), std::string::npos) << error;
}

// Resharding: rank files written by N ranks in one mode resume on M ranks in another (or alone),
// and the run goes on as one at M uninterrupted would (float32 tolerance: the first steps ran at
// N, whose sums differ from M's in the last bits).
struct Layout {
  int world;  // 1: one process, no group
  ShardMode mode;
};

class Resharding : public ShardedCheckpoint, public ::testing::WithParamInterface<std::pair<Layout, Layout>> {};

// `steps` steps of `model` from `first` at `layout`, `before` run first on the trainer(s).
RunResult run_at(const Model& model, Layout layout, int64_t steps, int64_t first = 0,
                 const std::function<void(Trainer&)>& before = nullptr,
                 const std::function<void(Trainer&)>& after = nullptr) {
  if (layout.world > 1) return group(model, layout.mode, layout.world, steps, first, before, after);
  const Graph g = model.forward(model.batch);
  Trainer trainer(g, adamw(), model.init(g));
  if (before) before(trainer);
  for (int64_t s = first; s < first + steps; ++s) trainer.step(global_batch(model, s));
  RunResult run{trainer.take_losses(), trainer.host_tensors()};
  if (after) after(trainer);
  return run;
}

TEST_P(Resharding, RankFilesResumeOnAnotherWorldSizeAndMode) {
  const auto& [from, to] = GetParam();
  Model model = kLlama;
  model.batch = 12;  // splits over 1, 2, 3 and 4 ranks
  const RunResult whole = run_at(model, to, 5);
  const std::string dir = dir_.string();
  run_at(model, from, 2, 0, nullptr, [&](Trainer& t) { t.save(train::checkpoint_path(dir, t.rank(), t.world_size())); });
  const std::optional<train::CheckpointFiles> files = train::find_checkpoint(dir, to.world);
  ASSERT_TRUE(files.has_value());
  EXPECT_EQ(files->world_size, from.world);
  EXPECT_EQ(files->steps_done, 2);
  const RunResult resumed = run_at(model, to, 3, 2, [&](Trainer& t) {
    t.load(files->paths);
    EXPECT_EQ(t.steps_done(), 2);
  });
  RunResult tail = whole;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 2);
  EXPECT_GT(std::abs(tail.losses.front() - tail.losses.back()), 1e-3);
  expect_same_run(tail, resumed, param_tolerance(adamw()));
}

INSTANTIATE_TEST_SUITE_P(
    Gloo, Resharding,
    ::testing::Values(std::pair(Layout{4, ShardMode::kZero3}, Layout{2, ShardMode::kZero1}),
                      std::pair(Layout{2, ShardMode::kZero2}, Layout{1, ShardMode::kNone}),
                      std::pair(Layout{1, ShardMode::kNone}, Layout{4, ShardMode::kZero3}),
                      std::pair(Layout{3, ShardMode::kDp}, Layout{2, ShardMode::kZero3}),
                      std::pair(Layout{2, ShardMode::kZero3}, Layout{3, ShardMode::kZero2})),
    [](const auto& info) {
      const auto name = [](Layout l) {
        return l.world == 1 ? std::string("One") : fmt::format("{}{}", l.world, shard_mode_name(l.mode));
      };
      return name(info.param.first) + "To" + name(info.param.second);
    });

}  // namespace
}  // namespace kiln

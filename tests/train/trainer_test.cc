// The training program and the Trainer: schedule, one step against hand-computed updates,
// clipping, learning, exact resume, and checkpoint errors.
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <thread>

#include "ir/builder.h"
#include "models/models.h"
#include "test_util.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

// loss = sum(w * x): d loss / d w = x, so one SGD step gives w - lr * x exactly.
Graph linear_loss(int64_t n) {
  Builder b("linear");
  Expr w = b.param("w", {n});
  Expr x = b.data("x", {n});
  return b.finish({sum(w * x).named("loss")});
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kiln_trainer_test_" + name)).string();
}

TEST(TrainSchedule, WarmupThenCosineThenFloor) {
  OptimizerConfig c;
  c.lr = 1.0;
  c.warmup_steps = 4;
  c.decay_steps = 14;
  c.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(learning_rate(c, 0), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(c, 3), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(c, 4), 1.0);                     // cosine starts at the peak
  EXPECT_NEAR(learning_rate(c, 9), 0.1 + 0.9 * 0.5, 1e-12);      // halfway: cos(pi/2) = 0
  EXPECT_DOUBLE_EQ(learning_rate(c, 14), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(c, 1000), 0.1);
  c.decay_steps = 0;
  EXPECT_DOUBLE_EQ(learning_rate(c, 1000), 1.0);
}

TEST(TrainSchedule, BadConfigsAreClearErrors) {
  OptimizerConfig c;
  c.name = "adagrad";
  EXPECT_THROW(validate(c), Error);
  c = {};
  c.lr = -1;
  EXPECT_THROW(validate(c), Error);
  c = {};
  c.grad_clip = -1;
  EXPECT_THROW(validate(c), Error);
}

TEST(TrainStep, SgdStepMatchesHandComputedUpdate) {
  OptimizerConfig c;
  c.name = "sgd";
  c.hyper["momentum"] = 0.0;
  c.lr = 0.5;
  Tensor w = testing::rand(DType::kF32, {5}, 1);
  Trainer trainer(linear_loss(5), c, {w});
  Tensor x = testing::rand(DType::kF32, {5}, 2);
  std::vector<Tensor> out = trainer.step({x});
  double expected_loss = 0;
  for (int i = 0; i < 5; ++i) expected_loss += w.get(i) * x.get(i);
  EXPECT_NEAR(out[0].get(0), expected_loss, 1e-5);
  Tensor w1 = trainer.params()[0];
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(w1.get(i), w.get(i) - 0.5 * x.get(i), 1e-6);
  EXPECT_EQ(trainer.steps_done(), 1);
}

// Params still being made on another thread (kiln bench draws them beside the compile): the
// trainer waits for them, so its first step starts from them; an error making them is its own.
TEST(TrainStep, ParamsMadeOnAnotherThreadAreWaitedFor) {
  OptimizerConfig c;
  c.name = "sgd";
  c.hyper["momentum"] = 0.0;
  c.lr = 0.5;
  const Tensor w = testing::rand(DType::kF32, {5}, 3);
  std::promise<std::vector<Tensor>> made;
  std::thread maker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // most likely after the compile
    made.set_value({w.clone()});
  });
  Trainer trainer(linear_loss(5), c, made.get_future().share());
  maker.join();
  const Tensor x = testing::rand(DType::kF32, {5}, 4);
  trainer.step({x});
  const Tensor w1 = trainer.params()[0];
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(w1.get(i), w.get(i) - 0.5 * x.get(i), 1e-6);
  std::promise<std::vector<Tensor>> failed;
  failed.set_exception(std::make_exception_ptr(Error("drawing the params failed")));
  EXPECT_THROW(Trainer(linear_loss(5), c, failed.get_future().share()), Error);
}

TEST(TrainStep, GradientClippingBoundsTheUpdate) {
  OptimizerConfig c;
  c.name = "sgd";
  c.hyper["momentum"] = 0.0;
  c.lr = 1.0;
  c.grad_clip = 0.01;
  Tensor w = testing::rand(DType::kF32, {6}, 3);
  Trainer trainer(linear_loss(6), c, {w});
  Tensor x = testing::rand(DType::kF32, {6}, 4, 1.0, 2.0);  // gradient norm well above 0.01
  trainer.step({x});
  Tensor w1 = trainer.params()[0];
  double norm = 0, xnorm = 0;
  for (int i = 0; i < 6; ++i) {
    norm += std::pow(w1.get(i) - w.get(i), 2);
    xnorm += x.get(i) * x.get(i);
  }
  EXPECT_NEAR(std::sqrt(norm), 0.01, 1e-4);
  // The direction is still the gradient's.
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(w.get(i) - w1.get(i), 0.01 * x.get(i) / std::sqrt(xnorm), 1e-5);
}

TEST(TrainStep, AdamwStateAdvancesInTheGraph) {
  OptimizerConfig c;  // adamw
  Trainer trainer(linear_loss(3), c, {testing::rand(DType::kF32, {3}, 5)});
  for (int s = 0; s < 3; ++s) trainer.step({testing::rand(DType::kF32, {3}, 10 + s)});
  EXPECT_EQ(trainer.named_tensors().at("opt.step").get(0), 3.0);
  EXPECT_NE(trainer.named_tensors().at("opt.m.w").get(0), 0.0);
}

// A separable 3-class problem: label = argmax of three fixed random projections.
struct Synthetic {
  Tensor x, labels;
};
Synthetic synthetic(int64_t n, uint64_t seed) {
  Tensor x = testing::rand(DType::kF32, {n, 8}, seed);
  Tensor proj = testing::rand(DType::kF32, {8, 3}, 999);
  Tensor labels(TensorType{DType::kI64, {n}});
  for (int64_t i = 0; i < n; ++i) {
    int best = 0;
    double best_score = -1e30;
    for (int k = 0; k < 3; ++k) {
      double s = 0;
      for (int j = 0; j < 8; ++j) s += x.get(i * 8 + j) * proj.get(j * 3 + k);
      if (s > best_score) best_score = s, best = k;
    }
    labels.set(i, best);
  }
  return {x, labels};
}

TEST(TrainStep, MlpLearnsASeparableProblem) {
  models::MlpConfig mc{32, 8, {16}, 3};
  Graph g = models::mlp(mc);
  OptimizerConfig c;
  c.lr = 0.02;
  Trainer trainer(g, c, models::init_params(g, 1));
  double first = 0, last = 0;
  for (int s = 0; s < 150; ++s) {
    Synthetic d = synthetic(32, 100 + s);
    double loss = trainer.step({d.x, d.labels})[0].get(0);
    if (s < 10) first += loss / 10;
    if (s >= 140) last += loss / 10;
  }
  EXPECT_LT(last, 0.5 * first) << "loss went from " << first << " to " << last;
}

TEST(TrainCheckpoint, ResumeIsExact) {
  models::MlpConfig mc{16, 8, {12}, 3};
  Graph g = models::mlp(mc);
  OptimizerConfig c;
  c.lr = 0.01;
  c.warmup_steps = 2;
  c.decay_steps = 8;
  auto batch = [](int s) {
    Synthetic d = synthetic(16, 500 + s);
    return std::vector<Tensor>{d.x, d.labels};
  };
  Trainer straight(g, c, models::init_params(g, 7));
  std::vector<double> losses;
  for (int s = 0; s < 8; ++s) losses.push_back(straight.step(batch(s))[0].get(0));

  std::string path = temp_path("resume.safetensors");
  Trainer first_half(g, c, models::init_params(g, 7));
  for (int s = 0; s < 4; ++s) EXPECT_EQ(first_half.step(batch(s))[0].get(0), losses[s]);
  first_half.save(path, {{"note", "half"}});
  Trainer resumed(g, c, models::init_params(g, 99));  // different init: load must replace it
  auto metadata = resumed.load(path);
  EXPECT_EQ(metadata.at("note"), "half");
  EXPECT_EQ(resumed.steps_done(), 4);
  for (int s = 4; s < 8; ++s) EXPECT_EQ(resumed.step(batch(s))[0].get(0), losses[s]) << "step " << s;
  auto a = straight.named_tensors(), b = resumed.named_tensors();
  for (const auto& [name, t] : a) EXPECT_TRUE(testing::all_close(b.at(name), t, 0, 0)) << name;
  std::filesystem::remove(path);
}

TEST(TrainCheckpoint, CorruptOrMismatchedCheckpointLeavesTrainerUntouched) {
  Graph g = linear_loss(4);
  Trainer trainer(g, OptimizerConfig{}, {testing::rand(DType::kF32, {4}, 1)});
  Tensor before = trainer.params()[0].clone();
  std::string path = temp_path("corrupt.safetensors");
  trainer.save(path);
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 3);
  EXPECT_THROW(trainer.load(path), Error);
  Trainer other(linear_loss(5), OptimizerConfig{}, {testing::rand(DType::kF32, {5}, 2)});
  other.save(path);
  EXPECT_THROW(trainer.load(path), Error);  // shapes differ
  EXPECT_TRUE(testing::all_close(trainer.params()[0], before, 0, 0));
  EXPECT_THROW(trainer.load(temp_path("missing.safetensors")), Error);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kiln::train

// The training session (train/session.h) behind every front door: `kiln train`'s job, the
// session's own loop, and its trainer stepped by hand give one loss sequence for one model and
// seed; params drawn while the step compiles are the seed's params drawn up front; a model given
// as IR text trains in the session as a float64 reference computes it, and its checkpoint resumes
// where it stopped.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "ir/text.h"
#include "test_util.h"
#include "train/checkpoint/safetensors.h"
#include "train/job.h"
#include "train/session.h"
#include "train/tasks.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

std::filesystem::path temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("kiln_session_test_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::FILE* null_out() { return std::fopen("/dev/null", "w"); }

// A text of pseudo-random lowercase words (a byte-level language model's data).
std::string write_text(const std::filesystem::path& dir) {
  const std::string path = (dir / "text.txt").string();
  std::ofstream out(path);
  uint64_t x = 12345;
  for (int i = 0; i < 6000; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    out << (x >> 60 < 3 ? ' ' : static_cast<char>('a' + (x >> 40) % 26));
  }
  return path;
}

// A short language-model job on write_text's words, quiet.
JobOptions text_job(const std::filesystem::path& dir, const std::string& model, int64_t steps, int64_t batch,
                    uint64_t seed) {
  JobOptions o;
  o.model = model;
  o.data = write_text(dir);
  o.steps = steps;
  o.batch = batch;
  o.seq = 16;
  o.seed = seed;
  o.eval_batches = 1;
  o.optimizer.lr = 3e-3;
  o.out = null_out();
  return o;
}

TEST(TrainingSession, JobLoopAndHandSteppedTrainerGiveOneLossSequence) {
  const std::filesystem::path dir = temp_dir("faces");
  JobOptions o = text_job(dir, "gpt2-tiny", 6, 4, 5);
  o.metrics_path = (dir / "metrics.jsonl").string();
  const JobResult job = run_training_job(o);
  ASSERT_EQ(job.losses.size(), 6u);
  std::vector<double> written;
  std::ifstream metrics(o.metrics_path);
  for (std::string line; std::getline(metrics, line);) written.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  EXPECT_EQ(written, job.losses);

  // The session's own loop on the same task.
  SessionOptions options;
  options.optimizer = o.optimizer;
  {
    Task task = make_task(o);
    TrainingSession session(std::move(task.model), options);
    LoopOptions loop;
    loop.steps = 6;
    loop.out = o.out;
    const TrainResult r = session.train(task.data, loop);
    EXPECT_EQ(r.losses, job.losses);
    EXPECT_EQ(r.eval_name, "perplexity");
    EXPECT_EQ(r.steps_done, 6);
    // The steady state (the CPU's warm-up is its first step): the last five steps' time, which
    // the steps' whole time includes.
    EXPECT_GT(r.steady_step_seconds, 0);
    EXPECT_LE(5 * r.steady_step_seconds, r.step_seconds);
  }
  {
    // One step: no progress point after the warm-up, no steady state.
    Task task = make_task(o);
    TrainingSession session(std::move(task.model), options);
    LoopOptions loop;
    loop.steps = 1;
    loop.out = o.out;
    EXPECT_EQ(session.train(task.data, loop).steady_step_seconds, 0);
  }
  // Its trainer stepped by hand, as `kiln step` and the Python package step it.
  {
    Task task = make_task(o);
    TrainingSession session(std::move(task.model), options);
    for (int64_t step = 0; step < 6; ++step) session.trainer().step(task.data.batch(step));
    EXPECT_EQ(session.trainer().take_losses(), job.losses);
  }
  std::fclose(o.out);
  std::filesystem::remove_all(dir);
}

// `kiln train` draws a zoo model's params on another thread while the step compiles: its run
// ends with the losses and the params (and optimizer state) of a session given the seed's params
// drawn up front, so the overlapped draw is the same draw and the step waited for it.
TEST(TrainingSession, ParamsDrawnWhileTheStepCompilesAreTheSeedsParams) {
  const std::filesystem::path dir = temp_dir("drawn");
  JobOptions o = text_job(dir, "llama-tiny", 3, 2, 9);
  o.checkpoint_dir = (dir / "job").string();
  Task task = make_task(o);
  ASSERT_TRUE(task.model.draw_params != nullptr);  // the job's params are drawn, not given
  EXPECT_TRUE(task.model.params.empty());
  const JobResult job = run_training_job(o);
  ASSERT_EQ(job.losses.size(), 3u);
  EXPECT_LE(job.params_wait_seconds, job.compile_seconds);

  Model up_front;
  up_front.forward = task.model.forward;
  up_front.params = models::init_params(up_front.forward, o.seed, models::language_model_info(o.model).layers);
  SessionOptions options;
  options.optimizer = o.optimizer;
  TrainingSession session(std::move(up_front), options);
  LoopOptions loop;
  loop.steps = 3;
  loop.out = o.out;
  loop.checkpoints.dir = (dir / "up_front").string();
  const TrainResult r = session.train(task.data, loop);
  EXPECT_EQ(r.losses, job.losses);
  EXPECT_EQ(r.params_wait_seconds, 0);  // given, not drawn
  const SafetensorsFile got = load_safetensors(o.checkpoint_dir + "/last.safetensors");
  const SafetensorsFile want = load_safetensors(loop.checkpoints.dir + "/last.safetensors");
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (const auto& [name, t] : want.tensors) {
    ASSERT_TRUE(got.tensors.count(name)) << name;
    const Tensor& g = got.tensors.at(name);
    ASSERT_EQ(g.type(), t.type()) << name;
    EXPECT_EQ(std::memcmp(g.raw(), t.raw(), t.bytes()), 0) << name;
  }
  std::fclose(o.out);
  std::filesystem::remove_all(dir);
}

constexpr int64_t kB = 8, kIn = 5, kClasses = 3;
constexpr const char* kLinearModel =
    "graph @linear(%x: f32[8,5] data, %y: i64[8] data, %w: f32[5,3] param, %b: f32[3] param) {\n"
    "  %h = matmul(%x, %w) : f32[8,3]\n"
    "  %l = add(%h, %b) : f32[8,3]\n"
    "  %loss = cross_entropy(%l, %y) : f32[]\n"
    "  return %loss\n}\n";

std::vector<Tensor> linear_batch(int64_t step) {
  return {random_tensor(TensorType{DType::kF32, {kB, kIn}}, 100 + step),
          random_tensor(TensorType{DType::kI64, {kB}}, 200 + step, 0, kClasses)};
}

// The losses of `steps` SGD steps (lr `lr`, no momentum) of the linear model from w, b, in
// float64: softmax cross-entropy's gradient (softmax - one_hot) / B through the product.
std::vector<double> reference_losses(std::vector<double> w, std::vector<double> b, double lr, int64_t steps) {
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    const std::vector<Tensor> batch = linear_batch(step);
    std::vector<double> dw(w.size(), 0), db(b.size(), 0);
    double loss = 0;
    for (int64_t i = 0; i < kB; ++i) {
      double logits[kClasses], top = -INFINITY;
      for (int64_t k = 0; k < kClasses; ++k) {
        logits[k] = b[k];
        for (int64_t j = 0; j < kIn; ++j) logits[k] += batch[0].get(i * kIn + j) * w[j * kClasses + k];
        top = std::max(top, logits[k]);
      }
      double sum = 0;
      for (double l : logits) sum += std::exp(l - top);
      const int64_t label = static_cast<int64_t>(batch[1].get(i));
      loss += (top + std::log(sum) - logits[label]) / kB;
      for (int64_t k = 0; k < kClasses; ++k) {
        const double d = (std::exp(logits[k] - top) / sum - (k == label ? 1.0 : 0.0)) / kB;
        db[k] += d;
        for (int64_t j = 0; j < kIn; ++j) dw[j * kClasses + k] += batch[0].get(i * kIn + j) * d;
      }
    }
    losses.push_back(loss);
    for (size_t k = 0; k < w.size(); ++k) w[k] -= lr * dw[k];
    for (size_t k = 0; k < b.size(); ++k) b[k] -= lr * db[k];
  }
  return losses;
}

std::vector<double> values_of(const Tensor& t) {
  std::vector<double> out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(t.get(i));
  return out;
}

TEST(TrainingSession, IrModelTrainsAsTheFloat64ReferenceAndResumes) {
  const std::filesystem::path dir = temp_dir("ir");
  const Tensor w = random_tensor(TensorType{DType::kF32, {kIn, kClasses}}, 7);
  const Tensor b = random_tensor(TensorType{DType::kF32, {kClasses}}, 8);
  const double lr = 0.5;
  const std::vector<double> want = reference_losses(values_of(w), values_of(b), lr, 6);

  SessionOptions options;
  options.optimizer.name = "sgd";
  options.optimizer.lr = lr;
  options.optimizer.hyper = {{"momentum", 0.0}, {"weight_decay", 0.0}};
  TrainingData data;
  data.batch = linear_batch;  // no evaluate: the checkpoint is written at the end of the loop
  data.global_batch = kB;
  data.items_per_step = kB;
  LoopOptions loop;
  loop.steps = 3;
  loop.out = null_out();
  loop.checkpoints.dir = dir.string();
  loop.checkpoints.metadata = {{"kiln.model", "linear"}};
  TrainingSession first(model_from_values(parse(kLinearModel), {{"w", w}, {"b", b}}), options);
  const TrainResult r1 = first.train(data, loop);
  ASSERT_EQ(r1.losses.size(), 3u);
  EXPECT_EQ(r1.evaluations, 0);
  ASSERT_TRUE(std::filesystem::exists(dir / "last.safetensors"));

  // Resumed from other starting values: the checkpoint's params and step count win.
  loop.steps = 6;
  loop.checkpoints.resume = true;
  TrainingSession second(model_from_values(parse(kLinearModel), {}), options);
  const TrainResult r2 = second.train(data, loop);
  ASSERT_EQ(r2.losses.size(), 3u);
  EXPECT_EQ(r2.steps_done, 6);
  std::vector<double> got = r1.losses;
  got.insert(got.end(), r2.losses.begin(), r2.losses.end());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * (1 + std::abs(want[i]))) << "step " << i + 1;

  // Another model's checkpoint is refused, naming both.
  loop.checkpoints.metadata = {{"kiln.model", "other"}};
  TrainingSession third(model_from_values(parse(kLinearModel), {}), options);
  EXPECT_KILN_ERROR(third.train(data, loop), "of model 'linear'", "not 'other'");
  std::fclose(loop.out);
  std::filesystem::remove_all(dir);
}

// Alone, a model's draw is asked for its params whole, and its error is the session's.
TEST(TrainingSession, DrawnParamsAreWholeAloneAndTheirErrorIsTheSessions) {
  const Tensor w = random_tensor(TensorType{DType::kF32, {kIn, kClasses}}, 21);
  const Tensor b = random_tensor(TensorType{DType::kF32, {kClasses}}, 22);
  Model model;
  model.forward = parse(kLinearModel);
  int asked_world = 0, asked_rank = -1;
  model.draw_params = [&](int world, int rank) {
    asked_world = world;
    asked_rank = rank;
    return std::vector<Tensor>{w.clone(), b.clone()};
  };
  TrainingSession session(std::move(model), SessionOptions{});
  EXPECT_EQ(asked_world, 1);
  EXPECT_EQ(asked_rank, 0);
  const std::vector<Tensor> params = session.trainer().params();
  ASSERT_EQ(params.size(), 2u);
  EXPECT_EQ(values_of(params[0]), values_of(w));
  EXPECT_EQ(values_of(params[1]), values_of(b));

  Model failing;
  failing.forward = parse(kLinearModel);
  failing.draw_params = [](int, int) -> std::vector<Tensor> { fail("no memory for the params"); };
  EXPECT_KILN_ERROR(TrainingSession(std::move(failing), SessionOptions{}), "no memory for the params");
}

TEST(TrainingSession, ShardModeNeedsAGroup) {
  SessionOptions options;
  options.shard = "zero1";
  EXPECT_KILN_ERROR(TrainingSession(model_from_values(parse(kLinearModel), {}), options), "--shard zero1",
                    "several processes");
  options.shard = "auto";  // alone: none
  TrainingSession session(model_from_values(parse(kLinearModel), {}), options);
  EXPECT_EQ(session.shard(), "none");
  EXPECT_EQ(session.group(), nullptr);
}

}  // namespace
}  // namespace kiln::train

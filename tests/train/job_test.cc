// Training jobs as `kiln train` runs them: a short real Fashion-MNIST run, resume, a NaN stop
// that keeps the last good checkpoint, and bad options.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "test_util.h"
#include "train/data/fashion_mnist.h"
#include "train/job.h"

namespace kiln::train {
namespace {

std::string temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("kiln_job_test_" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

JobOptions quiet_mlp(int64_t steps) {
  JobOptions o;
  o.model = "mlp";
  o.steps = steps;
  o.batch = 32;
  o.eval_every = 0;
  o.out = std::fopen("/dev/null", "w");
  return o;
}

bool have_fashion_mnist() { return std::filesystem::exists(std::string(kFashionMnistDir) + "t10k-labels-idx1-ubyte.gz"); }

TEST(TrainJob, ShortMlpRunLearnsAndWritesMetrics) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  JobOptions o = quiet_mlp(150);
  o.optimizer.lr = 2e-3;
  o.metrics_path = temp_dir("metrics.jsonl");
  JobResult r = run_training_job(o);
  EXPECT_EQ(r.steps_done, 150);
  EXPECT_EQ(r.eval_name, "accuracy");
  EXPECT_GT(r.eval_metric, 0.65);  // chance is 0.10
  std::ifstream metrics(o.metrics_path);
  std::string line, last;
  int lines = 0;
  while (std::getline(metrics, line)) {
    ++lines;
    last = line;
  }
  EXPECT_EQ(lines, 150);
  EXPECT_NE(last.find("\"eval_accuracy\""), std::string::npos) << last;
  std::filesystem::remove(o.metrics_path);
}

TEST(TrainJob, ResumeContinuesToTheSameResult) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  JobOptions straight = quiet_mlp(40);
  JobResult a = run_training_job(straight);
  JobOptions first = quiet_mlp(20);
  first.checkpoint_dir = temp_dir("resume");
  run_training_job(first);
  JobOptions second = quiet_mlp(40);
  second.checkpoint_dir = first.checkpoint_dir;
  second.resume = true;
  JobResult b = run_training_job(second);
  EXPECT_EQ(b.steps_done, 40);
  EXPECT_EQ(a.final_loss, b.final_loss);
  EXPECT_EQ(a.eval_metric, b.eval_metric);
  std::filesystem::remove_all(first.checkpoint_dir);
}

TEST(TrainJob, NonFiniteLossStopsAndKeepsTheLastGoodCheckpoint) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  JobOptions o = quiet_mlp(60);
  o.optimizer.name = "sgd";
  o.optimizer.momentum = 0.0;
  o.optimizer.lr = 1e30;  // diverges within a few steps
  o.eval_every = 1;       // checkpoint after every good step
  o.checkpoint_dir = temp_dir("nan");
  try {
    run_training_job(o);
    FAIL() << "expected the run to stop on a non-finite loss";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("at step"), std::string::npos) << m;
    EXPECT_NE(m.find("last good checkpoint"), std::string::npos) << m;
  }
  EXPECT_TRUE(std::filesystem::exists(o.checkpoint_dir + "/last.safetensors"));
  std::filesystem::remove_all(o.checkpoint_dir);
}

TEST(TrainJob, BadOptionsAreOneClearError) {
  JobOptions o = quiet_mlp(10);
  o.model = "resnet";
  EXPECT_THROW(run_training_job(o), Error);
  o = quiet_mlp(10);
  o.data_dir = "/nonexistent/fashion";
  try {
    run_training_job(o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dataset-fashion-mnist"), std::string::npos) << e.what();
  }
  o = quiet_mlp(10);
  o.device = "tpu";
  EXPECT_THROW(run_training_job(o), Error);
  o = quiet_mlp(0);
  EXPECT_THROW(run_training_job(o), Error);
  o = quiet_mlp(10);
  o.model = "gpt2-tiny";
  o.data = "/nonexistent.txt";
  EXPECT_THROW(run_training_job(o), Error);
  o = quiet_mlp(10);
  o.model = "gpt2-tiny";
  o.data = "";
  o.seq = 100000;  // longer than the text allows
  EXPECT_THROW(run_training_job(o), Error);
}

TEST(TrainJob, TinyGptTrainsOnText) {
  JobOptions o = quiet_mlp(30);
  o.model = "gpt2-tiny";
  o.data = "";  // the default text
  o.batch = 2;
  o.seq = 32;
  o.eval_batches = 2;
  o.optimizer.lr = 3e-3;
  JobResult r = run_training_job(o);
  EXPECT_EQ(r.eval_name, "perplexity");
  EXPECT_LT(r.eval_metric, 256.0);  // better than uniform over the byte vocabulary
  EXPECT_LT(r.final_loss, 5.0);     // ln(256) = 5.55 at the start
}

}  // namespace
}  // namespace kiln::train

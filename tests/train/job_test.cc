// Training jobs as `kiln train` runs them: a short real Fashion-MNIST run, resume, a NaN stop
// that keeps the last good checkpoint, and bad options.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

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

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(TrainJob, TinyGptTrainsOnText) {
  JobOptions o = quiet_mlp(30);
  o.model = "gpt2-tiny";
  o.data = "";  // the default text
  o.batch = 2;
  o.seq = 32;
  o.eval_batches = 3;
  o.eval_every = 10;
  o.optimizer.lr = 3e-3;
  const std::string log = temp_dir("gpt_log.txt");
  o.out = std::fopen(log.c_str(), "w");
  JobResult r = run_training_job(o);
  std::fclose(o.out);
  EXPECT_EQ(r.eval_name, "perplexity");
  EXPECT_LT(r.eval_metric, 256.0);  // better than uniform over the byte vocabulary
  EXPECT_LT(r.final_loss, 5.0);     // ln(256) = 5.55 at the start
  // --eval-batches: each of the 3 evaluations ran 3 batches.
  EXPECT_EQ(r.evaluations, 3);
  EXPECT_EQ(r.eval_batches, 3);
  // Where the time went: every part measured, and together no more than the whole.
  EXPECT_GT(r.eval_seconds, 0);
  EXPECT_GT(r.step_seconds, 0);
  EXPECT_GT(r.first_step_seconds, r.setup_seconds + r.compile_seconds);
  EXPECT_LE(r.setup_seconds + r.compile_seconds + r.step_seconds + r.eval_seconds + r.checkpoint_seconds,
            r.seconds + 1e-6);
  // The first line says which device and precision and why; the summary names the evaluation
  // time and the breakdown follows it.
  const std::string text = read_file(log);
  EXPECT_EQ(text.rfind("kiln train: device cpu (as asked), amp off (as asked)\n", 0), 0u) << text;
  EXPECT_NE(text.find("first step done"), std::string::npos) << text;
  const size_t done = text.find("done: 30 steps");
  ASSERT_NE(done, std::string::npos) << text;
  const std::string summary = text.substr(done, text.find('\n', done) - done);
  EXPECT_NE(summary.find(fmt::format("evaluation {:.2f} s", r.eval_seconds)), std::string::npos) << summary;
  EXPECT_NE(text.find("wall time", done), std::string::npos) << text;
  EXPECT_NE(text.find("(3 x 3 batches", done), std::string::npos) << text;
  std::filesystem::remove(log);
}

TEST(TrainJob, TinyLlamaTrainsOnTextWithSizesFromOptions) {
  JobOptions o = quiet_mlp(20);
  o.model = "llama-tiny";
  o.data = "";  // the default text
  o.batch = 2;
  o.seq = 32;
  o.sizes.layers = 1;  // as `kiln train --layers 1 --kv-heads 1` gives them
  o.sizes.kv_heads = 1;
  o.eval_batches = 2;
  o.optimizer.lr = 3e-3;
  JobResult r = run_training_job(o);
  EXPECT_EQ(r.steps_done, 20);
  EXPECT_EQ(r.eval_name, "perplexity");
  EXPECT_LT(r.final_loss, 5.2);  // ln(256) = 5.55 at the start
  o.sizes.kv_heads = 3;          // 4 heads do not split into groups of 3 kv heads
  EXPECT_KILN_ERROR(run_training_job(o), "heads 4", "kv_heads 3");
}

TEST(TrainJob, EvalBatchesTakeTheFirstTestBatchesOfAClassifier) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  JobOptions o = quiet_mlp(20);
  JobResult all = run_training_job(o);
  EXPECT_EQ(all.eval_batches, (10000 + 31) / 32);  // the whole test set, the last batch padded
  o.eval_batches = 4;
  JobResult some = run_training_job(o);
  EXPECT_EQ(some.eval_batches, 4);
  EXPECT_EQ(some.final_loss, all.final_loss);
  // 128 images: the accuracy is a multiple of 1/128.
  EXPECT_NEAR(some.eval_metric * 128, std::round(some.eval_metric * 128), 1e-9);
  o.eval_batches = -1;
  EXPECT_THROW(run_training_job(o), Error);
}

TEST(TrainDevice, AutoPicksTheGpuWhenThereIsOneAndBf16FromSm80) {
  const DeviceAvailability no_backend{false, 0, "this build has no CUDA backend", 0};
  const DeviceAvailability no_gpu{true, 0, "no CUDA device", 0};
  const DeviceAvailability h100{true, 1, "NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB", 90};
  const DeviceAvailability t4{true, 1, "Tesla T4, sm_75, 14.6 GiB", 75};

  DeviceChoice c = choose_device("auto", "auto", h100);
  EXPECT_EQ(c.device, "cuda");
  EXPECT_EQ(c.amp, "bf16");
  EXPECT_EQ(c.note, "device cuda (auto: NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB), amp bf16 (auto: sm_90 has bf16)");
  c = choose_device("auto", "auto", t4);
  EXPECT_EQ(c.device, "cuda");
  EXPECT_EQ(c.amp, "off");  // no bf16 tensor cores before sm_80
  EXPECT_NE(c.note.find("sm_75 has no bf16"), std::string::npos) << c.note;
  for (const DeviceAvailability& none : {no_backend, no_gpu}) {
    c = choose_device("auto", "auto", none);
    EXPECT_EQ(c.device, "cpu");
    EXPECT_EQ(c.amp, "off");
    EXPECT_NE(c.note.find("auto: " + none.description), std::string::npos) << c.note;
  }
  // Explicit values win, whatever the machine has.
  c = choose_device("cpu", "auto", h100);
  EXPECT_EQ(c.device, "cpu");
  EXPECT_EQ(c.amp, "off");
  c = choose_device("auto", "f16", h100);
  EXPECT_EQ(c.amp, "f16");
  c = choose_device("cuda", "off", h100);
  EXPECT_EQ(c.device, "cuda");
  EXPECT_EQ(c.amp, "off");
  EXPECT_EQ(c.note, "device cuda (as asked), amp off (as asked)");
  c = choose_device("cpu", "bf16", no_backend);
  EXPECT_EQ(c.amp, "bf16");
  EXPECT_THROW(choose_device("tpu", "auto", h100), Error);
  EXPECT_THROW(choose_device("auto", "fp8", h100), Error);
}

TEST(TrainJob, AutoDeviceRunsWhereTheMachineSays) {
  JobOptions o = quiet_mlp(3);
  o.model = "gpt2-tiny";
  o.data = "";
  o.batch = 2;
  o.seq = 16;
  o.eval_batches = 1;
  o.device = "auto";
  o.optimizer.amp = "auto";
  JobResult r = run_training_job(o);
  const DeviceChoice expected = choose_device("auto", "auto", device_availability(Device::kCuda));
  EXPECT_EQ(r.device, expected.device);
  EXPECT_EQ(r.amp, expected.amp);
  EXPECT_EQ(r.steps_done, 3);
}

}  // namespace
}  // namespace kiln::train

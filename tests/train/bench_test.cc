// What runs without a GPU around the CUDA runtime: `kiln bench` on the CPU (its FLOP count
// checked by hand), the device peak table, and clear errors where CUDA is asked for but the
// build or the machine has none (library calls and the CLI). On a machine with a GPU the
// no-GPU cases skip; tests/cuda/ covers that side.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/memory.h"
#include "ir/text.h"
#include "models/models.h"
#include "runtime/executor.h"
#include "test_util.h"
#include "train/bench.h"
#include "train/job.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

bool have_gpu() { return cuda::built_with_cuda() && cuda::device_count() > 0; }

// Runs `kiln ARGS`, returns (exit status, stdout + stderr); status -1 if the binary is not built.
std::pair<int, std::string> run_cli(const std::string& args) {
  std::string binary = std::string(KILN_BINARY_DIR) + "/kiln";
  if (!std::filesystem::exists(binary)) return {-1, ""};
  FILE* pipe = popen((binary + " " + args + " 2>&1").c_str(), "r");
  std::string out;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128, out};
}

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

TEST(BenchCpu, MlpStepsAreTimedAndCounted) {
  BenchOptions o;
  o.model = "mlp";
  o.batch = 8;
  o.amp = "off";
  o.device = "cpu";
  o.steps = 3;
  o.untimed_steps = 1;
  o.out = nullptr;
  BenchResult r = run_benchmark(o);
  // mlp is 784-256-10: 784*256 + 256 + 256*10 + 10 parameters; no attention term.
  EXPECT_EQ(r.params, 203530);
  EXPECT_EQ(r.tokens_per_step, 8);
  EXPECT_DOUBLE_EQ(r.flops_per_step, 6.0 * 203530 * 8);
  EXPECT_GT(r.median_ms, 0);
  EXPECT_GT(r.pipelined_ms, 0);
  EXPECT_NEAR(r.tokens_per_s, 8 / (r.median_ms / 1e3), 1e-6 * r.tokens_per_s);
  EXPECT_EQ(r.peak_flops, 0);  // no CPU peak unless given: no MFU
  EXPECT_EQ(r.mfu, 0);
  EXPECT_GT(r.first_step_s, 0);
  EXPECT_TRUE(std::isfinite(r.final_loss));
  // The first step, 3 timed, 3 back to back: every loss, the last the final one.
  ASSERT_EQ(r.losses.size(), 7u);
  EXPECT_EQ(r.losses.back(), r.final_loss);
}

TEST(BenchCpu, GptFlopsCountAttention) {
  BenchOptions o;
  o.model = "gpt2-tiny";
  o.batch = 2;
  o.seq = 16;
  o.amp = "off";
  o.device = "cpu";
  o.steps = 1;
  o.untimed_steps = 1;
  o.peak_flops = 1e12;
  o.out = nullptr;
  BenchResult r = run_benchmark(o);
  models::GptConfig c = models::gpt_config("gpt2-tiny");
  const double tokens = 2 * 16;
  EXPECT_EQ(r.tokens_per_step, 32);
  EXPECT_DOUBLE_EQ(r.flops_per_step, 6.0 * static_cast<double>(r.params) * tokens +
                                         12.0 * static_cast<double>(c.layers * 16 * c.d_model) * tokens);
  EXPECT_NEAR(r.mfu, r.flops_per_step / (r.median_ms / 1e3) / 1e12, 1e-9);
}

// Under --amp fp8 the bench says how many products ran in fp8; none without it.
TEST(BenchCpu, Fp8SaysWhatRanInFp8) {
  BenchOptions o;
  o.model = "llama-tiny";
  o.batch = 2;
  o.seq = 32;
  o.device = "cpu";
  o.steps = 1;
  o.untimed_steps = 1;
  o.out = nullptr;
  o.amp = "bf16";
  EXPECT_EQ(run_benchmark(o).fp8_note, "");
  o.amp = "fp8";
  EXPECT_EQ(run_benchmark(o).fp8_note.rfind("fp8: none of the ", 0), 0u);
  o.optimizer.fp8_every_linear = true;
  const std::string forced = run_benchmark(o).fp8_note;
  EXPECT_EQ(forced.rfind("fp8: ", 0), 0u) << forced;
  EXPECT_EQ(forced.find("none"), std::string::npos) << forced;
}

TEST(BenchCpu, PeakRatesOfKnownDevices) {
  std::string note;
  EXPECT_EQ(device_peak_flops("NVIDIA H100 80GB HBM3", "bf16", &note), 989e12);
  expect_contains(note, "H100 SXM");
  EXPECT_EQ(device_peak_flops("NVIDIA H100 80GB HBM3", "off", &note), 494.7e12);
  expect_contains(note, "tf32");
  EXPECT_EQ(device_peak_flops("NVIDIA H100 PCIe", "bf16", nullptr), 756e12);
  EXPECT_EQ(device_peak_flops("NVIDIA H200", "f16", nullptr), 989e12);
  EXPECT_EQ(device_peak_flops("Some GPU", "bf16", &note), 0);
  expect_contains(note, "--peak-tflops");
}

TEST(CudaUnavailable, LibraryCallsSayWhy) {
  if (have_gpu()) GTEST_SKIP() << "this machine has a GPU";
  const std::string why = cuda::built_with_cuda() ? "no CUDA device" : "no CUDA backend";
  try {
    cuda::memory_info();
    FAIL();
  } catch (const Error& e) {
    expect_contains(e.what(), why);
  }
  if (!cuda::built_with_cuda()) {
    EXPECT_THROW(cuda::allocate(16), Error);
    EXPECT_THROW(cuda::Stream(), Error);
    EXPECT_THROW(cuda::to_device(Tensor(TensorType{DType::kF32, {2}})), Error);
    EXPECT_EQ(cuda::allocated_bytes(), 0u);
  }
  Graph g = parse(R"(
graph @g(%x: f32[4] data) {
  %y = exp(%x)
  return %y
}
)");
  ExecutorOptions o;
  o.device = Device::kCuda;
  try {
    Executor e(g, o);
    FAIL();
  } catch (const Error& e) {
    expect_contains(e.what(), "graph 'g' asks for device cuda");
    expect_contains(e.what(), cuda::built_with_cuda() ? "no CUDA device" : "no CUDA backend");
  }
  ExecutorOptions on_cuda;
  on_cuda.device = Device::kCuda;
  try {
    Trainer trainer(models::mlp(models::MlpConfig{4, 8, {8}, 3}), OptimizerConfig{},
                    models::init_params_fan_in(models::mlp(models::MlpConfig{4, 8, {8}, 3}), 1), on_cuda);
    FAIL();
  } catch (const Error& e) {
    expect_contains(e.what(), cuda::built_with_cuda() ? "no CUDA device" : "no CUDA backend");
  }
  JobOptions job;
  job.device = "cuda";
  job.out = std::fopen("/dev/null", "w");
  try {
    run_training_job(job);
    FAIL();
  } catch (const Error& e) {
    expect_contains(e.what(), "--device cuda");
  }
  std::fclose(job.out);
  BenchOptions bench;
  bench.out = nullptr;
  EXPECT_THROW(run_benchmark(bench), Error);  // the default device is cuda
}

TEST(CudaUnavailable, CliTrainOnCudaFailsWithOneClearLine) {
  if (have_gpu()) GTEST_SKIP() << "this machine has a GPU";
  auto [status, out] = run_cli("train --device cuda --steps 1");
  if (status == -1) GTEST_SKIP() << "the kiln binary is not built";
  EXPECT_EQ(status, 1) << out;
  expect_contains(out, "kiln: error: --device cuda:");
  expect_contains(out, cuda::built_with_cuda() ? "no CUDA device" : "no CUDA backend");
}

TEST(CliTrain, HelpNamesTheAutoDefaultsAndEvalBatches) {
  auto [status, help] = run_cli("train --help");
  if (status == -1) GTEST_SKIP() << "the kiln binary is not built";
  EXPECT_EQ(status, 0) << help;
  expect_contains(help, "--device");
  expect_contains(help, "--amp");
  expect_contains(help, "--eval-batches");
  expect_contains(help, "auto (cuda when the build has it");
  auto [bad, out] = run_cli("train --device tpu");
  EXPECT_NE(bad, 0) << out;
}

TEST(CliBench, RunsOnTheCpu) {
  auto [status, out] = run_cli("bench --device cpu --model mlp --batch 8 --amp off --steps 2 --untimed-steps 1");
  if (status == -1) GTEST_SKIP() << "the kiln binary is not built";
  EXPECT_EQ(status, 0) << out;
  expect_contains(out, "kiln bench: mlp");
  expect_contains(out, "ms/step");
  expect_contains(out, "samples/s");
  expect_contains(out, "MFU              n/a");
  expect_contains(out, "first step");
  auto [help_status, help] = run_cli("bench --help");
  EXPECT_EQ(help_status, 0);
  expect_contains(help, "--no-cuda-graphs");
  expect_contains(help, "--peak-tflops");
}

}  // namespace
}  // namespace kiln::train

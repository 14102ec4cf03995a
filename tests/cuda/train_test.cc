// The Trainer and training jobs on CUDA against the CPU: gpt2-tiny steps (losses read lazily,
// params kept on the device), evaluation, checkpoints across devices, a job on text, bf16 on
// the GPU tracking f32 on the CPU over 200 steps, an out-of-memory batch as a clear error, and
// `kiln bench`'s numbers. Tolerances as in executor_test.cc (TF32 GEMMs).
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "backends/backend.h"
#include "backends/cuda/runtime/memory.h"
#include "gpu_test_util.h"
#include "models/models.h"
#include "ops/fused/kind.h"
#include "passes/autodiff.h"
#include "runtime/executor.h"
#include "train/bench.h"
#include "train/job.h"
#include "train/trainer.h"

namespace kiln::train {
namespace {

ExecutorOptions cuda_options() {
  ExecutorOptions o;
  o.device = Device::kCuda;
  return o;
}

OptimizerConfig sgd() {
  OptimizerConfig c;
  c.name = "sgd";
  c.lr = 0.1;
  return c;
}

models::GptConfig tiny() {
  models::GptConfig c = models::gpt_config("gpt2-tiny");
  c.batch = 2;
  c.seq = 16;
  return c;
}

std::vector<Tensor> batch(const models::GptConfig& c, uint64_t seed) {
  TensorType type{DType::kI64, {c.batch, c.seq}};
  return {random_tensor(type, seed, 0, static_cast<double>(c.vocab)),
          random_tensor(type, seed + 1, 0, static_cast<double>(c.vocab))};
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kiln_cuda_train_test_" + name)).string();
}

TEST(CudaTrainer, Gpt2TinyStepsMatchCpu) {
  KILN_REQUIRE_GPU();
  models::GptConfig c = tiny();
  Graph forward = models::gpt(c);
  std::vector<Tensor> init = models::init_params(forward, 3, c.layers);
  Trainer cpu(forward, sgd(), init), gpu(forward, sgd(), init, cuda_options());
  EXPECT_EQ(gpu.params()[0].device(), Device::kCuda);
  for (int s = 0; s < 4; ++s) {
    cpu.step(batch(c, 10 * s));
    gpu.step(batch(c, 10 * s));
  }
  std::vector<double> a = cpu.take_losses(), b = gpu.take_losses();
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t s = 0; s < a.size(); ++s) EXPECT_NEAR(b[s], a[s], 2e-3 * std::abs(a[s])) << "step " << s;
  EXPECT_TRUE(gpu.take_losses().empty());
  auto host = gpu.host_tensors();
  for (const auto& [name, t] : cpu.named_tensors()) {
    ASSERT_EQ(host.at(name).device(), Device::kCpu);
    EXPECT_LE(max_scaled_error(host.at(name), t, 1e-4, 1e-3), 1.0) << name;
  }
  // The second step tuned the products (ExecutorOptions::tune_gemms), the third was captured,
  // the fourth replayed it.
  EXPECT_EQ(gpu.step_executor().graph_captures(), 1);
  EXPECT_EQ(gpu.step_executor().graph_replays(), 1);
  // Evaluation gives host tensors and agrees too.
  std::vector<Tensor> ea = cpu.evaluate(batch(c, 99)), eb = gpu.evaluate(batch(c, 99));
  ASSERT_EQ(eb[0].device(), Device::kCpu);
  EXPECT_NEAR(eb[0].get(0), ea[0].get(0), 2e-3 * std::abs(ea[0].get(0)));
  EXPECT_LE(max_scaled_error(eb[1], ea[1], 5e-3, 5e-3), 1.0);
}

// Offloaded AdamW moments (passes/offload.h) on the GPU: they live in pinned host memory (the
// trainer's device bytes drop by them), are copied in and out inside the step, and every step
// equals the one with the moments on the device, with CUDA graphs asked for or not.
TEST(CudaTrainer, OffloadedAdamwStateTrainsAsOnTheDevice) {
  KILN_REQUIRE_GPU();
  models::GptConfig c = tiny();
  Graph forward = models::gpt(c);
  std::vector<Tensor> init = models::init_params(forward, 5, c.layers);
  PassOptions offload;
  offload.offload = OffloadMode::kAll;
  for (bool graphs : {false, true}) {
    SCOPED_TRACE(graphs ? "CUDA graphs" : "no capture");
    ExecutorOptions options = cuda_options();
    options.cuda_graphs = graphs;
    Trainer plain(forward, {}, init, options), moved(forward, {}, init, options, offload);
    size_t param_bytes = 0;
    for (const Tensor& t : init) param_bytes += t.bytes();
    EXPECT_EQ(plain.param_and_state_bytes() - moved.param_and_state_bytes(), 2 * param_bytes);
    // Every step's params and state, not only the last's: a step that went missing or ran
    // twice shows at the step it happened.
    for (int s = 0; s < 6; ++s) {
      plain.step(batch(c, 20 * s));
      moved.step(batch(c, 20 * s));
      plain.synchronize();
      moved.synchronize();
      const auto want = plain.host_tensors(), got = moved.host_tensors();
      int bad = 0;
      for (const auto& [name, t] : want)
        bad += max_scaled_error(got.at(name), t, 1e-4, 1e-3) > 1.0;
      EXPECT_EQ(bad, 0) << bad << " tensors differ after step " << s;
    }
    // Both steps replay a CUDA graph when asked to (the offloaded one's copies captured too).
    EXPECT_EQ(plain.step_executor().graph_replays() > 0, graphs);
    EXPECT_EQ(moved.step_executor().graph_replays() > 0, graphs);
    std::vector<double> a = plain.take_losses(), b = moved.take_losses();
    ASSERT_EQ(a.size(), b.size());
    for (size_t s = 0; s < a.size(); ++s) EXPECT_NEAR(b[s], a[s], 1e-4 * std::abs(a[s])) << "step " << s;
    for (const auto& [name, t] : moved.named_tensors())
      if (name.rfind("opt.m.", 0) == 0 || name.rfind("opt.v.", 0) == 0) EXPECT_EQ(t.device(), Device::kCpu) << name;
  }
}

// Offloaded AdamW moments in a step captured into a CUDA graph (the default,
// runtime/executor.cc) train as the same step launched kernel by kernel, bit for bit, after every
// step: the reload and offload copies, captured, read and write the pinned state at each replay.
// The two trainers step at once on their own streams, as in the test above, where such replays
// once diverged from the second replay on.
TEST(CudaTrainer, OffloadedStepCapturedTrainsAsUncaptured) {
  KILN_REQUIRE_GPU();
  models::GptConfig c = tiny();
  c.batch = 4;
  c.seq = 32;
  Graph forward = models::gpt(c);
  std::vector<Tensor> init = models::init_params(forward, 11, c.layers);
  OptimizerConfig adamw;
  adamw.name = "adamw";
  adamw.lr = 1e-2;
  ExecutorOptions options = cuda_options();
  options.tune_gemms = false;  // the heuristic's algorithms in both, not timed winners
  PassOptions offload;
  offload.offload = OffloadMode::kAll;
  Trainer captured(forward, adamw, init, options, offload);
  ::setenv("KILN_CAPTURE_OFFLOAD", "0", 1);
  Trainer direct(forward, adamw, init, options, offload);
  ::unsetenv("KILN_CAPTURE_OFFLOAD");
  for (int s = 0; s < 8; ++s) {
    captured.step(batch(c, 40 * s));
    direct.step(batch(c, 40 * s));
    captured.synchronize();
    direct.synchronize();
    const auto want = direct.host_tensors(), got = captured.host_tensors();
    int differ = 0;
    for (const auto& [name, t] : want) {
      const Tensor& g = got.at(name);
      differ += g.bytes() != t.bytes() || std::memcmp(g.raw(), t.raw(), t.bytes()) != 0;
    }
    EXPECT_EQ(differ, 0) << differ << " of " << want.size() << " tensors differ after step " << s;
  }
  // The first step ran directly, the second was captured, the rest replayed it.
  EXPECT_EQ(captured.step_executor().graph_captures(), 1);
  EXPECT_GE(captured.step_executor().graph_replays(), 6);
  EXPECT_EQ(direct.step_executor().graph_replays(), 0);
  EXPECT_EQ(captured.take_losses(), direct.take_losses());
  int on_host = 0;
  for (const auto& [name, t] : captured.named_tensors())
    on_host += (name.rfind("opt.m.", 0) == 0 || name.rfind("opt.v.", 0) == 0) && t.device() == Device::kCpu;
  EXPECT_GT(on_host, 0);
}

// `kiln bench --offload all`'s pattern (src/train/bench.cc), for trainers stepped side by side:
// one step waited for, 3 more, 10 each waited for, then 10 issued back to back (the host runs
// ahead of the device, writing the next batch and learning rate while replays still run),
// alternating between two batches. 24 steps: the executor runs the first directly, tunes the
// products in the second, captures the third and replays the other 21.
constexpr int kBenchSteps = 24;
void step_like_bench(const std::vector<Trainer*>& trainers, const std::vector<std::vector<Tensor>>& batches) {
  auto step_all = [&](int64_t i, bool wait) {
    for (Trainer* t : trainers) t->step(batches[static_cast<size_t>(i % 2)]);
    if (wait)
      for (Trainer* t : trainers) t->synchronize();
  };
  step_all(0, true);
  for (int64_t i = 1; i < 4; ++i) step_all(i, false);
  for (Trainer* t : trainers) t->synchronize();
  for (int64_t i = 0; i < 10; ++i) step_all(i, true);
  for (int64_t i = 0; i < 10; ++i) step_all(i, false);
}

// Tensors (params and optimizer state, by name) of `got` whose bytes differ from `want`'s.
int bytes_differ(const std::map<std::string, Tensor>& want, const std::map<std::string, Tensor>& got) {
  int differ = 0;
  for (const auto& [name, t] : want) {
    const Tensor& g = got.at(name);
    differ += g.bytes() != t.bytes() || std::memcmp(g.raw(), t.raw(), t.bytes()) != 0;
  }
  return differ;
}

// Every dialect but cudnn: cuDNN's attention backward adds dq with atomics, so two runs of the
// same kernels differ in the last bits (cudnn_attention.cc); cuda-attention's is deterministic.
std::vector<std::string> deterministic_dialects() {
  std::vector<std::string> out;
  for (const std::string& d : kernel_registry().dialect_names())
    if (d != "cudnn") out.push_back(d);
  return out;
}

// Trains `forward` with AdamW (bench's defaults: lr 1e-3, here under bf16) in bench's pattern,
// three trainers side by side (or one after the other), each on its own stream: the optimizer
// state offloaded and the step captured (the default) and replayed; offloaded,
// launched kernel by kernel (KILN_CAPTURE_OFFLOAD=0); and not offloaded, captured. GEMM tuning as
// the bench has it (tune_gemms on): the tuned algorithms are
// cached per process and product, so the first trainer's tuning run picks them and the others'
// find them, and all three run the same algorithms at every step (across processes, as in two
// bench runs, timing may pick others). With `bitwise` (deterministic kernels: no cudnn) the
// captured and uncaptured offloaded runs agree bit for bit, losses, params and state; without it,
// losses within `tolerance` (relative). The step without offload agrees within 5e-3: the same
// kernels, but its own memory plan, so its products may differ in alignment and algorithm.
void expect_offloaded_capture_trains_as_uncaptured(const Graph& forward, const std::vector<Tensor>& init,
                                                   const std::vector<std::vector<Tensor>>& batches,
                                                   const std::vector<std::string>& dialects, int min_chunks,
                                                   bool bitwise, double tolerance, bool side_by_side = true) {
  OptimizerConfig adamw;
  adamw.name = "adamw";
  adamw.lr = 1e-3;
  adamw.amp = "bf16";
  ExecutorOptions options = cuda_options();
  options.dialects = dialects;
  PassOptions offload;
  offload.offload = OffloadMode::kAll;
  Trainer captured(forward, adamw, init, options, offload);
  ::setenv("KILN_CAPTURE_OFFLOAD", "0", 1);
  Trainer direct(forward, adamw, init, options, offload);
  ::unsetenv("KILN_CAPTURE_OFFLOAD");
  Trainer plain(forward, adamw, init, options);

  // The step's shape: multi-tensor chunks (each between its reloads and offloads; llama-1b has
  // four), every state tensor reloaded and offloaded once.
  const Graph& g = captured.step_executor().graph();
  int chunks = 0, reloads = 0, offloads = 0, host_inputs = 0;
  for (const Node& node : g.nodes) {
    chunks += is_fused(node, FusedKind::kMultiTensorUpdate);
    reloads += node.op == Op::kReload;
    offloads += node.op == Op::kOffload;
  }
  for (size_t i = 0; i < g.inputs.size(); ++i) host_inputs += captured.step_executor().input_on_host(i);
  EXPECT_GE(chunks, min_chunks);
  EXPECT_GT(host_inputs, 0);
  EXPECT_EQ(reloads, host_inputs);
  EXPECT_EQ(offloads, host_inputs);

  if (side_by_side) {
    step_like_bench({&captured, &direct, &plain}, batches);
  } else {  // as in separate bench runs, one trainer's steps at a time
    for (Trainer* t : {&captured, &direct, &plain}) step_like_bench({t}, batches);
  }
  EXPECT_EQ(captured.step_executor().graph_captures(), 1);
  EXPECT_EQ(captured.step_executor().graph_replays(), kBenchSteps - 3);
  EXPECT_EQ(direct.step_executor().graph_replays(), 0);
  EXPECT_EQ(plain.step_executor().graph_replays(), kBenchSteps - 3);
  const std::vector<double> a = captured.take_losses(), b = direct.take_losses(), c = plain.take_losses();
  ASSERT_EQ(a.size(), static_cast<size_t>(kBenchSteps));
  ASSERT_EQ(b.size(), a.size());
  ASSERT_EQ(c.size(), a.size());
  EXPECT_LT(b.back(), b[1]);  // it trains (both on the second batch)
  for (size_t s = 0; s < a.size(); ++s) {
    if (bitwise) {
      EXPECT_EQ(a[s], b[s]) << "step " << s << ": captured " << a[s] << ", uncaptured " << b[s];
    } else {
      EXPECT_NEAR(a[s], b[s], tolerance * std::abs(b[s])) << "step " << s;
    }
    EXPECT_NEAR(b[s], c[s], 5e-3 * std::abs(c[s])) << "step " << s << ": offloaded " << b[s] << ", on the device "
                                                        << c[s];
  }
  if (bitwise) {
    const int differ = bytes_differ(direct.host_tensors(), captured.host_tensors());
    EXPECT_EQ(differ, 0) << differ << " of " << direct.named_tensors().size() << " tensors differ after "
                         << kBenchSteps << " steps";
  }
}

std::vector<std::vector<Tensor>> two_batches(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  std::vector<std::vector<Tensor>> out;
  const TensorType type{DType::kI64, {batch, seq}};
  for (uint64_t k = 0; k < 2; ++k)
    out.push_back({random_tensor(type, seed + 2 * k, 0, static_cast<double>(vocab)),
                   random_tensor(type, seed + 2 * k + 1, 0, static_cast<double>(vocab))});
  return out;
}

// llama-tiny widened so that its step has llama-1b's shape under --offload all (kiln compile
// --model llama-1b --batch 4 --seq 2048 --amp bf16 --offload all: four multi-tensor chunks after
// the backward pass, each between its reloads and offloads, then the head's own update): 4
// layers, d_model 64, SwiGLU 128, vocab 256, 4 x 64 tokens.
models::LlamaConfig llama_like_1b() {
  models::LlamaConfig c = models::llama_config("llama-tiny");
  c.batch = 4;
  c.seq = 64;
  c.layers = 4;
  c.d_model = 64;
  c.hidden = 128;
  c.vocab = 256;
  return c;
}

// Offloaded AdamW state, the step captured and replayed (the default), trains as the
// same step launched kernel by kernel, bit for bit, in the bench's pattern (back-to-back steps,
// alternating batches, tuned GEMMs, bf16): llama-tiny shaped like llama-1b's offloaded step, the
// trainers stepped side by side and one at a time (as separate bench runs);
// llama-tiny with 4 MiB state tensors (embedding and head, 8192 x 128 f32: the pass then leaves
// every update alone, one kernel each, most reloads hoisted to the update phase's start); and
// gpt2-tiny (seven chunks interleaved with the backward pass).
TEST(CudaTrainer, OffloadedStepCapturedTrainsAsUncapturedInTheBenchPattern) {
  KILN_REQUIRE_GPU();
  {
    SCOPED_TRACE("llama-tiny as llama-1b");
    const models::LlamaConfig c = llama_like_1b();
    const Graph forward = models::llama(c);
    expect_offloaded_capture_trains_as_uncaptured(forward, models::init_params(forward, 13, c.layers),
                                                  two_batches(c.batch, c.seq, c.vocab, 1000), deterministic_dialects(),
                                                  /*min_chunks=*/2, /*bitwise=*/true, 1e-3);
  }
  {
    SCOPED_TRACE("llama-tiny as llama-1b, one trainer at a time");
    const models::LlamaConfig c = llama_like_1b();
    const Graph forward = models::llama(c);
    expect_offloaded_capture_trains_as_uncaptured(forward, models::init_params(forward, 14, c.layers),
                                                  two_batches(c.batch, c.seq, c.vocab, 1200), deterministic_dialects(),
                                                  /*min_chunks=*/2, /*bitwise=*/true, 1e-3, /*side_by_side=*/false);
  }
  {
    SCOPED_TRACE("llama-tiny, large state tensors");
    models::LlamaConfig c = llama_like_1b();
    c.d_model = 128;
    c.hidden = 256;
    c.vocab = 8192;
    const Graph forward = models::llama(c);
    expect_offloaded_capture_trains_as_uncaptured(forward, models::init_params(forward, 15, c.layers),
                                                  two_batches(c.batch, c.seq, c.vocab, 1500), deterministic_dialects(),
                                                  /*min_chunks=*/0, /*bitwise=*/true, 1e-3);
  }
  {
    SCOPED_TRACE("gpt2-tiny");
    models::GptConfig c = tiny();
    c.batch = 4;
    c.seq = 32;
    const Graph forward = models::gpt(c);
    expect_offloaded_capture_trains_as_uncaptured(forward, models::init_params(forward, 17, c.layers),
                                                  two_batches(c.batch, c.seq, c.vocab, 2000), deterministic_dialects(),
                                                  /*min_chunks=*/2, /*bitwise=*/true, 1e-3);
  }
}

// The same with every dialect, as the bench runs (cuDNN's attention where it takes the shapes):
// its backward's atomics let the runs drift apart in the last bits, so the losses agree within a
// tolerance, far below what a replay that lost or repeated an update, or read stale state, moves
// them.
TEST(CudaTrainer, OffloadedStepCapturedTrainsAsUncapturedWithCudnn) {
  KILN_REQUIRE_GPU();
  const models::LlamaConfig c = llama_like_1b();
  const Graph forward = models::llama(c);
  expect_offloaded_capture_trains_as_uncaptured(forward, models::init_params(forward, 19, c.layers),
                                                two_batches(c.batch, c.seq, c.vocab, 3000), {}, /*min_chunks=*/2,
                                                /*bitwise=*/false, 2e-3);
}

// The optimizer's updates on the update stream, beside the backward pass
// (passes/overlap_updates.h): in chunks small enough that gpt2-tiny has several, forked where
// their gradients are ready and joined at the end of the step, replayed from a CUDA graph. The
// training is the same, bit for bit, as with every update after the backward pass: the same
// kernels on the same bytes (a chunk that read a gradient the compute stream had already
// overwritten, or wrote a param a later kernel still read, would show). The two trainers step
// at once, each on its own stream: so this also checks that concurrent steps do not share a
// GEMM or attention workspace (they did, one per device, and differed from the third step on).
TEST(CudaTrainer, UpdatesBesideTheBackwardTrainAsAfterIt) {
  KILN_REQUIRE_GPU();
  // A batch whose activations outweigh the gradients, as a real model's do: the pass marks only
  // what keeps the planned arena.
  models::GptConfig c = tiny();
  c.batch = 8;
  c.seq = 64;
  Graph forward = models::gpt(c);
  std::vector<Tensor> init = models::init_params(forward, 7, c.layers);
  OptimizerConfig adamw;
  adamw.name = "adamw";
  adamw.lr = 1e-2;
  ExecutorOptions options = cuda_options();
  options.tune_gemms = false;  // the heuristic's algorithms in both, not timed winners
  PassOptions beside, after;
  CostModel costs = CostModel::defaults(Device::kCuda);
  costs.bytes_per_s = 64e3 / (25 * costs.launch_s);  // update_chunk_bytes: 64 kB
  beside.costs = after.costs = costs;
  after.disabled = {"overlap-updates"};
  ::setenv("KILN_OVERLAP_UPDATES", "1", 1);  // off by default (passes/overlap_updates.h)
  Trainer a(forward, adamw, init, options, beside);
  ::unsetenv("KILN_OVERLAP_UPDATES");
  Trainer b(forward, adamw, init, options, after);
  EXPECT_GE(a.step_executor().update_stream_nodes(), 3u);
  EXPECT_EQ(b.step_executor().update_stream_nodes(), 0u);
  for (int s = 0; s < 6; ++s) {
    a.step(batch(c, 30 * s));
    b.step(batch(c, 30 * s));
  }
  a.synchronize();
  b.synchronize();
  EXPECT_GE(a.step_executor().graph_replays(), 2);
  EXPECT_EQ(a.take_losses(), b.take_losses());
  const auto want = b.host_tensors(), got = a.host_tensors();
  int differ = 0;
  for (const auto& [name, t] : want) {
    const Tensor& g = got.at(name);
    differ += g.bytes() != t.bytes() || std::memcmp(g.raw(), t.raw(), t.bytes()) != 0;
  }
  EXPECT_EQ(differ, 0) << differ << " of " << want.size() << " tensors differ";
}

// Evaluation on the GPU under bf16 is the forward step compiled like the bf16 training step
// (fused, planned, captured): against the forward graph run as given by the CPU's reference
// kernels on the same (GPU-trained) params, within bf16's rounding; a second evaluation of the
// same batches replays the captured graph and gives the same losses.
TEST(CudaTrainer, Bf16EvaluationMatchesTheCpuReferenceAndReplays) {
  KILN_REQUIRE_GPU();
  models::GptConfig c = tiny();
  Graph forward = models::gpt(c);
  OptimizerConfig config;
  config.lr = 1e-3;
  config.amp = "bf16";
  Trainer gpu(forward, config, models::init_params(forward, 3, c.layers), cuda_options());
  for (int s = 0; s < 2; ++s) gpu.step(batch(c, 10 * s));
  const std::vector<Tensor> data = batch(c, 77);
  std::vector<Tensor> inputs;
  const std::map<std::string, Tensor> host = gpu.host_tensors();
  size_t d = 0;
  for (const GraphInput& in : forward.inputs)
    inputs.push_back(in.role == Role::kData ? data[d++] : host.at(forward.value(in.value).name));
  ExecutorOptions reference;
  reference.dialects = {"reference"};
  const std::vector<Tensor> want = Executor(forward, reference).run(inputs);
  const std::vector<Tensor> got = gpu.evaluate(data);
  ASSERT_EQ(got[0].device(), Device::kCpu);
  EXPECT_NEAR(got[0].get(0), want[0].get(0), 3e-2 * std::abs(want[0].get(0)));
  EXPECT_LE(max_scaled_error(got[1], want[1], 5e-2, 5e-2), 1.0);

  // The loss-only step, 3 batches per evaluation: runs 1-3 warm up, tune the products and
  // capture; 4-6 replay.
  auto eval_batch = [&](int64_t i) { return i == 0 ? data : batch(c, 500 + 10 * i); };
  const std::vector<Tensor> first = gpu.evaluate_batches(3, eval_batch);
  const std::vector<Tensor> second = gpu.evaluate_batches(3, eval_batch);
  const Executor& eval = gpu.eval_executor(/*loss_only=*/true);
  EXPECT_EQ(eval.graph_captures(), 1);
  EXPECT_GE(eval.graph_replays(), 3);  // 4 where no product tunes
  ASSERT_EQ(first.size(), 3u);
  ASSERT_EQ(second.size(), 3u);
  EXPECT_NEAR(first[0].get(0), got[0].get(0), 1e-3 * std::abs(got[0].get(0)));
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(second[i].get(0), first[i].get(0), 1e-6 * std::abs(first[i].get(0))) << i;
  bool has_bf16 = false;
  for (const Value& v : eval.graph().values) has_bf16 = has_bf16 || v.type.dtype == DType::kBF16;
  EXPECT_TRUE(has_bf16);
}

// The loss and every parameter gradient of gpt2-tiny, computed by the forward + autodiff graph
// on the GPU (every dialect allowed) against the CPU reference kernels (f64 inside), on random
// params and tokens. Tolerance: TF32 is off for f32 matmuls (cublaslt.h), so f32 rounding of
// different summation orders: 1e-3 scaled by each gradient's size.
TEST(CudaTrainer, Gpt2TinyLossAndGradientsMatchCpuReference) {
  KILN_REQUIRE_GPU();
  models::GptConfig c = tiny();
  Graph forward = models::gpt(c);
  std::vector<ValueId> wrt;
  for (const GraphInput& in : forward.inputs)
    if (in.role == Role::kParam) wrt.push_back(in.value);
  AutodiffResult ad = autodiff(forward, forward.outputs[0], wrt);
  Graph g = ad.graph;
  g.outputs = {forward.outputs[0]};
  g.outputs.insert(g.outputs.end(), ad.gradients.begin(), ad.gradients.end());
  std::vector<Tensor> params = models::init_params(forward, 5, c.layers);
  std::vector<Tensor> tokens = batch(c, 77);
  std::vector<Tensor> host_inputs, device_inputs;
  size_t p = 0, d = 0;
  for (const GraphInput& in : g.inputs) {
    host_inputs.push_back(in.role == Role::kParam ? params.at(p++) : tokens.at(d++));
    device_inputs.push_back(cuda::to_device(host_inputs.back()));
  }
  const std::vector<Tensor> want =
      Executor(g, ExecutorOptions{Device::kCpu, {"reference"}}).run(host_inputs);
  Executor gpu(g, cuda_options());
  const std::vector<Tensor> got = gpu.run(device_inputs);
  gpu.synchronize();
  ASSERT_EQ(got.size(), want.size());
  const double loss = want[0].get(0);
  EXPECT_NEAR(cuda::to_host(got[0]).get(0), loss, 1e-4 * std::abs(loss));
  for (size_t i = 1; i < want.size(); ++i) {
    double scale = 0;
    for (double v : want[i].to_f64()) scale = std::max(scale, std::abs(v));
    EXPECT_LE(max_scaled_error(cuda::to_host(got[i]), want[i], 1e-3 * scale, 1e-3), 1.0)
        << "gradient of " << g.value(wrt[i - 1]).name << " (max |g| " << scale << ")";
  }
}

TEST(CudaTrainer, WrongBatchShapeIsAClearErrorNotACudaCrash) {
  KILN_REQUIRE_GPU();
  models::GptConfig c = tiny();
  Graph forward = models::gpt(c);
  Trainer gpu(forward, sgd(), models::init_params(forward, 3, c.layers), cuda_options());
  models::GptConfig wrong = c;
  wrong.seq = c.seq + 1;
  EXPECT_KILN_ERROR(gpu.step(batch(wrong, 1)), "data input", "must be i64[2,16]", "got i64[2,17]");
  gpu.step(batch(c, 1));  // the trainer is still usable
  EXPECT_EQ(gpu.take_losses().size(), 1u);
}

TEST(CudaTrainer, CheckpointsMoveBetweenDevices) {
  KILN_REQUIRE_GPU();
  models::GptConfig c = tiny();
  Graph forward = models::gpt(c);
  std::vector<Tensor> init = models::init_params(forward, 4, c.layers);
  Trainer gpu(forward, sgd(), init, cuda_options());
  gpu.step(batch(c, 1));
  gpu.step(batch(c, 2));
  std::string path = temp_path("ckpt.safetensors");
  gpu.save(path);
  Trainer cpu(forward, sgd(), init), gpu2(forward, sgd(), init, cuda_options());
  cpu.load(path);
  gpu2.load(path);
  EXPECT_EQ(gpu2.steps_done(), 2);
  auto from_gpu = gpu.host_tensors(), loaded = gpu2.host_tensors();
  for (const auto& [name, t] : cpu.named_tensors()) {
    EXPECT_EQ(std::memcmp(t.raw(), from_gpu.at(name).raw(), t.bytes()), 0) << name;
    EXPECT_EQ(std::memcmp(loaded.at(name).raw(), from_gpu.at(name).raw(), t.bytes()), 0) << name;
  }
  gpu.take_losses();
  gpu.step(batch(c, 3));
  gpu2.step(batch(c, 3));
  // Same params and data; the two trainers' GEMMs may still differ in algorithm (cuBLASLt's
  // autotuning may pick another one while the first trainer is already captured), so TF32's
  // tolerance, not bits.
  double a = gpu.take_losses().at(0);
  EXPECT_NEAR(gpu2.take_losses().at(0), a, 2e-3 * std::abs(a));
  std::filesystem::remove(path);
}

TEST(CudaTrainer, BatchThatCannotFitNamesTheMemory) {
  KILN_REQUIRE_GPU();
  models::GptConfig c = tiny();
  c.batch = 1 << 20;  // logits alone: 2^20 * 16 * vocab * 4 bytes
  c.seq = 16;
  Graph forward = models::gpt(c);
  std::vector<Tensor> init = models::init_params(forward, 1, c.layers);
  size_t before = cuda::allocated_bytes();
  try {
    Trainer t(forward, sgd(), init, cuda_options());
    FAIL() << "a batch of 2^20 sequences fit";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("needs"), std::string::npos) << m;
    EXPECT_NE(m.find("GiB"), std::string::npos) << m;
    EXPECT_NE(m.find("for its inputs"), std::string::npos) << m;
    EXPECT_NE(m.find("free on"), std::string::npos) << m;
  }
  EXPECT_EQ(cuda::allocated_bytes(), before);
}

JobOptions text_job(const std::string& device, int64_t steps) {
  JobOptions o;
  o.model = "gpt2-tiny";
  o.device = device;
  o.steps = steps;
  o.batch = 4;
  o.seq = 32;
  o.eval_batches = 2;
  o.eval_every = 0;
  o.log_every = 50;
  o.optimizer.lr = 3e-3;
  o.out = std::fopen("/dev/null", "w");
  return o;
}

std::vector<double> metric_losses(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return out;
}

TEST(CudaTrainJob, TinyGptTrainsOnText) {
  KILN_REQUIRE_GPU();
  JobOptions o = text_job("cuda", 30);
  o.log_every = 7;  // losses read in groups of 7 (and at the end)
  o.metrics_path = temp_path("metrics.jsonl");
  std::filesystem::remove(o.metrics_path);
  JobResult r = run_training_job(o);
  EXPECT_EQ(r.steps_done, 30);
  EXPECT_EQ(r.eval_name, "perplexity");
  EXPECT_LT(r.eval_metric, 256.0);  // better than uniform over the byte vocabulary
  EXPECT_LT(r.final_loss, 5.0);     // ln(256) = 5.55 at the start
  EXPECT_EQ(metric_losses(o.metrics_path).size(), 30u);  // one record per step, read lazily
  std::filesystem::remove(o.metrics_path);
}

TEST(CudaTrainJob, Bf16OnTheGpuTracksF32OnTheCpu) {
  KILN_REQUIRE_GPU();
  // 200 steps of gpt2-tiny on the default text, same data and init. Tolerance: the mean loss of
  // every 20-step window within 5% of the f32 CPU run's (bf16 keeps 8 bits of mantissa in the
  // matmuls and attention; the runs drift apart step by step but must learn alike).
  JobOptions gpu = text_job("cuda", 200), cpu = text_job("cpu", 200);
  gpu.optimizer.amp = "bf16";
  gpu.metrics_path = temp_path("bf16.jsonl");
  cpu.metrics_path = temp_path("f32.jsonl");
  std::filesystem::remove(gpu.metrics_path);
  std::filesystem::remove(cpu.metrics_path);
  run_training_job(gpu);
  run_training_job(cpu);
  std::vector<double> a = metric_losses(gpu.metrics_path), b = metric_losses(cpu.metrics_path);
  ASSERT_EQ(a.size(), 200u);
  ASSERT_EQ(b.size(), 200u);
  for (size_t w = 0; w < 10; ++w) {
    double ma = 0, mb = 0;
    for (size_t k = 20 * w; k < 20 * (w + 1); ++k) {
      ma += a[k] / 20;
      mb += b[k] / 20;
    }
    EXPECT_NEAR(ma, mb, 0.05 * mb) << "steps " << 20 * w << ".." << 20 * w + 19;
  }
  EXPECT_LT(a.back(), a.front() - 1.0);  // it learned
  std::filesystem::remove(gpu.metrics_path);
  std::filesystem::remove(cpu.metrics_path);
}

TEST(CudaBench, ReportsReplayedStepsAndMemory) {
  KILN_REQUIRE_GPU();
  BenchOptions o;
  o.model = "gpt2-tiny";
  o.batch = 4;
  o.seq = 64;
  o.steps = 5;
  o.untimed_steps = 3;
  o.out = nullptr;
  BenchResult r = run_benchmark(o);
  EXPECT_GT(r.median_ms, 0);
  EXPECT_GT(r.tokens_per_s, 0);
  EXPECT_EQ(r.tokens_per_step, 4 * 64);
  EXPECT_GT(r.graph_replays, 0);
  EXPECT_GE(r.kiln_peak_bytes, r.param_state_bytes + r.arena_bytes);
  EXPECT_TRUE(std::isfinite(r.final_loss));
  if (r.peak_flops > 0) {
    EXPECT_GT(r.mfu, 0);
  }
}

}  // namespace
}  // namespace kiln::train

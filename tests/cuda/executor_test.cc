// The executor on CUDA against the CPU executor: small graphs (elementwise, matmul), MLP and
// gpt2-tiny training steps, CUDA-graph replay against capture-off, updates written into the
// inputs' device storage, outputs the executor owns, and the clear errors (a host tensor, a
// node with no CUDA kernel, an arena that cannot fit). Reshape views (no kernel launched): on
// random graphs bit-identical to the plan-off executor (every reshape a copy) through capture,
// replay and new input pointers; a view of a param delays its direct update; the profile lists
// view nodes at 0 ms. Slice views (rows at a byte offset: of an intermediate, a graph input, a
// graph output, a param) likewise, on a hand-written graph and on random graphs with slices.
//
// Tolerances, as scaled errors |gpu - cpu| / (atol + rtol * |cpu|) <= 1:
//   f32 elementwise and reductions: atol 1e-5, rtol 1e-4 (different summation orders and
//     device transcendental functions; both are within a few f32 ulps).
//   anything through an f32 GEMM: atol 5e-3, rtol 5e-3 — cuBLASLt may use TF32 tensor cores
//     (10-bit mantissa: each product is off by up to ~1e-3 relative; K <= 128 random-sign terms
//     of magnitude <= 1 sum to errors of a few 1e-3).
//   training steps (SGD, lr 0.1): losses rtol 2e-3, params atol 1e-4 rtol 1e-3 — a param moves
//     by lr * grad, so TF32's relative gradient error of ~1e-3 becomes ~1e-4 * |grad|.
//   GPU against GPU with the same kernels (graph replay vs direct launches): atol 1e-7, rtol
//     1e-6, not bits, because a reduction kernel may add with atomics in any order.
#include <cmath>
#include <cstring>
#include <optional>

#include "analysis/plan_check.h"
#include "backends/cuda/cublaslt/cublaslt.h"
#include "backends/cuda/runtime/memory.h"
#include "gpu_test_util.h"
#include "ir/text.h"
#include "models/models.h"
#include "runtime/executor.h"
#include "compile/training_graph.h"

namespace kiln {
namespace {

struct Tolerance {
  double atol, rtol;
};
constexpr Tolerance kElementwise{1e-5, 1e-4};
constexpr Tolerance kGemm{5e-3, 5e-3};
constexpr Tolerance kLoss{1e-6, 2e-3};
constexpr Tolerance kParams{1e-4, 1e-3};
constexpr Tolerance kSameKernels{1e-7, 1e-6};  // GPU vs GPU, same kernels

// Inputs for `g`: params random in [-0.5, 0.5), state zero (opt.step too), data random
// (integers in [0, int_high)), lr 0.1. Never all zeros.
std::vector<Tensor> host_inputs(const Graph& g, uint64_t seed, double int_high) {
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    const Value& v = g.value(g.inputs[i].value);
    if (g.inputs[i].role == Role::kState) inputs.push_back(Tensor(v.type));
    else if (v.name == "lr") inputs.push_back(Tensor::from_f64(v.type, std::vector<double>{0.1}));
    else if (is_integer(v.type.dtype)) inputs.push_back(random_tensor(v.type, seed * 1000 + i, 0.0, int_high));
    else if (g.inputs[i].role == Role::kParam) inputs.push_back(random_tensor(v.type, seed * 1000 + i, -0.5, 0.5));
    else inputs.push_back(random_tensor(v.type, seed * 1000 + i));
  }
  return inputs;
}

std::vector<Tensor> clones(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(t.clone());
  return out;
}

std::vector<Tensor> upload(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(cuda::to_device(t));
  return out;
}

std::vector<Tensor> download(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(cuda::to_host(t));
  return out;
}

ExecutorOptions on_cuda(bool graphs = true) {
  ExecutorOptions o;
  o.device = Device::kCuda;
  o.cuda_graphs = graphs;
  o.poison_arena = true;  // a kernel reading its output before writing it shows up as NaN
  return o;
}

// Runs `steps` steps (fresh data each step, params and state carried by the updates) on the
// CPU or on CUDA; returns every step's outputs and then the final param and state tensors, on
// the host.
std::vector<Tensor> run_steps(const Graph& g, std::optional<ExecutorOptions> cuda_options, int steps, double int_high) {
  std::vector<Tensor> inputs = host_inputs(g, 1, int_high);
  std::vector<Tensor> results;
  if (!cuda_options) {
    Executor e(g);
    for (int s = 0; s < steps; ++s) {
      std::vector<Tensor> fresh = host_inputs(g, 100 + s, int_high);
      for (size_t i = 0; i < g.inputs.size(); ++i)
        if (g.inputs[i].role == Role::kData) inputs[i] = fresh[i];
      for (const Tensor& t : e.run(inputs)) results.push_back(t.clone());
    }
  } else {
    Executor e(g, *cuda_options);
    std::vector<Tensor> device = upload(inputs);
    for (int s = 0; s < steps; ++s) {
      std::vector<Tensor> fresh = host_inputs(g, 100 + s, int_high);
      // New data into the same device buffers (their pointers stay, so the graph replays).
      for (size_t i = 0; i < g.inputs.size(); ++i)
        if (g.inputs[i].role == Role::kData) cuda::copy_async(device[i], fresh[i], e.stream().handle());
      e.synchronize();
      for (const Tensor& t : download(e.run(device))) results.push_back(t);
    }
    inputs = download(device);
  }
  for (size_t i = 0; i < g.inputs.size(); ++i)
    if (g.inputs[i].role != Role::kData) results.push_back(inputs[i]);
  return results;
}

void expect_close(const std::vector<Tensor>& gpu, const std::vector<Tensor>& cpu, Tolerance tol, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  for (size_t i = 0; i < gpu.size(); ++i)
    EXPECT_LE(max_scaled_error(gpu[i], cpu[i], tol.atol, tol.rtol), 1.0)
        << what << " #" << i << ": gpu " << summarize(gpu[i]) << " vs cpu " << summarize(cpu[i]);
}

void expect_bitwise(const std::vector<Tensor>& a, const std::vector<Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].type(), b[i].type()) << what << " #" << i;
    EXPECT_EQ(std::memcmp(a[i].raw(), b[i].raw(), a[i].bytes()), 0)
        << what << " #" << i << ": " << summarize(a[i]) << " vs " << summarize(b[i]);
  }
}

StepProgram sgd_training_graph(const Graph& forward) {
  OptimizerConfig config;
  config.name = "sgd";
  config.hyper["momentum"] = 0.9;
  return build_training_graph(forward, config);
}

const char* kElementwiseGraph = R"(
graph @elementwise(%x: f32[257, 33] data, %y: f32[257, 33] data, %row: f32[1, 33] data) {
  %a = exp(%x)
  %b = mul(%a, %y)
  %c = add(%b, %row)
  %d = tanh(%c)
  %e = neg(%d)
  %s = sum(%e)
  return %s, %d
}
)";

TEST(CudaExecutor, ElementwiseGraphMatchesCpu) {
  KILN_REQUIRE_GPU();
  Graph g = parse(kElementwiseGraph);
  std::vector<Tensor> inputs = host_inputs(g, 3, 1);
  std::vector<Tensor> cpu = Executor(g).run(inputs);
  for (bool graphs : {false, true}) {
    Executor e(g, on_cuda(graphs));
    std::vector<Tensor> device = upload(inputs);
    for (int run = 0; run < 3; ++run)  // eager, capture, replay
      expect_close(download(e.run(device)), cpu, {1e-4, 1e-4}, graphs ? "graphs, run " + std::to_string(run) : "eager");
  }
}

TEST(CudaExecutor, MatmulMatchesCpu) {
  KILN_REQUIRE_GPU();
  Graph g = parse(R"(
graph @mm(%a: f32[64, 96] data, %b: f32[96, 48] data) {
  %c = matmul(%a, %b)
  return %c
}
)");
  std::vector<Tensor> inputs = host_inputs(g, 5, 1);
  std::vector<Tensor> cpu = Executor(g).run(inputs);
  Executor e(g, on_cuda());
  expect_close(download(e.run(upload(inputs))), cpu, kGemm, "matmul");
}

TEST(CudaExecutor, MlpTrainingStepsMatchCpu) {
  KILN_REQUIRE_GPU();
  Graph g = sgd_training_graph(models::mlp(models::MlpConfig{32, 96, {64}, 10})).graph;
  std::vector<Tensor> cpu = run_steps(g, std::nullopt, 3, 10);
  std::vector<Tensor> gpu = run_steps(g, on_cuda(), 3, 10);
  ASSERT_EQ(gpu.size(), cpu.size());
  // Per step: loss, logits; then params and momentum buffers.
  const size_t per_step = g.outputs.size();
  for (size_t i = 0; i < gpu.size(); ++i) {
    Tolerance tol = i < 3 * per_step ? (i % per_step == 0 ? kLoss : kGemm) : kParams;
    EXPECT_LE(max_scaled_error(gpu[i], cpu[i], tol.atol, tol.rtol), 1.0) << "#" << i << ": " << summarize(gpu[i])
                                                                          << " vs " << summarize(cpu[i]);
  }
}

TEST(CudaExecutor, Gpt2TinyTrainingStepsMatchCpu) {
  KILN_REQUIRE_GPU();
  models::GptConfig config = models::gpt_config("gpt2-tiny");
  config.batch = 2;
  config.seq = 16;
  Graph g = sgd_training_graph(models::gpt(config)).graph;
  std::vector<Tensor> cpu = run_steps(g, std::nullopt, 2, static_cast<double>(config.vocab));
  std::vector<Tensor> gpu = run_steps(g, on_cuda(), 2, static_cast<double>(config.vocab));
  ASSERT_EQ(gpu.size(), cpu.size());
  const size_t per_step = g.outputs.size();
  for (size_t i = 0; i < gpu.size(); ++i) {
    Tolerance tol = i < 2 * per_step ? (i % per_step == 0 ? kLoss : kGemm) : kParams;
    EXPECT_LE(max_scaled_error(gpu[i], cpu[i], tol.atol, tol.rtol), 1.0) << "#" << i << ": " << summarize(gpu[i])
                                                                          << " vs " << summarize(cpu[i]);
  }
}

TEST(CudaExecutor, AdamwStepsApplyEveryUpdateOnTheDevice) {
  KILN_REQUIRE_GPU();
  Graph g = build_training_graph(models::mlp(models::MlpConfig{16, 40, {24}, 5}), OptimizerConfig{}).graph;
  std::vector<Tensor> gpu = run_steps(g, on_cuda(), 3, 5);
  std::vector<Tensor> initial = host_inputs(g, 1, 5);
  // The tail of gpu: params and state in input order; opt.step counted 3 steps, exactly.
  size_t tail = gpu.size();
  for (size_t i = 0; i < g.inputs.size(); ++i)
    if (g.inputs[i].role != Role::kData) --tail;
  size_t k = tail;
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    if (g.inputs[i].role == Role::kData) continue;
    const std::string& name = g.value(g.inputs[i].value).name;
    if (name == "opt.step") {
      EXPECT_EQ(gpu[k].get(0), 3.0);
    } else if (g.inputs[i].role == Role::kParam) {
      EXPECT_GT(max_scaled_error(gpu[k], initial[i], 0, 1e-6), 1.0) << name;
    }
    ++k;
  }
  // (No value comparison with the CPU here: AdamW moves a param by about lr whatever the
  // gradient's size, so a near-zero gradient whose sign TF32 flips moves it the other way. The
  // SGD tests above compare values.)
}

TEST(CudaExecutor, GraphReplayMatchesCaptureOff) {
  KILN_REQUIRE_GPU();
  Graph g = sgd_training_graph(models::mlp(models::MlpConfig{16, 40, {24}, 5})).graph;
  // Same kernels in the same order: replay gives what direct launches give, up to the order of
  // atomic additions a reduction kernel may use (hence 1e-6, not bits).
  expect_close(run_steps(g, on_cuda(true), 5, 5), run_steps(g, on_cuda(false), 5, 5), kSameKernels, "mlp sgd");

  Graph e = parse(kElementwiseGraph);
  Executor replaying(e, on_cuda(true)), direct(e, on_cuda(false));
  std::vector<Tensor> a = upload(host_inputs(e, 7, 1)), b = upload(host_inputs(e, 8, 1));
  for (const std::vector<Tensor>* in : {&a, &a, &a, &b, &b, &a}) {
    std::vector<Tensor> want = download(direct.run(*in));
    expect_close(download(replaying.run(*in)), want, kSameKernels, "elementwise");
  }
  // a: warm-up, capture, replay; b: new pointers, capture; b: replay; a: capture again.
  EXPECT_EQ(replaying.graph_captures(), 3);
  EXPECT_EQ(replaying.graph_replays(), 2);
  EXPECT_EQ(direct.graph_captures(), 0);
}

// A constant (an imported model's position ids, here gather indices) is copied from host values
// that must outlive the capture: a captured graph copies from the same host address at every
// replay. Eager, capture and replays all give the CPU's rows.
TEST(CudaExecutor, ConstantsSurviveCaptureAndReplay) {
  KILN_REQUIRE_GPU();
  Graph g = parse(R"(
graph @positions(%table: f32[8, 16] data, %x: f32[5, 16] data) {
  %i = constant() {dtype=i64, shape=[5], values=[3, 0, 7, 7, 2]}
  %w = constant() {dtype=f32, shape=[5, 1], values=[0.5, -1.25, 2, 3.5, -0.75]}
  %rows = gather(%table, %i)
  %scaled = mul(%rows, %w)
  %y = add(%scaled, %x)
  return %y
}
)");
  const std::vector<Tensor> inputs = host_inputs(g, 11, 1);
  const std::vector<Tensor> want = Executor(g).run(inputs);
  Executor e(g, on_cuda(true));
  std::vector<Tensor> device = upload(inputs);
  for (int run = 0; run < 5; ++run) {
    // Other host allocations between runs, as a training loop makes (they reused the freed buffer).
    std::vector<std::vector<double>> churn(64, std::vector<double>(5, 1e15 + run));
    expect_close(download(e.run(device)), want, {1e-6, 1e-6}, "run " + std::to_string(run));
  }
  EXPECT_GE(e.graph_replays(), 1);
}

TEST(CudaExecutor, SecondRunTunesTheProductsAndTheThirdCaptures) {
  KILN_REQUIRE_GPU();
  // Shapes no other test uses, so that their plans are not tuned yet.
  Graph g = parse(R"(
graph @products(%x: f32[200, 72] data, %w: f32[72, 136] data, %v: f32[136, 40] data) {
  %h = matmul(%x, %w)
  %y = matmul(%h, %v)
  return %y
}
)");
  const std::vector<Tensor> inputs = host_inputs(g, 5, 1);
  const std::vector<Tensor> want = Executor(g).run(inputs);
  std::vector<Tensor> device = upload(inputs);
  Executor e(g, on_cuda(true));
  size_t tuned = cuda::gemm_tuned_plan_count();
  for (int run = 0; run < 4; ++run) {
    expect_close(download(e.run(device)), want, kGemm, "run " + std::to_string(run));
    const size_t now = cuda::gemm_tuned_plan_count();
    if (run == 0) {
      EXPECT_EQ(now, tuned) << "the first run keeps the heuristic's algorithms";
    } else if (run == 1) {
      EXPECT_EQ(now, tuned + 2) << "the second run tunes both products";
      EXPECT_EQ(e.graph_captures(), 0);
    }
    tuned = now;
  }
  EXPECT_EQ(e.graph_captures(), 1);
  EXPECT_EQ(e.graph_replays(), 1);
  // Off: captured at the second run, as without products.
  ExecutorOptions off = on_cuda(true);
  off.tune_gemms = false;
  Executor plain(g, off);
  for (int run = 0; run < 3; ++run) expect_close(download(plain.run(device)), want, kGemm, "untuned");
  EXPECT_EQ(plain.graph_captures(), 1);
  EXPECT_EQ(plain.graph_replays(), 1);
}

TEST(CudaExecutor, UpdatesLandInTheInputsDeviceStorage) {
  KILN_REQUIRE_GPU();
  // %w's new value %c is computed after the last read of %w: written in place by its node.
  // %v is returned AND updated: the output shows the value from before the update.
  Graph g = parse(R"(
graph @upd(%x: f32[16] data, %w: f32[16] param, %v: f32[16] param) {
  %a = exp(%x)
  %b = mul(%a, %w)
  %c = neg(%b)
  %d = add(%c, %v)
  %s = sum(%d)
  update %w = %c
  update %v = %d
  return %s, %v
}
)");
  std::vector<Tensor> host = host_inputs(g, 11, 1);
  std::vector<Tensor> cpu_inputs = clones(host);
  std::vector<Tensor> cpu = Executor(g).run(cpu_inputs);
  for (bool graphs : {false, true}) {
    Executor e(g, on_cuda(graphs));
    EXPECT_EQ(e.direct_update_count(), 1u);  // %w; %v is an output, so copied at the end
    std::vector<Tensor> device = upload(host);
    const std::byte* w_pointer = device[1].raw();
    std::vector<Tensor> outputs = download(e.run(device));
    expect_close(outputs, cpu, kElementwise, "outputs");
    expect_close(download(device), cpu_inputs, kElementwise, "updated inputs");
    EXPECT_EQ(device[1].raw(), w_pointer);
    // By hand: w' = -exp(x) * w; v' = w' + v; the returned %v is the old v.
    for (int64_t i = 0; i < 16; ++i) {
      double w1 = -std::exp(host[0].get(i)) * host[1].get(i);
      EXPECT_NEAR(cuda::to_host(device[1]).get(i), w1, 1e-5 * (1 + std::abs(w1)));
      EXPECT_NEAR(cuda::to_host(device[2]).get(i), w1 + host[2].get(i), 1e-5 * (1 + std::abs(w1)));
      EXPECT_EQ(outputs[1].get(i), host[2].get(i));
    }
  }
}

TEST(CudaExecutor, OutputsAreOwnedAndReusedByTheExecutor) {
  KILN_REQUIRE_GPU();
  Graph g = parse(kElementwiseGraph);
  Executor e(g, on_cuda());
  std::vector<Tensor> in1 = upload(host_inputs(g, 1, 1)), in2 = upload(host_inputs(g, 2, 1));
  std::vector<Tensor> first = e.run(in1);
  Tensor kept = cuda::to_host(first[1]);
  std::vector<Tensor> second = e.run(in2);
  EXPECT_EQ(first[1].raw(), second[1].raw());
  EXPECT_EQ(first[1].device(), Device::kCuda);
  // The first run's output buffer now holds the second run's values.
  EXPECT_GT(max_scaled_error(cuda::to_host(first[1]), kept, 0, 1e-6), 1.0);
  EXPECT_GT(e.device_bytes(), 0u);
}

TEST(CudaExecutor, HostInputIsAClearError) {
  KILN_REQUIRE_GPU();
  Graph g = parse(kElementwiseGraph);
  Executor e(g, on_cuda());
  std::vector<Tensor> inputs = upload(host_inputs(g, 1, 1));
  inputs[1] = host_inputs(g, 1, 1)[1];
  try {
    e.run(inputs);
    FAIL() << "a host tensor was accepted";
  } catch (const Error& err) {
    std::string m = err.what();
    EXPECT_NE(m.find("'y'"), std::string::npos) << m;
    EXPECT_NE(m.find("cpu tensor"), std::string::npos) << m;
    EXPECT_NE(m.find("to_device"), std::string::npos) << m;
  }
}

TEST(CudaExecutor, NodeWithoutACudaKernelIsAClearError) {
  KILN_REQUIRE_GPU();
  Graph g = parse(kElementwiseGraph);
  ExecutorOptions o = on_cuda();
  o.dialects = {"no-such-dialect"};
  try {
    Executor e(g, o);
    FAIL() << "no kernel, no error";
  } catch (const Error& err) {
    std::string m = err.what();
    EXPECT_NE(m.find("node 0"), std::string::npos) << m;
    EXPECT_NE(m.find("exp(f32[257,33])"), std::string::npos) << m;
    EXPECT_NE(m.find("no cuda kernel"), std::string::npos) << m;
  }
}

TEST(CudaExecutor, ArenaThatCannotFitNamesTheBytes) {
  KILN_REQUIRE_GPU();
  // %a is 2^20 * 2^20 f32 = 4 TiB = 4096 GiB of intermediate.
  Graph g = parse(R"(
graph @huge(%x: f32[1048576, 1048576] data) {
  %a = exp(%x)
  %s = sum(%a)
  return %s
}
)");
  size_t before = cuda::allocated_bytes();
  try {
    Executor e(g, on_cuda());
    FAIL() << "a 4 TiB arena was accepted";
  } catch (const Error& err) {
    std::string m = err.what();
    EXPECT_NE(m.find("4096.00 GiB for intermediates"), std::string::npos) << m;
    EXPECT_NE(m.find("needs 4096.00 GiB"), std::string::npos) << m;
    EXPECT_NE(m.find("bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("free on"), std::string::npos) << m;
  }
  EXPECT_EQ(cuda::allocated_bytes(), before);
}

TEST(CudaExecutor, ProfileTimesEveryNodeAndChangesNoResult) {
  KILN_REQUIRE_GPU();
  Graph g = parse(kElementwiseGraph);
  std::vector<Tensor> inputs = upload(host_inputs(g, 9, 1));
  Executor plain(g, on_cuda(false));
  ExecutorOptions options = on_cuda(true);
  options.profile = true;  // overrides cuda_graphs: every run launches every kernel
  Executor profiling(g, options);
  EXPECT_THROW(profiling.profile(), Error);  // no run yet
  try {
    plain.profile();
    FAIL() << "profile() on a non-profiling executor must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ExecutorOptions::profile"), std::string::npos) << e.what();
  }
  std::vector<Tensor> want = download(plain.run(inputs));
  for (int run = 0; run < 3; ++run) {
    expect_close(download(profiling.run(inputs)), want, kSameKernels, "profiled run " + std::to_string(run));
    std::vector<NodeTiming> timings = profiling.profile();
    ASSERT_EQ(timings.size(), g.nodes.size());
    std::vector<std::string> dialects = profiling.node_dialects();
    for (size_t n = 0; n < timings.size(); ++n) {
      EXPECT_EQ(timings[n].node, static_cast<int64_t>(n));
      EXPECT_EQ(timings[n].op, std::string(op_name(g.nodes[n].op)));
      EXPECT_EQ(timings[n].dialect, dialects[n]);
      EXPECT_FALSE(timings[n].outputs.empty()) << n;
      EXPECT_GE(timings[n].ms, 0.0) << n;
      EXPECT_LT(timings[n].ms, 1000.0) << n;  // a 257x33 elementwise kernel, not a second
    }
  }
  EXPECT_EQ(profiling.graph_captures(), 0);
  EXPECT_EQ(profiling.graph_replays(), 0);
  EXPECT_NE(profile_table(profiling.profile(), 3).find("exp["), std::string::npos);
  // A training step (updates written into the inputs) gives what the unprofiled one gives.
  Graph step = sgd_training_graph(models::mlp(models::MlpConfig{16, 40, {24}, 5})).graph;
  expect_close(run_steps(step, options, 3, 5), run_steps(step, on_cuda(false), 3, 5), kSameKernels, "mlp sgd");
}

// The plan-off oracle on CUDA: every value its own bytes, every reshape its copy kernel.
ExecutorOptions plan_off_cuda() {
  ExecutorOptions o = on_cuda(false);
  o.plan_memory = false;
  return o;
}

// Runs a random graph (testing::random_graph) on both executors with inputs a, a, a (warm-up,
// capture, replay), b (new pointers: a new capture; views of graph inputs see them), b, a, and
// expects the same bits every time: outputs and the updated param (input 2).
void expect_runs_bitwise_equal(const Graph& g, const Executor& planned, const Executor& oracle, uint64_t seed) {
  std::vector<Tensor> host_a = host_inputs(g, seed, 1), host_b = host_inputs(g, seed + 100, 1);
  std::vector<Tensor> a_planned = upload(host_a), a_oracle = upload(host_a);
  std::vector<Tensor> b_planned = upload(host_b), b_oracle = upload(host_b);
  int run = 0;
  for (bool use_a : {true, true, true, false, false, true}) {
    std::vector<Tensor>& in_planned = use_a ? a_planned : b_planned;
    std::vector<Tensor>& in_oracle = use_a ? a_oracle : b_oracle;
    std::vector<Tensor> got = download(planned.run(in_planned));
    std::vector<Tensor> want = download(oracle.run(in_oracle));
    got.push_back(cuda::to_host(in_planned[2]));
    want.push_back(cuda::to_host(in_oracle[2]));
    expect_bitwise(got, want, "seed " + std::to_string(seed) + ", run " + std::to_string(run++));
  }
}

TEST(CudaExecutor, RandomGraphsWithViewsAreBitIdenticalToPlanOff) {
  KILN_REQUIRE_GPU();
  // The random graphs' kernels (elementwise, concat, split, row sums) add in a fixed order, so
  // the same kernels on the same bytes give the same bits (expect_runs_bitwise_equal).
  size_t views = 0, input_views = 0;
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    Graph g = testing::random_graph(seed, 60);
    Executor planned(g, on_cuda(true)), oracle(g, plan_off_cuda());
    ASSERT_NE(planned.memory_plan(), nullptr);
    const MemoryPlan& plan = *planned.memory_plan();
    EXPECT_TRUE(testing::no_live_overlap(g, plan)) << "seed " << seed;
    views += plan.view_count;
    for (size_t v = 0; v < g.values.size(); ++v)
      if (plan.is_view(static_cast<ValueId>(v)))
        input_views += g.input_index(view_root(plan.views, static_cast<ValueId>(v))) >= 0;
    expect_runs_bitwise_equal(g, planned, oracle, seed);
    EXPECT_EQ(planned.graph_captures(), 3) << "seed " << seed;
    EXPECT_EQ(planned.graph_replays(), 2) << "seed " << seed;
  }
  EXPECT_GT(views, 0u);
  EXPECT_GT(input_views, 0u);
}

TEST(CudaExecutor, Gpt2TinyStepsWithViewsMatchPlanOff) {
  KILN_REQUIRE_GPU();
  models::GptConfig config = models::gpt_config("gpt2-tiny");
  config.batch = 2;
  config.seq = 16;
  Graph g = sgd_training_graph(models::gpt(config)).graph;
  EXPECT_GT(Executor(g, on_cuda()).memory_plan()->view_count, 0u);  // heads, logits
  // Same kernels but the reshape copies; the embedding gradient adds with atomics: 1e-6.
  expect_close(run_steps(g, on_cuda(true), 3, static_cast<double>(config.vocab)),
               run_steps(g, plan_off_cuda(), 3, static_cast<double>(config.vocab)), kSameKernels, "gpt2-tiny");
}

TEST(CudaExecutor, AViewOfAParamDelaysItsDirectUpdate) {
  KILN_REQUIRE_GPU();
  // %wv views the param %w; its new value %nw reads neither. Read before %nw: neg writes it
  // straight into %w. Read after: %w keeps its old bytes until then; the update is a copy.
  const char* before = R"(
graph @before(%x: f32[4,16] data, %w: f32[4,16] param) {
  %wv = reshape(%w) {shape=[64]}
  %t = tanh(%wv)
  %a = exp(%x)
  %nw = neg(%a)
  %s = sum(%t)
  update %w = %nw
  return %s
}
)";
  const char* after = R"(
graph @after(%x: f32[4,16] data, %w: f32[4,16] param) {
  %wv = reshape(%w) {shape=[64]}
  %a = exp(%x)
  %nw = neg(%a)
  %t = tanh(%wv)
  %s = sum(%t)
  update %w = %nw
  return %s
}
)";
  for (auto [text, direct] : {std::pair{before, 1u}, {after, 0u}}) {
    Graph g = parse(text);
    std::vector<Tensor> host = host_inputs(g, 21, 1);
    for (bool graphs : {false, true}) {
      Executor e(g, on_cuda(graphs));
      EXPECT_EQ(e.memory_plan()->view_count, 1u);
      EXPECT_EQ(e.direct_update_count(), direct) << g.name;
      for (int run = 0; run < 3; ++run) {  // each run from the same old w
        std::vector<Tensor> device = upload(host);
        Tensor s = download(e.run(device))[0];
        Tensor w = cuda::to_host(device[1]);
        // By hand: s sums tanh of the OLD w; the new w is -exp(x).
        double want = 0;
        for (int64_t i = 0; i < 64; ++i) {
          want += std::tanh(host[1].get(i));
          EXPECT_NEAR(w.get(i), -std::exp(host[0].get(i)), 1e-5 * std::exp(host[0].get(i))) << g.name << " " << i;
        }
        EXPECT_NEAR(s.get(0), want, 1e-4) << g.name << " graphs " << graphs << " run " << run;
      }
    }
  }
}

TEST(CudaExecutor, ProfileListsViewsAtZeroMilliseconds) {
  KILN_REQUIRE_GPU();
  Graph g = parse(R"(
graph @views(%x: f32[64,48] data) {
  %a = exp(%x)
  %v = reshape(%a) {shape=[48,64]}
  %xv = reshape(%x) {shape=[3072]}
  %b = tanh(%v)
  %c = neg(%xv)
  %s = sum(%b)
  %t = sum(%c)
  %u = add(%s, %t)
  return %u
}
)");
  ExecutorOptions options = on_cuda(true);
  options.profile = true;
  Executor profiling(g, options);
  EXPECT_EQ(profiling.memory_plan()->view_count, 2u);
  std::vector<Tensor> inputs = upload(host_inputs(g, 4, 1));
  Tensor want = download(Executor(g, plan_off_cuda()).run(inputs))[0];
  expect_bitwise(download(profiling.run(inputs)), {want}, "profiled");
  std::vector<NodeTiming> timings = profiling.profile();
  ASSERT_EQ(timings.size(), g.nodes.size());
  for (size_t n = 0; n < timings.size(); ++n) {
    const bool view = n == 1 || n == 2;
    EXPECT_EQ(timings[n].op, std::string(op_name(g.nodes[n].op)));
    EXPECT_EQ(timings[n].dialect == "view", view) << n << " " << timings[n].dialect;
    if (view) {
      EXPECT_EQ(timings[n].ms, 0.0) << n;
    }
  }
  EXPECT_NE(profile_table(timings, 3).find("reshape[view]"), std::string::npos) << profile_table(timings, 3);
}


TEST(CudaExecutor, SliceViewsAreBitIdenticalToPlanOff) {
  KILN_REQUIRE_GPU();
  Graph g = parse(testing::kSliceViews);
  const std::vector<Tensor> host_a = host_inputs(g, 31, 1), host_b = host_inputs(g, 32, 1);
  for (bool graphs : {false, true}) {
    Executor planned(g, on_cuda(graphs)), oracle(g, plan_off_cuda());
    const MemoryPlan& plan = *planned.memory_plan();
    EXPECT_EQ(plan.view_count, 8u);  // every slice and the reshape
    EXPECT_TRUE(testing::no_live_overlap(g, plan));
    std::vector<Tensor> a_planned = upload(host_a), a_oracle = upload(host_a);
    std::vector<Tensor> b_planned = upload(host_b), b_oracle = upload(host_b);
    int run = 0;
    for (bool use_a : {true, true, true, false, true}) {
      std::vector<Tensor>& in_planned = use_a ? a_planned : b_planned;
      std::vector<Tensor>& in_oracle = use_a ? a_oracle : b_oracle;
      std::vector<Tensor> got = download(planned.run(in_planned));
      std::vector<Tensor> want = download(oracle.run(in_oracle));
      got.push_back(cuda::to_host(in_planned[2]));  // the updated param
      want.push_back(cuda::to_host(in_oracle[2]));
      expect_bitwise(got, want, "graphs " + std::to_string(graphs) + ", run " + std::to_string(run++));
    }
  }
  // The profile lists every slice view at 0 ms, and changes no result.
  ExecutorOptions options = on_cuda(true);
  options.profile = true;
  Executor profiling(g, options);
  std::vector<Tensor> inputs = upload(host_a), oracle_inputs = upload(host_a);
  expect_bitwise(download(profiling.run(inputs)), download(Executor(g, plan_off_cuda()).run(oracle_inputs)),
                 "profiled");
  const std::vector<NodeTiming> timings = profiling.profile();
  ASSERT_EQ(timings.size(), g.nodes.size());
  size_t views = 0;
  for (size_t n = 0; n < timings.size(); ++n) {
    const Op op = g.nodes[n].op;
    const bool view = op == Op::kSlice || op == Op::kReshape;
    EXPECT_EQ(timings[n].dialect == "view", view) << n << " " << timings[n].dialect;
    if (view) {
      EXPECT_EQ(timings[n].ms, 0.0) << n;
      ++views;
    }
  }
  EXPECT_EQ(views, 8u);
}

TEST(CudaExecutor, RandomGraphsWithSliceViewsAreBitIdenticalToPlanOff) {
  KILN_REQUIRE_GPU();
  size_t offset_views = 0;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    Graph g = testing::random_graph(seed, 60, /*slices=*/true);
    Executor planned(g, on_cuda(true)), oracle(g, plan_off_cuda());
    const MemoryPlan& plan = *planned.memory_plan();
    EXPECT_TRUE(testing::no_live_overlap(g, plan)) << "seed " << seed;
    for (size_t v = 0; v < g.values.size(); ++v)
      offset_views += plan.is_view(static_cast<ValueId>(v)) && plan.root_offset(static_cast<ValueId>(v)) > 0;
    expect_runs_bitwise_equal(g, planned, oracle, seed);
  }
  EXPECT_GT(offset_views, 0u);
}

TEST(CudaMemory, RoundTripsAndAsyncCopies) {
  KILN_REQUIRE_GPU();
  Tensor host = random_tensor({DType::kBF16, {3, 1001}}, 4);
  Tensor device = cuda::to_device(host);
  EXPECT_EQ(device.device(), Device::kCuda);
  EXPECT_THROW(device.get(0), Error);  // host accessors refuse device tensors
  expect_bitwise({cuda::to_host(device)}, {host}, "round trip");
  cuda::Stream stream;
  Tensor pinned = cuda::pinned_tensor(host.type());
  Tensor other = cuda::device_tensor(host.type());
  cuda::copy_async(other, device, stream.handle());
  cuda::copy_async(pinned, other, stream.handle());
  stream.synchronize();
  expect_bitwise({pinned}, {host}, "device to device to pinned");
  cuda::UploadStaging staging(2);
  for (int k = 0; k < 5; ++k) {
    Tensor fresh = random_tensor(host.type(), 10 + k);
    staging.upload(std::vector<Tensor>{fresh}, std::vector<Tensor>{other}, stream.handle());
    fresh = Tensor();  // staging copied it: the host tensor may go at once
    stream.synchronize();
    expect_bitwise({cuda::to_host(other)}, {random_tensor(host.type(), 10 + k)}, "staged upload");
  }
  size_t before = cuda::allocated_bytes();
  { Tensor t = cuda::device_tensor({DType::kF32, {1 << 20}}); EXPECT_EQ(cuda::allocated_bytes(), before + (4u << 20)); }
  EXPECT_EQ(cuda::allocated_bytes(), before);
  EXPECT_THROW(cuda::allocate(size_t{1} << 50, "a 1 PiB test buffer"), Error);
}

}  // namespace
}  // namespace kiln

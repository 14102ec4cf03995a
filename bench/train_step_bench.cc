// CPU training-step benchmark: ms/step of train::Trainer (forward, backward, AdamW as one
// graph) for the MLP that `kiln train` runs (batch 64, 784-256-10) and gpt2-tiny (batch 4,
// T 64), next to bench/torch_cpu_train_step.py's PyTorch numbers (bench/log/sessions-1-12.md).
//
// For each model it prints the median / min / max ms of N timed steps after W warmup steps,
// the forward alone (a compiled forward step) and forward + backward (an Executor on the raw
// autodiff graph), and a per-op profile of the training graph: the executor's loop run here node by
// node with a clock around each kernel, summed per (op, dialect) over the timed repetitions.
// The profile's total is close to the step's (it leaves out only the Trainer's bookkeeping).
//
// Usage: train_step_bench [--steps N] [--warmup W] [--top K]   (defaults 200, 20, 12)
// Threads: OMP_NUM_THREADS for the "cpu" kernels, OPENBLAS_NUM_THREADS for GEMM (default: all).
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "compile/compile_step.h"
#include "ir/op.h"
#include "models/models.h"
#include "passes/autodiff.h"
#include "runtime/executor.h"
#include "train/trainer.h"

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

struct Stats {
  double median, min, max;
};

Stats stats_of(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  return Stats{ms[ms.size() / 2], ms.front(), ms.back()};
}

// Median etc. of `steps` calls of fn after `warmup` untimed ones, in ms.
Stats time_calls(int warmup, int steps, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    const auto start = Clock::now();
    fn();
    ms.push_back(ms_since(start));
  }
  return stats_of(ms);
}

// A model to benchmark: its forward graph, initial params and one fixed batch.
struct Task {
  std::string name;
  Graph forward;
  std::vector<Tensor> params;
  std::vector<Tensor> batch;
};

Task mlp_task() {
  Task t{"mlp", models::mlp(models::MlpConfig{64, 784, {256}, 10}), {}, {}};
  t.params = models::init_params(t.forward, 1);
  t.batch = {random_tensor(TensorType{DType::kF32, {64, 784}}, 2, 0.0, 1.0),
             random_tensor(TensorType{DType::kI64, {64}}, 3, 0.0, 10.0)};
  return t;
}

Task gpt2_tiny_task() {
  const models::GptConfig c = models::gpt_config("gpt2-tiny");
  Task t{"gpt2-tiny", models::gpt(c), {}, {}};
  t.params = models::init_params(t.forward, 1234, c.layers);
  const TensorType tokens{DType::kI64, {c.batch, c.seq}};
  t.batch = {random_tensor(tokens, 4, 0.0, static_cast<double>(c.vocab)),
             random_tensor(tokens, 5, 0.0, static_cast<double>(c.vocab))};
  return t;
}

// All inputs of a graph: params, then the batch for data inputs, zeros for state, lr 1e-3.
std::vector<Tensor> bind_inputs(const Graph& g, const Task& task) {
  std::vector<Tensor> out;
  size_t p = 0, d = 0;
  for (const GraphInput& in : g.inputs) {
    const Value& v = g.value(in.value);
    if (in.role == Role::kParam) {
      out.push_back(task.params.at(p++).clone());
    } else if (in.role == Role::kData && v.type.rank() == 0 && v.name == "lr") {
      Tensor lr(v.type);
      lr.set(0, 1e-3);
      out.push_back(lr);
    } else if (in.role == Role::kData) {
      out.push_back(task.batch.at(d++));
    } else {
      out.push_back(Tensor(v.type));  // optimizer state starts at zero
    }
  }
  return out;
}

// The executor's loop with a clock around each kernel: ms per (op, dialect), summed over reps.
std::map<std::string, double> profile(const Graph& g, std::span<const Tensor> inputs, int reps) {
  std::vector<const KernelImpl*> kernels;
  for (const Node& node : g.nodes) {
    std::vector<TensorType> in, out;
    for (ValueId id : node.inputs) in.push_back(g.type(id));
    for (ValueId id : node.outputs) out.push_back(g.type(id));
    kernels.push_back(&kernel_registry().select(NodeView{node, in, out}, Device::kCpu, {}));
  }
  std::map<std::string, double> ms;
  for (int r = 0; r < reps; ++r) {
    std::vector<Tensor> values(g.values.size());
    for (size_t i = 0; i < inputs.size(); ++i) values[g.inputs[i].value] = inputs[i];
    for (size_t n = 0; n < g.nodes.size(); ++n) {
      const Node& node = g.nodes[n];
      std::vector<Tensor> args_in, args_out;
      for (ValueId id : node.inputs) args_in.push_back(values[id]);
      const auto start = Clock::now();
      for (ValueId id : node.outputs) args_out.push_back(Tensor(g.type(id)));
      kernels[n]->kernel(KernelArgs{node.attrs, args_in, args_out, nullptr, node.body.get()});
      ms[fmt::format("{} [{}]", op_name(node.op), kernels[n]->dialect)] += ms_since(start);
      for (size_t i = 0; i < node.outputs.size(); ++i) values[node.outputs[i]] = args_out[i];
    }
  }
  for (auto& [key, value] : ms) value /= reps;
  return ms;
}

void run(const Task& task, int warmup, int steps, int top) {
  OptimizerConfig config;  // adamw with its defaults, lr 1e-3, constant schedule
  train::Trainer trainer(task.forward, config, task.params);
  const Stats step = time_calls(warmup, steps, [&] { trainer.step(task.batch); });
  // The same step with every pass of the pipeline disabled: what the passes are worth.
  PassOptions no_passes;
  no_passes.disabled = {"all"};
  train::Trainer plain(task.forward, config, task.params, {}, no_passes);
  const Stats plain_step = time_calls(warmup, steps, [&] { plain.step(task.batch); });

  CompileOptions forward_only;
  forward_only.kind = StepKind::kForward;
  const CompiledStep forward = compile_step(task.forward, forward_only);
  const std::vector<Tensor> fwd_inputs = bind_inputs(task.forward, task);
  const Stats fwd = time_calls(warmup, steps, [&] { forward.executor->run(fwd_inputs); });

  std::vector<ValueId> wrt;
  for (const GraphInput& in : task.forward.inputs)
    if (in.role == Role::kParam) wrt.push_back(in.value);
  AutodiffResult ad = autodiff(task.forward, task.forward.outputs[0], wrt);
  ad.graph.outputs.insert(ad.graph.outputs.end(), ad.gradients.begin(), ad.gradients.end());
  Executor backward(ad.graph);
  const std::vector<Tensor> bwd_inputs = bind_inputs(ad.graph, task);
  const Stats fwd_bwd = time_calls(warmup, steps, [&] { backward.run(bwd_inputs); });

  const Graph& g = trainer.program().graph;
  fmt::print("{}: {} nodes in the training graph\n", task.name, g.nodes.size());
  fmt::print("  train step        {:8.3f} ms (min {:.3f}, max {:.3f})\n", step.median, step.min,
             step.max);
  fmt::print("  train step, no passes {:8.3f} ms (min {:.3f}, max {:.3f}): passes give {:.2f}x\n",
             plain_step.median, plain_step.min, plain_step.max, plain_step.median / step.median);
  const auto peak_mib = [](const train::Trainer& t) {
    const MemoryPlan* plan = t.step_executor().memory_plan();
    return plan ? static_cast<double>(plan->arena_bytes) / (1 << 20) : 0.0;
  };
  fmt::print("  planned peak      {:8.2f} MiB with passes, {:.2f} MiB without ({} and {} of {} "
             "updates written in place)\n",
             peak_mib(trainer), peak_mib(plain), trainer.step_executor().direct_update_count(),
             plain.step_executor().direct_update_count(), g.updates.size());
  fmt::print("  forward           {:8.3f} ms (min {:.3f}, max {:.3f})\n", fwd.median, fwd.min,
             fwd.max);
  fmt::print("  forward+backward  {:8.3f} ms (min {:.3f}, max {:.3f})\n", fwd_bwd.median,
             fwd_bwd.min, fwd_bwd.max);

  const std::vector<Tensor> step_inputs = bind_inputs(g, task);
  profile(g, step_inputs, warmup);
  std::map<std::string, double> ms = profile(g, step_inputs, steps);
  std::vector<std::pair<double, std::string>> rows;
  double total = 0;
  for (const auto& [key, value] : ms) {
    rows.emplace_back(value, key);
    total += value;
  }
  std::sort(rows.rbegin(), rows.rend());
  fmt::print("  per-op profile of the step (mean ms over {} runs; total {:.3f} ms):\n", steps,
             total);
  for (int i = 0; i < top && i < static_cast<int>(rows.size()); ++i)
    fmt::print("    {:36s} {:8.3f} ms  {:5.1f}%\n", rows[i].second, rows[i].first,
               100.0 * rows[i].first / total);
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  int steps = 200, warmup = 20, top = 12;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--steps") steps = value;
    else if (flag == "--warmup") warmup = value;
    else if (flag == "--top") top = value;
    else {
      fmt::print(stderr, "usage: {} [--steps N] [--warmup W] [--top K]\n", argv[0]);
      return 2;
    }
  }
  if (steps < 1 || warmup < 0) {
    fmt::print(stderr, "--steps must be >= 1 and --warmup >= 0\n");
    return 2;
  }
  try {
    kiln::run(kiln::mlp_task(), warmup, steps, top);
    kiln::run(kiln::gpt2_tiny_task(), warmup, steps, top);
  } catch (const std::exception& e) {
    fmt::print(stderr, "train_step_bench: {}\n", e.what());
    return 1;
  }
  return 0;
}

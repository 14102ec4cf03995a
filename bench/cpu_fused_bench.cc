// Fused vs unfused on the CPU: the same nodes run one by one (each a full pass over memory) and
// as one `fused` node (backends/cpu/fused.cc: one pass over row tiles). Two measurements each:
//   kernels   the selected kernels on preallocated tensors (unfused: every intermediate has its
//             own buffer, as the memory plan gives it), best of N: what fusion saves in the
//             kernels themselves;
//   executor  Executor::run of a graph holding the nodes vs one holding the fused node (it
//             allocates and zero-fills the graph outputs every run, in both cases).
// Bytes: unfused = every node reads its inputs and writes its outputs once; fused = the group's
// inputs and outputs only. GB/s = those bytes / best time. Prints one markdown table.
//
// Usage: cpu_fused_bench [--quick] [--tile-bytes N]
//   (threads: OMP_NUM_THREADS, OPENBLAS_NUM_THREADS; --tile-bytes: the tile policy's target)
#include <fmt/core.h>
#include <omp.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/fused.h"
#include "ir/graph.h"
#include "models/models.h"
#include "runtime/executor.h"
#include "tensor/tensor.h"
#include "train/trainer.h"

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;

double best_time(int reps, const std::function<void()>& fn) {
  fn();  // warm-up: first-touch of buffers, thread pool start
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

TensorType f32(Shape shape) { return TensorType{DType::kF32, std::move(shape)}; }

// The body's nodes as a plain graph: one kernel call per node on preallocated tensors.
class UnfusedCalls {
 public:
  UnfusedCalls(const Graph& g, const std::vector<Tensor>& inputs)
      : g_(g), values_(g.values.size()) {
    for (size_t i = 0; i < g.inputs.size(); ++i) values_[g.inputs[i].value] = inputs[i];
    for (const Node& node : g.nodes) {
      std::vector<TensorType> in_types, out_types;
      for (ValueId id : node.inputs) in_types.push_back(g.type(id));
      for (ValueId id : node.outputs) {
        out_types.push_back(g.type(id));
        values_[id] = Tensor(g.type(id));
      }
      impls_.push_back(&kernel_registry().select(NodeView{node, in_types, out_types},
                                                 Device::kCpu, {}));
    }
  }
  void operator()() {
    std::vector<Tensor> ins, outs;
    for (size_t n = 0; n < g_.nodes.size(); ++n) {
      const Node& node = g_.nodes[n];
      ins.clear();
      outs.clear();
      for (ValueId id : node.inputs) ins.push_back(values_[id]);
      for (ValueId id : node.outputs) outs.push_back(values_[id]);
      impls_[n]->kernel(KernelArgs{node.attrs, ins, outs});
    }
  }
  // Bytes every node reads and writes.
  double bytes() const {
    double b = 0;
    for (const Node& node : g_.nodes) {
      for (ValueId id : node.inputs) b += static_cast<double>(g_.type(id).bytes());
      for (ValueId id : node.outputs) b += static_cast<double>(g_.type(id).bytes());
    }
    return b;
  }
  std::string dialects() const {
    std::string s;
    for (const KernelImpl* impl : impls_) s += (s.empty() ? "" : ",") + impl->dialect;
    return s;
  }

 private:
  const Graph& g_;
  std::vector<Tensor> values_;
  std::vector<const KernelImpl*> impls_;
};

// `body` wrapped as the one fused node of a graph.
Graph fused_graph(const Graph& body, const std::string& kind) {
  Graph g;
  std::vector<ValueId> ins;
  for (const GraphInput& in : body.inputs)
    ins.push_back(g.add_input(body.value(in.value).name, body.type(in.value), Role::kData));
  g.outputs = g.add_node(Op::kFused, ins, {{"kind", kind}}, std::make_shared<const Graph>(body));
  return g;
}

struct Case {
  std::string name, kind;
  Graph body;
};

void run_case(const Case& c, int reps) {
  std::vector<Tensor> inputs;
  uint64_t seed = 1;
  for (const GraphInput& in : c.body.inputs)
    inputs.push_back(random_tensor(c.body.type(in.value), seed++, 0.1, 1.0));

  // Kernels only.
  UnfusedCalls unfused(c.body, inputs);
  const Graph fg = fused_graph(c.body, c.kind);
  const Node& fnode = fg.nodes[0];
  std::vector<TensorType> in_types, out_types;
  std::vector<Tensor> outputs;
  for (ValueId id : fnode.inputs) in_types.push_back(fg.type(id));
  for (ValueId id : fnode.outputs) {
    out_types.push_back(fg.type(id));
    outputs.emplace_back(fg.type(id));
  }
  const KernelImpl& impl =
      kernel_registry().select(NodeView{fnode, in_types, out_types}, Device::kCpu, {});
  double fused_bytes = 0;
  for (const Tensor& t : inputs) fused_bytes += static_cast<double>(t.bytes());
  for (const Tensor& t : outputs) fused_bytes += static_cast<double>(t.bytes());

  const double t_unfused = best_time(reps, [&] { unfused(); });
  const double t_fused = best_time(reps, [&] {
    impl.kernel(KernelArgs{fnode.attrs, inputs, outputs, nullptr, fnode.body.get()});
  });

  // Through the executor.
  Executor unfused_exec(c.body);
  Executor fused_exec(fg);
  const double e_unfused = best_time(reps, [&] { unfused_exec.run(inputs); });
  const double e_fused = best_time(reps, [&] { fused_exec.run(inputs); });

  const cpu::FusedPlanInfo info = cpu::fused_plan_info(c.body);
  fmt::print("| {} | {} | {:.2f} ms ({:.1f} GB/s) | {:.2f} ms ({:.1f} GB/s) | {:.2f}x | "
             "{:.2f} ms | {:.2f} ms | {:.2f}x | {} x {} rows |\n",
             c.name, unfused.dialects(), t_unfused * 1e3, unfused.bytes() / t_unfused / 1e9,
             t_fused * 1e3, fused_bytes / t_fused / 1e9, t_unfused / t_fused, e_unfused * 1e3,
             e_fused * 1e3, e_unfused / e_fused, info.tiles, info.tile_rows);
  if (impl.dialect != "cpu")
    fmt::print("  (fused node ran on {}: {})\n", impl.dialect, info.why_not);
}

Graph elementwise_chain(int64_t rows, int64_t c) {
  Graph g;
  ValueId x = g.add_input("x", f32({rows, c}), Role::kData);
  ValueId bias = g.add_input("bias", f32({c}), Role::kData);
  ValueId s = g.add_input("s", f32({}), Role::kData);
  ValueId h = g.add(Op::kAdd, {x, bias});
  h = g.add(Op::kGelu, {h});
  h = g.add(Op::kMul, {h, s});
  g.outputs = {g.add(Op::kTanh, {h})};
  return g;
}

// (x + bias) * s + res, relu: cheap ops, so memory bound.
Graph cheap_chain(int64_t rows, int64_t c) {
  Graph g;
  ValueId x = g.add_input("x", f32({rows, c}), Role::kData);
  ValueId bias = g.add_input("bias", f32({c}), Role::kData);
  ValueId s = g.add_input("s", f32({}), Role::kData);
  ValueId res = g.add_input("res", f32({rows, c}), Role::kData);
  ValueId h = g.add(Op::kMul, {g.add(Op::kAdd, {x, bias}), s});
  g.outputs = {g.add(Op::kRelu, {g.add(Op::kAdd, {h, res})})};
  return g;
}

Graph add_layer_norm(int64_t rows, int64_t c) {
  Graph g;
  ValueId x = g.add_input("x", f32({rows, c}), Role::kData);
  ValueId r = g.add_input("res", f32({rows, c}), Role::kData);
  ValueId gamma = g.add_input("gamma", f32({c}), Role::kData);
  ValueId beta = g.add_input("beta", f32({c}), Role::kData);
  ValueId h = g.add(Op::kAdd, {x, r});
  g.outputs = {h, g.add(Op::kLayerNorm, {h, gamma, beta})};
  return g;
}

Graph bias_grad(int64_t rows, int64_t c) {
  Graph g;
  ValueId x = g.add_input("x", f32({rows, c}), Role::kData);
  ValueId dy = g.add_input("dy", f32({rows, c}), Role::kData);
  ValueId dx = g.add(Op::kGeluGrad, {x, dy});
  g.outputs = {dx, g.add(Op::kSum, {dx}, {{"axes", std::vector<int64_t>{0}}})};
  return g;
}

Graph gemm_bias_gelu(int64_t rows, int64_t k, int64_t n) {
  Graph g;
  ValueId a = g.add_input("a", f32({rows, k}), Role::kData);
  ValueId w = g.add_input("w", f32({k, n}), Role::kData);
  ValueId bias = g.add_input("bias", f32({n}), Role::kData);
  ValueId c = g.add(Op::kMatmul, {a, w});
  g.outputs = {g.add(Op::kGelu, {g.add(Op::kAdd, {c, bias})})};
  return g;
}

// A whole training step of a GPT (the default pipeline, whose fusion pass outlines the groups)
// against the same step with the fusion pass disabled: ms per step, best of `reps`.
void training_step(const std::string& model, int reps) {
  models::GptConfig config = models::gpt_config(model);
  const Graph forward = models::gpt(config);
  const std::vector<Tensor> init = models::init_params(forward, 1, config.layers);
  const std::vector<Tensor> batch = {
      random_tensor(TensorType{DType::kI64, {config.batch, config.seq}}, 2, 0, config.vocab),
      random_tensor(TensorType{DType::kI64, {config.batch, config.seq}}, 3, 0, config.vocab)};
  auto time_steps = [&](PassOptions passes, int* fused_nodes) {
    std::vector<Tensor> params;
    for (const Tensor& t : init) params.push_back(t.clone());
    train::Trainer trainer(forward, OptimizerConfig{}, params, {}, std::move(passes));
    *fused_nodes = 0;
    for (const Node& node : trainer.program().graph.nodes) *fused_nodes += node.op == Op::kFused;
    int on_reference = 0;
    for (const std::string& d : trainer.step_executor().node_dialects())
      on_reference += d == "reference";
    fmt::print("  ({} nodes, {} fused, {} on the reference kernels)\n",
               trainer.program().graph.nodes.size(), *fused_nodes, on_reference);
    return best_time(reps, [&] { trainer.step(batch); });
  };
  try {
    PassOptions off;
    off.disabled = {"fusion"};
    int n_on = 0, n_off = 0;
    const double t_off = time_steps(off, &n_off);
    const double t_on = time_steps({}, &n_on);
    fmt::print("\n{} training step (B={}, T={}, C={}, vocab {}): unfused {:.2f} ms, "
               "fused {:.2f} ms ({} fused nodes): {:.2f}x\n",
               model, config.batch, config.seq, config.d_model, config.vocab, t_off * 1e3,
               t_on * 1e3, n_on, t_off / t_on);
  } catch (const Error& e) {
    fmt::print("\n{} training step: not measured ({})\n", model, e.what());
  }
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  using namespace kiln;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--tile-bytes") == 0 && i + 1 < argc)
      cpu::set_fused_tile_bytes(std::atoll(argv[++i]));
  }
  const int64_t rows = quick ? 1024 : 8192, c = 768;
  const int reps = quick ? 3 : 20;
  fmt::print("cpu_fused_bench: {} x {} f32, {} OpenMP threads, best of {}\n\n", rows, c,
             omp_get_max_threads(), reps);
  fmt::print("| group | unfused dialects | unfused kernels | fused kernel | speedup | "
             "unfused executor | fused executor | speedup | tiles |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|\n");
  run_case({"add, mul, add, relu (4 cheap ops)", "elementwise", cheap_chain(rows, c)}, reps);
  run_case({"add, gelu, mul, tanh (4 ops)", "elementwise", elementwise_chain(rows, c)}, reps);
  run_case({"add + layer_norm (h and y out)", "rows", add_layer_norm(rows, c)}, reps);
  run_case({"gelu_grad + bias grad (column sum)", "elementwise", bias_grad(rows, c)}, reps);
  run_case({"matmul (K=768) + bias + gelu", "gemm-epilogue", gemm_bias_gelu(rows, c, c)},
           quick ? reps : 5);
  training_step("gpt2-tiny", quick ? 3 : 10);
  return 0;
}

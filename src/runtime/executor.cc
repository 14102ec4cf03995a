#include "runtime/executor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "ir/verifier.h"
#include "support/error.h"

namespace kiln {
namespace {
std::vector<TensorType> types_of(const Graph& g, const std::vector<ValueId>& ids) {
  std::vector<TensorType> out;
  for (ValueId id : ids) out.push_back(g.type(id));
  return out;
}

std::shared_ptr<std::byte[]> allocate_arena(size_t bytes, bool poison) {
  // Never empty: a Tensor view of a null storage would read as undefined.
  size_t rounded = aligned_bytes(std::max<size_t>(bytes, 1));
  auto* p = static_cast<std::byte*>(std::aligned_alloc(MemoryPlan::kAlignment, rounded));
  if (!p) fail("out of host memory allocating a {}-byte arena", rounded);
  std::memset(p, poison ? 0xFF : 0, rounded);
  return std::shared_ptr<std::byte[]>(p, [](std::byte* q) { std::free(q); });
}
}  // namespace

Executor::Executor(Graph graph, ExecutorOptions options)
    : graph_(std::move(graph)), options_(std::move(options)) {
  verify(graph_);
  const KernelRegistry& registry = kernel_registry();
  for (const Node& node : graph_.nodes) {
    std::vector<TensorType> in = types_of(graph_, node.inputs);
    std::vector<TensorType> out = types_of(graph_, node.outputs);
    kernels_.push_back(&registry.select(NodeView{node, in, out}, options_.device, options_.dialects));
  }
  if (options_.plan_memory) {
    plan_ = plan_memory(graph_, [this](size_t node, size_t) { return kernels_[node]->in_place_ok; });
    arena_ = allocate_arena(plan_.arena_bytes, options_.poison_arena);
    last_use_ = plan_.liveness.last;
  } else {
    last_use_ = compute_liveness(graph_).last;
  }
}

std::vector<std::string> Executor::node_dialects() const {
  std::vector<std::string> out;
  for (const KernelImpl* k : kernels_) out.push_back(k->dialect);
  return out;
}

std::vector<Tensor> Executor::run(std::span<const Tensor> inputs) const {
  KILN_CHECK(inputs.size() == graph_.inputs.size(), "graph '{}' takes {} inputs, {} were given",
             graph_.name, graph_.inputs.size(), inputs.size());
  std::vector<Tensor> values(graph_.values.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Value& v = graph_.value(graph_.inputs[i].value);
    KILN_CHECK(inputs[i].defined() && inputs[i].type() == v.type,
               "input '{}' must be {}, got {}", v.name, to_string(v.type),
               inputs[i].defined() ? to_string(inputs[i].type()) : "no tensor");
    values[graph_.inputs[i].value] = inputs[i];
  }
  const bool planned = options_.plan_memory;
  std::vector<Tensor> args_in, args_out;
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    const Node& node = graph_.nodes[n];
    const int index = static_cast<int>(n);
    args_in.clear();
    args_out.clear();
    for (ValueId id : node.inputs) args_in.push_back(values[id]);
    for (ValueId id : node.outputs) {
      if (planned && plan_.in_arena(id)) {
        args_out.push_back(Tensor(graph_.type(id), arena_, static_cast<size_t>(plan_.offsets[id])));
      } else {
        args_out.push_back(Tensor(graph_.type(id)));
      }
    }
    kernels_[n]->kernel(KernelArgs{node.attrs, args_in, args_out});
    for (size_t i = 0; i < node.outputs.size(); ++i) values[node.outputs[i]] = args_out[i];
    // Release what no later node reads (graph inputs stay owned by the caller anyway; arena
    // views only drop a reference).
    for (ValueId id : node.inputs)
      if (last_use_[id] == index) values[id] = Tensor();
    for (ValueId id : node.outputs)
      if (last_use_[id] == index) values[id] = Tensor();
  }
  std::vector<Tensor> outputs;
  for (ValueId id : graph_.outputs) outputs.push_back(values[id]);
  // Outputs that alias an updated input must show the value from before the update.
  for (size_t i = 0; i < outputs.size(); ++i)
    for (const Update& u : graph_.updates)
      if (graph_.outputs[i] == u.target) outputs[i] = outputs[i].clone();
  // In-place updates: new param/state values overwrite the caller's input tensors.
  for (const Update& u : graph_.updates) {
    const Tensor& target = inputs[graph_.input_index(u.target)];
    std::memcpy(target.raw(), values[u.value].raw(), target.bytes());
  }
  return outputs;
}

}  // namespace kiln

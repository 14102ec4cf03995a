#include "runtime/executor.h"

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
  last_use_.assign(graph_.values.size(), -1);
  for (size_t n = 0; n < graph_.nodes.size(); ++n)
    for (ValueId id : graph_.nodes[n].inputs) last_use_[id] = static_cast<int>(n);
  for (ValueId id : graph_.outputs) last_use_[id] = static_cast<int>(graph_.nodes.size());
  for (const Update& u : graph_.updates) last_use_[u.value] = static_cast<int>(graph_.nodes.size());
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
  std::vector<Tensor> args_in, args_out;
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    const Node& node = graph_.nodes[n];
    args_in.clear();
    args_out.clear();
    for (ValueId id : node.inputs) args_in.push_back(values[id]);
    for (ValueId id : node.outputs) args_out.push_back(Tensor(graph_.type(id)));
    kernels_[n]->kernel(KernelArgs{node.attrs, args_in, args_out});
    for (size_t i = 0; i < node.outputs.size(); ++i) values[node.outputs[i]] = args_out[i];
    // Release what no later node reads (graph inputs stay owned by the caller anyway).
    for (ValueId id : node.inputs)
      if (last_use_[id] == static_cast<int>(n)) values[id] = Tensor();
    for (ValueId id : node.outputs)
      if (last_use_[id] < 0) values[id] = Tensor();
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

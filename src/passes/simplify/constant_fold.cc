#include "passes/simplify/constant_fold.h"

#include <bit>
#include <cmath>
#include <optional>
#include <vector>

#include "ir/op_def.h"
#include "passes/simplify/compact.h"
#include "support/error.h"
#include "tensor/tensor.h"

namespace kiln {
namespace {

bool is_source(Op op) { return op == Op::kConstant || op == Op::kFull || op == Op::kIota; }

// Runs `node`'s reference kernel on `inputs`; nullopt when the kernel throws.
std::optional<std::vector<Tensor>> evaluate(const Graph& graph, const Node& node,
                                            const std::vector<Tensor>& inputs) {
  std::vector<Tensor> outputs;
  for (ValueId out : node.outputs) outputs.emplace_back(graph.type(out));
  try {
    op_def(node.op).reference(KernelArgs{node.attrs, inputs, outputs, nullptr, node.body.get()});
  } catch (const Error&) {
    return std::nullopt;  // stays a run-time error
  }
  return outputs;
}

// The source node that produces `t` as value `out`: full when all elements share their bits
// (and, for integers, when a double holds the value exactly: full's value is a double), else a
// constant (integer values as ints: exact).
std::optional<Node> source_node(const Tensor& t, ValueId out) {
  Attributes attrs{{"dtype", t.dtype()}, {"shape", t.shape()}};
  if (!is_float(t.dtype())) {
    std::vector<int64_t> values = t.to_i64();
    bool splat = !values.empty() && std::abs(static_cast<double>(values[0])) <= std::ldexp(1.0, 53);
    for (int64_t v : values) splat = splat && v == values[0];
    if (splat) {
      attrs.set("value", static_cast<double>(values[0]));
      return Node{Op::kFull, {}, {out}, normalize_attributes(Op::kFull, std::move(attrs))};
    }
    attrs.set("values", std::move(values));
    return Node{Op::kConstant, {}, {out}, normalize_attributes(Op::kConstant, std::move(attrs))};
  }
  std::vector<double> values = t.to_f64();
  bool splat = !values.empty();
  for (double v : values)
    splat = splat && std::bit_cast<uint64_t>(v) == std::bit_cast<uint64_t>(values[0]);
  if (splat) {
    attrs.set("value", values[0]);
    return Node{Op::kFull, {}, {out}, normalize_attributes(Op::kFull, std::move(attrs))};
  }
  attrs.set("values", std::move(values));
  return Node{Op::kConstant, {}, {out}, normalize_attributes(Op::kConstant, std::move(attrs))};
}

}  // namespace

bool ConstantFolding::run(Graph& graph) {
  // Per value: its source node's index in `nodes` (-1: not a source output), and its
  // materialized tensor once a fold needed it.
  std::vector<int> source(graph.values.size(), -1);
  std::vector<Tensor> known(graph.values.size());
  std::vector<Node> nodes;
  nodes.reserve(graph.nodes.size());
  bool changed = false;

  auto materialize = [&](ValueId id) -> const Tensor& {
    if (!known[id].defined()) {
      const Node& src = nodes[source[id]];
      std::vector<Tensor> out = *evaluate(graph, src, {});
      known[id] = out[0];
    }
    return known[id];
  };

  for (Node& node : graph.nodes) {
    bool foldable = !is_source(node.op) && !needs_process_group(node.op);
    int64_t out_elements = 0;
    for (ValueId out : node.outputs) out_elements += graph.type(out).numel();
    foldable = foldable && out_elements <= kMaxFoldedElements;
    for (ValueId in : node.inputs)
      foldable = foldable && source[in] >= 0 && graph.type(in).numel() <= kMaxFoldInputElements;

    std::vector<Node> replacements;
    if (foldable) {
      std::vector<Tensor> inputs;
      for (ValueId in : node.inputs) inputs.push_back(materialize(in));
      if (std::optional<std::vector<Tensor>> result = evaluate(graph, node, inputs)) {
        for (size_t i = 0; i < node.outputs.size(); ++i) {
          std::optional<Node> src = source_node((*result)[i], node.outputs[i]);
          if (!src) {
            replacements.clear();
            break;
          }
          known[node.outputs[i]] = (*result)[i];
          replacements.push_back(std::move(*src));
        }
      }
    }
    if (replacements.empty()) {
      if (is_source(node.op)) source[node.outputs[0]] = static_cast<int>(nodes.size());
      nodes.push_back(std::move(node));
      continue;
    }
    for (Node& r : replacements) {
      source[r.outputs[0]] = static_cast<int>(nodes.size());
      nodes.push_back(std::move(r));
    }
    changed = true;
  }
  graph.nodes = std::move(nodes);
  if (changed) compact(graph);  // multi-output folds may leave nothing to drop; harmless
  return changed;
}

}  // namespace kiln

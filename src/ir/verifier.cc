#include "ir/verifier.h"

#include <set>

#include "ir/op_def.h"
#include "support/error.h"

namespace kiln {
namespace {
std::string value_label(const Graph& g, ValueId id) {
  if (g.is_valid(id) && !g.value(id).name.empty()) return "%" + g.value(id).name;
  return fmt::format("value #{}", id);
}
}  // namespace

void verify(const Graph& graph) {
  std::vector<bool> defined(graph.values.size(), false);
  auto define = [&](ValueId id, const std::string& where) {
    KILN_CHECK(graph.is_valid(id), "{}: value id {} is out of range ({} values)", where, id,
               graph.values.size());
    KILN_CHECK(!defined[id], "{}: {} is defined twice", where, value_label(graph, id));
    defined[id] = true;
  };
  for (const GraphInput& input : graph.inputs) define(input.value, "graph input");

  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    std::string where = fmt::format("node {} ({})", n, op_name(node.op));
    std::vector<TensorType> input_types;
    for (ValueId id : node.inputs) {
      KILN_CHECK(graph.is_valid(id), "{}: input value id {} is out of range", where, id);
      KILN_CHECK(defined[id], "{}: input {} is used before it is defined", where,
                 value_label(graph, id));
      input_types.push_back(graph.type(id));
    }
    std::vector<TensorType> expected;
    try {
      Attributes normalized = normalize_attributes(node.op, node.attrs);
      // same_values, not ==: a NaN attribute is unchanged by normalization but != itself.
      KILN_CHECK(same_values(normalized, node.attrs),
                 "attributes are not normalized (a default is missing or a kind is unconverted)");
      expected = infer_types(node.op, input_types, node.attrs, node.body.get());
    } catch (const Error& e) {
      fail("{}: {}", where, e.what());
    }
    KILN_CHECK(expected.size() == node.outputs.size(), "{}: has {} outputs, expected {}", where,
               node.outputs.size(), expected.size());
    for (size_t i = 0; i < node.outputs.size(); ++i) {
      define(node.outputs[i], where);
      const TensorType& actual = graph.type(node.outputs[i]);
      KILN_CHECK(actual == expected[i], "{}: output {} has type {}, inference gives {}", where,
                 value_label(graph, node.outputs[i]), to_string(actual), to_string(expected[i]));
    }
  }
  for (ValueId id : graph.outputs) {
    KILN_CHECK(graph.is_valid(id) && defined[id], "graph output {} is not defined",
               value_label(graph, id));
  }
  // Collectives and their joins pair up (ops/collective.h): a collective's output is read only
  // by collective_wait nodes (never by a kernel that would race the communication stream, nor
  // as a graph output), and a wait reads only a collective's output.
  std::vector<int> producer(graph.values.size(), -1);
  for (size_t n = 0; n < graph.nodes.size(); ++n)
    for (ValueId out : graph.nodes[n].outputs) producer[out] = static_cast<int>(n);
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    for (ValueId in : node.inputs) {
      const bool from_collective = producer[in] >= 0 && has_flag(graph.nodes[producer[in]].op, kCollective);
      if (node.op == Op::kCollectiveWait) {
        KILN_CHECK(from_collective, "node {} (collective_wait): {} is not the output of a collective", n,
                   value_label(graph, in));
      } else {
        KILN_CHECK(!from_collective, "node {} ({}) reads {}, a collective's output, without its collective_wait",
                   n, op_name(node.op), value_label(graph, in));
      }
    }
  }
  for (ValueId id : graph.outputs)
    KILN_CHECK(producer[id] < 0 || !has_flag(graph.nodes[producer[id]].op, kCollective),
               "graph output {} is a collective's output: wait for it (collective_wait)", value_label(graph, id));
  for (const Update& u : graph.updates)
    KILN_CHECK(!graph.is_valid(u.value) || producer[u.value] < 0 || !has_flag(graph.nodes[producer[u.value]].op, kCollective),
               "update of {} is a collective's output: wait for it (collective_wait)", value_label(graph, u.target));
  // Per value: its graph input's index (the first), or -1; one look-up per update, where
  // input_index's walk per update grew with the square of the params.
  std::vector<int> input_at(graph.values.size(), -1);
  for (size_t i = graph.inputs.size(); i-- > 0;)
    if (graph.is_valid(graph.inputs[i].value)) input_at[graph.inputs[i].value] = static_cast<int>(i);
  std::set<ValueId> updated;
  for (const Update& u : graph.updates) {
    const int index = graph.is_valid(u.target) ? input_at[u.target] : -1;
    KILN_CHECK(index >= 0 && graph.inputs[index].role != Role::kData,
               "update target {} is not a param or state input", value_label(graph, u.target));
    KILN_CHECK(updated.insert(u.target).second, "{} is updated twice", value_label(graph, u.target));
    KILN_CHECK(graph.is_valid(u.value) && defined[u.value], "update of {}: value is not defined",
               value_label(graph, u.target));
    KILN_CHECK(graph.type(u.value) == graph.type(u.target), "update of {}: value has type {}, expected {}",
               value_label(graph, u.target), to_string(graph.type(u.value)), to_string(graph.type(u.target)));
  }
  std::set<std::string> names;
  for (size_t i = 0; i < graph.values.size(); ++i) {
    const std::string& name = graph.values[i].name;
    if (name.empty()) continue;
    KILN_CHECK(names.insert(name).second, "value name '%{}' is used twice", name);
  }
}

}  // namespace kiln

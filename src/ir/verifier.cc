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
  std::set<ValueId> updated;
  for (const Update& u : graph.updates) {
    int index = graph.input_index(u.target);
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

#include "ir/graph.h"

#include <array>

#include "ir/op_def.h"
#include "support/error.h"

namespace kiln {
namespace {
constexpr std::array<std::string_view, 3> kRoleNames = {"param", "state", "data"};
}

std::string_view role_name(Role role) { return kRoleNames[static_cast<int>(role)]; }

std::optional<Role> parse_role(std::string_view name) {
  for (int i = 0; i < 3; ++i)
    if (kRoleNames[i] == name) return static_cast<Role>(i);
  return std::nullopt;
}

ValueId Graph::add_input(const std::string& input_name, TensorType type, Role role) {
  KILN_CHECK(!input_name.empty(), "graph input needs a name");
  for (const Value& v : values)
    KILN_CHECK(v.name != input_name, "graph input name '{}' is already used", input_name);
  for (int64_t d : type.shape)
    KILN_CHECK(d >= 0, "graph input '{}': negative dimension in {}", input_name, to_string(type));
  values.push_back(Value{input_name, std::move(type)});
  ValueId id = static_cast<ValueId>(values.size() - 1);
  inputs.push_back(GraphInput{id, role});
  return id;
}

std::vector<ValueId> Graph::add_node(Op op, std::vector<ValueId> node_inputs, Attributes attrs,
                                     std::shared_ptr<const Graph> body) {
  std::vector<TensorType> input_types;
  for (ValueId id : node_inputs) {
    KILN_CHECK(is_valid(id), "{}: input value id {} does not exist in the graph", op_name(op), id);
    input_types.push_back(type(id));
  }
  Attributes normalized = normalize_attributes(op, std::move(attrs));
  std::vector<TensorType> output_types = infer_types(op, input_types, normalized, body.get());
  Node node{op, std::move(node_inputs), {}, std::move(normalized), std::move(body)};
  for (TensorType& t : output_types) {
    values.push_back(Value{"", std::move(t)});
    node.outputs.push_back(static_cast<ValueId>(values.size() - 1));
  }
  nodes.push_back(std::move(node));
  return nodes.back().outputs;
}

ValueId Graph::add(Op op, std::vector<ValueId> node_inputs, Attributes attrs) {
  std::vector<ValueId> outs = add_node(op, std::move(node_inputs), std::move(attrs));
  KILN_CHECK(outs.size() == 1, "{} has {} outputs, expected 1 here", op_name(op), outs.size());
  return outs[0];
}

int Graph::input_index(ValueId id) const {
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].value == id) return static_cast<int>(i);
  return -1;
}

}  // namespace kiln

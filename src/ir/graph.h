// The graph IR: Values (typed tensors), Nodes (an op applied to values) in topological order,
// graph inputs tagged by role, and graph outputs. Values are referred to by ValueId, an index
// into Graph::values, so a Graph is a plain copyable value that passes can rebuild freely.
#pragma once

#include <string>
#include <vector>

#include "ir/attribute.h"
#include "ir/op.h"
#include "ir/shape.h"

namespace kiln {

using ValueId = int32_t;

// What a graph input is for: trained parameters, optimizer/loss-scale state, or the batch.
enum class Role : uint8_t { kParam, kState, kData };
std::string_view role_name(Role role);
std::optional<Role> parse_role(std::string_view name);

struct Value {
  std::string name;  // may be empty: the printer then numbers it
  TensorType type;
};

struct Node {
  Op op;
  std::vector<ValueId> inputs;
  std::vector<ValueId> outputs;
  Attributes attrs;
};

struct GraphInput {
  ValueId value;
  Role role;
};

// After a step, `value` replaces the contents of graph input `target` (a param or state): how the
// optimizer's in-place updates are explicit in the IR.
struct Update {
  ValueId target;
  ValueId value;
};

class Graph {
 public:
  std::string name = "main";
  std::vector<Value> values;
  std::vector<Node> nodes;  // topological order
  std::vector<GraphInput> inputs;
  std::vector<ValueId> outputs;
  std::vector<Update> updates;

  // Adds a graph input. Throws kiln::Error if the name is empty or already used.
  ValueId add_input(const std::string& name, TensorType type, Role role);
  // Appends a node: normalizes attributes against the op's schema (defaults filled, kinds
  // checked), infers output types, and returns the new output values. Throws kiln::Error on
  // bad inputs or attributes, leaving the graph unchanged.
  std::vector<ValueId> add_node(Op op, std::vector<ValueId> inputs, Attributes attrs = {});
  // Same, for single-output ops.
  ValueId add(Op op, std::vector<ValueId> inputs, Attributes attrs = {});

  const Value& value(ValueId id) const { return values.at(static_cast<size_t>(id)); }
  const TensorType& type(ValueId id) const { return value(id).type; }
  bool is_valid(ValueId id) const { return id >= 0 && static_cast<size_t>(id) < values.size(); }
  // Index of the graph input holding `id`, or -1.
  int input_index(ValueId id) const;
};

}  // namespace kiln

// The graph IR: Values (typed tensors), Nodes (an op applied to values) in topological order,
// graph inputs tagged by role, and graph outputs. Values are referred to by ValueId, an index
// into Graph::values, so a Graph is a plain copyable value that passes can rebuild freely.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ir/attribute.h"
#include "ir/op.h"
#include "ir/shape.h"

namespace kiln {

using ValueId = int32_t;
class Graph;

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
  // Only for `fused` nodes: the subgraph the node computes. Its inputs (all role data) match the
  // node's inputs 1:1 and its outputs the node's outputs. Shared and immutable: copies of the
  // graph and passes that move nodes share it.
  std::shared_ptr<const Graph> body = nullptr;
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
  // bad inputs or attributes, leaving the graph unchanged. `body` is for `fused` nodes only
  // (their output types come from it; see ops/fused.cc).
  std::vector<ValueId> add_node(Op op, std::vector<ValueId> inputs, Attributes attrs = {},
                                std::shared_ptr<const Graph> body = nullptr);
  // Same, for single-output ops.
  ValueId add(Op op, std::vector<ValueId> inputs, Attributes attrs = {});

  const Value& value(ValueId id) const { return values.at(static_cast<size_t>(id)); }
  const TensorType& type(ValueId id) const { return value(id).type; }
  bool is_valid(ValueId id) const { return id >= 0 && static_cast<size_t>(id) < values.size(); }
  // Index of the graph input holding `id`, or -1.
  int input_index(ValueId id) const;
};

}  // namespace kiln

#include "passes/simplify/cse.h"

#include <bit>
#include <numeric>
#include <unordered_map>
#include <vector>

#include "ir/text.h"
#include "passes/simplify/compact.h"

namespace kiln {
namespace {

size_t mix(size_t seed, size_t value) {
  return seed ^ (value + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2));
}

// Hash consistent with same_value: doubles by their bits.
size_t hash_attr(const AttrValue& value) {
  size_t h = value.index();
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, double>) {
          h = mix(h, std::bit_cast<uint64_t>(v));
        } else if constexpr (std::is_same_v<T, std::vector<double>>) {
          for (double d : v) h = mix(h, std::bit_cast<uint64_t>(d));
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          for (int64_t i : v) h = mix(h, std::hash<int64_t>{}(i));
        } else if constexpr (std::is_same_v<T, DType>) {
          h = mix(h, static_cast<size_t>(v));
        } else {
          h = mix(h, std::hash<T>{}(v));
        }
      },
      value);
  return h;
}

bool is_commutative(Op op) {
  return op == Op::kAdd || op == Op::kMul || op == Op::kEq || op == Op::kNe;
}

// The inputs as the key sees them: sorted for commutative ops.
std::vector<ValueId> key_inputs(const Node& node) {
  std::vector<ValueId> inputs = node.inputs;
  if (is_commutative(node.op) && inputs[1] < inputs[0]) std::swap(inputs[0], inputs[1]);
  return inputs;
}

size_t hash_node(const Node& node) {
  size_t h = static_cast<size_t>(node.op);
  for (ValueId id : key_inputs(node)) h = mix(h, static_cast<size_t>(id));
  for (const auto& [name, value] : node.attrs.items())
    h = mix(mix(h, std::hash<std::string>{}(name)), hash_attr(value));
  return h;
}

// Fused nodes are equal only with equal bodies: the same shared body, or the same canonical
// text (which names every op, attribute and type of the body).
bool same_body(const Node& a, const Node& b) {
  if (a.body == b.body) return true;
  if (!a.body || !b.body) return false;
  return print(*a.body) == print(*b.body);
}

bool same_node(const Node& a, const Node& b) {
  return a.op == b.op && a.outputs.size() == b.outputs.size() && key_inputs(a) == key_inputs(b) &&
         same_values(a.attrs, b.attrs) && same_body(a, b);
}

}  // namespace

bool CommonSubexpressionElimination::run(Graph& graph) {
  std::vector<ValueId> replacement(graph.values.size());
  std::iota(replacement.begin(), replacement.end(), 0);
  std::unordered_multimap<size_t, size_t> seen;  // hash -> index into `kept`
  seen.reserve(graph.nodes.size());
  std::vector<Node> kept;
  kept.reserve(graph.nodes.size());
  bool changed = false;

  for (Node& node : graph.nodes) {
    for (ValueId& id : node.inputs) id = replacement[id];  // earlier merges first
    // Two collectives of one value are two rounds of communication that the program asked for
    // (zero3 gathers a param again for the backward so it need not stay resident): never merged.
    if (has_flag(node.op, kCollective)) {
      kept.push_back(std::move(node));
      continue;
    }
    const size_t h = hash_node(node);
    const Node* match = nullptr;
    auto [begin, end] = seen.equal_range(h);
    for (auto it = begin; it != end && match == nullptr; ++it)
      if (same_node(kept[it->second], node)) match = &kept[it->second];
    if (match == nullptr) {
      seen.emplace(h, kept.size());
      kept.push_back(std::move(node));
      continue;
    }
    for (size_t i = 0; i < node.outputs.size(); ++i) {
      replacement[node.outputs[i]] = match->outputs[i];
      move_name(graph, node.outputs[i], match->outputs[i]);
    }
    changed = true;
  }
  graph.nodes = std::move(kept);
  if (!changed) return false;
  replace_uses(graph, replacement);  // outputs and updates (node inputs are already resolved)
  compact(graph);
  return true;
}

}  // namespace kiln

// The one driver for tables of local rewrite rules (algebraic, training-rewrites), plus the facts
// about values that rules ask for (is this a splat of 1? are these indices in range?).
//
// A rule is a name and a function (Rewriter&, node) -> Replacement: one value per output of the
// node, of the same types, or empty when the rule does not apply. A rule may emit new nodes
// through the Rewriter; they are placed just before the node being rewritten (so the graph stays
// in topological order), and are discarded again when the rule ends up not applying. The driver
// sweeps the graph in order, tries the rules in table order on each node (inputs already
// redirected to earlier replacements), and repeats sweeps until none fires: a fixed point.
// Replaced nodes are removed; nodes that become unused are left for dead-code.
#pragma once

#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "tensor/tensor.h"

namespace kiln {

// One value per output of the rewritten node; empty: the rule does not apply.
using Replacement = std::vector<ValueId>;

class Rewriter;
std::optional<Tensor> known_value(const Rewriter& rewriter, ValueId id, int64_t max_elements);

class Rewriter {
 public:
  Rewriter(Graph& graph, std::vector<int>& producer)
      : graph_(graph), producer_(producer), values_before_(graph.values.size()) {}
  Graph& graph() { return graph_; }
  const TensorType& type(ValueId id) const { return graph_.type(id); }
  // The node defining `id`, or nullptr for a graph input. The pointer is invalidated by emit().
  const Node* producer(ValueId id) const;
  // Appends a node before the one being rewritten and returns its outputs (types inferred;
  // throws kiln::Error on bad inputs, which is a bug in the rule).
  std::vector<ValueId> emit_node(Op op, std::vector<ValueId> inputs, Attributes attrs = {});
  ValueId emit(Op op, std::vector<ValueId> inputs, Attributes attrs = {});
  // Shorthands for source nodes.
  ValueId full(const Shape& shape, double value, DType dtype);

 private:
  Graph& graph_;
  std::vector<int>& producer_;  // per value: index into graph.nodes, -1 for inputs
  // known_value's results for the values the sweep started with (whose ids stay theirs through
  // the sweep, unlike those of nodes a rule emits and then discards): one evaluation of a mask
  // or a table that every layer's pattern reads.
  friend std::optional<Tensor> known_value(const Rewriter&, ValueId, int64_t);
  size_t values_before_;
  mutable std::map<ValueId, std::optional<Tensor>> known_;
};

struct RewriteRule {
  std::string name;  // kebab-case, e.g. "mul-by-one"
  Replacement (*apply)(Rewriter& rewriter, const Node& node);
};

// Applies `rules` to a fixed point. Returns how often each rule fired (absent: never); the graph
// is compacted when anything fired. Throws kiln::Error when a rule returns a value of the wrong
// type, or when 64 sweeps do not reach a fixed point (two rules undoing each other).
std::map<std::string, int> apply_rules(Graph& graph, std::span<const RewriteRule> rules);

// ---- facts about values, for the rules' conditions ----

// The value every element of `id` has, when it is a splat: a full, a constant whose values are
// all bitwise equal, or a broadcast_to / reshape of one. The double is the stored value.
std::optional<double> splat_value(const Rewriter& rewriter, ValueId id);

// Bounds that every element of the integer (or bool) value `id` provably lies within, found
// from its producers: full, constant, iota, argmax, where, maximum, minimum, widening casts;
// anything else gets its dtype's whole range. Floats: nullopt.
struct IntRange {
  double low, high;  // inclusive; integers stored exactly in doubles (|x| <= 2^53)
};
std::optional<IntRange> integer_range(const Rewriter& rewriter, ValueId id);

// The value of `id` when it depends on no graph input: its producers back to sources (constant,
// full, iota) evaluated with the ops' reference kernels. nullopt when it reads an input, when a
// value on the way holds more than `max_elements`, or when a kernel throws. A mask or a table
// an importer left as a chain of constant ops is known this way.
inline constexpr int64_t kKnownValueMaxElements = int64_t{1} << 24;
std::optional<Tensor> known_value(const Rewriter& rewriter, ValueId id,
                                  int64_t max_elements = kKnownValueMaxElements);

// ---- shapes of rearranging ops ----

// A transpose node's permutation, the default (empty: reverse the axes) spelled out and
// negative axes normalized.
std::vector<int64_t> transpose_perm(const Node& node, int rank);
// The permutation that swaps axes rank-3 and rank-2: (..., H, T, D) <-> (..., T, H, D), the
// transpose between attention's layouts "bthd" and "bhtd".
std::vector<int64_t> heads_swap_perm(int rank);

}  // namespace kiln

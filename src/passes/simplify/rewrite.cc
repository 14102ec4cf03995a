#include "passes/simplify/rewrite.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>

#include "ir/op_def.h"
#include "passes/simplify/compact.h"
#include "support/error.h"

namespace kiln {

const Node* Rewriter::producer(ValueId id) const {
  const int index = producer_.at(id);
  return index < 0 ? nullptr : &graph_.nodes[index];
}

std::vector<ValueId> Rewriter::emit_node(Op op, std::vector<ValueId> inputs, Attributes attrs) {
  std::vector<ValueId> outs = graph_.add_node(op, std::move(inputs), std::move(attrs));
  producer_.resize(graph_.values.size(), -1);
  for (ValueId out : outs) producer_[out] = static_cast<int>(graph_.nodes.size() - 1);
  return outs;
}

ValueId Rewriter::emit(Op op, std::vector<ValueId> inputs, Attributes attrs) {
  std::vector<ValueId> outs = emit_node(op, std::move(inputs), std::move(attrs));
  KILN_CHECK(outs.size() == 1, "{} has {} outputs, expected 1 here", op_name(op), outs.size());
  return outs[0];
}

ValueId Rewriter::full(const Shape& shape, double value, DType dtype) {
  return emit(Op::kFull, {}, {{"shape", shape}, {"value", value}, {"dtype", dtype}});
}

namespace {

// One sweep: returns true when a rule fired.
bool sweep(Graph& graph, std::span<const RewriteRule> rules, std::vector<ValueId>& replacement,
           std::map<std::string, int>& fired) {
  std::vector<Node> old_nodes = std::move(graph.nodes);
  graph.nodes.clear();
  graph.nodes.reserve(old_nodes.size());
  std::vector<int> producer(graph.values.size(), -1);
  Rewriter rewriter(graph, producer);
  auto resolve = [&](ValueId id) {
    while (static_cast<size_t>(id) < replacement.size() && replacement[id] != id)
      id = replacement[id];
    return id;
  };
  bool changed = false;
  for (Node& node : old_nodes) {
    for (ValueId& id : node.inputs) id = resolve(id);
    Replacement result;
    for (const RewriteRule& rule : rules) {
      const size_t nodes_before = graph.nodes.size(), values_before = graph.values.size();
      result = rule.apply(rewriter, node);
      if (!result.empty()) {
        KILN_CHECK(result.size() == node.outputs.size(),
                   "rule {}: {} replacements for the {} outputs of {}", rule.name, result.size(),
                   node.outputs.size(), op_name(node.op));
        for (size_t i = 0; i < result.size(); ++i)
          KILN_CHECK(graph.type(result[i]) == graph.type(node.outputs[i]),
                     "rule {}: replaces a {} output of {} by a {} value", rule.name,
                     to_string(graph.type(node.outputs[i])), op_name(node.op),
                     to_string(graph.type(result[i])));
        ++fired[rule.name];
        break;
      }
      // Not applied: forget whatever the rule emitted while finding that out.
      graph.nodes.resize(nodes_before);
      graph.values.resize(values_before);
      producer.resize(values_before);
    }
    if (result.empty()) {
      for (ValueId out : node.outputs) producer[out] = static_cast<int>(graph.nodes.size());
      graph.nodes.push_back(std::move(node));
      continue;
    }
    while (replacement.size() < graph.values.size())
      replacement.push_back(static_cast<ValueId>(replacement.size()));
    for (size_t i = 0; i < result.size(); ++i) {
      replacement[node.outputs[i]] = result[i];
      move_name(graph, node.outputs[i], result[i]);
    }
    changed = true;
  }
  return changed;
}

}  // namespace

std::map<std::string, int> apply_rules(Graph& graph, std::span<const RewriteRule> rules) {
  std::map<std::string, int> fired;
  std::vector<ValueId> replacement(graph.values.size());
  std::iota(replacement.begin(), replacement.end(), 0);
  constexpr int kMaxSweeps = 64;
  int sweeps = 0;
  while (sweep(graph, rules, replacement, fired)) {
    KILN_CHECK(++sweeps < kMaxSweeps, "rewrite rules did not reach a fixed point in {} sweeps",
               kMaxSweeps);
  }
  if (fired.empty()) return fired;
  // Resolve chains once, then redirect the outputs and updates.
  std::vector<ValueId> resolved(graph.values.size());
  for (size_t v = 0; v < resolved.size(); ++v) {
    ValueId id = static_cast<ValueId>(v);
    while (static_cast<size_t>(id) < replacement.size() && replacement[id] != id)
      id = replacement[id];
    resolved[v] = id;
  }
  replace_uses(graph, resolved);
  compact(graph);
  return fired;
}

}  // namespace kiln

// ---- facts ----

namespace kiln {
namespace {

constexpr int kMaxFactDepth = 8;  // producer chains followed; keeps every query O(1)

// A constant's values as doubles, for facts that compare them with small numbers (x * 1, ranges
// of indices): integer values (ints) convert, those above 2^53 rounded, which moves no fact
// about small numbers. Fold exact values with the reference kernels, not these.
std::vector<double> constant_values(const Node& node) {
  const AttrValue& values = node.attrs.get("values");
  if (const auto* ints = std::get_if<std::vector<int64_t>>(&values))
    return std::vector<double>(ints->begin(), ints->end());
  return std::get<std::vector<double>>(values);
}

std::optional<double> splat_at(const Rewriter& rewriter, ValueId id, int depth) {
  const Node* node = rewriter.producer(id);
  if (node == nullptr || depth > kMaxFactDepth) return std::nullopt;
  switch (node->op) {
    case Op::kFull:
      return node->attrs.f("value");
    case Op::kConstant: {
      if (const auto* ints = std::get_if<std::vector<int64_t>>(&node->attrs.get("values"))) {
        // Exactly equal, and a value a double holds exactly.
        if (ints->empty() || std::abs(static_cast<double>((*ints)[0])) > std::ldexp(1.0, 53))
          return std::nullopt;
        for (int64_t v : *ints)
          if (v != (*ints)[0]) return std::nullopt;
        return static_cast<double>((*ints)[0]);
      }
      const std::vector<double>& values = node->attrs.floats("values");
      if (values.empty()) return std::nullopt;
      const uint64_t first = std::bit_cast<uint64_t>(values[0]);
      for (double v : values)
        if (std::bit_cast<uint64_t>(v) != first) return std::nullopt;
      return values[0];
    }
    case Op::kBroadcastTo:
    case Op::kReshape:
      return splat_at(rewriter, node->inputs[0], depth + 1);
    default:
      return std::nullopt;
  }
}

IntRange dtype_range(DType dtype) {
  switch (dtype) {
    case DType::kBool: return {0, 1};
    case DType::kU8: return {0, 255};
    case DType::kI32: return {-2147483648.0, 2147483647.0};
    default: return {-std::ldexp(1.0, 63), std::ldexp(1.0, 63)};  // i64 (bounds rounded)
  }
}

IntRange range_at(const Rewriter& rewriter, ValueId id, int depth) {
  const IntRange whole = dtype_range(rewriter.type(id).dtype);
  const Node* node = rewriter.producer(id);
  if (node == nullptr || depth > kMaxFactDepth) return whole;
  auto input_range = [&](size_t i) { return range_at(rewriter, node->inputs[i], depth + 1); };
  IntRange r = whole;
  switch (node->op) {
    case Op::kFull:
    case Op::kConstant: {
      // Stored values convert by truncation, which is monotone: bounds carry over. Values
      // outside the dtype (which would wrap) or NaN leave the whole range.
      std::vector<double> values = node->op == Op::kFull
                                       ? std::vector<double>{node->attrs.f("value")}
                                       : constant_values(*node);
      if (values.empty() || rewriter.type(id).dtype == DType::kBool) break;
      double low = values[0], high = values[0];
      for (double v : values) {
        if (std::isnan(v)) return whole;
        low = std::min(low, v);
        high = std::max(high, v);
      }
      if (std::trunc(low) < whole.low || std::trunc(high) > whole.high) return whole;
      r = {std::trunc(low), std::trunc(high)};
      break;
    }
    case Op::kIota: {
      const int64_t dim = rewriter.type(id).shape[normalize_axis(node->attrs.i("axis"),
                                                                  rewriter.type(id).rank())];
      r = {0, static_cast<double>(std::max<int64_t>(dim - 1, 0))};
      break;
    }
    case Op::kArgmax: {
      const TensorType& in = rewriter.type(node->inputs[0]);
      const int64_t dim = in.shape[normalize_axis(node->attrs.i("axis"), in.rank())];
      r = {0, static_cast<double>(dim - 1)};
      break;
    }
    case Op::kWhere: {
      IntRange a = input_range(1), b = input_range(2);
      r = {std::min(a.low, b.low), std::max(a.high, b.high)};
      break;
    }
    case Op::kMaximum: {
      IntRange a = input_range(0), b = input_range(1);
      r = {std::max(a.low, b.low), std::max(a.high, b.high)};
      break;
    }
    case Op::kMinimum: {
      IntRange a = input_range(0), b = input_range(1);
      r = {std::min(a.low, b.low), std::min(a.high, b.high)};
      break;
    }
    case Op::kCast: {
      // From an integer or bool source that fits the target, values are unchanged.
      if (is_float(rewriter.type(node->inputs[0]).dtype)) break;
      IntRange in = input_range(0);
      if (in.low >= whole.low && in.high <= whole.high) r = in;
      break;
    }
    case Op::kBroadcastTo:
    case Op::kReshape:
    case Op::kTranspose:
    case Op::kSlice:
      r = input_range(0);
      break;
    default:
      break;
  }
  return {std::max(r.low, whole.low), std::min(r.high, whole.high)};
}

}  // namespace

namespace {

std::optional<Tensor> known_at(const Rewriter& rewriter, ValueId id, int64_t max_elements,
                               int depth) {
  const Node* node = rewriter.producer(id);
  if (node == nullptr || depth > 4 * kMaxFactDepth || node->op == Op::kFused ||
      has_flag(node->op, kRandom) || needs_process_group(node->op))
    return std::nullopt;
  std::vector<Tensor> inputs;
  for (ValueId in : node->inputs) {
    std::optional<Tensor> t = known_at(rewriter, in, max_elements, depth + 1);
    if (!t) return std::nullopt;
    inputs.push_back(std::move(*t));
  }
  std::vector<Tensor> outputs;
  for (ValueId out : node->outputs) {
    if (rewriter.type(out).numel() > max_elements) return std::nullopt;
    outputs.emplace_back(rewriter.type(out));
  }
  try {
    op_def(node->op).reference(KernelArgs{node->attrs, inputs, outputs, nullptr, node->body.get()});
  } catch (const Error&) {
    return std::nullopt;
  }
  for (size_t i = 0; i < node->outputs.size(); ++i)
    if (node->outputs[i] == id) return outputs[i];
  return std::nullopt;
}

}  // namespace

std::optional<Tensor> known_value(const Rewriter& rewriter, ValueId id, int64_t max_elements) {
  // Cached under the default limit only, so a result never depends on another call's limit.
  const bool cacheable = max_elements == kKnownValueMaxElements && id >= 0 &&
                         static_cast<size_t>(id) < rewriter.values_before_;
  if (!cacheable) return known_at(rewriter, id, max_elements, 0);
  auto [at, inserted] = rewriter.known_.try_emplace(id);
  if (inserted) at->second = known_at(rewriter, id, max_elements, 0);
  return at->second;
}

std::vector<int64_t> transpose_perm(const Node& node, int rank) {
  std::vector<int64_t> perm = node.attrs.ints("perm");
  if (perm.empty()) {
    perm.resize(rank);
    std::iota(perm.rbegin(), perm.rend(), 0);
  }
  for (int64_t& p : perm) p = normalize_axis(p, rank);
  return perm;
}

std::vector<int64_t> heads_swap_perm(int rank) {
  std::vector<int64_t> perm(rank);
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[rank - 3], perm[rank - 2]);
  return perm;
}

std::optional<double> splat_value(const Rewriter& rewriter, ValueId id) {
  return splat_at(rewriter, id, 0);
}

std::optional<IntRange> integer_range(const Rewriter& rewriter, ValueId id) {
  DType dtype = rewriter.type(id).dtype;
  if (is_float(dtype)) return std::nullopt;
  return range_at(rewriter, id, 0);
}

}  // namespace kiln

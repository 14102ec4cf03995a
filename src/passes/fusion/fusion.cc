// The fusion pass: node classification, the partition problem of a graph, outlining of groups
// into fused nodes, and the per-node report. See passes/fusion/fusion.h for the rules.
#include "passes/fusion/fusion.h"

#include <algorithm>
#include <map>
#include <memory>
#include <queue>
#include <set>

#include "ir/op_def.h"
#include "ops/fused/group.h"
#include "passes/schedule.h"
#include "passes/simplify/compact.h"
#include "support/error.h"

namespace kiln {
namespace fusion {
namespace {

bool is_fusable_float(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

// (rows, row length) of a shape: a scalar is one row of one element.
std::pair<int64_t, int64_t> rows_of(const Shape& shape) {
  if (shape.empty()) return {1, 1};
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return {rows, shape.back()};
}

NodeClass make_class(ItemKind kind, const Shape& shape) {
  auto [rows, length] = rows_of(shape);
  if (rows * length == 0) return {};  // nothing to compute: no reason to fuse
  return NodeClass{kind, rows, length};
}

bool is_cross_entropy(Op op) { return op == Op::kCrossEntropy || op == Op::kCrossEntropyGrad; }

// The dtype rule of fusion.h.
bool operands_fusable(const Graph& graph, const Node& node) {
  for (ValueId out : node.outputs)
    if (!is_fusable_float(graph.type(out).dtype)) return false;
  for (size_t i = 0; i < node.inputs.size(); ++i) {
    const DType d = graph.type(node.inputs[i]).dtype;
    if (is_fusable_float(d)) continue;
    if (node.op == Op::kWhere && i == 0 && d == DType::kBool) continue;
    if (is_cross_entropy(node.op) && i == 1 && is_integer(d)) continue;
    return false;
  }
  return true;
}

// An elementwise input a row tile can read: the full output shape, one element, a row vector
// [1..., N] or a per-row column [R..., 1].
bool row_friendly_broadcast(const Shape& input, const Shape& output) {
  const size_t rank = output.size();
  if (input.size() > rank) return false;
  Shape padded(rank - input.size(), 1);
  padded.insert(padded.end(), input.begin(), input.end());
  if (padded == output) return true;
  int64_t n = 1;
  for (int64_t d : padded) n *= d;
  if (n == 1) return true;
  bool row_vector = padded.back() == output.back();
  bool per_row = padded.back() == 1;
  for (size_t i = 0; i + 1 < rank; ++i) {
    row_vector = row_vector && padded[i] == 1;
    per_row = per_row && padded[i] == output[i];
  }
  return row_vector || per_row;
}

}  // namespace

NodeClass classify_node(const Graph& graph, const Node& node) {
  if (node.op == Op::kFused || !operands_fusable(graph, node)) return {};
  switch (group_role(graph, node)) {
    case GroupRole::kElementwise: {
      const Shape& out = graph.type(node.outputs[0]).shape;
      for (ValueId in : node.inputs)
        if (!row_friendly_broadcast(graph.type(in).shape, out)) return {};
      return make_class(ItemKind::kElementwise, out);
    }
    case GroupRole::kRowOp:
      return make_class(ItemKind::kRowOp, graph.type(node.inputs[0]).shape);
    case GroupRole::kColumnReduction:
      return make_class(ItemKind::kColumnReduction, graph.type(node.inputs[0]).shape);
    case GroupRole::kGemm:
      return make_class(ItemKind::kGemm, graph.type(node.outputs[0]).shape);
    case GroupRole::kOther:
      return {};
  }
  return {};
}

namespace {

// An elementwise item computing one value per row (output [R..., 1]; every input one per row
// or a single element): the per-row statistics of a decomposed norm (var + eps, rsqrt). It runs
// in the space of the rows it belongs to (fusion.h, "Per-row work").
bool is_per_row(const Graph& graph, const Node& node, const NodeClass& c) {
  if (c.kind != ItemKind::kElementwise || c.row_length != 1 || c.rows <= 1) return false;
  const Shape& out = graph.type(node.outputs[0]).shape;
  for (ValueId in : node.inputs) {
    const Shape& s = graph.type(in).shape;
    if (numel(s) != 1 && s != out) return false;
  }
  return true;
}

}  // namespace

Problem build_problem(const Graph& graph) {
  Problem problem;
  std::map<std::pair<int64_t, int64_t>, int64_t> keys;
  auto key_of = [&](int64_t rows, int64_t length) {
    return keys.emplace(std::make_pair(rows, length), static_cast<int64_t>(keys.size())).first->second;
  };
  std::vector<int> value_index(graph.values.size(), -1);
  std::vector<NodeClass> classes(graph.nodes.size());
  // Per-row items (see fusion.h, "Per-row work") that took no space from a producer yet.
  std::vector<int> unresolved;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    const NodeClass c = classes[n] = classify_node(graph, node);
    Item item{c.kind, -1};
    if (c.kind != ItemKind::kOpaque) item.space = key_of(c.rows, c.row_length);
    if (is_per_row(graph, node, c)) {
      // The space of the first fusable producer with the same rows (a row statistic's input,
      // or another per-row item that took one).
      int64_t adopted = -1;
      for (ValueId in : node.inputs) {
        const int v = value_index[in];
        if (v < 0) continue;
        const int p = problem.values[v].producer;
        if (problem.items[p].kind != ItemKind::kOpaque && classes[p].rows == c.rows &&
            problem.items[p].space != item.space) {
          adopted = problem.items[p].space;
          break;
        }
      }
      if (adopted >= 0) {
        item.space = adopted;
      } else {
        unresolved.push_back(static_cast<int>(n));
      }
    }
    problem.items.push_back(item);
    for (ValueId in : node.inputs)
      if (value_index[in] >= 0) problem.values[value_index[in]].consumers.push_back(static_cast<int>(n));
    const int column_from = c.kind == ItemKind::kRowOp ? op_def(node.op).column_outputs_from : -1;
    for (size_t k = 0; k < node.outputs.size(); ++k) {
      const ValueId out = node.outputs[k];
      value_index[out] = static_cast<int>(problem.values.size());
      ValueUse use;
      use.producer = static_cast<int>(n);
      use.bytes = static_cast<int64_t>(graph.type(out).bytes());
      use.column = column_from >= 0 && static_cast<int>(k) >= column_from;
      problem.values.push_back(std::move(use));
    }
  }
  // Per-row items with no such producer (their inputs come from outside or are opaque): the
  // space of the first fusable consumer with the same rows, last items first so a chain of
  // per-row items takes its space from the item it feeds.
  for (auto it = unresolved.rbegin(); it != unresolved.rend(); ++it) {
    const int n = *it;
    Item& item = problem.items[static_cast<size_t>(n)];
    for (ValueId out : graph.nodes[static_cast<size_t>(n)].outputs) {
      bool done = false;
      for (int consumer : problem.values[static_cast<size_t>(value_index[out])].consumers) {
        const Item& c = problem.items[static_cast<size_t>(consumer)];
        if (c.kind != ItemKind::kOpaque && classes[consumer].rows == classes[n].rows &&
            c.space != item.space) {
          item.space = c.space;
          done = true;
          break;
        }
      }
      if (done) break;
    }
  }
  for (ValueId id : graph.outputs)
    if (value_index[id] >= 0) problem.values[value_index[id]].external = true;
  for (const Update& u : graph.updates)
    if (value_index[u.value] >= 0) problem.values[value_index[u.value]].external = true;
  return problem;
}

namespace {

FusedKind group_kind(const Graph& graph, const std::vector<int>& members) {
  bool gemm = false, rows = false;
  for (int n : members) {
    ItemKind k = classify_node(graph, graph.nodes[static_cast<size_t>(n)]).kind;
    gemm = gemm || k == ItemKind::kGemm;
    rows = rows || k == ItemKind::kRowOp;
  }
  return gemm ? FusedKind::kGemmEpilogue : rows ? FusedKind::kRows : FusedKind::kElementwise;
}

std::string describe_group(const Graph& graph, const std::vector<int>& members) {
  std::vector<std::string> parts;
  for (int n : members)
    parts.push_back(fmt::format("{} ({})", n, op_name(graph.nodes[static_cast<size_t>(n)].op)));
  return fmt::format("{{{}}}", fmt::join(parts, ", "));
}

}  // namespace

int outline(Graph& graph, const std::vector<int>& group_of) {
  const size_t n = graph.nodes.size();
  KILN_CHECK(group_of.size() == n, "fusion: {} group ids given for {} nodes", group_of.size(), n);

  // Units of the contracted graph: one per group id, members in node order.
  std::map<int, int> unit_of_group;
  std::vector<std::vector<int>> members;
  std::vector<int> unit_of(n);
  for (size_t i = 0; i < n; ++i) {
    auto [it, inserted] = unit_of_group.emplace(group_of[i], static_cast<int>(members.size()));
    if (inserted) members.emplace_back();
    unit_of[i] = it->second;
    members[static_cast<size_t>(it->second)].push_back(static_cast<int>(i));
  }
  const size_t units = members.size();

  // Producers and readers of every value.
  std::vector<int> producer(graph.values.size(), -1);
  std::vector<std::vector<int>> readers(graph.values.size());
  std::vector<char> external(graph.values.size(), 0);
  for (size_t i = 0; i < n; ++i) {
    for (ValueId out : graph.nodes[i].outputs) producer.at(static_cast<size_t>(out)) = static_cast<int>(i);
    for (ValueId in : graph.nodes[i].inputs) readers.at(static_cast<size_t>(in)).push_back(static_cast<int>(i));
  }
  for (ValueId id : graph.outputs) external.at(static_cast<size_t>(id)) = 1;
  for (const Update& u : graph.updates) external.at(static_cast<size_t>(u.value)) = 1;

  // Topological order of the units, the earliest first node first (Kahn with a heap).
  std::vector<std::set<int>> succ(units);
  std::vector<int> indegree(units, 0);
  for (size_t i = 0; i < n; ++i) {
    for (ValueId in : graph.nodes[i].inputs) {
      const int p = producer[static_cast<size_t>(in)];
      if (p < 0 || unit_of[p] == unit_of[i]) continue;
      if (succ[static_cast<size_t>(unit_of[p])].insert(unit_of[i]).second) ++indegree[unit_of[i]];
    }
  }
  using Entry = std::pair<int, int>;  // (first node, unit)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> ready;
  for (size_t u = 0; u < units; ++u)
    if (indegree[u] == 0) ready.emplace(members[u][0], static_cast<int>(u));
  std::vector<int> order;
  while (!ready.empty()) {
    const int u = ready.top().second;
    ready.pop();
    order.push_back(u);
    for (int s : succ[static_cast<size_t>(u)])
      if (--indegree[s] == 0) ready.emplace(members[static_cast<size_t>(s)][0], s);
  }
  if (order.size() != units) {
    std::vector<std::string> stuck;
    for (size_t u = 0; u < units; ++u)
      if (indegree[u] > 0 && members[u].size() > 1) stuck.push_back(describe_group(graph, members[u]));
    fail("fusion: outlining these groups would create a cycle (a path leaves a group and comes "
         "back into it): {}",
         fmt::join(stuck, "; "));
  }

  std::vector<Node> nodes;
  nodes.reserve(units);
  int fused_count = 0;
  for (int u : order) {
    const std::vector<int>& group = members[static_cast<size_t>(u)];
    if (group.size() == 1) {
      nodes.push_back(std::move(graph.nodes[static_cast<size_t>(group[0])]));
      continue;
    }
    auto in_group = [&](int node) { return node >= 0 && unit_of[static_cast<size_t>(node)] == u; };
    // Names: outer names travel into the body (unique there too); generated input names avoid them.
    std::set<std::string> used;
    for (int m : group) {
      const Node& node = graph.nodes[static_cast<size_t>(m)];
      for (ValueId id : node.inputs) used.insert(graph.value(id).name);
      for (ValueId id : node.outputs) used.insert(graph.value(id).name);
    }
    auto body = std::make_shared<Graph>();
    body->name = fmt::format("fused_{}", fused_count);
    std::map<ValueId, ValueId> to_body;
    std::set<std::string> body_inputs;
    std::vector<ValueId> outer_inputs;
    int generated = 0;
    for (int m : group) {
      for (ValueId id : graph.nodes[static_cast<size_t>(m)].inputs) {
        if (in_group(producer[static_cast<size_t>(id)]) || to_body.count(id)) continue;
        std::string name = graph.value(id).name;
        if (name.empty()) {
          do name = fmt::format("in{}", generated++);
          while (used.count(name));
          used.insert(name);
        }
        // What Graph::add_input does, less its walk over every value for a taken name (a
        // multi-tensor group reads thousands of inputs): `body_inputs` holds the names taken.
        KILN_CHECK(body_inputs.insert(name).second, "fusion: body input name '{}' is used twice", name);
        to_body[id] = static_cast<ValueId>(body->values.size());
        body->values.push_back(Value{name, graph.type(id)});
        body->inputs.push_back(GraphInput{to_body[id], Role::kData});
        outer_inputs.push_back(id);
      }
    }
    std::vector<ValueId> outer_outputs;
    for (int m : group) {
      const Node& node = graph.nodes[static_cast<size_t>(m)];
      KILN_CHECK(node.op != Op::kFused, "fusion: node {} is already fused and cannot join group {}",
                 m, describe_group(graph, group));
      std::vector<ValueId> inputs;
      for (ValueId id : node.inputs) inputs.push_back(to_body.at(id));
      std::vector<ValueId> outs = body->add_node(node.op, std::move(inputs), node.attrs);
      for (size_t k = 0; k < outs.size(); ++k) {
        const ValueId outer = node.outputs[k];
        body->values[static_cast<size_t>(outs[k])].name = graph.value(outer).name;
        to_body[outer] = outs[k];
        const std::vector<int>& r = readers[static_cast<size_t>(outer)];
        const bool leaves = external[static_cast<size_t>(outer)] || r.empty() ||
                            std::any_of(r.begin(), r.end(), [&](int c) { return !in_group(c); });
        if (leaves) {
          body->outputs.push_back(outs[k]);
          outer_outputs.push_back(outer);
        }
      }
    }
    nodes.push_back(Node{Op::kFused, std::move(outer_inputs), std::move(outer_outputs),
                         fused_attrs(group_kind(graph, group)), std::move(body)});
    ++fused_count;
  }
  graph.nodes = std::move(nodes);
  compact(graph);  // the values that now live only inside bodies
  return fused_count;
}

std::vector<FusedNodeReport> report(const Graph& graph) {
  std::vector<FusedNodeReport> out;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (node.op != Op::kFused || !node.body) continue;
    const Graph& body = *node.body;
    FusedNodeReport r;
    r.node = n;
    r.kind = std::string(fused_kind_name(fused_kind(node)));
    std::set<ValueId> leaving(body.outputs.begin(), body.outputs.end());
    for (const Node& inner : body.nodes) {
      r.ops.emplace_back(op_name(inner.op));
      for (ValueId id : inner.outputs)
        if (!leaving.count(id)) r.bytes_kept += static_cast<int64_t>(body.type(id).bytes());
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace fusion

namespace fusion {
namespace {

// The arena the rest of the pipeline gives `graph` outlined with `group_of`: scheduled (as the
// schedule pass will) and planned (as `kiln compile --report` does).
size_t outlined_arena(const Graph& graph, const std::vector<int>& group_of) {
  Graph g = graph;
  outline(g, group_of);
  size_t arena = 0;
  memory_aware_order(g, &arena);  // the schedule pass's order, and the arena of g run in it
  return arena;
}

// Per group of two or more items: the bytes times node positions (in the graph's order) by
// which outlining stretches the lifetimes of the values the group reads. The fused node runs
// once every input exists, so an input that a member reads early and nothing reads later lives
// on until the group's last input is made (e.g. a weight-gradient GEMM whose epilogue adds a
// gradient made at the end of the backward pass keeps its two operands alive across it).
std::map<int, double> stretch_of_groups(const Graph& graph, const std::vector<int>& group_of) {
  const size_t n = graph.nodes.size();
  std::vector<int> producer(graph.values.size(), -1), last(graph.values.size(), -1);
  for (size_t i = 0; i < n; ++i) {
    for (ValueId in : graph.nodes[i].inputs) last[static_cast<size_t>(in)] = static_cast<int>(i);
    for (ValueId out : graph.nodes[i].outputs) producer[static_cast<size_t>(out)] = static_cast<int>(i);
  }
  std::map<int, std::vector<int>> members;
  for (size_t i = 0; i < n; ++i) members[group_of[i]].push_back(static_cast<int>(i));
  std::map<int, double> stretch;
  for (const auto& [g, m] : members) {
    if (m.size() < 2) continue;
    // The fused node's earliest position: after its last member and every input's producer.
    int at = m.back();
    for (int i : m)
      for (ValueId in : graph.nodes[static_cast<size_t>(i)].inputs) {
        const int p = producer[static_cast<size_t>(in)];
        if (p >= 0 && group_of[static_cast<size_t>(p)] != g) at = std::max(at, p);
      }
    double total = 0;
    std::set<ValueId> seen;
    for (int i : m)
      for (ValueId in : graph.nodes[static_cast<size_t>(i)].inputs) {
        const int p = producer[static_cast<size_t>(in)];
        if (p < 0 || group_of[static_cast<size_t>(p)] == g || !seen.insert(in).second) continue;
        const int end = last[static_cast<size_t>(in)];
        if (end < at)
          total += static_cast<double>(graph.type(in).bytes()) * static_cast<double>(at - end);
      }
    if (total > 0) stretch[g] = total;
  }
  return stretch;
}

}  // namespace

int unstretch_groups(const Graph& graph, std::vector<int>& group_of, int max_candidates) {
  constexpr double kMinArenaGain = 0.01;  // of the arena
  std::map<int, double> stretch = stretch_of_groups(graph, group_of);
  if (stretch.empty()) return 0;
  // The most stretching groups first.
  std::vector<std::pair<double, int>> ranked;
  for (const auto& [g, s] : stretch) ranked.push_back({-s, g});
  std::sort(ranked.begin(), ranked.end());
  if (static_cast<int>(ranked.size()) > max_candidates) ranked.resize(static_cast<size_t>(max_candidates));
  int next_id = 0;
  for (int g : group_of) next_id = std::max(next_id, g + 1);
  // `dropped`: the candidate groups currently taken apart (their items alone).
  auto with_dropped = [&](const std::vector<bool>& dropped) {
    std::vector<int> out = group_of;
    int id = next_id;
    for (size_t i = 0; i < out.size(); ++i)
      for (size_t c = 0; c < ranked.size(); ++c)
        if (dropped[c] && out[i] == ranked[c].second) {
          out[i] = id++;
          break;
        }
    return out;
  };
  const size_t base = outlined_arena(graph, group_of);
  std::vector<bool> dropped(ranked.size(), true);
  size_t best = outlined_arena(graph, with_dropped(dropped));
  // Only for a real gain: a few bytes of placement luck are not worth a kernel's speed.
  if (best >= base || base - best < static_cast<size_t>(kMinArenaGain * static_cast<double>(base)))
    return 0;
  // Every candidate apart lowers the arena; put back, least stretching first, each group whose
  // return does not raise it again (each kept group keeps its kernel's speed).
  for (size_t c = ranked.size(); c-- > 0;) {
    dropped[c] = false;
    const size_t arena = outlined_arena(graph, with_dropped(dropped));
    if (arena <= best) {
      best = arena;
    } else {
      dropped[c] = true;
    }
  }
  group_of = with_dropped(dropped);
  return static_cast<int>(std::count(dropped.begin(), dropped.end(), true));
}

}  // namespace fusion

bool FusionPass::run(Graph& graph) {
  fusion::Problem problem = fusion::build_problem(graph);
  last_ = options_.optimal ? fusion::partition_optimal(problem, options_.optimal_options)
                           : fusion::partition_greedy(problem);
  std::string why;
  KILN_CHECK(fusion::is_legal(problem, last_.group_of, &why),
             "fusion: the partitioner returned an illegal partition: {}", why);
  if (options_.absorb_readers) last_ = fusion::absorb_readers(problem, last_);
  if (options_.max_unstretch_candidates > 0) {
    last_.groups_dropped =
        fusion::unstretch_groups(graph, last_.group_of, options_.max_unstretch_candidates);
    if (last_.groups_dropped > 0) last_.saved_bytes = fusion::saved_bytes(problem, last_.group_of);
  }
  return fusion::outline(graph, last_.group_of) > 0;
}

}  // namespace kiln

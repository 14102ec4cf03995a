#include "passes/multi_tensor.h"

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>

#include "analysis/memory_plan.h"
#include "ops/fused/kind.h"
#include "passes/fusion/fusion.h"
#include "passes/schedule.h"
#include "passes/simplify/compact.h"
#include "support/error.h"

namespace kiln {
namespace {

// ---- inlining fusion groups -----------------------------------------------------------------

// A node of the kinds the fusion pass gives its groups: those may be taken apart and outlined
// again.
bool is_outlined_group(const Node& node) {
  if (node.op != Op::kFused || !node.body || !is_fusion_group(fused_kind(node))) return false;
  // Inlining maps each body output to one outer value: a body input passed through, or a value
  // output twice, has no node of its own to produce it (fusion makes neither).
  std::set<ValueId> seen;
  for (ValueId id : node.body->outputs)
    if (node.body->input_index(id) >= 0 || !seen.insert(id).second) return false;
  return true;
}

struct Flat {
  Graph graph;
  std::vector<int> origin;  // per node: the index of the node of the original graph it came from
};

// `graph` with the bodies of the nodes `expand` picks put back in their place as plain nodes.
Flat inline_groups(const Graph& graph, const std::function<bool(size_t)>& expand) {
  Flat flat;
  flat.graph = graph;
  flat.graph.nodes.clear();
  std::set<std::string> names;
  for (const Value& v : graph.values)
    if (!v.name.empty()) names.insert(v.name);
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (!expand(n)) {
      flat.graph.nodes.push_back(node);
      flat.origin.push_back(static_cast<int>(n));
      continue;
    }
    const Graph& body = *node.body;
    std::vector<ValueId> outer(body.values.size(), -1);
    for (size_t i = 0; i < body.inputs.size(); ++i) outer[body.inputs[i].value] = node.inputs[i];
    for (size_t i = 0; i < body.outputs.size(); ++i) outer[body.outputs[i]] = node.outputs[i];
    for (const Node& inner : body.nodes) {
      Node copy{inner.op, {}, {}, inner.attrs, nullptr};
      for (ValueId id : inner.inputs) copy.inputs.push_back(outer.at(static_cast<size_t>(id)));
      for (ValueId id : inner.outputs) {
        if (outer[id] < 0) {
          // A value that lived only inside the group: a new outer value (its body name if free).
          const Value& v = body.value(id);
          const bool keep = !v.name.empty() && names.insert(v.name).second;
          outer[id] = static_cast<ValueId>(flat.graph.values.size());
          flat.graph.values.push_back(Value{keep ? v.name : "", v.type});
        }
        copy.outputs.push_back(outer[id]);
      }
      flat.graph.nodes.push_back(std::move(copy));
      flat.origin.push_back(static_cast<int>(n));
    }
  }
  return flat;
}

// Per value: the nodes reading it, and whether it leaves the graph (output or update value).
struct Uses {
  std::vector<int> readers;  // count of node-input uses
  std::vector<bool> external;
  explicit Uses(const Graph& graph)
      : readers(graph.values.size(), 0), external(graph.values.size(), false) {
    for (const Node& node : graph.nodes)
      for (ValueId id : node.inputs) ++readers[id];
    for (ValueId id : graph.outputs) external[id] = true;
    for (const Update& u : graph.updates) external[u.value] = true;
  }
  // Read by exactly one node input and nothing else.
  bool single(ValueId id) const { return readers[id] == 1 && !external[id]; }
};

std::string fresh_name(std::set<std::string>& used, const std::string& stem) {
  for (int i = 0;; ++i) {
    std::string name = fmt::format("{}_{}", stem, i);
    if (used.insert(name).second) return name;
  }
}

// Gives every body not in `before` (made by fusion::outline, which numbers its bodies from
// fused_0 on each call) a name no other body has; kind_of(node) is the kind to set, or nullopt
// to keep the one outline gave (the fusion pass's).
void rename_new_bodies(Graph& graph, const std::set<const Graph*>& before,
                       const std::function<std::optional<FusedKind>(const Node&)>& kind_of) {
  std::set<std::string> used;
  for (const Node& node : graph.nodes)
    if (node.body && before.count(node.body.get())) used.insert(node.body->name);
  for (Node& node : graph.nodes) {
    if (!node.body || before.count(node.body.get())) continue;
    const std::optional<FusedKind> kind = kind_of(node);
    if (kind) node.attrs = fused_attrs(*kind);
    auto body = std::make_shared<Graph>(*node.body);
    std::string stem = kind ? std::string(fused_kind_name(*kind)) : "fused";
    std::replace(stem.begin(), stem.end(), '-', '_');
    body->name = fresh_name(used, stem);
    node.body = std::move(body);
  }
}

std::set<const Graph*> bodies_of(const Graph& graph) {
  std::set<const Graph*> out;
  for (const Node& node : graph.nodes)
    if (node.body) out.insert(node.body.get());
  return out;
}

// ---- the global norm ------------------------------------------------------------------------

bool f32_scalar(const Graph& g, ValueId id) {
  const TensorType& t = g.type(id);
  return t.dtype == DType::kF32 && t.rank() == 0;
}

// The nodes of each exact global-norm pattern of `graph` (see multi_tensor.h), one list per
// add tree, in node order.
std::vector<std::vector<int>> find_norms(const Graph& graph) {
  const Uses uses(graph);
  const size_t num_values = graph.values.size();
  std::vector<int> producer(num_values, -1);
  for (size_t n = 0; n < graph.nodes.size(); ++n)
    for (ValueId id : graph.nodes[n].outputs) producer[id] = static_cast<int>(n);
  auto produced_by = [&](ValueId id, Op op) {
    const int p = producer[id];
    return p >= 0 && graph.nodes[static_cast<size_t>(p)].op == op ? p : -1;
  };
  // Per value: the nodes of the term or add tree it is the result of (empty: none).
  std::vector<std::vector<int>> tree(num_values);
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (node.op == Op::kSum && f32_scalar(graph, node.outputs[0])) {
      const ValueId q = node.inputs[0];
      const int square = produced_by(q, Op::kSquare);
      if (square < 0 || !uses.single(q) || graph.type(q).dtype != DType::kF32) continue;
      std::vector<int> nodes;
      const ValueId x = graph.nodes[static_cast<size_t>(square)].inputs[0];
      const int cast = produced_by(x, Op::kCast);
      if (cast >= 0 && uses.single(x) && is_float(graph.type(graph.nodes[static_cast<size_t>(cast)].inputs[0]).dtype))
        nodes.push_back(cast);
      nodes.push_back(square);
      nodes.push_back(static_cast<int>(n));
      tree[node.outputs[0]] = std::move(nodes);
    } else if (node.op == Op::kAdd && f32_scalar(graph, node.outputs[0]) &&
               node.inputs.size() == 2 && node.inputs[0] != node.inputs[1]) {
      std::vector<int> nodes;
      bool ok = true;
      for (ValueId in : node.inputs) {
        ok = ok && f32_scalar(graph, in) && !tree[in].empty() && uses.single(in);
        if (ok) nodes.insert(nodes.end(), tree[in].begin(), tree[in].end());
      }
      if (!ok) continue;
      nodes.push_back(static_cast<int>(n));
      tree[node.outputs[0]] = std::move(nodes);
    }
  }
  // Per value: a node reading it (the only one of a value read once).
  std::vector<int> reader(num_values, -1);
  for (size_t n = 0; n < graph.nodes.size(); ++n)
    for (ValueId id : graph.nodes[n].inputs) reader[id] = static_cast<int>(n);
  // Roots: add trees whose result is not itself an operand of a larger tree.
  std::vector<std::vector<int>> out;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (node.op != Op::kAdd) continue;
    const ValueId y = node.outputs[0];
    if (tree[y].empty()) continue;
    if (uses.single(y)) {
      const Node& next = graph.nodes[static_cast<size_t>(reader[y])];
      if (next.op == Op::kAdd && !tree[next.outputs[0]].empty()) continue;  // inner
    }
    std::vector<int> nodes = tree[y];
    std::sort(nodes.begin(), nodes.end());
    out.push_back(std::move(nodes));
  }
  return out;
}

bool group_global_norms(Graph& graph) {
  // Fusion may hold parts of the pattern: look for it with every fusion group inlined, then
  // inline only the groups that hold part of it.
  const Flat all = inline_groups(graph, [&](size_t n) { return is_outlined_group(graph.nodes[n]); });
  std::vector<std::vector<int>> norms = find_norms(all.graph);
  if (norms.empty()) return false;
  std::set<int> touched;
  for (const auto& norm : norms)
    for (int n : norm) touched.insert(all.origin[static_cast<size_t>(n)]);
  Flat flat = inline_groups(graph, [&](size_t n) {
    return touched.count(static_cast<int>(n)) && is_outlined_group(graph.nodes[n]);
  });
  norms = find_norms(flat.graph);
  const int first_new = static_cast<int>(graph.nodes.size());
  std::vector<int> group_of = flat.origin;
  // Each tree's root (its last node) gets a name of its own, by which its node is found after
  // outlining (which renumbers values); an existing name is kept when no other value has it.
  std::map<std::string, int> name_count;
  for (const Value& v : flat.graph.values) ++name_count[v.name];
  std::set<std::string> root_names;
  for (size_t k = 0; k < norms.size(); ++k) {
    for (int n : norms[k]) group_of[static_cast<size_t>(n)] = first_new + static_cast<int>(k);
    const ValueId root = flat.graph.nodes[static_cast<size_t>(norms[k].back())].outputs[0];
    std::string& name = flat.graph.values[static_cast<size_t>(root)].name;
    if (name.empty() || name_count[name] > 1) {
      std::string stem = "grad_sumsq";
      for (int i = 1; name_count.count(stem); ++i) stem = fmt::format("grad_sumsq_{}", i);
      name = stem;
      ++name_count[name];
    }
    root_names.insert(name);
  }
  // Nodes of an inlined group outside the pattern are outlined again as one group (their
  // origin); a plain node is its own group.
  const std::set<const Graph*> before = bodies_of(graph);
  Graph out = flat.graph;
  try {
    fusion::outline(out, group_of);
  } catch (const Error&) {
    return false;  // taking the pattern out would make a cycle through a group: leave it
  }
  rename_new_bodies(out, before, [&](const Node& node) -> std::optional<FusedKind> {
    for (ValueId id : node.outputs)
      if (root_names.count(out.value(id).name)) return FusedKind::kGlobalNorm;
    return std::nullopt;
  });
  graph = std::move(out);
  return true;
}

// ---- the updates (and the grouping under the schedule's peak, which the casts share) ------

struct UpdateKey {
  Attributes attrs;
  std::vector<ValueId> scalars;
  std::vector<DType> dtypes;
};

bool same_key(const UpdateKey& a, const UpdateKey& b) {
  return same_values(a.attrs, b.attrs) && a.scalars == b.scalars && a.dtypes == b.dtypes;
}

// The order the schedule pass would pick, and the peak of live bytes in it with the updates the
// executor writes straight into their targets dropped (analysis/memory_plan.h: direct_updates;
// their bytes still count from their node, all at once for a group), the others live to the end.
struct Scheduled {
  std::vector<int> order;
  size_t peak = 0;
};
Scheduled schedule_of(const Graph& graph) {
  Scheduled s;
  s.order = memory_aware_order(graph);
  Graph ordered = in_order(graph, s.order);
  drop_direct_updates(ordered);
  std::vector<int> identity(s.order.size());
  std::iota(identity.begin(), identity.end(), 0);
  s.peak = peak_live_bytes(ordered, identity);
  return s;
}

// `graph` with each list of `groups` (node indices) outlined into one node of `kind`.
Graph outline_groups(const Graph& graph, const std::vector<std::vector<int>>& groups,
                     FusedKind kind) {
  std::vector<int> group_of(graph.nodes.size());
  for (size_t n = 0; n < graph.nodes.size(); ++n) group_of[n] = static_cast<int>(n);
  const int first_new = static_cast<int>(graph.nodes.size());
  for (size_t g = 0; g < groups.size(); ++g)
    for (int n : groups[g]) group_of[static_cast<size_t>(n)] = first_new + static_cast<int>(g);
  const std::set<const Graph*> before = bodies_of(graph);
  Graph out = graph;
  fusion::outline(out, group_of);
  rename_new_bodies(out, before, [&](const Node&) -> std::optional<FusedKind> { return kind; });
  return out;
}

// Outlines each list of `whole` (node indices, two or more per list) into one node of `kind`
// if the scheduled peak does not rise; otherwise into chunks of consecutive members of the
// scheduled order under a cap on member_bytes (halved until it does not rise); otherwise
// changes nothing. Returns whether it changed `graph`. `scheduled`: schedule_of(graph) if
// known (each measure schedules the whole step), and so again on return.
using Measured = std::optional<Scheduled>;
bool group_under_peak(Graph& graph, const std::vector<std::vector<int>>& whole, FusedKind kind,
                      const std::function<size_t(int)>& member_bytes, Measured& scheduled) {
  if (whole.empty()) return false;
  if (!scheduled) scheduled = schedule_of(graph);
  const size_t baseline = scheduled->peak;
  auto fits = [&](const Graph& g) {
    Scheduled after = schedule_of(g);
    if (after.peak > baseline) return false;
    scheduled = std::move(after);
    return true;
  };
  Graph grouped;
  try {
    grouped = outline_groups(graph, whole, kind);
  } catch (const Error&) {
    return false;  // a path from one member to another (none in an optimizer's graph)
  }
  if (fits(grouped)) {
    graph = std::move(grouped);
    return true;
  }
  const std::vector<int> order = scheduled->order;  // of `graph`, which no try has replaced
  std::vector<int> position(graph.nodes.size());
  for (size_t i = 0; i < order.size(); ++i) position[static_cast<size_t>(order[i])] = static_cast<int>(i);
  size_t total = 0, largest = 0;
  for (const auto& members : whole)
    for (int n : members) {
      total += member_bytes(n);
      largest = std::max(largest, member_bytes(n));
    }
  for (size_t cap = total / 2; cap >= largest && cap > 0; cap /= 2) {
    std::vector<std::vector<int>> chunks;
    for (std::vector<int> members : whole) {
      std::sort(members.begin(), members.end(), [&](int a, int b) { return position[a] < position[b]; });
      std::vector<int> chunk;
      size_t bytes = 0;
      for (int n : members) {
        if (!chunk.empty() && bytes + member_bytes(n) > cap) {
          if (chunk.size() >= 2) chunks.push_back(chunk);
          chunk.clear();
          bytes = 0;
        }
        chunk.push_back(n);
        bytes += member_bytes(n);
      }
      if (chunk.size() >= 2) chunks.push_back(chunk);
    }
    if (chunks.empty()) break;
    for (auto& chunk : chunks) std::sort(chunk.begin(), chunk.end());
    Graph chunked;
    try {
      chunked = outline_groups(graph, chunks, kind);
    } catch (const Error&) {
      return false;
    }
    if (fits(chunked)) {
      graph = std::move(chunked);
      return true;
    }
  }
  return false;
}

// Node n (an optimizer_update) as a multi-tensor-update node of one member, whose body is that
// node alone: what outline() makes of a group of two or more.
void wrap_update(Graph& graph, size_t n, std::set<std::string>& used) {
  Node& node = graph.nodes[n];
  auto body = std::make_shared<Graph>();
  body->name = fresh_name(used, "multi_tensor_update");
  Node inner{node.op, {}, {}, node.attrs, nullptr};
  std::vector<ValueId> outer_inputs;
  for (ValueId id : node.inputs) {
    const auto at = std::find(outer_inputs.begin(), outer_inputs.end(), id);
    if (at != outer_inputs.end()) {
      inner.inputs.push_back(body->inputs[static_cast<size_t>(at - outer_inputs.begin())].value);
      continue;
    }
    const std::string& name = graph.value(id).name;
    inner.inputs.push_back(body->add_input(name.empty() ? fmt::format("in{}", outer_inputs.size()) : name,
                                           graph.type(id), Role::kData));
    outer_inputs.push_back(id);
  }
  for (ValueId id : node.outputs) {
    const auto inner_id = static_cast<ValueId>(body->values.size());
    body->values.push_back(Value{graph.value(id).name, graph.type(id)});
    inner.outputs.push_back(inner_id);
    body->outputs.push_back(inner_id);
  }
  body->nodes.push_back(std::move(inner));
  node = Node{Op::kFused, outer_inputs, node.outputs, fused_attrs(FusedKind::kMultiTensorUpdate), std::move(body)};
}

// The overlap grouping (MultiTensorPass's overlap_chunk_bytes): each list of `by_key` in chunks
// by readiness under `cap` operand bytes; a chunk of one update is a group of its own too, so
// that the overlap pass moves and marks every update the same way.
bool group_ready_chunks(Graph& graph, const std::vector<std::vector<int>>& by_key, size_t cap,
                        const std::function<size_t(int)>& member_bytes) {
  const std::vector<int> order = memory_aware_order(graph);
  std::vector<int> position(graph.nodes.size());
  for (size_t i = 0; i < order.size(); ++i) position[static_cast<size_t>(order[i])] = static_cast<int>(i);
  std::vector<int> producer(graph.values.size(), -1);
  for (size_t n = 0; n < graph.nodes.size(); ++n)
    for (ValueId id : graph.nodes[n].outputs) producer[id] = static_cast<int>(n);
  auto ready = [&](int n) {
    int at = -1;
    for (ValueId id : graph.nodes[static_cast<size_t>(n)].inputs)
      if (producer[id] >= 0) at = std::max(at, position[static_cast<size_t>(producer[id])]);
    return at;
  };
  std::vector<std::vector<int>> chunks;
  for (std::vector<int> members : by_key) {
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return ready(a) < ready(b); });
    std::vector<int> chunk;
    size_t bytes = 0;
    for (int n : members) {
      if (!chunk.empty() && bytes + member_bytes(n) > cap) {
        chunks.push_back(chunk);
        chunk.clear();
        bytes = 0;
      }
      chunk.push_back(n);
      bytes += member_bytes(n);
    }
    if (!chunk.empty()) chunks.push_back(chunk);
  }
  if (chunks.empty()) return false;
  std::vector<std::vector<int>> groups;
  std::set<std::string> used;
  for (const Node& node : graph.nodes)
    if (node.body) used.insert(node.body->name);
  for (auto& chunk : chunks) {
    std::sort(chunk.begin(), chunk.end());
    if (chunk.size() >= 2) groups.push_back(chunk);
    else wrap_update(graph, static_cast<size_t>(chunk[0]), used);  // indices stay valid: one node for one
  }
  if (!groups.empty()) graph = outline_groups(graph, groups, FusedKind::kMultiTensorUpdate);
  return true;
}

bool group_updates(Graph& graph, Measured& scheduled, size_t overlap_chunk_bytes) {
  // Candidates by key, in node order.
  std::vector<UpdateKey> keys;
  std::vector<std::vector<int>> by_key;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (node.op != Op::kOptimizerUpdate) continue;
    UpdateKey key{node.attrs, {node.inputs.end() - 2, node.inputs.end()}, {}};  // lr and step
    for (size_t i = 0; i < node.inputs.size(); ++i) key.dtypes.push_back(graph.type(node.inputs[i]).dtype);
    size_t k = 0;
    while (k < keys.size() && !same_key(keys[k], key)) ++k;
    if (k == keys.size()) {
      keys.push_back(std::move(key));
      by_key.emplace_back();
    }
    by_key[k].push_back(static_cast<int>(n));
  }
  // Chunks are capped by the bytes of their tensor operands (the gradients a chunk keeps
  // waiting are among them).
  auto operand_bytes = [&](int n) {
    size_t bytes = 0;
    const Node& node = graph.nodes[static_cast<size_t>(n)];
    for (size_t i = 0; i + 2 < node.inputs.size(); ++i) bytes += graph.type(node.inputs[i]).bytes();
    return bytes;
  };
  if (overlap_chunk_bytes > 0) return group_ready_chunks(graph, by_key, overlap_chunk_bytes, operand_bytes);
  std::vector<std::vector<int>> whole;
  for (auto& members : by_key)
    if (members.size() >= 2) whole.push_back(members);
  return group_under_peak(graph, whole, FusedKind::kMultiTensorUpdate, operand_bytes, scheduled);
}

// ---- the casts of the params ----------------------------------------------------------------

bool sixteen_bit_float(DType d) { return d == DType::kBF16 || d == DType::kF16; }

bool group_param_casts(Graph& graph, Measured& scheduled) {
  std::vector<bool> is_param(graph.values.size(), false);
  for (const GraphInput& in : graph.inputs) is_param[in.value] = in.role == Role::kParam;
  std::vector<int> members;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (node.op != Op::kCast || node.inputs.size() != 1 || node.outputs.size() != 1) continue;
    const ValueId x = node.inputs[0];
    if (is_param[x] && graph.type(x).dtype == DType::kF32 &&
        sixteen_bit_float(graph.type(node.outputs[0]).dtype))
      members.push_back(static_cast<int>(n));
  }
  if (members.size() < 2) return false;
  // Chunks are capped by the bytes of their results: what a chunk makes alive before its
  // readers need it.
  return group_under_peak(graph, {members}, FusedKind::kMultiTensorCast, [&](int n) {
    return graph.type(graph.nodes[static_cast<size_t>(n)].outputs[0]).bytes();
  }, scheduled);
}

// ---- widening casts of gradients --------------------------------------------------------------

// An update whose gradient is a standalone cast from 16 bits to f32 or f64, read by nothing
// else, reads the 16-bit value itself: widening is exact and the update kernels convert their
// gradient on load, so the step is the same bit for bit, less one launch-bound cast per
// gradient (GPT-2 under bf16 amp: the 48 bias gradients whose column sums stay 16-bit). Runs
// after fusion: a cast that fusion put into its producer's group (a GEMM's f32 weight gradient)
// is no standalone node, and stays.
bool fold_gradient_casts(Graph& graph) {
  const Uses uses(graph);
  std::vector<int> producer(graph.values.size(), -1);
  for (size_t n = 0; n < graph.nodes.size(); ++n)
    for (ValueId id : graph.nodes[n].outputs) producer[id] = static_cast<int>(n);
  std::set<int> folded;
  for (Node& node : graph.nodes) {
    if (node.op != Op::kOptimizerUpdate) continue;
    const ValueId grad = node.inputs[1];
    const int p = producer[grad];
    if (p < 0 || !uses.single(grad)) continue;
    const Node& cast = graph.nodes[static_cast<size_t>(p)];
    if (cast.op != Op::kCast || cast.inputs.size() != 1) continue;
    const DType from = graph.type(cast.inputs[0]).dtype, to = graph.type(grad).dtype;
    if (!sixteen_bit_float(from) || (to != DType::kF32 && to != DType::kF64)) continue;
    node.inputs[1] = cast.inputs[0];
    folded.insert(p);
  }
  if (folded.empty()) return false;
  for (auto it = folded.rbegin(); it != folded.rend(); ++it)
    graph.nodes.erase(graph.nodes.begin() + *it);
  compact(graph);
  return true;
}

}  // namespace

bool MultiTensorPass::run(Graph& graph) {
  bool changed = fold_gradient_casts(graph);
  changed = group_global_norms(graph) || changed;
  Measured scheduled;  // of the graph as it is, once measured
  changed = group_updates(graph, scheduled, overlap_chunk_bytes_) || changed;
  if (group_casts_) changed = group_param_casts(graph, scheduled) || changed;
  return changed;
}

}  // namespace kiln

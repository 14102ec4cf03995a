#include "passes/overlap_updates.h"

#include <algorithm>

#include "analysis/memory_plan.h"
#include "ops/fused/kind.h"
#include "ops/update_stream.h"
#include "passes/uses.h"
#include "support/bytes.h"
#include "support/error.h"

namespace kiln {
namespace {

bool is_update_group(const Node& node) { return is_fused(node, FusedKind::kMultiTensorUpdate); }

// The last node other than `except` that reads `id`, or a reshape or slice of it (which the
// memory plan may make a view of its bytes, read as long as the view is): -1 if none.
int last_read(const Graph& graph, const Uses& uses, ValueId id, int except) {
  int last = -1;
  for (int r : uses.readers[static_cast<size_t>(id)]) {
    if (r == except) continue;
    last = std::max(last, r);
    const Node& node = graph.nodes[static_cast<size_t>(r)];
    if ((node.op == Op::kReshape || node.op == Op::kSlice) && node.outputs.size() == 1)
      last = std::max(last, last_read(graph, uses, node.outputs[0], except));
  }
  return last;
}

// Moves node `from` to index `to` (<= from), the nodes in between one down.
void move_up(Graph& graph, size_t from, size_t to) {
  std::rotate(graph.nodes.begin() + static_cast<std::ptrdiff_t>(to), graph.nodes.begin() + static_cast<std::ptrdiff_t>(from),
              graph.nodes.begin() + static_cast<std::ptrdiff_t>(from) + 1);
}

// A node of a few bytes of results (a scalar: the optimizer's step count, its bias corrections)
// that may run anywhere after its inputs. Nothing urges the schedule to run such a node early,
// so it may stand last, holding back every update that reads it.
bool is_small(const Node& node, const Graph& graph) {
  if (has_flag(node.op, kCollective) || node.op == Op::kCollectiveWait || node.body) return false;
  for (ValueId id : node.outputs)
    if (graph.type(id).bytes() > 64) return false;
  return true;
}

// Moves the small nodes that the update groups read (directly or through other small nodes) up
// to right after their last input's producer, in order, so each sees its own producers moved.
void hoist_small_producers(Graph& graph) {
  std::vector<bool> wanted(graph.nodes.size(), false);
  {
    const Uses uses(graph);
    for (size_t n = graph.nodes.size(); n-- > 0;) {
      const Node& node = graph.nodes[n];
      if (!is_update_group(node) && !wanted[n]) continue;
      for (ValueId id : node.inputs) {
        const int p = uses.producer[static_cast<size_t>(id)];
        if (p >= 0 && is_small(graph.nodes[static_cast<size_t>(p)], graph)) wanted[static_cast<size_t>(p)] = true;
      }
    }
  }
  std::vector<int> producer(graph.values.size(), -1);
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    size_t at = n;
    int last = -1;
    if (wanted[n])
      for (ValueId id : graph.nodes[n].inputs) last = std::max(last, producer[static_cast<size_t>(id)]);
    if (wanted[n] && static_cast<size_t>(last + 1) < n) {
      at = static_cast<size_t>(last + 1);
      move_up(graph, n, at);
      std::rotate(wanted.begin() + static_cast<std::ptrdiff_t>(at), wanted.begin() + static_cast<std::ptrdiff_t>(n),
                  wanted.begin() + static_cast<std::ptrdiff_t>(n) + 1);
      // The nodes from `at` on moved one down: their outputs' producers too.
      for (size_t k = at + 1; k <= n; ++k)
        for (ValueId id : graph.nodes[k].outputs) producer[static_cast<size_t>(id)] = static_cast<int>(k);
    }
    for (ValueId id : graph.nodes[at].outputs) producer[static_cast<size_t>(id)] = static_cast<int>(at);
  }
}

// Moves every update group up to the earliest index where it may run (see the header), once the
// small producers it reads are hoisted.
void move_groups_up(Graph& graph) {
  std::vector<int> target_of(graph.values.size(), -1);  // per update value: its target
  for (const Update& u : graph.updates) target_of[u.value] = u.target;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    if (!is_update_group(graph.nodes[n])) continue;
    const Uses uses(graph);  // the order changes with every move
    const Node& node = graph.nodes[n];
    int earliest = -1;
    for (ValueId id : node.inputs) earliest = std::max(earliest, uses.producer[id]);
    for (ValueId id : node.outputs)
      if (target_of[id] >= 0) earliest = std::max(earliest, last_read(graph, uses, target_of[id], static_cast<int>(n)));
    const size_t to = static_cast<size_t>(earliest + 1);
    if (to < n) move_up(graph, n, to);
  }
}

Graph with_marks(const Graph& graph, const std::vector<size_t>& nodes) {
  Graph out = graph;
  for (size_t n : nodes) out.nodes[n].attrs.set("stream", std::string(kUpdateStream));
  return out;
}

size_t arena_of(const Graph& graph) { return plan_step_memory(graph).arena_bytes; }

}  // namespace

size_t update_chunk_bytes(const CostModel& costs) {
  return static_cast<size_t>(25 * costs.launch_s * costs.bytes_per_s);
}

bool OverlapUpdates::run(Graph& graph) {
  notes_.clear();
  if (!enabled_) return false;
  const auto count = std::count_if(graph.nodes.begin(), graph.nodes.end(),
                                   [](const Node& n) { return is_update_group(n) && !on_update_stream(n); });
  if (count == 0) return false;
  // The scalars first: they cost a few bytes, counted in the limit.
  hoist_small_producers(graph);
  const Graph as_came = graph;
  // Without a budget: no more than the step as it came.
  const size_t limit = memory_budget_ ? *memory_budget_ : arena_of(as_came);
  move_groups_up(graph);

  // Candidates: groups with compute after them, whose results only the step's updates read.
  const Uses uses(graph);
  std::vector<double> after(graph.nodes.size() + 1, 0.0);  // predicted compute after each node
  for (size_t n = graph.nodes.size(); n-- > 0;)
    after[n] = after[n + 1] + (is_update_group(graph.nodes[n]) ? 0.0 : costs_.node_seconds(graph, n));
  std::vector<size_t> candidates;
  double update_s = 0, beside_s = 0;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (!is_update_group(node) || on_update_stream(node)) continue;
    update_s += costs_.node_seconds(graph, n);
    const bool unread = std::all_of(node.outputs.begin(), node.outputs.end(),
                                    [&](ValueId id) { return uses.readers[id].empty(); });
    if (unread && after[n + 1] > costs_.launch_s) candidates.push_back(n);
  }
  // Marking the earliest chunks keeps the most gradients live to the end: find the earliest
  // chunk from which on every mark fits the limit (the arena only grows with more marks).
  size_t lo = 0, hi = candidates.size();
  auto fits_from = [&](size_t k) {
    return arena_of(with_marks(graph, std::vector<size_t>(candidates.begin() + static_cast<std::ptrdiff_t>(k), candidates.end()))) <= limit;
  };
  if (!candidates.empty() && !fits_from(hi - 1)) lo = hi;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (fits_from(mid)) hi = mid;
    else lo = mid + 1;
  }
  std::vector<size_t> marked(candidates.begin() + static_cast<std::ptrdiff_t>(lo), candidates.end());
  if (arena_of(with_marks(graph, marked)) > limit) {
    // Even the moves alone cost memory (an update copied at the end, live from its node on).
    graph = as_came;
    notes_.push_back("no update group moved: the planned arena would exceed its limit");
    return false;
  }
  const size_t unmarked_arena = arena_of(graph);
  graph = with_marks(graph, marked);
  for (size_t n : marked) beside_s += std::min(costs_.node_seconds(graph, n), after[n + 1]);
  notes_.push_back(fmt::format("{} of {} update groups on the update stream ({} with compute after them); predicted "
                               "{:.2f} of {:.2f} ms of updates beside the compute; planned arena {} (limit {}; {} unmarked)",
                               marked.size(), count, candidates.size(), 1e3 * beside_s, 1e3 * update_s,
                               format_bytes(arena_of(graph)), format_bytes(limit), format_bytes(unmarked_arena)));
  return true;
}

}  // namespace kiln

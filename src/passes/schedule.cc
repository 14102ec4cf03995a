#include "passes/schedule.h"

#include <algorithm>
#include <numeric>
#include <queue>

#include "analysis/memory_plan.h"
#include "support/error.h"

namespace kiln {
namespace {

size_t aligned(size_t bytes) { return (bytes + 63) / 64 * 64; }

// Facts about the graph that do not depend on the order. Bytes belong to buffers: a value and
// its views (reshapes and contiguous slices the memory plan gives no bytes of their own, a
// slice's at an offset inside its root's: analysis/memory_plan.h) are one buffer of the root's
// size, named by its root value, live from the root's node to the last read of any of them.
struct Dependencies {
  std::vector<int> producer;                 // per value: defining node, or -1
  std::vector<ValueId> root;                 // per value: the value owning its bytes
  std::vector<bool> pinned;                  // per root: live to the end (output, update)
  std::vector<int64_t> size;                 // per value: aligned bytes (0 for a view)
  std::vector<std::vector<ValueId>> inputs;  // per node: the distinct roots it reads
  std::vector<std::vector<int>> consumers;   // per root: the distinct nodes reading its buffer

  explicit Dependencies(const Graph& graph) {
    const size_t num_values = graph.values.size();
    const std::vector<ValueId> views = find_views(graph).input;
    producer.assign(num_values, -1);
    root.resize(num_values);
    pinned.assign(num_values, false);
    size.resize(num_values);
    consumers.resize(num_values);
    for (size_t v = 0; v < num_values; ++v) {
      root[v] = view_root(views, static_cast<ValueId>(v));
      size[v] = views[v] >= 0 ? 0 : static_cast<int64_t>(aligned(graph.values[v].type.bytes()));
    }
    for (ValueId id : graph.outputs) pinned[root[id]] = true;
    for (const Update& u : graph.updates) pinned[root[u.value]] = true;
    inputs.resize(graph.nodes.size());
    for (size_t n = 0; n < graph.nodes.size(); ++n) {
      const Node& node = graph.nodes[n];
      for (ValueId id : node.outputs) producer[id] = static_cast<int>(n);
      std::vector<ValueId>& in = inputs[n];
      for (ValueId id : node.inputs) in.push_back(root[id]);
      std::sort(in.begin(), in.end());
      in.erase(std::unique(in.begin(), in.end()), in.end());
      for (ValueId id : in) consumers[id].push_back(static_cast<int>(n));
    }
  }
  // A buffer the step allocates and can free before its end.
  bool freeable(ValueId id) const { return producer[id] >= 0 && !pinned[id]; }
};

// Greedy list scheduling (see schedule.h). `count_pinned`: whether allocating a value that lives
// to the end counts against a node.
std::vector<int> greedy_order(const Graph& graph, const Dependencies& deps, bool count_pinned) {
  const size_t num_nodes = graph.nodes.size();
  std::vector<int> remaining(graph.values.size());  // unscheduled readers per buffer
  for (size_t v = 0; v < remaining.size(); ++v) remaining[v] = static_cast<int>(deps.consumers[v].size());
  std::vector<int> pending(num_nodes, 0);  // inputs not computed yet, per node
  std::vector<std::vector<int>> waiting(graph.values.size());  // per value: nodes reading it
  std::vector<int64_t> gain(num_nodes, 0);
  for (size_t n = 0; n < num_nodes; ++n) {
    const Node& node = graph.nodes[n];
    std::vector<ValueId> read = node.inputs;
    std::sort(read.begin(), read.end());
    read.erase(std::unique(read.begin(), read.end()), read.end());
    for (ValueId id : read)
      if (deps.producer[id] >= 0) {
        ++pending[n];
        waiting[id].push_back(static_cast<int>(n));
      }
    for (ValueId id : deps.inputs[n])
      if (deps.freeable(id) && remaining[id] == 1) gain[n] += deps.size[id];
    for (ValueId id : node.outputs) {
      if (deps.size[id] == 0) continue;  // a view: no bytes of its own
      // A value nobody reads is freed right after its node: no net change.
      if (deps.freeable(id) && remaining[id] == 0) continue;
      if (deps.freeable(id) || count_pinned) gain[n] -= deps.size[id];
    }
  }

  // Best gain first; on a tie, the earlier node of the original order.
  using Entry = std::pair<int64_t, int>;
  auto worse = [](const Entry& a, const Entry& b) {
    return a.first != b.first ? a.first < b.first : a.second > b.second;
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(worse)> ready(worse);
  for (size_t n = 0; n < num_nodes; ++n)
    if (pending[n] == 0) ready.push({gain[n], static_cast<int>(n)});

  std::vector<bool> scheduled(num_nodes, false);
  std::vector<int> order;
  order.reserve(num_nodes);
  while (!ready.empty()) {
    auto [g, n] = ready.top();
    ready.pop();
    if (scheduled[n] || g != gain[n]) continue;  // stale: re-pushed with a larger gain
    scheduled[n] = true;
    order.push_back(n);
    for (ValueId id : deps.inputs[n]) {
      if (--remaining[id] != 1 || !deps.freeable(id)) continue;
      // The one reader left now frees this buffer: it gains its bytes.
      for (int c : deps.consumers[id]) {
        if (scheduled[c]) continue;
        gain[c] += deps.size[id];
        if (pending[c] == 0) ready.push({gain[c], c});
        break;
      }
    }
    for (ValueId id : graph.nodes[n].outputs)
      for (int c : waiting[id])
        if (--pending[c] == 0) ready.push({gain[c], c});
  }
  KILN_CHECK(order.size() == num_nodes,
             "schedule: graph '{}' has a cycle: only {} of its {} nodes could be ordered",
             graph.name, order.size(), num_nodes);
  return order;
}

size_t peak_of(const Graph& graph, const Dependencies& deps, const std::vector<int>& order) {
  const size_t num_nodes = graph.nodes.size();
  std::vector<int> position(num_nodes);
  for (size_t i = 0; i < order.size(); ++i) position[order[i]] = static_cast<int>(i);
  std::vector<int64_t> delta(num_nodes + 2, 0);
  for (size_t v = 0; v < graph.values.size(); ++v) {
    if (deps.producer[v] < 0 || deps.size[v] == 0) continue;
    const int start = position[deps.producer[v]];
    int end = start;
    if (deps.pinned[v]) {
      end = static_cast<int>(num_nodes);
    } else {
      for (int c : deps.consumers[v]) end = std::max(end, position[c]);
    }
    delta[start] += deps.size[v];
    delta[end + 1] -= deps.size[v];
  }
  int64_t live = 0, peak = 0;
  for (int64_t d : delta) peak = std::max(peak, live += d);
  return static_cast<size_t>(peak);
}

}  // namespace

size_t peak_live_bytes(const Graph& graph, const std::vector<int>& order) {
  KILN_CHECK(order.size() == graph.nodes.size(), "peak_live_bytes: order has {} nodes, graph {}",
             order.size(), graph.nodes.size());
  return peak_of(graph, Dependencies(graph), order);
}

std::vector<int> memory_aware_order(const Graph& graph, size_t* arena_bytes) {
  const Dependencies deps(graph);
  std::vector<int> best(graph.nodes.size());
  std::iota(best.begin(), best.end(), 0);
  // Ranked by the memory plan's arena (what the step allocates), then by the live peak.
  auto key = [&](const std::vector<int>& order) {
    return std::make_pair(planned_arena_bytes(graph, order), peak_of(graph, deps, order));
  };
  std::pair<size_t, size_t> best_key = key(best);
  std::vector<std::vector<int>> tried;
  for (bool count_pinned : {true, false}) {
    std::vector<int> order = greedy_order(graph, deps, count_pinned);
    if (std::find(tried.begin(), tried.end(), order) != tried.end()) continue;  // planned already
    tried.push_back(order);
    const std::pair<size_t, size_t> k = key(order);
    if (k < best_key) {
      best_key = k;
      best = std::move(order);
    }
  }
  if (arena_bytes) *arena_bytes = best_key.first;
  return best;
}

Graph in_order(const Graph& graph, const std::vector<int>& order) {
  KILN_CHECK(order.size() == graph.nodes.size(), "in_order: order has {} nodes, graph {}", order.size(),
             graph.nodes.size());
  Graph ordered;
  ordered.name = graph.name;
  ordered.values = graph.values;
  ordered.inputs = graph.inputs;
  ordered.outputs = graph.outputs;
  ordered.updates = graph.updates;
  ordered.nodes.reserve(order.size());
  for (int n : order) ordered.nodes.push_back(graph.nodes[static_cast<size_t>(n)]);
  return ordered;
}

size_t planned_arena_bytes(const Graph& graph, const std::vector<int>& order) {
  return plan_step_memory(in_order(graph, order)).arena_bytes;
}

bool SchedulePass::run(Graph& graph) {
  std::vector<int> order = memory_aware_order(graph);
  bool changed = false;
  for (size_t i = 0; i < order.size(); ++i) changed |= order[i] != static_cast<int>(i);
  if (!changed) return false;
  std::vector<Node> nodes;
  nodes.reserve(order.size());
  for (int n : order) nodes.push_back(std::move(graph.nodes[n]));
  graph.nodes = std::move(nodes);
  return true;
}

}  // namespace kiln

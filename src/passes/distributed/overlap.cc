#include "passes/distributed/overlap.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "analysis/memory_plan.h"
#include "passes/distributed/collectives.h"
#include "passes/uses.h"
#include "support/error.h"
#include "support/bytes.h"

namespace kiln {
namespace {

using distributed::Collective;

// Key offsets within the gap before a node index: a moved param-only chain, then a start, then
// a wait (so a wait placed at its start's own index still follows it), then the readers that
// follow a wait (sink_readers).
constexpr double kChainKey = -0.8, kStartKey = -0.6, kWaitKey = -0.4, kSinkKey = -0.3;

// The last index p <= `limit` with t[limit] - t[p] >= lead (0 if none).
int latest_with_lead(const std::vector<double>& t, int limit, double lead) {
  const double at = t[static_cast<size_t>(limit)] - lead;
  // t is non-decreasing: the last p with t[p] <= at.
  const auto it = std::upper_bound(t.begin(), t.begin() + limit + 1, at);
  return std::max(0, static_cast<int>(it - t.begin()) - 1);
}

// The first index q in [from, limit] with t[q] >= time (limit if none).
int first_reaching(const std::vector<double>& t, int from, int limit, double time) {
  const auto it = std::lower_bound(t.begin() + from, t.begin() + limit, time);
  return static_cast<int>(it - t.begin());
}

struct Placement {
  Graph graph;
  size_t arena = 0;
  OverlapPrediction predicted;
};

class Planner {
 public:
  Planner(const Graph& graph, const CostModel& costs)
      : graph_(graph), costs_(costs), uses_(graph),
        collectives_(distributed::find_collectives(graph, uses_, costs)),
        t_(distributed::compute_start_times(graph, costs)) {
    sinks_.resize(collectives_.size());
    // Reduce-scatters only: measured on 2 H200s in one call, deferring zero3's updates took
    // GPT-2 medium from 87.7 to 86.7 ms and llama-8b from 769 to 744 ms, but dp's all-reduces
    // from 82.9 to 84.1 ms (their transfers then slow more of the backward's GEMMs).
    for (size_t i = 0; i < collectives_.size(); ++i)
      if (graph_.nodes[static_cast<size_t>(collectives_[i].start)].op == Op::kReduceScatter)
        sinks_[i] = sink_readers(collectives_[i]);
  }

  bool empty() const { return collectives_.empty(); }

  // The order with every collective placed at `scale` of the overlap it needs.
  Placement place(double scale) const {
    std::vector<double> keys(graph_.nodes.size());
    for (size_t n = 0; n < keys.size(); ++n) keys[n] = static_cast<double>(n);
    // Extra lead per gather, from the stalls the previous round predicted (queueing behind
    // other collectives on the communication stream).
    std::map<int, double> extra;
    Placement best;
    for (int round = 0; round < 3; ++round) {
      for (size_t n = 0; n < keys.size(); ++n) keys[n] = static_cast<double>(n);
      std::vector<std::pair<double, size_t>> starts;  // (key, collective index)
      for (size_t i = 0; i < collectives_.size(); ++i) {
        const Collective& c = collectives_[i];
        if (c.first_reader < 0) {
          starts.push_back({keys[static_cast<size_t>(c.start)], i});
          continue;
        }
        const Node& node = graph_.nodes[static_cast<size_t>(c.start)];
        int at;  // the start goes right before node `at`, its chain of casts and shape ops before it
        if (node.op == Op::kAllGather) {
          const double lead = scale * (c.seconds + extra[c.start]);
          at = std::max(c.ready, latest_with_lead(t_, c.first_reader, lead));
        } else if (distributed::hoists_producers(node.op)) {
          at = c.earliest;  // its producers hoisted to right after their inputs (collectives.h)
          for (int p : c.producers)
            keys[static_cast<size_t>(p)] = std::min(keys[static_cast<size_t>(p)], at + kChainKey - 0.1 + 1e-7 * p);
        } else {
          at = c.ready;
        }
        for (int p : c.chain)  // up only: a chain node may have readers before
          keys[static_cast<size_t>(p)] = std::min(keys[static_cast<size_t>(p)], at + kChainKey + 1e-7 * p);
        keys[static_cast<size_t>(c.start)] = at + kStartKey;
        starts.push_back({keys[static_cast<size_t>(c.start)], i});
      }
      // The communication stream runs the collectives in start order.
      std::sort(starts.begin(), starts.end());
      double free = 0;
      for (const auto& [key, i] : starts) {
        const Collective& c = collectives_[i];
        const int at = std::clamp(static_cast<int>(std::ceil(key)), 0, static_cast<int>(graph_.nodes.size()));
        const double begin = std::max(free, t_[static_cast<size_t>(at)]);
        free = begin + c.seconds;
        if (c.first_reader < 0) continue;
        int wait_at;
        if (gathers(c)) {
          wait_at = c.first_reader;
          extra[c.start] += std::max(0.0, free - t_[static_cast<size_t>(c.first_reader)]);
        } else {
          const double done = t_[static_cast<size_t>(at)] + scale * (free - t_[static_cast<size_t>(at)]);
          // Readers that nothing else reads (the gradient's optimizer update) follow the wait
          // wherever it goes; other readers bound it.
          const std::vector<int>& sinks = sinks_[i];
          const int limit = sinks.empty() ? c.first_reader : static_cast<int>(graph_.nodes.size());
          wait_at = first_reaching(t_, at, limit, done);
          for (int r : sinks)
            keys[static_cast<size_t>(r)] =
                std::max(keys[static_cast<size_t>(r)], std::max(wait_at, at) + kSinkKey + 1e-7 * r);
        }
        keys[static_cast<size_t>(c.wait)] = std::max(wait_at, at) + kWaitKey;
      }
      Placement p;
      p.graph = graph_;
      distributed::reorder_by_keys(p.graph, keys);
      p.predicted = predict_step(p.graph, costs_);
      if (round == 0 || p.predicted.step_s < best.predicted.step_s) best = std::move(p);
    }
    best.arena = plan_step_memory(best.graph).arena_bytes;
    return best;
  }

  size_t collectives() const { return collectives_.size(); }

 private:
  bool gathers(const Collective& c) const { return graph_.nodes[static_cast<size_t>(c.start)].op == Op::kAllGather; }

  // The nodes reading a reduction's result, and theirs in turn, when none of them feeds anything
  // outside that set (their outputs escape or go unread) and none is a collective: such a set
  // (an optimizer update, or a cast and an update) may run any time after the wait. Without it
  // the wait stops at the first reader, which the memory-ordered schedule puts right after the
  // reduction, and the compute stream idles through every gradient's reduce-scatter. Empty when
  // the readers feed other work (a gradient norm for clipping) or the set grows past a few nodes.
  std::vector<int> sink_readers(const Collective& c) const {
    if (c.first_reader < 0) return {};
    constexpr size_t kMaxSinks = 8;
    std::vector<int> set;
    std::vector<ValueId> values{graph_.nodes[static_cast<size_t>(c.wait)].outputs[0]};
    while (!values.empty()) {
      const ValueId v = values.back();
      values.pop_back();
      for (int r : uses_.readers[static_cast<size_t>(v)]) {
        if (std::find(set.begin(), set.end(), r) != set.end()) continue;
        const Node& node = graph_.nodes[static_cast<size_t>(r)];
        if (has_flag(node.op, kCollective) || node.op == Op::kCollectiveWait || set.size() == kMaxSinks) return {};
        set.push_back(r);
        for (ValueId out : node.outputs) values.push_back(out);
      }
    }
    std::sort(set.begin(), set.end());
    return set;
  }

  const Graph& graph_;
  const CostModel& costs_;
  Uses uses_;
  std::vector<Collective> collectives_;
  std::vector<double> t_;
  std::vector<std::vector<int>> sinks_;  // per collective: sink_readers (reduce-scatters only)
};


}  // namespace

OverlapPrediction predict_step(const Graph& graph, const CostModel& costs) {
  OverlapPrediction p;
  std::map<ValueId, double> finish;  // per collective output
  double t = 0, comm_free = 0;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (has_flag(node.op, kCollective)) {
      const double begin = std::max(comm_free, t);
      comm_free = begin + costs.collective_seconds(graph, node);
      finish[node.outputs[0]] = comm_free;
      continue;
    }
    if (node.op == Op::kCollectiveWait) {
      if (auto it = finish.find(node.inputs[0]); it != finish.end()) t = std::max(t, it->second);
      continue;
    }
    const double d = costs.node_seconds(graph, n);
    t += d;
    p.compute_s += d;
  }
  p.step_s = t;
  return p;
}

bool OverlapCollectives::run(Graph& graph) {
  notes_.clear();
  const Planner planner(graph, costs_);
  if (planner.empty()) return false;
  const OverlapPrediction before = predict_step(graph, costs_);
  const size_t base_arena = plan_step_memory(graph).arena_bytes;
  const size_t limit = memory_budget_ ? std::max(*memory_budget_, base_arena)
                                      : base_arena + base_arena / 20;
  // Above 1 first: a collective beside the compute runs slower than the size sweep measured it
  // alone (they share SMs and memory bandwidth: GPT-2 medium's dp all-reduces moved ~134 GB/s
  // inside the step on 4 H100s, bench/log/session18-h100x4-timeline-dp4.log), so a wait
  // placed where the prediction says the transfer ends stalls the compute stream; where memory
  // allows, the waits go later and the prefetches earlier than the prediction needs.
  for (double scale : {8.0, 4.0, 2.0, 1.0, 0.5, 0.25, 0.125}) {
    Placement p = planner.place(scale);
    if (p.arena > limit || p.predicted.step_s >= before.step_s) continue;
    notes_.push_back(fmt::format(
        "{} collectives placed at {:.3g} of the overlap they need: predicted step {:.3f} -> {:.3f} ms, "
        "communication exposed {:.3f} -> {:.3f} ms ({}); planned arena {} -> {} (limit {})",
        planner.collectives(), scale, 1e3 * before.step_s, 1e3 * p.predicted.step_s, 1e3 * before.exposed_s(),
        1e3 * p.predicted.exposed_s(), costs_.source, format_bytes(base_arena), format_bytes(p.arena), format_bytes(limit)));
    graph = std::move(p.graph);
    return true;
  }
  notes_.push_back(fmt::format("{} collectives left in place: no placement beat the order as it came within the "
                               "memory limit {} (predicted step {:.3f} ms, {:.3f} ms exposed)",
                               planner.collectives(), format_bytes(limit), 1e3 * before.step_s, 1e3 * before.exposed_s()));
  return false;
}

}  // namespace kiln

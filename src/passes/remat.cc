#include "passes/remat.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <numeric>
#include <set>
#include <tuple>

#include "analysis/cost_model.h"
#include "analysis/memory_plan.h"
#include "ir/op_def.h"
#include "passes/schedule.h"
#include "support/error.h"

namespace kiln {
namespace {

// A chain longer than this keeps its remaining dead inputs alive instead (bounds the clones one
// choice can add; real chains are a few shape and elementwise ops).
constexpr size_t kMaxChain = 16;
// Candidates tried per round before giving up on the round's peak (each try is one re-plan).
constexpr size_t kMaxTriesPerRound = 48;
// Nodes, by live bytes, whose live-across values a round considers.
constexpr size_t kPeakNodesPerRound = 4;

// Collectives and updates never are (OpTraits::recompute): every rank makes a collective's round
// in the same order, and the sharding pass, not remat, decides when one is repeated.
bool recomputable(Op op) { return op_def(op).traits.recompute != Recompute::kNever; }

// Which improvement counts: the arena first; then the live peak and the live bytes summed over
// nodes, so choices that lower one of several equal peaks are still progress.
using Key = std::tuple<size_t, size_t, double>;

struct Evaluated {
  Graph scheduled;  // the graph in the order the pipeline will run it
  MemoryPlan plan;
  std::vector<int64_t> live;  // aligned arena bytes live at each node
  Key key;
};

Evaluated evaluate(const Graph& graph, bool schedule_after) {
  Evaluated e{graph, {}, {}, {}};
  if (schedule_after) SchedulePass().run(e.scheduled);
  const Graph& g = e.scheduled;
  e.plan = plan_step_memory(g);
  const Liveness& l = e.plan.liveness;
  const size_t n = g.nodes.size();
  std::vector<int64_t> delta(n + 2, 0);
  for (size_t v = 0; v < g.values.size(); ++v) {
    if (!e.plan.in_arena(static_cast<ValueId>(v))) continue;
    const int64_t bytes = static_cast<int64_t>(aligned_bytes(g.values[v].type.bytes()));
    delta[l.def[v]] += bytes;
    delta[l.last[v] + 1] -= bytes;
  }
  e.live.resize(n);
  int64_t running = 0;
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    running += delta[i];
    e.live[i] = running;
    sum += static_cast<double>(running);
  }
  e.key = Key{e.plan.arena_bytes, e.plan.live_peak_bytes, sum};
  return e;
}

struct Candidate {
  ValueId value = -1;
  std::vector<int> chain;  // node indices to clone, ascending
  int64_t benefit = 0;     // bytes fewer live at the peak
  double flops = 0;
  bool heavy = false;
};

// The nodes to clone so that `v` can be recomputed after the peak node `p`, and what that saves.
// Inputs dead at p are recomputed too (allow_heavy: even through heavy ops) or kept alive.
std::optional<Candidate> make_candidate(const Graph& g, const Liveness& l, int p, ValueId v,
                                        bool allow_heavy) {
  Candidate c;
  c.value = v;
  const int producer = l.def[v];
  if (is_heavy_op(g.nodes[producer].op) && !allow_heavy) return std::nullopt;
  c.chain.push_back(producer);
  std::set<ValueId> kept;
  for (size_t i = 0; i < c.chain.size(); ++i) {
    for (ValueId u : g.nodes[c.chain[i]].inputs) {
      if (l.def[u] < 0 || l.last[u] >= p) continue;  // a graph input, or live at p anyway
      const int m = l.def[u];
      if (std::find(c.chain.begin(), c.chain.end(), m) != c.chain.end()) continue;
      const Op op = g.nodes[m].op;
      if (recomputable(op) && (allow_heavy || !is_heavy_op(op)) && c.chain.size() < kMaxChain) {
        c.chain.push_back(m);
      } else {
        kept.insert(u);
      }
    }
  }
  std::sort(c.chain.begin(), c.chain.end());
  c.benefit = static_cast<int64_t>(aligned_bytes(g.type(v).bytes()));
  for (ValueId u : kept) c.benefit -= static_cast<int64_t>(aligned_bytes(g.type(u).bytes()));
  if (c.benefit <= 0) return std::nullopt;
  for (int n : c.chain) {
    c.flops += node_flops(g, g.nodes[n]);
    c.heavy |= is_heavy_op(g.nodes[n].op);
  }
  return c;
}

// Every value live across `p` that recomputation could free there, best first: light before
// heavy, large before small, then fewest FLOPs per byte saved.
std::vector<Candidate> candidates(const Graph& g, const Liveness& l, int p, int64_t live_at_p) {
  const Node& peak = g.nodes[p];
  std::vector<Candidate> out;
  const int end = static_cast<int>(g.nodes.size());
  for (size_t i = 0; i < g.values.size(); ++i) {
    const ValueId v = static_cast<ValueId>(i);
    if (l.def[v] < 0 || l.def[v] >= p || l.last[v] <= p || l.last[v] >= end) continue;
    if (std::find(peak.inputs.begin(), peak.inputs.end(), v) != peak.inputs.end()) continue;
    if (!recomputable(g.nodes[l.def[v]].op)) continue;
    std::optional<Candidate> light = make_candidate(g, l, p, v, false);
    std::optional<Candidate> full = make_candidate(g, l, p, v, true);
    if (light) out.push_back(*light);
    if (full && (!light || full->chain != light->chain)) out.push_back(*full);
  }
  // Small values (under 1/256 of the live bytes) after the others: each choice costs a re-plan,
  // and a few large values do what many small ones would.
  const int64_t small = live_at_p / 256;
  std::stable_sort(out.begin(), out.end(), [small](const Candidate& a, const Candidate& b) {
    if (a.heavy != b.heavy) return !a.heavy;
    if ((a.benefit < small) != (b.benefit < small)) return b.benefit < small;
    const double ra = a.flops / static_cast<double>(a.benefit);
    const double rb = b.flops / static_cast<double>(b.benefit);
    if (ra != rb) return ra < rb;
    return a.benefit > b.benefit;
  });
  return out;
}

// `g` (in its scheduled order) with the candidate's chain cloned just before v's first reader
// after `p`, and every reader of v after p reading the clone.
Graph apply(const Graph& g, const Liveness& l, int p, const Candidate& c) {
  Graph out;
  out.name = g.name;
  out.values = g.values;
  out.inputs = g.inputs;
  out.outputs = g.outputs;
  out.updates = g.updates;
  std::vector<std::pair<ValueId, ValueId>> remap;  // original -> clone
  auto mapped = [&](ValueId id) {
    for (const auto& [from, to] : remap)
      if (from == id) return to;
    return id;
  };
  std::vector<Node> clones;
  for (int n : c.chain) {
    Node clone = g.nodes[n];
    for (ValueId& in : clone.inputs) in = mapped(in);
    for (ValueId& o : clone.outputs) {
      const ValueId fresh = static_cast<ValueId>(out.values.size());
      out.values.push_back(Value{"", g.type(o)});  // unnamed: names must be unique
      remap.emplace_back(o, fresh);
      o = fresh;
    }
    clones.push_back(std::move(clone));
  }
  const ValueId v = c.value;
  const ValueId v_clone = mapped(v);
  int first_late = static_cast<int>(g.nodes.size());
  for (int n = p + 1; n <= l.last[v]; ++n) {
    const auto& in = g.nodes[n].inputs;
    if (std::find(in.begin(), in.end(), v) != in.end()) {
      first_late = n;
      break;
    }
  }
  out.nodes.reserve(g.nodes.size() + clones.size());
  for (int n = 0; n < static_cast<int>(g.nodes.size()); ++n) {
    if (n == first_late)
      for (Node& clone : clones) out.nodes.push_back(std::move(clone));
    Node node = g.nodes[n];
    if (n > p)
      for (ValueId& in : node.inputs)
        if (in == v) in = v_clone;
    out.nodes.push_back(std::move(node));
  }
  return out;
}

}  // namespace

bool is_heavy_op(Op op) { return op_def(op).traits.recompute == Recompute::kHeavy; }

size_t planned_peak_bytes(const Graph& graph, bool schedule_after) {
  return std::get<0>(evaluate(graph, schedule_after).key);
}

bool Rematerialize::run(Graph& graph) {
  stats_ = {};
  if (!budget_) return false;
  const size_t budget = *budget_;
  Evaluated current = evaluate(graph, schedule_after_);
  stats_.peak_before = stats_.peak_after = current.plan.arena_bytes;
  if (current.plan.arena_bytes <= budget) return false;

  Graph result = graph;  // the unscheduled graph whose schedule `current` holds
  // Every accepted round lowers the key, so this ends; the cap only bounds pathological cases.
  const size_t max_rounds = 4 * graph.nodes.size() + 16;
  for (size_t round = 0; round < max_rounds && current.plan.arena_bytes > budget; ++round) {
    const Graph& g = current.scheduled;
    const Liveness& l = current.plan.liveness;
    // The nodes with the most live bytes first (ties: earlier); a value freed at one of several
    // equal peaks is progress too (the key's tie-breakers see it).
    std::vector<int> peaks(g.nodes.size());
    std::iota(peaks.begin(), peaks.end(), 0);
    const size_t num_peaks = std::min(kPeakNodesPerRound, peaks.size());
    std::partial_sort(peaks.begin(), peaks.begin() + static_cast<std::ptrdiff_t>(num_peaks),
                      peaks.end(), [&](int a, int b) {
                        return current.live[a] != current.live[b] ? current.live[a] > current.live[b]
                                                                  : a < b;
                      });
    peaks.resize(num_peaks);
    bool accepted = false;
    size_t tries = 0;
    for (int p : peaks) {
      for (const Candidate& c : candidates(g, l, p, current.live[p])) {
        if (accepted || tries++ >= kMaxTriesPerRound) break;
        Graph next_graph = apply(g, l, p, c);
        Evaluated next = evaluate(next_graph, schedule_after_);
        if (!(next.key < current.key)) continue;
        ++stats_.values_recomputed;
        stats_.nodes_cloned += static_cast<int>(c.chain.size());
        for (int n : c.chain) stats_.heavy_nodes_cloned += is_heavy_op(g.nodes[n].op) ? 1 : 0;
        stats_.flops_added += c.flops;
        current = std::move(next);
        result = std::move(next_graph);
        accepted = true;
      }
      if (accepted) break;
    }
    if (!accepted) break;
  }
  stats_.peak_after = current.plan.arena_bytes;
  KILN_CHECK(current.plan.arena_bytes <= budget,
             "memory budget {} is too small for this step: the smallest plan found needs {} "
             "({} bytes) (without remat: {})",
             format_bytes(budget), format_bytes(current.plan.arena_bytes), current.plan.arena_bytes,
             format_bytes(stats_.peak_before));
  graph = std::move(result);
  return true;
}

size_t parse_byte_size(std::string_view text) {
  const std::string original(text);
  auto bad = [&](const char* why) -> size_t {
    fail("memory size '{}': {}; expected a number of bytes or a number with a unit, e.g. 4096, "
         "512MiB, 2GiB, 1.5GB",
         original, why);
  };
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  const size_t start = i;
  bool dot = false;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) {
    if (text[i] == '.') {
      if (dot) return bad("more than one decimal point");
      dot = true;
    }
    ++i;
  }
  const std::string number(text.substr(start, i - start));
  if (number.empty() || number == ".") return bad("no number");
  std::string unit(text.substr(i));
  unit.erase(0, unit.find_first_not_of(" \t"));
  unit.erase(unit.find_last_not_of(" \t") + 1);
  if (unit.find_first_of(" \t") != std::string::npos) return bad("unexpected space");
  for (char& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "kib") scale = 1024.0;
  else if (unit == "mib") scale = 1024.0 * 1024;
  else if (unit == "gib") scale = 1024.0 * 1024 * 1024;
  else if (unit == "tib") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb") scale = 1e3;
  else if (unit == "mb") scale = 1e6;
  else if (unit == "gb") scale = 1e9;
  else if (unit == "tb") scale = 1e12;
  else return bad("unknown unit (B, KiB, MiB, GiB, TiB, kB, MB, GB or TB)");
  if (scale == 1 && dot) return bad("a plain byte count must be a whole number");
  const double bytes = std::floor(std::stod(number) * scale);
  if (!(bytes > 0)) return bad("it must be more than 0 bytes");
  if (bytes >= 1.8e19) return bad("too large");
  return static_cast<size_t>(bytes);
}


}  // namespace kiln

#include "compile/report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <map>

#include "analysis/memory_plan.h"
#include "ir/op_def.h"
#include "ops/fused/kind.h"
#include "ops/transfer.h"
#include "passes/fusion/fusion.h"
#include "support/bytes.h"

namespace kiln {
namespace {

// Ops in order, a run of one op once with its count: "cast x96" (a multi-tensor node's casts).
std::string op_runs(const std::vector<std::string>& ops) {
  std::vector<std::string> runs;
  for (size_t i = 0; i < ops.size();) {
    size_t j = i;
    while (j < ops.size() && ops[j] == ops[i]) ++j;
    runs.push_back(j - i > 1 ? fmt::format("{} x{}", ops[i], j - i) : ops[i]);
    i = j;
  }
  return fmt::format("{}", fmt::join(runs, " "));
}


// What is live at the plan's busiest node, grouped by producer and type, largest first: where a
// step's memory goes (saved activations, gradients, weight copies) and what remat could drop.
std::string peak_contents(const Graph& graph, const MemoryPlan& plan) {
  // Each arena buffer (a view root) lives from its definition to the last read of it or of a view.
  // Update values are left out: the executor writes them straight over their params and state.
  const size_t count = graph.values.size();
  std::vector<char> update(count, 0);
  for (const Update& u : graph.updates) update[static_cast<size_t>(u.value)] = 1;
  std::vector<int> first(count, -1), last(count, -1);
  for (size_t v = 0; v < count; ++v) {
    const ValueId id = static_cast<ValueId>(v);
    if (!plan.in_arena(id) || plan.liveness.def[v] < 0 || update[v]) continue;
    const size_t root = static_cast<size_t>(view_root(plan.views, id));
    if (first[root] < 0) first[root] = plan.liveness.def[root];
    last[root] = std::max(last[root], plan.liveness.last[v]);
  }
  std::vector<int64_t> live(graph.nodes.size() + 1, 0);
  for (size_t v = 0; v < count; ++v)
    if (first[v] >= 0 && !plan.is_view(static_cast<ValueId>(v)))
      for (int n = first[v]; n <= std::min<int>(last[v], static_cast<int>(graph.nodes.size()) - 1); ++n)
        live[static_cast<size_t>(n)] += static_cast<int64_t>(aligned_bytes(graph.type(static_cast<ValueId>(v)).bytes()));
  const int peak = static_cast<int>(std::max_element(live.begin(), live.end()) - live.begin());
  std::map<std::string, std::pair<int64_t, int>> groups;  // producer and type -> bytes, count
  for (size_t v = 0; v < count; ++v) {
    if (first[v] < 0 || plan.is_view(static_cast<ValueId>(v)) || first[v] > peak || last[v] < peak) continue;
    const Node& producer = graph.nodes[static_cast<size_t>(first[v])];
    std::string what = producer.op == Op::kFused ? fmt::format("fused:{}", fused_kind_name(fused_kind(producer)))
                                                 : std::string(op_name(producer.op));
    if (producer.op == Op::kFused && producer.body) {
      std::vector<std::string> ops;
      for (const Node& inner : producer.body->nodes) ops.emplace_back(op_name(inner.op));
      what += "(" + op_runs(ops) + ")";
    }
    auto& [bytes, n] = groups[fmt::format("{} -> {}", what, to_string(graph.type(static_cast<ValueId>(v))))];
    bytes += static_cast<int64_t>(aligned_bytes(graph.type(static_cast<ValueId>(v)).bytes()));
    ++n;
  }
  std::vector<std::pair<int64_t, std::string>> sorted;
  for (const auto& [name, entry] : groups)
    sorted.emplace_back(entry.first, fmt::format("{:>4} x {}", entry.second, name));
  std::sort(sorted.rbegin(), sorted.rend());
  std::string out = fmt::format("  memory peak at node {} ({} live in the arena besides the updates), largest groups:\n",
                                peak, format_bytes(double(live[peak])));
  for (size_t i = 0; i < std::min<size_t>(sorted.size(), 12); ++i)
    out += fmt::format("    {:>12}  {}\n", format_bytes(double(sorted[i].first)), sorted[i].second);
  return out;
}

}  // namespace

std::string compile_report(const std::string& what, const std::string& source, const Graph& forward, double source_s,
                           const CompiledStep& step, double total_s) {
  std::string out;
  auto line = [&out](fmt::string_view format, auto&&... args) {
    out += fmt::vformat(format, fmt::make_format_args(args...));
  };
  const Graph& graph = step.program.graph;
  int64_t param_count = 0;
  for (int i : step.program.param_inputs) param_count += graph.type(graph.inputs[i].value).numel();
  const auto& [program_phase, program_s] = step.phase_seconds.at(1);  // after "forward passes"
  const size_t forward_nodes = forward.nodes.size(), nodes_before = step.nodes_before_passes;
  line("{}: {} forward nodes, {} parameters; {} {} nodes\n", what, forward_nodes, param_count, program_phase,
       nodes_before);
  line("  {:<22} {:>9} {:>8} {:>8}\n", "step", "ms", "nodes", "changed");
  const double source_ms = 1e3 * source_s, program_ms = 1e3 * program_s;
  line("  {:<22} {:>9.2f} {:>8}\n", source, source_ms, forward_nodes);
  auto record = [&](const PassRecord& r) {
    const std::string ms = r.ran ? fmt::format("{:.2f}", 1e3 * r.seconds) : "disabled";
    const std::string_view changed = r.changed ? "yes" : "no";
    line("  {:<22} {:>9} {:>8} {:>8}\n", r.name, ms, r.nodes_after, changed);
  };
  for (const PassRecord& r : step.forward_pass_records) record(r);
  line("  {:<22} {:>9.2f} {:>8}\n", program_phase, program_ms, nodes_before);
  for (const PassRecord& r : step.pass_records) record(r);
  for (const std::vector<PassRecord>* records : {&step.forward_pass_records, &step.pass_records})
    for (const PassRecord& r : *records)
      for (const std::string& note : r.notes) line("  {}: {}\n", r.name, note);
  // The step's kernels, and the composite ops among them (also those inside fused nodes): what
  // an imported model runs of kiln's own kernels.
  std::map<std::string, int> composite;
  int64_t fused_nodes = 0;
  std::function<void(const Graph&)> count = [&](const Graph& g) {
    for (const Node& node : g.nodes) {
      if (node.op == Op::kFused) ++fused_nodes;
      if (node.body) count(*node.body);
      if (op_def(node.op).traits.composite) ++composite[std::string(op_name(node.op))];
    }
  };
  count(graph);
  std::string ops;
  for (const auto& [name, n] : composite) ops += fmt::format("{}{} {}", ops.empty() ? "" : ", ", name, n);
  const size_t step_nodes = graph.nodes.size();
  line("  kernels: {} nodes in the step, {} of them fused; composite ops: {}\n", step_nodes, fused_nodes,
       ops.empty() ? "none" : ops);
  // The fusion groups: one line per fused node, then the total.
  std::vector<fusion::FusedNodeReport> fused = fusion::report(graph);
  int64_t kept_bytes = 0;
  const std::string_view plural = fused.size() == 1 ? "" : "s";
  line("  fusion: {} fused node{}\n", fused.size(), plural);
  for (const fusion::FusedNodeReport& f : fused) {
    kept_bytes += f.bytes_kept;
    const double kept_mib = f.bytes_kept / double(1 << 20);
    const std::string ops = op_runs(f.ops);
    line("    node {:<5} {:<14} {:>10.3f} MiB kept  {}\n", f.node, f.kind, kept_mib, ops);
  }
  const double kept_mib = kept_bytes / double(1 << 20);
  line("  fusion total: {:.3f} MiB kept out of memory\n", kept_mib);
  MemoryPlan plan = plan_step_memory(graph);
  int64_t input_bytes = 0, host_bytes = 0;
  const std::vector<bool> on_host = host_resident_inputs(graph);
  for (size_t i = 0; i < graph.inputs.size(); ++i)
    (on_host[i] ? host_bytes : input_bytes) += static_cast<int64_t>(graph.type(graph.inputs[i].value).bytes());
  line("  memory: inputs (params, state, batch) {}{}; intermediates planned {} (lower bound {}, one buffer each {})\n",
       format_bytes(input_bytes), host_bytes > 0 ? fmt::format(" (and {} in host memory)", format_bytes(host_bytes)) : "",
       format_bytes(plan.arena_bytes), format_bytes(plan.live_peak_bytes), format_bytes(plan.naive_bytes));
  out += peak_contents(graph, plan);
  line("  total {:.3f} s\n", total_s);
  return out;
}

}  // namespace kiln

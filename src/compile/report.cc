#include "compile/report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "analysis/memory_plan.h"
#include "passes/fusion/fusion.h"

namespace kiln {
namespace {

// MiB below a GiB, so that small models show their numbers.
std::string format_size(double bytes) {
  return bytes < double(1 << 30) ? fmt::format("{:.2f} MiB", bytes / double(1 << 20))
                                 : fmt::format("{:.3f} GiB", bytes / double(1 << 30));
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
  const auto& [program_phase, program_s] = step.phase_seconds.at(0);
  const size_t forward_nodes = forward.nodes.size(), nodes_before = step.nodes_before_passes;
  line("{}: {} forward nodes, {} parameters; {} {} nodes\n", what, forward_nodes, param_count, program_phase,
       nodes_before);
  line("  {:<22} {:>9} {:>8} {:>8}\n", "step", "ms", "nodes", "changed");
  const double source_ms = 1e3 * source_s, program_ms = 1e3 * program_s;
  line("  {:<22} {:>9.2f} {:>8}\n", source, source_ms, forward_nodes);
  line("  {:<22} {:>9.2f} {:>8}\n", program_phase, program_ms, nodes_before);
  for (const PassRecord& r : step.pass_records) {
    const std::string ms = r.ran ? fmt::format("{:.2f}", 1e3 * r.seconds) : "disabled";
    const std::string_view changed = r.changed ? "yes" : "no";
    line("  {:<22} {:>9} {:>8} {:>8}\n", r.name, ms, r.nodes_after, changed);
  }
  for (const PassRecord& r : step.pass_records)
    for (const std::string& note : r.notes) line("  {}: {}\n", r.name, note);
  // The fusion groups: one line per fused node, then the total.
  std::vector<fusion::FusedNodeReport> fused = fusion::report(graph);
  int64_t kept_bytes = 0;
  const std::string_view plural = fused.size() == 1 ? "" : "s";
  line("  fusion: {} fused node{}\n", fused.size(), plural);
  for (const fusion::FusedNodeReport& f : fused) {
    kept_bytes += f.bytes_kept;
    const double kept_mib = f.bytes_kept / double(1 << 20);
    const std::string ops = fmt::format("{}", fmt::join(f.ops, " "));
    line("    node {:<5} {:<14} {:>10.3f} MiB kept  {}\n", f.node, f.kind, kept_mib, ops);
  }
  const double kept_mib = kept_bytes / double(1 << 20);
  line("  fusion total: {:.3f} MiB kept out of memory\n", kept_mib);
  MemoryPlan plan = plan_memory(graph);
  int64_t input_bytes = 0;
  for (const GraphInput& in : graph.inputs) input_bytes += static_cast<int64_t>(graph.type(in.value).bytes());
  line("  memory: inputs (params, state, batch) {}; intermediates planned {} (lower bound {}, one buffer each {})\n",
       format_size(input_bytes), format_size(plan.arena_bytes), format_size(plan.live_peak_bytes),
       format_size(plan.naive_bytes));
  line("  total {:.3f} s\n", total_s);
  return out;
}

}  // namespace kiln

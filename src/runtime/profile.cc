// Reports of per-kernel timings (runtime/profile.h).
#include "runtime/profile.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "support/error.h"

namespace kiln {

std::string timing_label(const NodeTiming& t) {
  return t.kind.empty() ? fmt::format("{}[{}]", t.op, t.dialect) : fmt::format("{}:{}[{}]", t.op, t.kind, t.dialect);
}

namespace {
double total_ms(const std::vector<NodeTiming>& timings) {
  double total = 0;
  for (const NodeTiming& t : timings) total += t.ms;
  return total;
}
}  // namespace

std::vector<ProfileGroup> group_timings(const std::vector<NodeTiming>& timings, bool by_outputs) {
  std::map<std::tuple<std::string, std::string, std::string, std::string>, ProfileGroup> by_key;
  for (const NodeTiming& t : timings) {
    ProfileGroup& g = by_key[{t.op, t.dialect, t.kind, by_outputs ? t.outputs : std::string()}];
    if (g.count == 0) {
      g.label = timing_label(t);
      if (by_outputs) g.outputs = t.outputs;
    }
    ++g.count;
    g.total_ms += t.ms;
  }
  const double total = total_ms(timings);
  std::vector<ProfileGroup> groups;
  for (auto& [key, g] : by_key) {
    g.percent = total > 0 ? 100.0 * g.total_ms / total : 0.0;
    groups.push_back(g);
  }
  std::stable_sort(groups.begin(), groups.end(), [](const ProfileGroup& a, const ProfileGroup& b) {
    if (a.total_ms != b.total_ms) return a.total_ms > b.total_ms;
    return a.label != b.label ? a.label < b.label : a.outputs < b.outputs;
  });
  return groups;
}

namespace {
// A multi-tensor node has hundreds of outputs: a line keeps the first ones.
std::string outputs_text(const std::string& outputs) {
  constexpr size_t kMaxOutputsText = 100;
  return outputs.size() > kMaxOutputsText ? outputs.substr(0, kMaxOutputsText) + ", ..." : outputs;
}
}  // namespace

std::string profile_table(const std::vector<NodeTiming>& timings, int top) {
  const double total = total_ms(timings);
  auto percent = [total](double ms) { return total > 0 ? 100.0 * ms / total : 0.0; };
  std::string out = fmt::format("kernel time: {:.3f} ms over {} nodes (sum of per-node event times)\n", total,
                                timings.size());
  std::vector<ProfileGroup> groups = group_timings(timings);
  out += fmt::format("  {:>10}  {:>6}  {:>6}  {:>9}  {}\n", "total ms", "%", "count", "mean ms", "op:kind[dialect]");
  // One line per group; by output types, " -> outputs" after the label.
  auto group_line = [](const ProfileGroup& g, bool outputs) {
    return fmt::format("  {:>10.3f}  {:>6.2f}  {:>6}  {:>9.4f}  {}{}\n", g.total_ms, g.percent, g.count,
                       g.total_ms / static_cast<double>(g.count), g.label,
                       outputs ? " -> " + outputs_text(g.outputs) : std::string());
  };
  for (const ProfileGroup& g : groups) out += group_line(g, false);
  const std::vector<ProfileGroup> shapes = group_timings(timings, /*by_outputs=*/true);
  const size_t shown_shapes = std::min(shapes.size(), static_cast<size_t>(std::max(top, 0)));
  if (shown_shapes > 0) {
    out += fmt::format("top {} by op and output types:\n", shown_shapes);
    out += fmt::format("  {:>10}  {:>6}  {:>6}  {:>9}  {}\n", "total ms", "%", "count", "mean ms",
                       "op:kind[dialect] -> outputs");
    for (size_t i = 0; i < shown_shapes; ++i) out += group_line(shapes[i], true);
  }
  std::vector<size_t> order(timings.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return timings[a].ms > timings[b].ms; });
  const size_t shown = std::min(order.size(), static_cast<size_t>(std::max(top, 0)));
  if (shown > 0) {
    out += fmt::format("top {} nodes:\n", shown);
    out += fmt::format("  {:>10}  {:>6}  {:>6}  {}\n", "ms", "%", "node", "op:kind[dialect] -> outputs");
    for (size_t i = 0; i < shown; ++i) {
      const NodeTiming& t = timings[order[i]];
      out += fmt::format("  {:>10.4f}  {:>6.2f}  {:>6}  {} -> {}\n", t.ms, percent(t.ms), t.node, timing_label(t),
                         outputs_text(t.outputs));
    }
  }
  return out;
}

void write_chrome_trace(const std::vector<NodeTiming>& timings, const std::string& path) {
  nlohmann::json events = nlohmann::json::array();
  double ts_us = 0;
  for (const NodeTiming& t : timings) {
    const double dur_us = t.ms * 1e3;
    nlohmann::json args{{"node", t.node}, {"outputs", t.outputs}, {"dialect", t.dialect}};
    if (!t.kind.empty()) args["kind"] = t.kind;
    events.push_back({{"name", timing_label(t)}, {"cat", t.dialect}, {"ph", "X"}, {"ts", ts_us}, {"dur", dur_us},
                      {"pid", 1}, {"tid", 1}, {"args", std::move(args)}});
    ts_us += dur_us;
  }
  nlohmann::json trace{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  std::ofstream file(path);
  KILN_CHECK(file.good(), "cannot write the trace file '{}'", path);
  file << trace.dump(1) << "\n";
  file.close();
  KILN_CHECK(!file.fail(), "writing the trace file '{}' failed", path);
}

}  // namespace kiln

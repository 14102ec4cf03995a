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

std::string profile_table(const std::vector<NodeTiming>& timings, int top, const std::string& source) {
  const double total = total_ms(timings);
  auto percent = [total](double ms) { return total > 0 ? 100.0 * ms / total : 0.0; };
  std::string out = fmt::format("kernel time: {:.3f} ms over {} nodes ({})\n", total, timings.size(), source);
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

namespace {
void write_trace_json(nlohmann::json events, const std::string& path) {
  nlohmann::json trace{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  std::ofstream file(path);
  KILN_CHECK(file.good(), "cannot write the trace file '{}'", path);
  file << trace.dump(1) << "\n";
  file.close();
  KILN_CHECK(!file.fail(), "writing the trace file '{}' failed", path);
}
}  // namespace

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
  write_trace_json(std::move(events), path);
}

std::vector<std::vector<TraceEvent>> split_steps(std::vector<TraceEvent> events) {
  std::map<uint64_t, std::vector<TraceEvent>> by_launch;
  for (TraceEvent& e : events) by_launch[e.launch].push_back(std::move(e));
  std::vector<std::vector<TraceEvent>> steps;
  for (auto& [launch, step] : by_launch) {
    if (step.size() < 2) continue;
    std::stable_sort(step.begin(), step.end(),
                     [](const TraceEvent& a, const TraceEvent& b) { return a.start_us < b.start_us; });
    steps.push_back(std::move(step));
  }
  std::sort(steps.begin(), steps.end(), [](const auto& a, const auto& b) { return a[0].start_us < b[0].start_us; });
  return steps;
}

namespace {
// The idle intervals of a step (events by start): each gap's length and the events on either
// side (the one that last extended the covered time, and the next to start); `end` gets the
// step's last end.
struct Gap {
  double us;
  size_t before, after;
};
std::vector<Gap> gaps_of(const std::vector<TraceEvent>& step, double* end) {
  std::vector<Gap> gaps;
  double covered_to = step.empty() ? 0 : step[0].end_us;
  size_t last = 0;
  for (size_t i = 1; i < step.size(); ++i) {
    if (step[i].start_us > covered_to) gaps.push_back({step[i].start_us - covered_to, last, i});
    if (step[i].end_us > covered_to) {
      covered_to = step[i].end_us;
      last = i;
    }
  }
  *end = covered_to;
  return gaps;
}
}  // namespace

StepTimes step_times(const std::vector<TraceEvent>& step) {
  StepTimes t;
  if (step.empty()) return t;
  double end = 0;
  const std::vector<Gap> gaps = gaps_of(step, &end);
  t.gaps = static_cast<int64_t>(gaps.size());
  for (const Gap& g : gaps) t.idle_ms += g.us / 1e3;
  t.span_ms = (end - step[0].start_us) / 1e3;
  t.busy_ms = t.span_ms - t.idle_ms;
  return t;
}

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

namespace {

// The node an event belongs to, if `labels` knows it.
bool known_node(const TraceEvent& e, const std::vector<NodeTiming>& labels) {
  return e.node >= 0 && static_cast<size_t>(e.node) < labels.size();
}

std::string event_label(const TraceEvent& e, const std::vector<NodeTiming>& labels) {
  return known_node(e, labels) ? fmt::format("node {} {}", e.node, timing_label(labels[static_cast<size_t>(e.node)]))
                               : e.name;
}
}  // namespace

std::vector<NodeTiming> timeline_node_times(const std::vector<std::vector<TraceEvent>>& steps,
                                            const std::vector<NodeTiming>& labels) {
  std::vector<std::vector<double>> per_node(labels.size(), std::vector<double>(steps.size(), 0.0));
  std::map<std::string, std::vector<double>> unmapped;  // by kernel name
  for (size_t s = 0; s < steps.size(); ++s)
    for (const TraceEvent& e : steps[s]) {
      const double ms = (e.end_us - e.start_us) / 1e3;
      if (known_node(e, labels)) {
        per_node[static_cast<size_t>(e.node)][s] += ms;
      } else {
        auto [it, fresh] = unmapped.try_emplace(e.name, std::vector<double>(steps.size(), 0.0));
        it->second[s] += ms;
      }
    }
  std::vector<NodeTiming> out;
  for (size_t n = 0; n < labels.size(); ++n) {
    NodeTiming t = labels[n];
    t.ms = median_of(per_node[n]);
    out.push_back(std::move(t));
  }
  for (auto& [name, ms] : unmapped) {
    NodeTiming t;
    t.node = -1;
    t.op = name;
    t.dialect = "unmapped";
    t.ms = median_of(ms);
    out.push_back(std::move(t));
  }
  return out;
}

std::string timeline_report(const std::vector<std::vector<TraceEvent>>& steps, const std::vector<NodeTiming>& labels,
                            int top, int gaps) {
  KILN_CHECK(!steps.empty(), "the trace holds no step (no launch ran more than one kernel)");
  std::vector<StepTimes> times;
  std::vector<double> span, busy, idle, between;
  for (size_t s = 0; s < steps.size(); ++s) {
    times.push_back(step_times(steps[s]));
    span.push_back(times.back().span_ms);
    busy.push_back(times.back().busy_ms);
    idle.push_back(times.back().idle_ms);
    if (s > 0) {
      const double last_end_us = steps[s - 1][0].start_us + 1e3 * times[s - 1].span_ms;
      between.push_back((steps[s][0].start_us - last_end_us) / 1e3);
    }
  }
  // The step whose span is the median's (the lower one for an even count): its gaps are shown.
  std::vector<size_t> order(steps.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return span[a] < span[b]; });
  const size_t mid = order[(order.size() - 1) / 2];
  auto range = [](const std::vector<double>& v) {
    return fmt::format("{:.3f} ms median ({:.3f} .. {:.3f})", median_of(v), *std::min_element(v.begin(), v.end()),
                       *std::max_element(v.begin(), v.end()));
  };
  std::string out = fmt::format("timeline: {} steps as the device ran them (CUPTI activity, device clock)\n", steps.size());
  out += fmt::format("  step span   {}  first kernel start to last kernel end\n", range(span));
  out += fmt::format("  busy        {}  {} pieces of work in the median step\n", range(busy), steps[mid].size());
  out += fmt::format("  idle        {}  {} gaps between them in the median step\n", range(idle), times[mid].gaps);
  if (!between.empty()) out += fmt::format("  between     {}  one step's last end to the next's first start\n", range(between));
  // The median step's largest gaps, with the work on either side.
  const std::vector<TraceEvent>& step = steps[mid];
  double end = 0;
  std::vector<Gap> found = gaps_of(step, &end);
  std::sort(found.begin(), found.end(), [](const Gap& a, const Gap& b) { return a.us > b.us; });
  const size_t shown = std::min(found.size(), static_cast<size_t>(std::max(gaps, 0)));
  if (shown > 0) {
    out += fmt::format("  largest gaps of the median step:\n");
    for (size_t i = 0; i < shown; ++i)
      out += fmt::format("    {:>8.1f} us  after {}  before {}\n", found[i].us, event_label(step[found[i].before], labels),
                         event_label(step[found[i].after], labels));
  }
  out += profile_table(timeline_node_times(steps, labels), top, "per node: median over the steps of its kernels' time");
  return out;
}

void write_timeline_trace(const std::vector<std::vector<TraceEvent>>& steps, const std::vector<NodeTiming>& labels,
                          const std::string& path) {
  nlohmann::json events = nlohmann::json::array();
  const double origin = steps.empty() || steps[0].empty() ? 0 : steps[0][0].start_us;
  for (size_t s = 0; s < steps.size(); ++s)
    for (const TraceEvent& e : steps[s]) {
      nlohmann::json args{{"kernel", e.name}, {"step", s}, {"node", e.node}};
      std::string name = e.name, cat = "unmapped";
      if (known_node(e, labels)) {
        const NodeTiming& l = labels[static_cast<size_t>(e.node)];
        name = timing_label(l);
        cat = l.dialect;
        args["outputs"] = l.outputs;
      }
      events.push_back({{"name", name}, {"cat", cat}, {"ph", "X"}, {"ts", e.start_us - origin},
                        {"dur", e.end_us - e.start_us}, {"pid", 1}, {"tid", 1}, {"args", std::move(args)}});
    }
  write_trace_json(std::move(events), path);
}

}  // namespace kiln

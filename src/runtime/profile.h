// Per-kernel timings of one executor run (Executor::profile(), ExecutorOptions::profile) and
// their reports: a table grouped by op, dialect and fused kind, and a Chrome trace-event JSON
// file (chrome://tracing, ui.perfetto.dev) that lays the step's kernels out on a timeline.
// Plain C++: no CUDA headers, so the CLI and CPU-only tests use it in any build.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/trace_event.h"

namespace kiln {

// One node's kernel in one run, in node order.
struct NodeTiming {
  int64_t node = 0;       // index into graph.nodes
  std::string op;         // "matmul"
  std::string dialect;    // the kernel's dialect, e.g. "cublaslt"
  std::string kind;       // fused nodes: their "kind" attribute; "" for the rest
  std::string outputs;    // output types, e.g. "bf16[8,1024,768], f32[8,1024]"
  double ms = 0;          // time between the events around the node's kernel(s)
};

// The timings of one (op, dialect, kind), heaviest first.
struct ProfileGroup {
  std::string label;      // "matmul[cublaslt]", or "fused:<kind>[nvrtc]" for fused nodes
  std::string outputs;    // grouped by output types too: theirs ("" otherwise)
  int64_t count = 0;
  double total_ms = 0;
  double percent = 0;     // of the sum over every node; 0 when that sum is 0
};

// "op[dialect]", or "fused:<kind>[dialect]" for a node with a kind.
std::string timing_label(const NodeTiming& t);
// Groups by (op, dialect, kind), and by output types too with `by_outputs` (GPT-2's twelve
// layers' nodes of one kind and shape fall together: "23 x 345 us"), sorted by total time
// (descending; ties by label, then outputs).
std::vector<ProfileGroup> group_timings(const std::vector<NodeTiming>& timings, bool by_outputs = false);
// A text report: the step's total, the groups, the `top` heaviest groups by output types too,
// then the `top` slowest single nodes.
// `source` says where the times came from (the first line: "kernel time: X ms over N nodes (source)").
std::string profile_table(const std::vector<NodeTiming>& timings, int top = 25,
                          const std::string& source = "sum of per-node event times");
// Writes Chrome trace-event JSON: one complete event (ph "X") per node, back to back in node
// order (ts = sum of the earlier durations; ts and dur in microseconds), name = timing_label,
// args = node index, outputs (and kind). The measured gaps between kernels (launch overhead)
// are not shown: the timeline is the kernels' own times. Throws kiln::Error if `path` cannot be
// written.
void write_chrome_trace(const std::vector<NodeTiming>& timings, const std::string& path);

// ---- timelines of real runs (cuda::KernelTrace; their events: backends/trace_event.h) ----

// The traced steps: the launches that ran more than one piece of work (graph replays; a step's
// uploads and read-backs are single copies of their own), each one step, its events by start.
std::vector<std::vector<TraceEvent>> split_steps(std::vector<TraceEvent> events);

// One step's span (first start to last end), busy time (the union of its events' intervals) and
// idle time between them.
struct StepTimes {
  double span_ms = 0;
  double busy_ms = 0;
  double idle_ms = 0;
  int64_t gaps = 0;       // idle intervals between events
};
StepTimes step_times(const std::vector<TraceEvent>& step);

// The median of `v` (the mean of the middle two for an even count); 0 when empty.
double median_of(std::vector<double> v);

// Per node of `labels` (one per graph node, in node order, as Executor::node_labels gives them),
// the median over `steps` of the summed durations of its events; events of no known node are
// grouped by name (node -1, dialect "unmapped").
std::vector<NodeTiming> timeline_node_times(const std::vector<std::vector<TraceEvent>>& steps,
                                            const std::vector<NodeTiming>& labels);

// A text report of traced steps: span, busy and idle times (median and range), the time between
// steps, the `gaps` largest gaps of the median step with the nodes around them, then
// profile_table over timeline_node_times. Throws kiln::Error when `steps` is empty.
std::string timeline_report(const std::vector<std::vector<TraceEvent>>& steps, const std::vector<NodeTiming>& labels,
                            int top = 25, int gaps = 12);

// Chrome trace-event JSON of traced steps on the device's clock (microseconds from the first
// event): one complete event per piece of work named by its node (timing_label) or its kernel
// name, args: kernel, node, step. Throws kiln::Error if `path` cannot be written.
void write_timeline_trace(const std::vector<std::vector<TraceEvent>>& steps, const std::vector<NodeTiming>& labels,
                          const std::string& path);

}  // namespace kiln

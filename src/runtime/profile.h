// Per-kernel timings of one executor run (Executor::profile(), ExecutorOptions::profile) and
// their reports: a table grouped by op, dialect and fused kind, and a Chrome trace-event JSON
// file (chrome://tracing, ui.perfetto.dev) that lays the step's kernels out on a timeline.
// Plain C++: no CUDA headers, so the CLI and CPU-only tests use it in any build.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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
std::string profile_table(const std::vector<NodeTiming>& timings, int top = 25);
// Writes Chrome trace-event JSON: one complete event (ph "X") per node, back to back in node
// order (ts = sum of the earlier durations; ts and dur in microseconds), name = timing_label,
// args = node index, outputs (and kind). The measured gaps between kernels (launch overhead)
// are not shown: the timeline is the kernels' own times. Throws kiln::Error if `path` cannot be
// written.
void write_chrome_trace(const std::vector<NodeTiming>& timings, const std::string& path);

}  // namespace kiln

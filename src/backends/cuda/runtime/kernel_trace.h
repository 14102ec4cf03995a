// A timeline of the device's real work, through CUPTI's activity API: every kernel, copy and
// fill the GPU ran while a trace was recording, with the device's own start and end times.
// Unlike the event profile (ExecutorOptions::profile, runtime/profile.h), which brackets each
// node with events and runs without a CUDA graph, this sees graph-replayed steps as they run,
// gaps between kernels included. Declared without CUDA headers; in a build without CUDA or
// without CUPTI, kernel_trace_available() is false and KernelTrace's constructor throws.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/trace_event.h"

namespace kiln::cuda {

// Whether this build can trace (CUDA and CUPTI were found at configure time).
bool kernel_trace_available();

// One trace at a time in a process. From construction on, graph nodes that a CUDA-graph
// capture creates are remembered with the kiln node that launched them (set_trace_node), so a
// replayed kernel names its node: build the executor to be traced (or at least capture its
// graph) while a KernelTrace exists. Activity is recorded only between start() and stop().
class KernelTrace {
 public:
  KernelTrace();
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  void start();
  // Waits for the device, flushes CUPTI's buffers and returns what ran since start(), by start
  // time (TraceEvent::launch says which API call launched it: one graph replay, one launch).
  std::vector<TraceEvent> stop();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The executor names the graph node whose kernels it is about to enqueue on this thread (-1 after
// them), through DeviceRuntime::node_marker. A thread-local store: costs nothing when no trace
// exists.
void set_trace_node(int64_t node);

}  // namespace kiln::cuda

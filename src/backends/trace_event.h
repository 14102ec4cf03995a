// One piece of device work in a traced run, as a backend's tracer records it
// (cuda::KernelTrace, backends/cuda/runtime/kernel_trace.h). Here, below the runtime, so that
// the tracer needs nothing above the backends; the reports on traced runs (split into steps,
// per-node times, gaps) are the runtime's (runtime/profile.h). Plain C++: no CUDA headers.
#pragma once

#include <cstdint>
#include <string>

namespace kiln {

// A kernel, a copy or a fill.
struct TraceEvent {
  std::string name;       // the kernel's name (demangled), "memcpy <kind>" or "memset"
  double start_us = 0;    // the device's clock
  double end_us = 0;
  uint64_t launch = 0;    // the launching API call's correlation id: one graph replay, one launch
  int64_t node = -1;      // the graph node that enqueued it; -1: unknown
};

}  // namespace kiln

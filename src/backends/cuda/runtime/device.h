// What the CUDA backend knows about the machine. Declared without CUDA headers so the CLI and
// tests can ask in any build; in a build without CUDA these report "no CUDA".
#pragma once

#include <string>

namespace kiln::cuda {

// Whether this build has the CUDA backend compiled in.
bool built_with_cuda();
// Number of usable CUDA devices (0 without a driver or GPU, or in a build without CUDA).
int device_count();
// "NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB" for device 0, or why there is none.
std::string describe_device(int device = 0);
// The compute capability of `device` as major * 10 + minor (90 for sm_90); 0 where there is no
// such device.
int compute_capability(int device = 0);
// Runs a tiny kernel (y = a*x + y on n floats) on device 0 and returns max |error| against the
// host result: a smoke test that compiling, loading and launching work. Throws kiln::Error.
double smoke_test_saxpy(int n);
// The calling thread's current device (CUDA keeps it per thread: a new thread starts on device
// 0), and setting it. Throw kiln::Error in a build without CUDA.
int current_device();
void set_current_device(int device);

// While one exists on a thread, the cuBLASLt products that thread enqueues outside a graph
// capture choose their algorithm by timing the heuristic's candidates (once per description; the
// plan cache keeps the winner for every later run), as KILN_GEMM_AUTOTUNE=1 does everywhere.
// The executor opens one for its tuning run (ExecutorOptions::tune_gemms) through
// DeviceRuntime::tune_kernels. A no-op without CUDA.
class GemmTuningScope {
 public:
  GemmTuningScope();
  ~GemmTuningScope();
  GemmTuningScope(const GemmTuningScope&) = delete;
  GemmTuningScope& operator=(const GemmTuningScope&) = delete;
};

}  // namespace kiln::cuda

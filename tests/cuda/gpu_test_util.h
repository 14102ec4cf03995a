// Shared by the GPU tests (tests/cuda/, the kiln_gpu_tests binary, ctest label "gpu"): every
// test starts with KILN_REQUIRE_GPU(), so the suite skips cleanly on machines without a GPU.
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/device.h"
#include "test_util.h"

#define KILN_REQUIRE_GPU()                                                          \
  do {                                                                              \
    if (!::kiln::cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";     \
    if (::kiln::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device here";   \
  } while (0)

namespace kiln::testing {

// Milliseconds per call of fn (enqueued on `stream`), averaged over `reps` after a warm-up call:
// the GPU benchmarks' timer (they print numbers; no test asserts on them).
template <typename Fn>
double time_ms(cudaStream_t stream, int reps, Fn&& fn) {
  fn();
  cudaEvent_t start, stop;
  KILN_CUDA_CHECK(cudaEventCreate(&start));
  KILN_CUDA_CHECK(cudaEventCreate(&stop));
  KILN_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < reps; ++i) fn();
  KILN_CUDA_CHECK(cudaEventRecord(stop, stream));
  KILN_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  KILN_CUDA_CHECK(cudaEventDestroy(start));
  KILN_CUDA_CHECK(cudaEventDestroy(stop));
  return ms / reps;
}

}  // namespace kiln::testing

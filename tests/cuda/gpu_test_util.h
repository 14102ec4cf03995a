// Shared by the GPU tests (tests/cuda/, the kiln_gpu_tests binary, ctest label "gpu"): every
// test starts with KILN_REQUIRE_GPU(), so the suite skips cleanly on machines without a GPU.
#pragma once

#include <cuda_runtime.h>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/runtime/device.h"
#include "test_util.h"

#define KILN_REQUIRE_GPU()                                                          \
  do {                                                                              \
    if (!::kiln::cuda::built_with_cuda()) GTEST_SKIP() << "built without CUDA";     \
    if (::kiln::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device here";   \
  } while (0)

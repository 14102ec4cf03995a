// Check macros for CUDA runtime calls: a failed call throws kiln::Error with file:line and the
// runtime's own description. Every CUDA call in kiln goes through one of these.
#pragma once

#include <cuda_runtime.h>

#include "support/error.h"

#define KILN_CUDA_CHECK(call)                                                                  \
  do {                                                                                         \
    cudaError_t kiln_status_ = (call);                                                         \
    if (kiln_status_ != cudaSuccess)                                                           \
      ::kiln::fail("{}:{}: {} failed: {} ({})", __FILE__, __LINE__, #call,                     \
                   cudaGetErrorString(kiln_status_), cudaGetErrorName(kiln_status_));          \
  } while (0)

// Scratch: temporary device memory for a launcher (partial sums, per-row statistics, sort
// buffers), taken from the stream-ordered allocator on the op's stream. C++17-clean, for *.cu
// files (and any host code that launches on a stream).
//
// Why stream-ordered (cudaMallocAsync / cudaFreeAsync) rather than cudaMalloc / cudaFree:
//   - no host synchronization: cudaFree waits for the whole device, cudaFreeAsync is enqueued
//     after the kernels that use the memory, so the launcher returns at once and the memory is
//     reused by later work on the stream from the pool (no driver call in the steady state);
//   - it is legal inside CUDA-graph capture (the executor captures training steps): the
//     allocation and the free become graph nodes, where cudaMalloc / cudaFree would break the
//     capture.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "backends/cuda/common/cuda_check.h"

namespace kiln::cuda {

// `bytes` (at least 16, so that as<T>() is never null) on `stream`, freed on `stream` when the
// Scratch goes out of scope: after every kernel the launcher enqueued on `stream` while it
// lived. Use it only from kernels on that stream.
class Scratch {
 public:
  Scratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
    KILN_CUDA_CHECK(cudaMallocAsync(&ptr_, std::max<size_t>(bytes, 16), stream));
  }
  // A destructor cannot throw: a failed free (only on an already broken stream or context) is
  // left to the next checked CUDA call to report.
  ~Scratch() { cudaFreeAsync(ptr_, stream_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace kiln::cuda

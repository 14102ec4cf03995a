// The Communicator over NCCL (CUDA tensors): backends/cuda/nccl/nccl_communicator.cc. Built with the
// CUDA backend when CMake finds nccl.h and libnccl (KILN_HAVE_NCCL); make_communicator
// (backends/communicator.cc) is how the rest of kiln gets one. No CUDA headers here.
#pragma once

#include <chrono>
#include <memory>

#include "device/communicator.h"

namespace kiln {

// On the calling thread's current GPU (the process group selects LOCAL_RANK's first).
std::unique_ptr<Communicator> make_nccl_communicator(int rank, int world_size,
                                                     KeyValueStore& store,
                                                     std::chrono::milliseconds timeout);

}  // namespace kiln

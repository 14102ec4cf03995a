// The Communicator over Gloo (CPU tensors, TCP transport): backends/cpu/gloo_communicator.cc.
// Built when CMake finds Gloo (KILN_HAVE_GLOO); make_communicator (backends/communicator.cc)
// is how the rest of kiln gets one.
#pragma once

#include <chrono>
#include <memory>

#include "device/communicator.h"

namespace kiln {

std::unique_ptr<Communicator> make_gloo_communicator(int rank, int world_size,
                                                     KeyValueStore& store,
                                                     std::chrono::milliseconds timeout);

}  // namespace kiln

// The communicator factory (device/communicator.h): each device's collective engine, or why
// this build has none.
#include "backends/cpu/gloo_communicator.h"
#include "backends/cuda/nccl/nccl_communicator.h"
#include "device/communicator.h"
#include "support/error.h"

namespace kiln {

std::unique_ptr<Communicator> make_communicator(Device device, int rank, int world_size,
                                                KeyValueStore& store,
                                                std::chrono::milliseconds timeout) {
  if (device == Device::kCpu) {
#ifdef KILN_HAVE_GLOO
    return make_gloo_communicator(rank, world_size, store, timeout);
#else
    fail("this kiln was built without Gloo, which CPU collectives need (install libgloo-dev and "
         "reconfigure)");
#endif
  }
#ifdef KILN_HAVE_NCCL
  return make_nccl_communicator(rank, world_size, store, timeout);
#elif defined(KILN_HAVE_CUDA)
  fail("this kiln was built without NCCL, which GPU collectives need (it comes with the CUDA "
       "toolkit or PyTorch's nvidia-nccl-cu* wheel; reconfigure where nccl.h is found)");
#else
  fail("this build has no CUDA backend (configure with -DKILN_CUDA=ON)");
#endif
}

}  // namespace kiln

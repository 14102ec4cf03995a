// The source of generated kernels, by device (backends/generated_source.h).
#include "backends/generated_source.h"

#include "backends/cuda/nvrtc/nvrtc.h"
#include "support/error.h"

namespace kiln {

std::string generated_kernel_source(Device device, const Graph& body, FusedKind kind) {
  KILN_CHECK(device == Device::kCuda,
             "the {} backend generates no kernel source (the nvrtc dialect of cuda does)",
             device_name(device));
  return cuda::fused_kernel_listing(body, kind);
}

}  // namespace kiln

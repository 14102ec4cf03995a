// The runtime factory and what every runtime shares (device/device_runtime.h).
#include "device/device_runtime.h"

#include "backends/cuda/runtime/device.h"
#include "support/error.h"

namespace kiln {

std::unique_ptr<DeviceRuntime> device_runtime(Device device) {
  if (device == Device::kCpu) return make_cpu_runtime();
  KILN_CHECK(cuda::built_with_cuda(), "this build has no CUDA backend (configure with -DKILN_CUDA=ON)");
  KILN_CHECK(cuda::device_count() > 0, "no CUDA device on this machine");
  return make_cuda_runtime();
}

DeviceAvailability device_availability(Device device) {
  if (device == Device::kCpu) return {true, 1, make_cpu_runtime()->name()};
  DeviceAvailability out;
  out.built = cuda::built_with_cuda();
  out.count = cuda::device_count();
  out.description = cuda::describe_device(0);
  out.compute_capability = cuda::compute_capability(0);
  return out;
}

}  // namespace kiln

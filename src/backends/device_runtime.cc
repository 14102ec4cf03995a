// The runtime factory and what every runtime shares (device/device_runtime.h).
#include "device/device_runtime.h"

#include "backends/cuda/runtime/device.h"
#include "support/error.h"

namespace kiln {

namespace {

void check_cuda_devices() {
  KILN_CHECK(cuda::built_with_cuda(), "this build has no CUDA backend (configure with -DKILN_CUDA=ON)");
  KILN_CHECK(cuda::device_count() > 0, "no CUDA device on this machine");
}

}  // namespace

std::unique_ptr<DeviceRuntime> device_runtime(Device device) {
  if (device == Device::kCpu) return make_cpu_runtime();
  check_cuda_devices();
  return make_cuda_runtime(cuda::current_device());
}

std::unique_ptr<DeviceRuntime> device_runtime(Device device, int index) {
  if (device == Device::kCpu) {
    KILN_CHECK(index == 0, "cpu device {}: the cpu is device 0, the only one", index);
    return make_cpu_runtime();
  }
  check_cuda_devices();
  const int count = cuda::device_count();
  KILN_CHECK(index >= 0 && index < count, "CUDA device {}: this machine has {} GPU{} (0 to {})", index,
             count, count == 1 ? "" : "s", count - 1);
  return make_cuda_runtime(index);
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

// The host side of the kernel-time data errors (device_errors.h): the registry of the device
// error slots (one per *.cu file that includes device_errors.cuh) and check_device_errors(),
// which reads them all, clears them and throws kiln::Error for the earliest error, worded as
// the reference kernel words it.
#include "backends/cuda/runtime/device_errors.h"

#include <cuda_runtime.h>

#include <mutex>
#include <optional>
#include <vector>

#include "backends/cuda/common/cuda_check.h"
#include "support/error.h"

namespace kiln::cuda {
namespace {

struct Registry {
  std::mutex mutex;
  std::vector<const void*> slots;
};
// Function-local: slots register during static initialization, in any order of files.
Registry& registry() {
  static Registry r;
  return r;
}

[[noreturn]] void throw_error(const DeviceErrorRecord& e) {
  switch (e.code) {
    case kGatherIndexError:
    case kScatterAddIndexError:
    case kGatherElementsIndexError:
    case kScatterElementsIndexError:
      fail("{}: index {} (at position {} of indices) is out of range for a dim of {} "
           "(expected 0..{})",
           e.code == kGatherIndexError           ? "gather"
           : e.code == kScatterAddIndexError     ? "scatter_add"
           : e.code == kGatherElementsIndexError ? "gather_elements"
                                                 : "scatter_elements",
           e.value, e.position, e.limit, e.limit - 1);
    case kDivideByZeroError:
      fail("div: integer division by zero ({} / 0)", e.value);
    case kRemainderByZeroError:
      fail("mod/fmod: integer remainder by zero ({} % 0)", e.value);
    case kCrossEntropyLabelError:
    case kCrossEntropyGradLabelError:
      fail("{}: label {} (row {}) is out of range [0, {}) and is not ignore_index {}",
           e.code == kCrossEntropyLabelError ? "cross_entropy" : "cross_entropy_grad", e.value,
           e.position, e.limit, e.extra);
    default:
      fail("cuda: unknown device error code {} (value {}, position {}, limit {})", e.code,
           e.value, e.position, e.limit);
  }
}

}  // namespace

void register_device_error_slot(const void* symbol) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.slots.push_back(symbol);
}

void check_device_errors() {
  std::vector<const void*> slots;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    slots = r.slots;
  }
  std::optional<DeviceErrorRecord> earliest;
  for (const void* slot : slots) {
    DeviceErrorRecord e;
    KILN_CUDA_CHECK(cudaMemcpyFromSymbol(&e, slot, sizeof(e), 0, cudaMemcpyDeviceToHost));
    if (e.code == kNoDeviceError) continue;
    const DeviceErrorRecord cleared;
    KILN_CUDA_CHECK(cudaMemcpyToSymbol(slot, &cleared, sizeof(cleared), 0,
                                       cudaMemcpyHostToDevice));
    if (!earliest || e.time_ns < earliest->time_ns) earliest = e;
  }
  if (earliest) throw_error(*earliest);
}

}  // namespace kiln::cuda

// The device side of the kernel-time data errors (device_errors.h says why they are recorded,
// not thrown): record_device_error() for kernels, writing this translation unit's error slot.
// C++17-clean, for *.cu files only.
//
// nvcc compiles each *.cu file on its own (no relocatable device code), so a __device__ variable
// cannot be shared between files: every file that includes this header gets its own slot (in an
// anonymous namespace) and registers it with check_device_errors() during static initialization.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/runtime/device_errors.h"

namespace kiln::cuda {
namespace {

__device__ DeviceErrorRecord g_device_error;

// Records a data error unless one is already recorded in this file's slot (the first one wins):
// the CAS claims the slot, the fields are written, then the code is published. Cheap when
// nothing goes wrong: call it only on the error path. Codes: DeviceErrorCode (device_errors.h).
__device__ inline void record_device_error(int32_t code, int64_t value, int64_t position = -1,
                                           int64_t limit = 0, int64_t extra = 0) {
  if (atomicCAS(&g_device_error.code, 0, -1) != 0) return;
  uint64_t now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  g_device_error.value = value;
  g_device_error.position = position;
  g_device_error.limit = limit;
  g_device_error.extra = extra;
  g_device_error.time_ns = now;
  __threadfence();
  atomicExch(&g_device_error.code, code);
}

// Registers this file's slot before main() (makes no CUDA call, so the order against the CUDA
// runtime's own registration of this file does not matter).
struct DeviceErrorSlotRegistration {
  DeviceErrorSlotRegistration() { register_device_error_slot(&g_device_error); }
};
const DeviceErrorSlotRegistration g_device_error_registration;

}  // namespace
}  // namespace kiln::cuda

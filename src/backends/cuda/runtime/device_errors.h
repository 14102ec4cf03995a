// Kernel-time data errors of the CUDA kernels: an index out of range in gather or scatter_add, a
// cross_entropy label out of range that is not ignore_index, an integer division by zero. A
// kernel cannot throw, and stopping to ask the device after every launch would cost a
// synchronization each time, so a kernel records the first such error in a device slot
// (device_errors.cuh, record_device_error) and carries on with a defined output; the host reads
// the slots when it synchronizes anyway: check_device_errors() throws kiln::Error describing it,
// as the reference kernel would have.
//
// No CUDA headers and nothing past C++17 here: the executor includes it in every build (the
// build without CUDA defines check_device_errors() as a no-op in backends/cuda_stub.cc) and the
// *.cu files include it through device_errors.cuh.
#pragma once

#include <cstdint>

namespace kiln::cuda {

// Throws kiln::Error for the first data error a CUDA kernel recorded since the last call (the
// earliest by the device clock when several were recorded) and clears every recorded error, so
// the next call is clean. Returns quietly when there is none. Call it after synchronizing the
// streams the kernels ran on; it reads the current device's slots. Costs one small synchronous
// copy per CUDA translation unit that records errors (a few microseconds each).
void check_device_errors();

// ---- shared with device_errors.cuh (the kernels) and device_errors.cc (the host side) ----------

enum DeviceErrorCode : int32_t {
  kNoDeviceError = 0,
  kGatherIndexError = 1,            // value: index, position: p in indices, limit: dim
  kScatterAddIndexError = 2,        // same
  kDivideByZeroError = 3,           // value: the dividend
  kCrossEntropyLabelError = 4,      // value: label, position: row, limit: vocab, extra: ignore_index
  kCrossEntropyGradLabelError = 5,  // same, in cross_entropy_grad
  kGatherElementsIndexError = 6,    // value: index, position: p in indices, limit: dim
  kScatterElementsIndexError = 7,   // same
  kRemainderByZeroError = 8,        // value: the dividend (mod, fmod)
};

// The device slot's layout. code is -1 while a thread is filling the other fields.
struct DeviceErrorRecord {
  int32_t code = kNoDeviceError;
  int32_t unused = 0;
  int64_t value = 0, position = 0, limit = 0, extra = 0;
  uint64_t time_ns = 0;  // the device's global timer when recorded: orders errors across slots
};

// Called once per *.cu translation unit that includes device_errors.cuh, during static
// initialization, with the host address of that unit's __device__ slot (whole-program CUDA
// compilation gives every translation unit its own device globals, so there is one slot per unit
// and check_device_errors() reads them all). Makes no CUDA call.
void register_device_error_slot(const void* symbol);

}  // namespace kiln::cuda

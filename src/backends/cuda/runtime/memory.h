// The CUDA layer under the CUDA device runtime (cuda_runtime.cc, device/device_runtime.h):
// device memory (Tensors whose storage is device memory), copies between host and device
// (synchronous, and asynchronous on a stream through pinned host staging), streams, events and
// captured CUDA graphs. Declared without CUDA headers (streams and events are void*, i.e.
// cudaStream_t and cudaEvent_t), so tests include it in any build; in a build without CUDA every
// function here throws kiln::Error "this build has no CUDA backend" (backends/cuda_stub.cc).
//
// Every device allocation kiln makes goes through allocate() (device_tensor() and the
// executor's arena do), so allocated_bytes() / peak_allocated_bytes() count what kiln holds:
// the one process-wide counter, kept because `kiln bench` and the trainer report it.
#pragma once

#include <cstdint>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace kiln::cuda {

// ---- device memory ----

struct MemoryInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};
// cudaMemGetInfo on the current device.
MemoryInfo memory_info();
// Throws kiln::Error "<what> needs X GiB (N bytes) of device memory, Y GiB free on <device>"
// when `bytes` is more than the device has free.
void check_fits(size_t bytes, const std::string& what);

// `bytes` (at least 1) of device memory, 256-byte aligned; cudaFree runs when the last
// reference goes. `what` names the allocation in the error when it does not fit, which says
// how much was asked and how much is free.
std::shared_ptr<std::byte[]> allocate(size_t bytes, const std::string& what = "an allocation");
// Bytes kiln holds on the device now, and the most it held since the last reset.
size_t allocated_bytes();
size_t peak_allocated_bytes();
void reset_peak_allocated_bytes();

// A device tensor of `type`: zero-filled (synchronously) when `zero`, else its bytes are
// whatever the device held.
Tensor device_tensor(const TensorType& type, bool zero = true);
// `bytes` (at least 1) of page-locked host memory, zero-filled; cudaFreeHost runs when the last
// reference goes.
std::shared_ptr<std::byte[]> allocate_pinned(size_t bytes);
// A host tensor (Device::kCpu, every host accessor works) in page-locked memory, so that
// asynchronous copies to and from it really overlap the host. Zero-filled.
Tensor pinned_tensor(const TensorType& type);

// Synchronous copies: a new device tensor holding `host`'s values, a new host tensor holding
// `device`'s values. They wait for the whole device (every stream): for setup, tests and
// checkpoints, never inside a step.
Tensor to_device(const Tensor& host);
Tensor to_host(const Tensor& device);
// Copies src's bytes into dst (same type; any of host->device, device->host, device->device),
// enqueued on `stream`: returns at once. Host memory must stay unchanged (src) or unread (dst)
// until the stream reaches the copy; with pageable host memory CUDA may copy synchronously.
void copy_async(const Tensor& dst, const Tensor& src, void* stream);
// Sets every byte of the device tensor `dst` to `byte`, enqueued on `stream`.
void fill_bytes_async(const Tensor& dst, uint8_t byte, void* stream);

// ---- streams ----

// An owned non-blocking stream (never the legacy default stream, which would serialize with
// every other stream). Priority: a plain stream one above the device's lowest, a background one
// at the lowest, so that the block scheduler serves the plain streams' pending blocks first
// (DeviceRuntime::create_background_stream).
class Stream {
 public:
  explicit Stream(bool background = false);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* handle() const { return stream_; }  // cudaStream_t
  // Waits for everything enqueued so far; throws kiln::Error on an asynchronous kernel error.
  void synchronize() const;

 private:
  void* stream_ = nullptr;
};
// Waits for everything enqueued on `stream` (a cudaStream_t).
void synchronize(void* stream);

// ---- pinned staging ----

// Host -> device copies of pageable host tensors without blocking the host on the device:
// each upload() packs its tensors into a page-locked slot and enqueues the slot -> device
// copies on the stream; one larger than 64 MiB fills the slots in turn, a piece each. Before
// reusing a slot the host waits only for the copies that last used it, so the host runs at
// most `slots` slots' worth of copies ahead of the device.
class UploadStaging {
 public:
  explicit UploadStaging(int slots = 2);
  ~UploadStaging();
  UploadStaging(const UploadStaging&) = delete;
  UploadStaging& operator=(const UploadStaging&) = delete;
  // hosts[i] -> devices[i] (same types), enqueued on `stream`.
  void upload(std::span<const Tensor> hosts, std::span<const Tensor> devices, void* stream);

 private:
  struct Slot {
    Tensor buffer;  // pinned bytes
    void* event = nullptr;  // cudaEvent_t recorded after the slot's copies
    bool pending = false;
  };
  std::vector<Slot> slots_;
  size_t next_ = 0;
};

// ---- events ----

// One CUDA event (a cudaEvent_t, created once and reused): recorded on a stream, then waited
// for by the host (synchronize), by another stream (wait_event) or timed against another event
// (elapsed_ms).
class Event {
 public:
  // `timing` off (cudaEventDisableTiming): records faster, but elapsed_ms refuses it.
  explicit Event(bool timing = true);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void* handle() const { return event_; }  // cudaEvent_t
  void record(void* stream);
  void synchronize() const;

 private:
  void* event_ = nullptr;
};
// Work enqueued on `stream` from now on waits for the work before `event`'s last record (the
// host does not wait). Both are handles (cudaStream_t, cudaEvent_t).
void wait_event(void* stream, void* event);
// Waits for `end`, then returns the milliseconds from event `start` to `end` (both recorded,
// both with timing).
float elapsed_ms(void* start, void* end);

// ---- CUDA graphs ----

// One captured stream sequence, replayed with launch(). Usage:
//   graph.begin_capture(stream); <enqueue work on stream>; graph.end_capture(stream);
//   graph.launch(stream);  // as often as wanted
// A new capture replaces the old one (updating the instantiated graph in place when CUDA can).
class CapturedGraph {
 public:
  CapturedGraph() = default;
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  // Relaxed capture mode: kernels may allocate (cudaMalloc) on first use while capturing.
  void begin_capture(void* stream);
  // Ends the capture and instantiates it. After a failure inside the captured region, call
  // abandon_capture() instead (it ends the capture and drops what was recorded).
  void end_capture(void* stream);
  void abandon_capture(void* stream) noexcept;
  void launch(void* stream) const;
  bool ready() const { return exec_ != nullptr; }
  size_t node_count() const { return nodes_; }

 private:
  void* exec_ = nullptr;  // cudaGraphExec_t
  size_t nodes_ = 0;
};

}  // namespace kiln::cuda

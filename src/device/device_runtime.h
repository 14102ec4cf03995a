// The device runtime: everything kiln does with ONE device besides choosing kernels — memory
// (device buffers, host staging), copies between host and device (synchronous, and
// asynchronous on a stream), fills, streams, events, waits, capturing a stream's work into a
// graph replayed with one launch, and the hooks kernels and traces need (tuning, node names).
// The executor (runtime/executor.h) and the trainer (train/) reach a device only through it,
// so one code path serves every device; each backend implements it (backends/cpu/cpu_runtime.cc,
// backends/cuda/runtime/cuda_runtime.cc, which wraps memory.h and device.h beside it). No CUDA
// headers here: a stream's handle is a void* (a cudaStream_t on CUDA).
//
// On the CPU, work runs when it is enqueued: a stream is an empty handle, an asynchronous copy
// is a memcpy, an event records the host's clock, and nothing can be captured (can_capture()
// is false, create_graph() throws).
//
// A runtime is a small object without device state of its own (the memory it hands out, the
// streams, events and graphs it makes are owned by whoever asked); make one per user with
// device_runtime(). On CUDA it is one GPU (index()): the one current on the thread that made it
// (one process per GPU), or the one asked for by index. CUDA keeps the current GPU per thread
// and works on it, so make_current() makes the runtime's GPU current on the calling thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tensor/tensor.h"
#include "support/bytes.h"

namespace kiln {

struct TraceEvent;  // runtime/profile.h

// "1.50 GiB" (for messages about memory).

class DeviceEvent;

// An ordered queue of device work: what is enqueued on one stream runs in order; two streams
// run concurrently unless one waits for an event recorded on the other.
class DeviceStream {
 public:
  virtual ~DeviceStream() = default;
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;
  // What kernels enqueue on (KernelArgs::stream): a cudaStream_t; nullptr on the CPU.
  void* handle() const { return handle_; }
  // Waits until everything enqueued so far has run. Throws kiln::Error on an asynchronous
  // device fault; kernels' data errors are DeviceRuntime::check_kernel_errors()'s.
  virtual void synchronize() const = 0;
  // Work enqueued on this stream from now on waits for the work `event` was recorded after (the
  // host does not wait): how one stream joins another's results.
  virtual void wait(const DeviceEvent& event) const = 0;

 protected:
  explicit DeviceStream(void* handle) : handle_(handle) {}

 private:
  void* handle_;
};

// A point in a stream's work.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  // A cudaEvent_t; nullptr on the CPU.
  void* handle() const { return handle_; }
  // Marks the point the work enqueued on `stream` so far will reach.
  virtual void record(const DeviceStream& stream) = 0;
  // Waits (on the host) until the work before the last record() has run.
  virtual void synchronize() const = 0;
  // Milliseconds from `start`'s last record() to this event's; waits for this one. Both must
  // have been recorded, by the same runtime's kind of device, and with timing (create_event).
  virtual float elapsed_ms_since(const DeviceEvent& start) const = 0;

 protected:
  explicit DeviceEvent(void* handle) : handle_(handle) {}

 private:
  void* handle_;
};

// A stream's work recorded once and replayed with one launch (a CUDA graph). Usage:
//   graph.begin_capture(stream); <enqueue work on stream>; graph.end_capture(stream);
//   graph.launch(stream);  // as often as wanted
class DeviceGraph {
 public:
  virtual ~DeviceGraph() = default;
  // Work enqueued on `stream` from now on is recorded, not run. Kernels may allocate on first
  // use while capturing.
  virtual void begin_capture(const DeviceStream& stream) = 0;
  // Ends the capture and makes it launchable; it replaces an earlier capture.
  virtual void end_capture(const DeviceStream& stream) = 0;
  // After a failure inside the captured region: ends the capture and drops what was recorded.
  virtual void abandon_capture(const DeviceStream& stream) noexcept = 0;
  // Enqueues the captured work on `stream`.
  virtual void launch(const DeviceStream& stream) const = 0;
  virtual bool ready() const = 0;
  // Device operations in the last capture (kernels, copies, fills).
  virtual size_t node_count() const = 0;
};

// Host -> device copies of host tensors in ordinary (pageable) memory that do not make the host
// wait for the device: on CUDA each upload packs its tensors into `slots` page-locked buffers
// used in turn, 64 MiB at most each (the host waits only for the copies that last used a
// buffer); on the CPU it copies at once.
class DeviceUploader {
 public:
  virtual ~DeviceUploader() = default;
  // hosts[i] -> devices[i] (same types), enqueued on `stream`. The host tensors may change as
  // soon as it returns.
  virtual void upload(std::span<const Tensor> hosts, std::span<const Tensor> devices,
                      const DeviceStream& stream) = 0;
};

// While one lives, kernels that can tune themselves do, on the runs the calling thread enqueues
// outside a capture (DeviceRuntime::tune_kernels).
class KernelTuning {
 public:
  virtual ~KernelTuning() = default;
};

// A timeline of what the device ran (every kernel, copy and fill, with the device's own times):
// backends/cuda/runtime/kernel_trace.h. Graph nodes captured while a trace exists are remembered
// with the kiln node that enqueued them (DeviceRuntime::node_marker), so build the executor to be
// traced after making the trace.
class DeviceTrace {
 public:
  virtual ~DeviceTrace() = default;
  virtual void start() = 0;
  // Waits for the device and returns what ran since start(), by start time.
  virtual std::vector<TraceEvent> stop() = 0;
};

struct DeviceMemoryInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  // ---- the device ----
  virtual Device device() const = 0;
  // Which device of its kind: the CUDA device ordinal; 0 on the CPU.
  virtual int index() const = 0;
  // What the device is, for reports and messages: "NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB" (the
  // name device_peak_flops looks up), "cpu (16 threads)".
  virtual std::string name() const = 0;
  // Makes this runtime's device current on the calling thread (CUDA keeps the current device
  // per thread; a new thread starts on GPU 0). No-op on the CPU.
  virtual void make_current() const = 0;

  // ---- memory ----
  virtual DeviceMemoryInfo memory_info() const = 0;
  // Throws kiln::Error "<what> needs X GiB (N bytes) of device memory, Y GiB free on <name>"
  // when `bytes` is more than the device has free: the out-of-memory check made before
  // allocating, so that the message names the whole need.
  virtual void check_fits(size_t bytes, const std::string& what) const = 0;
  // `bytes` (at least 1) of device memory, 256-byte aligned, contents unspecified; freed when
  // the last reference goes. `what` names the allocation in the error when it does not fit.
  virtual std::shared_ptr<std::byte[]> allocate(size_t bytes, const std::string& what = "an allocation") const = 0;
  // A device tensor of `type`: zero-filled (the host waits for it) when `zero`, else its bytes
  // are unspecified.
  virtual Tensor device_tensor(const TensorType& type, bool zero = true) const = 0;
  // A host tensor (Device::kCpu) that asynchronous copies overlap the host with: page-locked on
  // CUDA. Zero-filled.
  virtual Tensor pinned_tensor(const TensorType& type) const = 0;
  // Bytes the process holds through allocate() on this kind of device now, and the most it held
  // since reset_peak_allocated_bytes(). The CPU does not count them (0).
  virtual size_t allocated_bytes() const = 0;
  virtual size_t peak_allocated_bytes() const = 0;
  virtual void reset_peak_allocated_bytes() const = 0;

  // ---- copies and fills ----
  // Synchronous copies, waiting for the whole device: a new device tensor holding `host`'s
  // values, a new host tensor holding `device`'s. For setup, tests and checkpoints, never
  // inside a step.
  virtual Tensor to_device(const Tensor& host) const = 0;
  virtual Tensor to_host(const Tensor& device) const = 0;
  // Copies src's bytes into dst (same type; host or device on either side), enqueued on
  // `stream`. A host tensor must stay unchanged (src) or unread (dst) until the stream reaches
  // the copy; from pageable host memory CUDA may copy synchronously.
  virtual void copy_async(const Tensor& dst, const Tensor& src, const DeviceStream& stream) const = 0;
  // Sets every byte of the device tensor `dst` to `byte`, enqueued on `stream`.
  virtual void fill_async(const Tensor& dst, uint8_t byte, const DeviceStream& stream) const = 0;
  virtual std::unique_ptr<DeviceUploader> create_uploader(int slots = 2) const = 0;

  // ---- streams, events, graphs ----
  // A new stream that runs concurrently with the others (never CUDA's legacy default stream,
  // which would serialize with every stream).
  virtual std::unique_ptr<DeviceStream> create_stream() const = 0;
  // A stream whose work the device schedules only where the other streams' leaves room (CUDA:
  // the lowest stream priority, the others one above it): for work that may fill the gaps of
  // the compute stream but must not delay it (the optimizer's updates beside the backward pass,
  // runtime/executor.h). Where the device has no priorities, a plain stream.
  virtual std::unique_ptr<DeviceStream> create_background_stream() const { return create_stream(); }
  // `timing`: elapsed_ms_since works (recording costs a little more); off for joins.
  virtual std::unique_ptr<DeviceEvent> create_event(bool timing = false) const = 0;
  virtual bool can_capture() const = 0;
  // Throws kiln::Error where !can_capture().
  virtual std::unique_ptr<DeviceGraph> create_graph() const = 0;
  // Throws kiln::Error for the first data error a kernel recorded since the last call (an index
  // or a label out of range: backends/cuda/runtime/device_errors.h) and clears them. Call it after
  // synchronizing the streams the kernels ran on. No-op on the CPU, whose kernels throw at once.
  virtual void check_kernel_errors() const = 0;

  // ---- kernels and traces ----
  // While the returned object lives, kernels that the calling thread enqueues outside a
  // capture may tune themselves (cuBLASLt products time the heuristic's candidates, once per
  // description: cuda::GemmTuningScope). nullptr where no kernel tunes.
  virtual std::unique_ptr<KernelTuning> tune_kernels() const = 0;
  // A plain function that names the graph node whose kernels the calling thread enqueues next
  // (-1 after them), so that a device trace can name each kernel's node; nullptr where nothing
  // listens. A function pointer rather than a virtual call: the executor calls it per node.
  using NodeMarker = void (*)(int64_t node);
  virtual NodeMarker node_marker() const = 0;
  // Whether create_trace() works (CUDA built with CUPTI).
  virtual bool can_trace() const = 0;
  virtual std::unique_ptr<DeviceTrace> create_trace() const = 0;
};

// A runtime for `device` (CUDA: the calling thread's current GPU). Throws kiln::Error saying why
// there is none: "this build has no CUDA backend (configure with -DKILN_CUDA=ON)", or "no CUDA
// device on this machine".
std::unique_ptr<DeviceRuntime> device_runtime(Device device);
// A runtime for device `index` of its kind (the CUDA device ordinal; the CPU has index 0 only).
// It does not change the thread's current device: make_current() does. Throws kiln::Error as
// device_runtime(device) does, and naming the index and the devices there are when it is out
// of range.
std::unique_ptr<DeviceRuntime> device_runtime(Device device, int index);

// What a build and machine offer for `device`, without making a runtime (`kiln version`).
struct DeviceAvailability {
  bool built = false;       // the build has the backend
  int count = 0;            // usable devices
  std::string description;  // the first device's name(), or why there is none
  // CUDA: the first device's compute capability as major * 10 + minor (90 for an H100); 0 where
  // there is none (and on the CPU). bf16 tensor cores from 80 (A100) on.
  int compute_capability = 0;
};
DeviceAvailability device_availability(Device device);

// Each backend's runtime (backends/cpu/cpu_runtime.cc, backends/cuda/runtime/cuda_runtime.cc;
// in a build without CUDA, backends/cuda_stub.cc's throws). device_runtime() checks first.
std::unique_ptr<DeviceRuntime> make_cpu_runtime();
std::unique_ptr<DeviceRuntime> make_cuda_runtime(int index);

}  // namespace kiln

// Device memory, copies, streams, pinned staging, events and CUDA graphs (backends/cuda/runtime/memory.h).
#include "backends/cuda/runtime/memory.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "backends/cuda/common/cuda_check.h"
#include "support/parallel.h"
#include "device/device_runtime.h"
#include "backends/cuda/runtime/device.h"

namespace kiln::cuda {
namespace {

std::atomic<size_t> g_allocated{0};
std::atomic<size_t> g_peak{0};

void count_allocation(size_t bytes) {
  size_t now = g_allocated.fetch_add(bytes) + bytes;
  size_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace

MemoryInfo memory_info() {
  KILN_CHECK(device_count() > 0, "no CUDA device: {}", describe_device(0));
  MemoryInfo info;
  KILN_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

void check_fits(size_t bytes, const std::string& what) {
  MemoryInfo info = memory_info();
  KILN_CHECK(bytes <= info.free_bytes, "{} needs {} ({} bytes) of device memory, {} free on {}", what,
             format_bytes(bytes), bytes, format_bytes(info.free_bytes), describe_device(current_device()));
}

std::shared_ptr<std::byte[]> allocate(size_t bytes, const std::string& what) {
  bytes = std::max<size_t>(bytes, 1);
  check_fits(bytes, what);
  void* p = nullptr;
  cudaError_t status = cudaMalloc(&p, bytes);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear it: out of memory is not sticky
    MemoryInfo info = memory_info();
    fail("{} needs {} ({} bytes) of device memory, cudaMalloc failed ({}) with {} free on {}", what,
         format_bytes(bytes), bytes, cudaGetErrorString(status), format_bytes(info.free_bytes),
         describe_device(current_device()));
  }
  count_allocation(bytes);
  return std::shared_ptr<std::byte[]>(static_cast<std::byte*>(p), [bytes](std::byte* q) {
    // A deleter must not throw; a failure here means the context is already broken.
    cudaFree(q);
    g_allocated.fetch_sub(bytes);
  });
}

size_t allocated_bytes() { return g_allocated.load(); }
size_t peak_allocated_bytes() { return g_peak.load(); }
void reset_peak_allocated_bytes() { g_peak.store(g_allocated.load()); }

Tensor device_tensor(const TensorType& type, bool zero) {
  auto storage = allocate(type.bytes(), fmt::format("a tensor of {}", to_string(type)));
  if (zero) {
    KILN_CUDA_CHECK(cudaMemset(storage.get(), 0, std::max<size_t>(type.bytes(), 1)));
    KILN_CUDA_CHECK(cudaDeviceSynchronize());  // the legacy stream does not order our streams
  }
  return Tensor(type, std::move(storage), 0, Device::kCuda);
}

std::shared_ptr<std::byte[]> allocate_pinned(size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  void* p = nullptr;
  KILN_CUDA_CHECK(cudaMallocHost(&p, bytes));
  std::memset(p, 0, bytes);
  return std::shared_ptr<std::byte[]>(static_cast<std::byte*>(p), [](std::byte* q) { cudaFreeHost(q); });
}

Tensor pinned_tensor(const TensorType& type) {
  return Tensor(type, allocate_pinned(type.bytes()), 0, Device::kCpu);
}

Tensor to_device(const Tensor& host) {
  KILN_CHECK(host.defined() && host.device() == Device::kCpu, "to_device: expected a host tensor, got {}",
             host.defined() ? fmt::format("a {} tensor of {}", device_name(host.device()), to_string(host.type()))
                            : std::string("no tensor"));
  Tensor device = device_tensor(host.type(), false);
  KILN_CUDA_CHECK(cudaMemcpy(device.raw(), host.raw(), host.bytes(), cudaMemcpyHostToDevice));
  // cudaMemcpy from pageable memory may return before the DMA lands, and kiln's streams are
  // non-blocking (not ordered after the legacy stream): wait, so any stream sees the values.
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  return device;
}

Tensor to_host(const Tensor& device) {
  KILN_CHECK(device.defined() && device.device() == Device::kCuda, "to_host: expected a cuda tensor, got {}",
             device.defined() ? fmt::format("a {} tensor of {}", device_name(device.device()), to_string(device.type()))
                              : std::string("no tensor"));
  Tensor host(device.type());
  // Work enqueued on kiln's non-blocking streams is not ordered before the legacy stream's copy.
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  KILN_CUDA_CHECK(cudaMemcpy(host.raw(), device.raw(), device.bytes(), cudaMemcpyDeviceToHost));
  return host;
}

void copy_async(const Tensor& dst, const Tensor& src, void* stream) {
  KILN_CHECK(dst.defined() && src.defined() && dst.type() == src.type(), "copy: types differ: destination {}, source {}",
             dst.defined() ? to_string(dst.type()) : "none", src.defined() ? to_string(src.type()) : "none");
  if (src.bytes() == 0) return;
  cudaMemcpyKind kind = src.device() == Device::kCuda
                            ? (dst.device() == Device::kCuda ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                            : (dst.device() == Device::kCuda ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
  KILN_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.bytes(), kind, as_stream(stream)));
}

void fill_bytes_async(const Tensor& dst, uint8_t byte, void* stream) {
  KILN_CHECK(dst.defined() && dst.device() == Device::kCuda, "fill_bytes_async: expected a cuda tensor");
  KILN_CUDA_CHECK(cudaMemsetAsync(dst.raw(), byte, dst.bytes(), as_stream(stream)));
}

// ---- streams ----

Stream::Stream(bool background) {
  // Lower numbers are higher priorities; `least` is the default streams' (0 on current GPUs).
  int least = 0, greatest = 0;
  KILN_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const int priority = background ? least : std::max(greatest, least - 1);
  cudaStream_t s = nullptr;
  KILN_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  stream_ = s;
}

Stream::~Stream() {
  if (stream_) cudaStreamDestroy(as_stream(stream_));
}

void Stream::synchronize() const { cuda::synchronize(stream_); }

void synchronize(void* stream) { KILN_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream))); }

// ---- pinned staging ----

UploadStaging::UploadStaging(int slots) {
  KILN_CHECK(slots >= 1, "UploadStaging needs at least one slot, got {}", slots);
  slots_.resize(static_cast<size_t>(slots));
  for (Slot& slot : slots_) {
    cudaEvent_t event = nullptr;
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    slot.event = event;
  }
}

UploadStaging::~UploadStaging() {
  for (Slot& slot : slots_) {
    if (slot.pending) cudaEventSynchronize(static_cast<cudaEvent_t>(slot.event));  // the copy reads the buffer
    cudaEventDestroy(static_cast<cudaEvent_t>(slot.event));
  }
}

void UploadStaging::upload(std::span<const Tensor> hosts, std::span<const Tensor> devices, void* stream) {
  KILN_CHECK(hosts.size() == devices.size(), "upload: {} host tensors for {} device tensors", hosts.size(),
             devices.size());
  size_t total = 0;
  for (size_t i = 0; i < hosts.size(); ++i) {
    KILN_CHECK(hosts[i].defined() && hosts[i].device() == Device::kCpu, "upload: tensor {} is not a host tensor", i);
    KILN_CHECK(devices[i].defined() && devices[i].device() == Device::kCuda,
               "upload: destination {} is not a cuda tensor", i);
    KILN_CHECK(hosts[i].type() == devices[i].type(), "upload: tensor {} is {}, its destination {}", i,
               to_string(hosts[i].type()), to_string(devices[i].type()));
    total += (hosts[i].bytes() + 255) / 256 * 256;
  }
  // A batch fits one slot. A larger upload (a model's params: 16 GB a rank for an 8B model under
  // zero3) goes through the slots in turn, kSlotBytes at a time, so that pinned memory stays
  // small and packing one piece overlaps the device's copy of the one before.
  constexpr size_t kSlotBytes = size_t{64} << 20;
  const size_t capacity = std::max<size_t>(std::min(total, kSlotBytes), 256);
  Slot* slot = nullptr;
  size_t offset = capacity;  // full: the first piece takes a slot
  auto finish = [&] {
    KILN_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(slot->event), as_stream(stream)));
    slot->pending = true;
  };
  for (size_t i = 0; i < hosts.size(); ++i) {
    const size_t bytes = hosts[i].bytes();
    for (size_t done = 0; done < bytes;) {
      if (offset == capacity) {
        if (slot) finish();
        slot = &slots_[next_];
        next_ = (next_ + 1) % slots_.size();
        if (slot->pending) KILN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(slot->event)));
        slot->pending = false;
        if (!slot->buffer.defined() || slot->buffer.bytes() < capacity)
          slot->buffer = pinned_tensor(TensorType{DType::kU8, {static_cast<int64_t>(capacity)}});
        offset = 0;
      }
      const size_t piece = std::min(bytes - done, capacity - offset);
      std::byte* staged = slot->buffer.raw() + offset;
      const std::byte* from = hosts[i].raw() + done;
      // One thread copies ~10 GB/s, less than the link takes: large pieces are split over them.
      parallel_for(0, static_cast<int64_t>(piece), int64_t{1} << 20, [&](int64_t b, int64_t e) {
        std::memcpy(staged + b, from + b, static_cast<size_t>(e - b));
      });
      KILN_CUDA_CHECK(cudaMemcpyAsync(devices[i].raw() + done, staged, piece, cudaMemcpyHostToDevice, as_stream(stream)));
      done += piece;
      offset = std::min(capacity, (offset + piece + 255) / 256 * 256);
    }
  }
  if (slot) finish();
}

// ---- events ----

Event::Event(bool timing) {
  cudaEvent_t event = nullptr;
  KILN_CUDA_CHECK(cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
  event_ = event;
}

Event::~Event() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

void Event::record(void* stream) {
  KILN_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), as_stream(stream)));
}

void Event::synchronize() const { KILN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_))); }

void wait_event(void* stream, void* event) {
  KILN_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(event), 0));
}

float elapsed_ms(void* start, void* end) {
  KILN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(end)));
  float ms = 0;
  cudaError_t status = cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end));
  if (status != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it, or the next launch's check would report it
    fail("the time between two CUDA events: {} (both must be recorded, and made with timing)",
         cudaGetErrorString(status));
  }
  return ms;
}

// ---- CUDA graphs ----

CapturedGraph::~CapturedGraph() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}

void CapturedGraph::begin_capture(void* stream) {
  KILN_CUDA_CHECK(cudaStreamBeginCapture(as_stream(stream), cudaStreamCaptureModeRelaxed));
}

void CapturedGraph::end_capture(void* stream) {
  cudaGraph_t graph = nullptr;
  KILN_CUDA_CHECK(cudaStreamEndCapture(as_stream(stream), &graph));
  struct GraphGuard {
    cudaGraph_t g;
    ~GraphGuard() { cudaGraphDestroy(g); }
  } guard{graph};
  size_t nodes = 0;
  KILN_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  if (exec_) {
    // Same topology (a recapture after the inputs moved): patch the parameters in place.
    cudaGraphExecUpdateResultInfo info;
    if (cudaGraphExecUpdate(static_cast<cudaGraphExec_t>(exec_), graph, &info) == cudaSuccess) {
      nodes_ = nodes;
      return;
    }
    cudaGetLastError();
    cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    exec_ = nullptr;
  }
  cudaGraphExec_t exec = nullptr;
  KILN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  exec_ = exec;
  nodes_ = nodes;
}

void CapturedGraph::abandon_capture(void* stream) noexcept {
  cudaGraph_t graph = nullptr;
  if (cudaStreamEndCapture(as_stream(stream), &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
  cudaGetLastError();
}

void CapturedGraph::launch(void* stream) const {
  KILN_CHECK(exec_ != nullptr, "launch of a CUDA graph that was never captured");
  KILN_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), as_stream(stream)));
}

}  // namespace kiln::cuda

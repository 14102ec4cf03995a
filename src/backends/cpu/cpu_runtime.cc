// The CPU's device runtime (device/device_runtime.h). The device is the host: work runs when
// it is enqueued, so a stream is an empty handle and waits are no-ops, an asynchronous copy or
// fill is a memcpy or memset, an upload copies at once (no staging), an event records the
// host's clock, and nothing can be captured.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "device/device_runtime.h"
#include "support/error.h"

namespace kiln {
namespace {

constexpr size_t kAllocationAlignment = 256;  // as CUDA's allocations, so offsets mean the same

std::string describe(const Tensor& t) {
  return t.defined() ? fmt::format("a {} tensor of {}", device_name(t.device()), to_string(t.type()))
                     : std::string("no tensor");
}

void check_host(const Tensor& t, const char* what) {
  KILN_CHECK(t.defined() && t.device() == Device::kCpu, "{}: expected a cpu tensor, got {}", what, describe(t));
}

void check_copy(const Tensor& dst, const Tensor& src, const char* what) {
  check_host(dst, what);
  check_host(src, what);
  KILN_CHECK(dst.type() == src.type(), "{}: types differ: destination {}, source {}", what, to_string(dst.type()),
             to_string(src.type()));
}

class CpuStream final : public DeviceStream {
 public:
  CpuStream() : DeviceStream(nullptr) {}
  void synchronize() const override {}
  void wait(const DeviceEvent&) const override {}
};

class CpuEvent final : public DeviceEvent {
 public:
  explicit CpuEvent(bool timing) : DeviceEvent(nullptr), timing_(timing) {}
  void record(const DeviceStream&) override {
    time_ = std::chrono::steady_clock::now();
    recorded_ = true;
  }
  void synchronize() const override {}
  float elapsed_ms_since(const DeviceEvent& start) const override {
    const auto* from = dynamic_cast<const CpuEvent*>(&start);
    KILN_CHECK(from != nullptr, "elapsed_ms_since: the start event is not a cpu event");
    KILN_CHECK(timing_ && from->timing_, "elapsed_ms_since: events made without timing (create_event(true) times)");
    KILN_CHECK(recorded_ && from->recorded_, "elapsed_ms_since: an event that was never recorded");
    return std::chrono::duration<float, std::milli>(time_ - from->time_).count();
  }

 private:
  bool timing_;
  bool recorded_ = false;
  std::chrono::steady_clock::time_point time_;
};

class CpuUploader final : public DeviceUploader {
 public:
  void upload(std::span<const Tensor> hosts, std::span<const Tensor> devices, const DeviceStream&) override {
    KILN_CHECK(hosts.size() == devices.size(), "upload: {} host tensors for {} device tensors", hosts.size(),
               devices.size());
    for (size_t i = 0; i < hosts.size(); ++i) check_copy(devices[i], hosts[i], "upload");
    for (size_t i = 0; i < hosts.size(); ++i) std::memcpy(devices[i].raw(), hosts[i].raw(), hosts[i].bytes());
  }
};

// MemTotal and MemAvailable (what can be allocated without swapping: free memory plus
// reclaimable caches) from /proc/meminfo; the sysconf page counts where it is unreadable.
DeviceMemoryInfo host_memory() {
  DeviceMemoryInfo info;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  size_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib) {
    std::getline(meminfo, unit);
    if (key == "MemTotal:") info.total_bytes = kib * 1024;
    if (key == "MemAvailable:") info.free_bytes = kib * 1024;
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (info.total_bytes == 0) info.total_bytes = static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * page;
  if (info.free_bytes == 0) info.free_bytes = static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * page;
  return info;
}

class CpuRuntime final : public DeviceRuntime {
 public:
  Device device() const override { return Device::kCpu; }
  int index() const override { return 0; }
  std::string name() const override { return fmt::format("cpu ({} threads)", std::thread::hardware_concurrency()); }
  void make_current() const override {}

  DeviceMemoryInfo memory_info() const override { return host_memory(); }
  void check_fits(size_t bytes, const std::string& what) const override {
    const DeviceMemoryInfo info = memory_info();
    KILN_CHECK(bytes <= info.free_bytes, "{} needs {} ({} bytes) of host memory, {} free on {}", what,
               format_bytes(bytes), bytes, format_bytes(info.free_bytes), name());
  }
  std::shared_ptr<std::byte[]> allocate(size_t bytes, const std::string& what) const override {
    // More than the machine has can never succeed: refuse it before asking the allocator (which,
    // under AddressSanitizer, aborts on an absurd size instead of returning null).
    const size_t total = memory_info().total_bytes;
    KILN_CHECK(total == 0 || bytes <= total, "{} needs {} ({} bytes) of host memory, more than the {} of {}",
               what, format_bytes(bytes), bytes, format_bytes(total), name());
    const size_t rounded = (std::max<size_t>(bytes, 1) + kAllocationAlignment - 1) / kAllocationAlignment *
                           kAllocationAlignment;
    auto* p = static_cast<std::byte*>(std::aligned_alloc(kAllocationAlignment, rounded));
    KILN_CHECK(p != nullptr, "{} needs {} ({} bytes) of host memory: out of memory", what, format_bytes(rounded),
               rounded);
    std::memset(p, 0, rounded);  // commit the pages now, not inside the first run
    return std::shared_ptr<std::byte[]>(p, [](std::byte* q) { std::free(q); });
  }
  Tensor device_tensor(const TensorType& type, bool) const override { return Tensor(type); }
  Tensor pinned_tensor(const TensorType& type) const override { return Tensor(type); }
  size_t allocated_bytes() const override { return 0; }
  size_t peak_allocated_bytes() const override { return 0; }
  void reset_peak_allocated_bytes() const override {}

  Tensor to_device(const Tensor& host) const override {
    check_host(host, "to_device");
    return host.clone();
  }
  Tensor to_host(const Tensor& device) const override {
    check_host(device, "to_host");
    return device.clone();
  }
  void copy_async(const Tensor& dst, const Tensor& src, const DeviceStream&) const override {
    check_copy(dst, src, "copy");
    std::memcpy(dst.raw(), src.raw(), src.bytes());
  }
  void fill_async(const Tensor& dst, uint8_t byte, const DeviceStream&) const override {
    check_host(dst, "fill");
    std::memset(dst.raw(), byte, dst.bytes());
  }
  std::unique_ptr<DeviceUploader> create_uploader(int slots) const override {
    KILN_CHECK(slots >= 1, "an uploader needs at least one slot, got {}", slots);
    return std::make_unique<CpuUploader>();
  }

  std::unique_ptr<DeviceStream> create_stream() const override { return std::make_unique<CpuStream>(); }
  std::unique_ptr<DeviceEvent> create_event(bool timing) const override { return std::make_unique<CpuEvent>(timing); }
  bool can_capture() const override { return false; }
  std::unique_ptr<DeviceGraph> create_graph() const override {
    fail("the cpu runtime cannot capture work into a graph: it runs work as it is enqueued (see can_capture())");
  }
  void check_kernel_errors() const override {}

  std::unique_ptr<KernelTuning> tune_kernels() const override { return nullptr; }
  NodeMarker node_marker() const override { return nullptr; }
  bool can_trace() const override { return false; }
  std::unique_ptr<DeviceTrace> create_trace() const override {
    fail("device traces need the CUDA backend built with CUPTI; the cpu runtime has none (an executor's "
         "profile times the CPU's kernels)");
  }
};

}  // namespace

std::unique_ptr<DeviceRuntime> make_cpu_runtime() { return std::make_unique<CpuRuntime>(); }

}  // namespace kiln

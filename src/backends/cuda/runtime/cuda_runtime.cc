// The CUDA device runtime (device/device_runtime.h): a thin face over the CUDA layer that
// already exists — memory, copies, streams, events, pinned staging and CUDA graphs
// (memory.h), devices and GEMM tuning (device.h), kernels' data errors (device_errors.h) and
// CUPTI traces (kernel_trace.h). Nothing here talks to CUDA itself.
#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/device_errors.h"
#include "backends/cuda/runtime/kernel_trace.h"
#include "backends/cuda/runtime/memory.h"
#include "device/device_runtime.h"

namespace kiln {
namespace {

class CudaStream final : public DeviceStream {
 public:
  explicit CudaStream(bool background) : CudaStream(std::make_unique<cuda::Stream>(background)) {}
  void synchronize() const override { stream_->synchronize(); }
  void wait(const DeviceEvent& event) const override { cuda::wait_event(handle(), event.handle()); }

 private:
  explicit CudaStream(std::unique_ptr<cuda::Stream> stream) : DeviceStream(stream->handle()), stream_(std::move(stream)) {}
  std::unique_ptr<cuda::Stream> stream_;
};

class CudaEvent final : public DeviceEvent {
 public:
  explicit CudaEvent(bool timing) : CudaEvent(std::make_unique<cuda::Event>(timing)) {}
  void record(const DeviceStream& stream) override { event_->record(stream.handle()); }
  void synchronize() const override { event_->synchronize(); }
  float elapsed_ms_since(const DeviceEvent& start) const override { return cuda::elapsed_ms(start.handle(), handle()); }

 private:
  explicit CudaEvent(std::unique_ptr<cuda::Event> event) : DeviceEvent(event->handle()), event_(std::move(event)) {}
  std::unique_ptr<cuda::Event> event_;
};

class CudaGraph final : public DeviceGraph {
 public:
  void begin_capture(const DeviceStream& stream) override { graph_.begin_capture(stream.handle()); }
  void end_capture(const DeviceStream& stream) override { graph_.end_capture(stream.handle()); }
  void abandon_capture(const DeviceStream& stream) noexcept override { graph_.abandon_capture(stream.handle()); }
  void launch(const DeviceStream& stream) const override { graph_.launch(stream.handle()); }
  bool ready() const override { return graph_.ready(); }
  size_t node_count() const override { return graph_.node_count(); }

 private:
  cuda::CapturedGraph graph_;
};

class CudaUploader final : public DeviceUploader {
 public:
  explicit CudaUploader(int slots) : staging_(slots) {}
  void upload(std::span<const Tensor> hosts, std::span<const Tensor> devices, const DeviceStream& stream) override {
    staging_.upload(hosts, devices, stream.handle());
  }

 private:
  cuda::UploadStaging staging_;
};

class CudaTuning final : public KernelTuning {
  cuda::GemmTuningScope scope_;
};

class CudaTrace final : public DeviceTrace {
 public:
  void start() override { trace_.start(); }
  std::vector<TraceEvent> stop() override { return trace_.stop(); }

 private:
  cuda::KernelTrace trace_;
};

class CudaRuntime final : public DeviceRuntime {
 public:
  explicit CudaRuntime(int ordinal) : ordinal_(ordinal) {}

  Device device() const override { return Device::kCuda; }
  int index() const override { return ordinal_; }
  std::string name() const override { return cuda::describe_device(ordinal_); }
  void make_current() const override { cuda::set_current_device(ordinal_); }

  DeviceMemoryInfo memory_info() const override {
    const cuda::MemoryInfo info = cuda::memory_info();
    return {info.free_bytes, info.total_bytes};
  }
  void check_fits(size_t bytes, const std::string& what) const override { cuda::check_fits(bytes, what); }
  std::shared_ptr<std::byte[]> allocate(size_t bytes, const std::string& what) const override {
    return cuda::allocate(bytes, what);
  }
  Tensor device_tensor(const TensorType& type, bool zero) const override { return cuda::device_tensor(type, zero); }
  Tensor pinned_tensor(const TensorType& type) const override { return cuda::pinned_tensor(type); }
  size_t allocated_bytes() const override { return cuda::allocated_bytes(); }
  size_t peak_allocated_bytes() const override { return cuda::peak_allocated_bytes(); }
  void reset_peak_allocated_bytes() const override { cuda::reset_peak_allocated_bytes(); }

  Tensor to_device(const Tensor& host) const override { return cuda::to_device(host); }
  Tensor to_host(const Tensor& device) const override { return cuda::to_host(device); }
  void copy_async(const Tensor& dst, const Tensor& src, const DeviceStream& stream) const override {
    cuda::copy_async(dst, src, stream.handle());
  }
  void fill_async(const Tensor& dst, uint8_t byte, const DeviceStream& stream) const override {
    cuda::fill_bytes_async(dst, byte, stream.handle());
  }
  std::unique_ptr<DeviceUploader> create_uploader(int slots) const override {
    return std::make_unique<CudaUploader>(slots);
  }

  std::unique_ptr<DeviceStream> create_stream() const override { return std::make_unique<CudaStream>(false); }
  std::unique_ptr<DeviceStream> create_background_stream() const override { return std::make_unique<CudaStream>(true); }
  std::unique_ptr<DeviceEvent> create_event(bool timing) const override { return std::make_unique<CudaEvent>(timing); }
  bool can_capture() const override { return true; }
  std::unique_ptr<DeviceGraph> create_graph() const override { return std::make_unique<CudaGraph>(); }
  void check_kernel_errors() const override { cuda::check_device_errors(); }

  std::unique_ptr<KernelTuning> tune_kernels() const override { return std::make_unique<CudaTuning>(); }
  NodeMarker node_marker() const override { return &cuda::set_trace_node; }
  bool can_trace() const override { return cuda::kernel_trace_available(); }
  std::unique_ptr<DeviceTrace> create_trace() const override { return std::make_unique<CudaTrace>(); }

 private:
  int ordinal_;
};

}  // namespace

std::unique_ptr<DeviceRuntime> make_cuda_runtime(int index) { return std::make_unique<CudaRuntime>(index); }

}  // namespace kiln

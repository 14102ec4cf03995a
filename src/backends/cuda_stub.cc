// The CUDA backend's host API in a build without it (-DKILN_CUDA=OFF or no nvcc): device
// queries report "no CUDA", everything else throws kiln::Error saying this build has none.
#ifndef KILN_HAVE_CUDA
#include "backends/backend.h"
#include "device/device_runtime.h"
#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/device_errors.h"
#include "backends/cuda/runtime/kernel_trace.h"
#include "backends/cuda/runtime/memory.h"
#include "backends/cuda/nvrtc/nvrtc.h"
#include "support/error.h"

namespace kiln::cuda {
namespace {
[[noreturn]] void no_cuda() { fail("this build has no CUDA backend (configure with -DKILN_CUDA=ON)"); }
}  // namespace

bool built_with_cuda() { return false; }
int device_count() { return 0; }
std::string describe_device(int) { return "this build has no CUDA backend"; }
int compute_capability(int) { return 0; }
// No CUDA kernel ever ran, so none recorded a data error.
void check_device_errors() {}
double smoke_test_saxpy(int) { no_cuda(); }
int current_device() { no_cuda(); }
void set_current_device(int) { no_cuda(); }
GemmTuningScope::GemmTuningScope() = default;
GemmTuningScope::~GemmTuningScope() = default;

MemoryInfo memory_info() { no_cuda(); }
void check_fits(size_t, const std::string&) { no_cuda(); }
std::shared_ptr<std::byte[]> allocate(size_t, const std::string&) { no_cuda(); }
size_t allocated_bytes() { return 0; }
size_t peak_allocated_bytes() { return 0; }
void reset_peak_allocated_bytes() {}
Tensor device_tensor(const TensorType&, bool) { no_cuda(); }
std::shared_ptr<std::byte[]> allocate_pinned(size_t) { no_cuda(); }
Tensor pinned_tensor(const TensorType&) { no_cuda(); }
Tensor to_device(const Tensor&) { no_cuda(); }
Tensor to_host(const Tensor&) { no_cuda(); }
void copy_async(const Tensor&, const Tensor&, void*) { no_cuda(); }
void fill_bytes_async(const Tensor&, uint8_t, void*) { no_cuda(); }

Stream::Stream(bool) { no_cuda(); }
Stream::~Stream() = default;
void Stream::synchronize() const { no_cuda(); }
void synchronize(void*) { no_cuda(); }

UploadStaging::UploadStaging(int) { no_cuda(); }
UploadStaging::~UploadStaging() = default;
void UploadStaging::upload(std::span<const Tensor>, std::span<const Tensor>, void*) { no_cuda(); }

Event::Event(bool) { no_cuda(); }
Event::~Event() = default;
void Event::record(void*) { no_cuda(); }
void Event::synchronize() const { no_cuda(); }
void wait_event(void*, void*) { no_cuda(); }
float elapsed_ms(void*, void*) { no_cuda(); }

bool kernel_trace_available() { return false; }
struct KernelTrace::State {};
KernelTrace::KernelTrace() { no_cuda(); }
KernelTrace::~KernelTrace() = default;
void KernelTrace::start() { no_cuda(); }
std::vector<TraceEvent> KernelTrace::stop() { no_cuda(); }
void set_trace_node(int64_t) {}

std::string fused_kernel_listing(const Graph&, FusedKind) { no_cuda(); }

CapturedGraph::~CapturedGraph() = default;
void CapturedGraph::begin_capture(void*) { no_cuda(); }
void CapturedGraph::end_capture(void*) { no_cuda(); }
void CapturedGraph::abandon_capture(void*) noexcept {}
void CapturedGraph::launch(void*) const { no_cuda(); }
}  // namespace kiln::cuda

namespace kiln {
void register_cuda_kernels(KernelRegistry&) {}
std::unique_ptr<DeviceRuntime> make_cuda_runtime(int) { cuda::no_cuda(); }
}  // namespace kiln
#endif

// The CUDA runtime (backends/cuda/runtime/cuda_runtime.cc) held to the DeviceRuntime contract
// (tests/backends/device_runtime_contract.h, which the CPU runtime meets too), and what is
// CUDA's own: allocations counted, host tensors refused where device memory is expected, kernel
// tuning and trace hooks present, the device made current on another thread.
#include <thread>

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/kernel_trace.h"
#include "backends/device_runtime_contract.h"
#include "gpu_test_util.h"

namespace kiln {
namespace {

std::unique_ptr<DeviceRuntime> gpu() { return device_runtime(Device::kCuda); }

TEST(CudaRuntime, RoundTrips) {
  KILN_REQUIRE_GPU();
  testing::runtime_round_trips(*gpu());
}

TEST(CudaRuntime, CopiesOnAStream) {
  KILN_REQUIRE_GPU();
  testing::runtime_copies_on_a_stream(*gpu());
}

TEST(CudaRuntime, Fills) {
  KILN_REQUIRE_GPU();
  testing::runtime_fills(*gpu());
}

TEST(CudaRuntime, Uploads) {
  KILN_REQUIRE_GPU();
  testing::runtime_uploads(*gpu());
}

TEST(CudaRuntime, Events) {
  KILN_REQUIRE_GPU();
  testing::runtime_events(*gpu());
}

TEST(CudaRuntime, CapturesAndReplays) {
  KILN_REQUIRE_GPU();
  std::unique_ptr<DeviceRuntime> runtime = gpu();
  EXPECT_TRUE(runtime->can_capture());
  testing::runtime_captures_or_says_it_cannot(*runtime);
}

TEST(CudaRuntime, Memory) {
  KILN_REQUIRE_GPU();
  testing::runtime_memory(*gpu());
}

TEST(CudaRuntime, CountsAllocationsAndRefusesHostTensors) {
  KILN_REQUIRE_GPU();
  std::unique_ptr<DeviceRuntime> runtime = gpu();
  EXPECT_EQ(runtime->device(), Device::kCuda);
  EXPECT_EQ(runtime->name(), cuda::describe_device(cuda::current_device()));
  const size_t before = runtime->allocated_bytes();
  {
    std::shared_ptr<std::byte[]> bytes = runtime->allocate(3 << 20, "a test buffer");
    EXPECT_EQ(runtime->allocated_bytes(), before + (3u << 20));
    EXPECT_GE(runtime->peak_allocated_bytes(), before + (3u << 20));
  }
  EXPECT_EQ(runtime->allocated_bytes(), before);
  runtime->reset_peak_allocated_bytes();
  EXPECT_EQ(runtime->peak_allocated_bytes(), before);
  std::unique_ptr<DeviceStream> stream = runtime->create_stream();
  EXPECT_NE(stream->handle(), nullptr);  // a cudaStream_t of its own, never the legacy stream
  Tensor host = random_tensor({DType::kF32, {8}}, 3);
  EXPECT_THROW(runtime->to_host(host), Error);
  EXPECT_THROW(runtime->to_device(runtime->to_device(host)), Error);
  EXPECT_THROW(runtime->fill_async(host, 0, *stream), Error);
}

TEST(CudaRuntime, KernelsCanTuneAndTracesCanNameNodes) {
  KILN_REQUIRE_GPU();
  std::unique_ptr<DeviceRuntime> runtime = gpu();
  EXPECT_NE(runtime->tune_kernels(), nullptr);
  EXPECT_EQ(runtime->node_marker(), &cuda::set_trace_node);
  EXPECT_EQ(runtime->can_trace(), cuda::kernel_trace_available());
  if (!runtime->can_trace()) {
    EXPECT_THROW(runtime->create_trace(), Error);
  }
}

TEST(CudaRuntime, MakesItsDeviceCurrentOnAnotherThread) {
  KILN_REQUIRE_GPU();
  std::unique_ptr<DeviceRuntime> runtime = gpu();
  const int device = cuda::current_device();
  const Tensor host = random_tensor({DType::kBF16, {1000}}, 5);
  int seen = -1;
  Tensor back;
  std::thread other([&] {
    runtime->make_current();
    seen = cuda::current_device();
    back = runtime->to_host(runtime->to_device(host));
  });
  other.join();
  EXPECT_EQ(seen, device);
  EXPECT_TRUE(testing::same_bytes(back, host));
}

// A runtime made for a GPU by index is that GPU (the last one: on one GPU the current one, on
// several another), and makes it current where asked, leaving the maker's device alone.
TEST(CudaRuntime, IsTheDeviceOfItsIndex) {
  KILN_REQUIRE_GPU();
  EXPECT_EQ(gpu()->index(), cuda::current_device());
  const int before = cuda::current_device();
  const int last = cuda::device_count() - 1;
  std::unique_ptr<DeviceRuntime> runtime = device_runtime(Device::kCuda, last);
  EXPECT_EQ(runtime->index(), last);
  EXPECT_EQ(runtime->name(), cuda::describe_device(last));
  EXPECT_EQ(cuda::current_device(), before);
  int seen = -1;
  std::thread other([&] {
    runtime->make_current();
    seen = cuda::current_device();
  });
  other.join();
  EXPECT_EQ(seen, last);
}

}  // namespace
}  // namespace kiln

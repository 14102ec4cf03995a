// The CPU runtime (backends/cpu/cpu_runtime.cc) held to the DeviceRuntime contract
// (device_runtime_contract.h, which the CUDA runtime meets in tests/cuda/device_runtime_test.cc),
// what is the CPU's own (work done when enqueued, nothing captured, tuned or traced), and the
// factory's answers for each device.
#include <cmath>

#include "backends/device_runtime_contract.h"

namespace kiln {
namespace {

std::unique_ptr<DeviceRuntime> cpu() { return device_runtime(Device::kCpu); }

TEST(CpuRuntime, RoundTrips) { testing::runtime_round_trips(*cpu()); }
TEST(CpuRuntime, CopiesOnAStream) { testing::runtime_copies_on_a_stream(*cpu()); }
TEST(CpuRuntime, Fills) { testing::runtime_fills(*cpu()); }
TEST(CpuRuntime, Uploads) { testing::runtime_uploads(*cpu()); }
TEST(CpuRuntime, Events) { testing::runtime_events(*cpu()); }
TEST(CpuRuntime, SaysItCannotCapture) { testing::runtime_captures_or_says_it_cannot(*cpu()); }
TEST(CpuRuntime, Memory) { testing::runtime_memory(*cpu()); }

TEST(CpuRuntime, RunsWorkWhenEnqueued) {
  std::unique_ptr<DeviceRuntime> runtime = cpu();
  EXPECT_EQ(runtime->device(), Device::kCpu);
  std::unique_ptr<DeviceStream> stream = runtime->create_stream();
  EXPECT_EQ(stream->handle(), nullptr);  // what CPU kernels get as KernelArgs::stream
  const Tensor host = random_tensor({DType::kF32, {333}}, 7);
  Tensor device = runtime->device_tensor(host.type());
  runtime->copy_async(device, host, *stream);  // no synchronize: done already
  EXPECT_TRUE(testing::same_bytes(device, host));
  runtime->fill_async(device, 0xFF, *stream);
  for (int64_t i = 0; i < device.numel(); ++i) ASSERT_TRUE(std::isnan(device.get(i))) << i;
}

TEST(CpuRuntime, TunesNothingAndTracesNothing) {
  std::unique_ptr<DeviceRuntime> runtime = cpu();
  EXPECT_EQ(runtime->tune_kernels(), nullptr);
  EXPECT_EQ(runtime->node_marker(), nullptr);
  EXPECT_FALSE(runtime->can_trace());
  EXPECT_THROW(runtime->create_trace(), Error);
  runtime->make_current();  // nothing to make current
  std::shared_ptr<std::byte[]> bytes = runtime->allocate(1 << 20);
  EXPECT_EQ(runtime->allocated_bytes(), 0u);  // the CPU does not count
  // Device tensors of the CPU are host tensors.
  Tensor cuda_labelled(TensorType{DType::kF32, {4}}, runtime->allocate(16), 0, Device::kCuda);
  try {
    runtime->to_host(cuda_labelled);
    FAIL() << "the cpu runtime must refuse a cuda tensor";
  } catch (const Error& e) {
    testing::expect_contains_text(e.what(), "expected a cpu tensor, got a cuda tensor of f32[4]");
  }
}

TEST(DeviceRuntimeFactory, SaysWhatEachDeviceHas) {
  const DeviceAvailability host = device_availability(Device::kCpu);
  EXPECT_TRUE(host.built);
  EXPECT_EQ(host.count, 1);
  EXPECT_EQ(host.description, cpu()->name());
  const DeviceAvailability gpu = device_availability(Device::kCuda);
  if (gpu.built && gpu.count > 0) {
    EXPECT_EQ(device_runtime(Device::kCuda)->device(), Device::kCuda);
    return;
  }
  try {
    device_runtime(Device::kCuda);
    FAIL() << "device_runtime(kCuda) without a GPU must throw";
  } catch (const Error& e) {
    testing::expect_contains_text(e.what(), gpu.built ? "no CUDA device on this machine" : "this build has no CUDA backend");
  }
}

TEST(DeviceRuntimeFactory, GivesTheDeviceOfAnIndex) {
  EXPECT_EQ(cpu()->index(), 0);
  EXPECT_EQ(device_runtime(Device::kCpu, 0)->index(), 0);
  try {
    device_runtime(Device::kCpu, 1);
    FAIL() << "the cpu has no device 1";
  } catch (const Error& e) {
    testing::expect_contains_text(e.what(), "cpu device 1: the cpu is device 0, the only one");
  }
  const DeviceAvailability gpu = device_availability(Device::kCuda);
  if (gpu.built && gpu.count > 0) {
    EXPECT_EQ(device_runtime(Device::kCuda, gpu.count - 1)->index(), gpu.count - 1);
    try {
      device_runtime(Device::kCuda, gpu.count);
      FAIL() << "CUDA device " << gpu.count << " of " << gpu.count;
    } catch (const Error& e) {
      testing::expect_contains_text(e.what(), fmt::format("CUDA device {}: this machine has {} GPU", gpu.count, gpu.count));
    }
    return;
  }
  try {
    device_runtime(Device::kCuda, 0);
    FAIL() << "device_runtime(kCuda, 0) without a GPU must throw";
  } catch (const Error& e) {
    testing::expect_contains_text(e.what(), gpu.built ? "no CUDA device on this machine" : "this build has no CUDA backend");
  }
}

}  // namespace
}  // namespace kiln

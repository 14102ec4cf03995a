// The DeviceRuntime contract (device/device_runtime.h) as test bodies that take a runtime, so
// the CPU runtime (tests/backends/device_runtime_test.cc) and the CUDA runtime
// (tests/cuda/device_runtime_test.cc) are held to the same semantics: round trips, copies on a
// stream (host to device, device to device, device to pinned host, into offset views), fills,
// staged uploads, events (timing, cross-stream joins), capture and replay, memory checks and the
// clear errors. Every payload is random (never zeros), of several dtypes.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "device/device_runtime.h"
#include "test_util.h"

namespace kiln::testing {

inline bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.type() == b.type() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

inline void expect_contains_text(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

// Random host tensors of a few dtypes and shapes (an odd byte count among them).
inline std::vector<Tensor> random_payloads(uint64_t seed) {
  return {random_tensor({DType::kF32, {37, 19}}, seed), random_tensor({DType::kBF16, {3, 1001}}, seed + 1),
          random_tensor({DType::kI64, {129}}, seed + 2, -1000, 1000), random_tensor({DType::kU8, {77}}, seed + 3, 0, 255)};
}

inline void runtime_round_trips(const DeviceRuntime& runtime) {
  for (Tensor& host : random_payloads(11)) {
    Tensor device = runtime.to_device(host);
    EXPECT_EQ(device.device(), runtime.device());
    EXPECT_EQ(device.type(), host.type());
    const Tensor original = host.clone();
    std::memset(host.raw(), 0x5A, host.bytes());  // a new tensor: the host's later changes do not reach it
    Tensor back = runtime.to_host(device);
    EXPECT_EQ(back.device(), Device::kCpu);
    EXPECT_TRUE(same_bytes(back, original)) << to_string(host.type());
  }
  // Zero-filled device tensors read back as zeros.
  Tensor zeros = runtime.to_host(runtime.device_tensor({DType::kF32, {1000}}));
  for (int64_t i = 0; i < zeros.numel(); ++i) ASSERT_EQ(zeros.get(i), 0.0) << i;
}

inline void runtime_copies_on_a_stream(const DeviceRuntime& runtime) {
  std::unique_ptr<DeviceStream> stream = runtime.create_stream();
  for (const Tensor& host : random_payloads(21)) {
    Tensor a = runtime.device_tensor(host.type(), /*zero=*/false);
    Tensor b = runtime.device_tensor(host.type(), /*zero=*/false);
    Tensor pinned = runtime.pinned_tensor(host.type());
    EXPECT_EQ(pinned.device(), Device::kCpu);
    runtime.copy_async(a, host, *stream);    // host -> device
    runtime.copy_async(b, a, *stream);       // device -> device
    runtime.copy_async(pinned, b, *stream);  // device -> pinned host
    stream->synchronize();
    EXPECT_TRUE(same_bytes(pinned, host)) << to_string(host.type());
  }
  // Into the middle of a buffer: an offset view gets the bytes, its neighbours keep theirs.
  const Tensor whole = random_tensor({DType::kF32, {4, 64}}, 31), row = random_tensor({DType::kF32, {64}}, 32);
  Tensor device = runtime.to_device(whole);
  runtime.copy_async(device.viewed(row.type(), 2 * 64 * sizeof(float)), row, *stream);
  stream->synchronize();
  Tensor back = runtime.to_host(device);
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t c = 0; c < 64; ++c)
      ASSERT_EQ(back.get(r * 64 + c), r == 2 ? row.get(c) : whole.get(r * 64 + c)) << r << " " << c;
  // A copy between different types names both.
  try {
    runtime.copy_async(device, row, *stream);
    FAIL() << "a copy between different types must throw";
  } catch (const Error& e) {
    expect_contains_text(e.what(), "f32[4,64]");
    expect_contains_text(e.what(), "f32[64]");
  }
}

inline void runtime_fills(const DeviceRuntime& runtime) {
  std::unique_ptr<DeviceStream> stream = runtime.create_stream();
  const Tensor host = random_tensor({DType::kU8, {3, 100}}, 41, 0, 255);
  Tensor device = runtime.to_device(host);
  const uint8_t byte = 0xA7;
  runtime.fill_async(device.viewed({DType::kU8, {100}}, 100), byte, *stream);  // the middle row only
  stream->synchronize();
  Tensor back = runtime.to_host(device);
  const uint8_t* got = back.data<uint8_t>();
  const uint8_t* was = host.data<uint8_t>();
  for (int64_t i = 0; i < 300; ++i) ASSERT_EQ(got[i], i >= 100 && i < 200 ? byte : was[i]) << i;
}

inline void runtime_uploads(const DeviceRuntime& runtime) {
  std::unique_ptr<DeviceStream> stream = runtime.create_stream();
  std::unique_ptr<DeviceUploader> uploader = runtime.create_uploader(2);
  const std::vector<Tensor> shapes = random_payloads(0);
  std::vector<Tensor> devices;
  for (const Tensor& t : shapes) devices.push_back(runtime.device_tensor(t.type(), /*zero=*/false));
  for (uint64_t k = 0; k < 5; ++k) {  // more uploads than slots: the slots are reused in turn
    std::vector<Tensor> hosts = random_payloads(100 + 10 * k);
    uploader->upload(hosts, devices, *stream);
    for (Tensor& h : hosts) std::memset(h.raw(), 0, h.bytes());  // the host may change them at once
    stream->synchronize();
    const std::vector<Tensor> want = random_payloads(100 + 10 * k);
    for (size_t i = 0; i < devices.size(); ++i)
      EXPECT_TRUE(same_bytes(runtime.to_host(devices[i]), want[i])) << "upload " << k << " tensor " << i;
  }
  // An upload larger than a slot (a model's params) goes through the slots in pieces: here two
  // pieces of one tensor, then a tensor that starts in one slot and ends in the next.
  std::vector<Tensor> large = {Tensor({DType::kU8, {(int64_t{70} << 20) + 13}}), random_tensor({DType::kF32, {1000}}, 61),
                               Tensor({DType::kU8, {(int64_t{64} << 20) - 5}})};
  uint32_t state = 2463534242u;  // xorshift32: every byte differs from a copy shifted by any piece
  for (const Tensor* t : {&large[0], &large[2]})
    for (int64_t i = 0; i < t->numel(); ++i) {
      state ^= state << 13, state ^= state >> 17, state ^= state << 5;
      t->data<uint8_t>()[i] = static_cast<uint8_t>(state);
    }
  std::vector<Tensor> large_devices;
  for (const Tensor& t : large) large_devices.push_back(runtime.device_tensor(t.type(), /*zero=*/false));
  uploader->upload(large, large_devices, *stream);
  stream->synchronize();
  for (size_t i = 0; i < large.size(); ++i)
    EXPECT_TRUE(same_bytes(runtime.to_host(large_devices[i]), large[i])) << "large upload, tensor " << i;
  // A mismatched pair names the tensor.
  std::vector<Tensor> wrong = {random_tensor({DType::kF32, {3}}, 1)};
  EXPECT_THROW(uploader->upload(wrong, std::span<const Tensor>(devices.data(), 1), *stream), Error);
}

inline void runtime_events(const DeviceRuntime& runtime) {
  std::unique_ptr<DeviceStream> first = runtime.create_stream(), second = runtime.create_stream();
  std::unique_ptr<DeviceEvent> start = runtime.create_event(true), end = runtime.create_event(true);
  std::unique_ptr<DeviceEvent> ready = runtime.create_event();
  // Timing: the milliseconds between two events around some work are >= 0, and 0 from one to
  // itself.
  const Tensor host = random_tensor({DType::kF32, {1 << 20}}, 51);
  Tensor a = runtime.device_tensor(host.type(), false), b = runtime.device_tensor(host.type(), false);
  start->record(*first);
  runtime.copy_async(a, host, *first);
  end->record(*first);
  end->synchronize();
  EXPECT_GE(end->elapsed_ms_since(*start), 0.0f);
  EXPECT_EQ(end->elapsed_ms_since(*end), 0.0f);
  // A join: `second` copies a -> b only after `first` wrote a.
  const Tensor fresh = random_tensor(host.type(), 52);
  runtime.copy_async(a, fresh, *first);
  ready->record(*first);
  second->wait(*ready);
  runtime.copy_async(b, a, *second);
  second->synchronize();
  EXPECT_TRUE(same_bytes(runtime.to_host(b), fresh));
  // Without timing, or never recorded: elapsed time is an error, not a number.
  EXPECT_THROW(ready->elapsed_ms_since(*start), Error);
  std::unique_ptr<DeviceEvent> never = runtime.create_event(true);
  EXPECT_THROW(end->elapsed_ms_since(*never), Error);
}

inline void runtime_captures_or_says_it_cannot(const DeviceRuntime& runtime) {
  if (!runtime.can_capture()) {
    try {
      runtime.create_graph();
      FAIL() << "create_graph must throw where can_capture() is false";
    } catch (const Error& e) {
      expect_contains_text(e.what(), "cannot capture");
    }
    return;
  }
  std::unique_ptr<DeviceStream> stream = runtime.create_stream();
  std::unique_ptr<DeviceGraph> graph = runtime.create_graph();
  EXPECT_FALSE(graph->ready());
  const Tensor x0 = random_tensor({DType::kF32, {4096}}, 61), y0 = random_tensor({DType::kF32, {4096}}, 62);
  Tensor x = runtime.to_device(x0), y = runtime.to_device(y0), z = runtime.to_device(y0);
  graph->begin_capture(*stream);
  runtime.copy_async(y, x, *stream);
  runtime.fill_async(z, 0x3C, *stream);
  graph->end_capture(*stream);
  stream->synchronize();
  EXPECT_TRUE(graph->ready());
  EXPECT_GE(graph->node_count(), 2u);
  EXPECT_TRUE(same_bytes(runtime.to_host(y), y0)) << "captured work must not run before launch";
  graph->launch(*stream);
  stream->synchronize();
  EXPECT_TRUE(same_bytes(runtime.to_host(y), x0));
  Tensor z_host = runtime.to_host(z);
  for (size_t i = 0; i < z_host.bytes(); ++i) ASSERT_EQ(static_cast<uint8_t>(z_host.raw()[i]), 0x3C) << i;
  // A replay reads the memory as it is then.
  const Tensor x1 = random_tensor(x0.type(), 63);
  runtime.copy_async(x, x1, *stream);
  graph->launch(*stream);
  stream->synchronize();
  EXPECT_TRUE(same_bytes(runtime.to_host(y), x1));
}

inline void runtime_memory(const DeviceRuntime& runtime) {
  const DeviceMemoryInfo info = runtime.memory_info();
  EXPECT_GT(info.total_bytes, 0u);
  EXPECT_GT(info.free_bytes, 0u);
  EXPECT_LE(info.free_bytes, info.total_bytes);
  EXPECT_FALSE(runtime.name().empty());
  runtime.check_fits(1 << 20, "a small test buffer");
  try {
    runtime.check_fits(size_t{1} << 60, "a 1 EiB test buffer");
    FAIL() << "check_fits of 1 EiB must throw";
  } catch (const Error& e) {
    expect_contains_text(e.what(), "a 1 EiB test buffer needs 1073741824.00 GiB");
    expect_contains_text(e.what(), "free on " + runtime.name());
  }
  std::shared_ptr<std::byte[]> bytes = runtime.allocate(1000, "a test buffer");
  ASSERT_NE(bytes, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(bytes.get()) % 256, 0u);
  EXPECT_THROW(runtime.allocate(size_t{1} << 60, "a 1 EiB test buffer"), Error);
  runtime.check_kernel_errors();  // nothing ran that could record one
}

}  // namespace kiln::testing

// Shared by the GPU benchmarks (bench/gpu_*.cc, built only with the CUDA backend): a CUDA-event
// timer, device buffers of random values, and a kernel chosen from the registry for an op. They
// print numbers; nothing here asserts.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/memory.h"
#include "ir/op_def.h"
#include "runtime/profile.h"
#include "tensor/tensor.h"

namespace kiln::bench {

// Milliseconds per call of fn (enqueued on `stream`): the median of 3 batches of `reps` calls,
// after 3 warm-up calls.
template <typename Fn>
double time_ms(cudaStream_t stream, int reps, Fn&& fn) {
  for (int i = 0; i < 3; ++i) fn();
  cudaEvent_t start, stop;
  KILN_CUDA_CHECK(cudaEventCreate(&start));
  KILN_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int batch = 0; batch < 3; ++batch) {
    KILN_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < reps; ++i) fn();
    KILN_CUDA_CHECK(cudaEventRecord(stop, stream));
    KILN_CUDA_CHECK(cudaEventSynchronize(stop));
    float elapsed = 0.0f;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
    ms.push_back(elapsed / reps);
  }
  KILN_CUDA_CHECK(cudaEventDestroy(start));
  KILN_CUDA_CHECK(cudaEventDestroy(stop));
  return median_of(ms);
}

// A device tensor of `type` filled with a random 1M-element block of values in [low, high),
// repeated (a kernel's speed does not depend on the values).
inline Tensor random_device(const TensorType& type, uint64_t seed, double low = -1.0,
                            double high = 1.0) {
  const Tensor block = random_tensor(
      TensorType{type.dtype, {std::min<int64_t>(std::max<int64_t>(type.numel(), 1), 1 << 20)}},
      seed, low, high);
  Tensor device = cuda::device_tensor(type, /*zero=*/false);
  for (size_t off = 0; off < type.bytes(); off += block.bytes())
    KILN_CUDA_CHECK(cudaMemcpy(device.raw() + off, block.raw(),
                               std::min(block.bytes(), type.bytes() - off),
                               cudaMemcpyHostToDevice));
  return device;
}

// The CUDA kernel the registry picks for `op` on inputs of these types among `dialects` (all
// when empty), with the node it was chosen for (kept alive: a NodeView refers to it).
struct ChosenKernel {
  std::unique_ptr<Node> node;
  std::vector<TensorType> inputs, outputs;
  const KernelImpl* impl = nullptr;
  // Runs the kernel on `stream` (after its prepare hook once).
  void operator()(std::span<const Tensor> in, std::span<Tensor> out, cudaStream_t stream) const {
    impl->kernel(KernelArgs{node->attrs, in, out, stream, node->body.get()});
  }
};
inline ChosenKernel choose_kernel(Op op, std::vector<TensorType> inputs, Attributes attrs,
                                  const std::vector<std::string>& dialects = {},
                                  std::shared_ptr<const Graph> body = nullptr) {
  ChosenKernel k;
  attrs = normalize_attributes(op, std::move(attrs));
  k.outputs = infer_types(op, inputs, attrs, body.get());
  k.inputs = std::move(inputs);
  k.node = std::make_unique<Node>(Node{op, {}, {}, std::move(attrs), std::move(body)});
  const NodeView view{*k.node, k.inputs, k.outputs};
  k.impl = &kernel_registry().select(view, Device::kCuda, dialects);
  if (k.impl->prepare) k.impl->prepare(view);
  return k;
}

// A GPU benchmark's main: runs the sections named on the command line (all when none), after
// printing the device; a message and a non-zero status for an unknown section, no device, or a
// kiln::Error.
inline int run_sections(
    const char* program, int argc, char** argv,
    const std::vector<std::pair<std::string, std::function<void()>>>& sections) {
  std::set<std::string> chosen(argv + 1, argv + argc);
  std::string names;
  for (const auto& [name, fn] : sections) names += (names.empty() ? "" : ", ") + name;
  for (const std::string& name : chosen)
    if (std::none_of(sections.begin(), sections.end(),
                     [&](const auto& s) { return s.first == name; })) {
      fmt::print(stderr, "{}: unknown section {} (sections: {})\n", program, name, names);
      return 2;
    }
  try {
    if (cuda::device_count() == 0) {
      fmt::print(stderr, "{}: no CUDA device\n", program);
      return 1;
    }
    fmt::print("device: {}\n", cuda::describe_device(0));
    for (const auto& [name, fn] : sections)
      if (chosen.empty() || chosen.count(name)) {
        fmt::print("== {}\n", name);
        fn();
      }
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: {}\n", program, e.what());
    return 1;
  }
  return 0;
}

}  // namespace kiln::bench

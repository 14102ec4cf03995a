// Shared by the attention dialects' GPU tests (attention_test.cc: cuda-attention,
// cudnn_attention_test.cc: cudnn): run one dialect's kernel on device copies of host inputs
// with NaN-poisoned outputs, and the error measure both use.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "backends/cuda/runtime/memory.h"
#include "gpu_test_util.h"

namespace kiln::testing {

inline const KernelImpl& dialect_impl(const std::string& dialect, Op op) {
  for (const KernelImpl* impl : kernel_registry().candidates(op, Device::kCuda))
    if (impl->dialect == dialect) return *impl;
  fail("no {} kernel for {}", dialect, op_info(op).name);
}

// All bytes 0xFF: NaN in f32, f16 and bf16, so an element the kernel never writes shows.
inline Tensor poisoned_device(const TensorType& type) {
  Tensor t = cuda::device_tensor(type, false);
  KILN_CUDA_CHECK(cudaMemset(t.raw(), 0xFF, type.bytes()));
  KILN_CUDA_CHECK(cudaDeviceSynchronize());  // the legacy stream does not order our streams
  return t;
}

// Runs `dialect`'s kernel for `op` (prepared first where it has a prepare hook, as the
// executor does at construction) on device copies of `inputs`; returns host outputs. Fails the
// test if the dialect does not claim the node.
inline std::vector<Tensor> run_attention_dialect(const std::string& dialect, Op op,
                                                 const std::vector<Tensor>& inputs,
                                                 Attributes attrs) {
  attrs = normalize_attributes(op, attrs);
  std::vector<TensorType> in_types;
  for (const Tensor& t : inputs) in_types.push_back(t.type());
  const std::vector<TensorType> out_types = infer_types(op, in_types, attrs);
  Node node{op, {}, {}, attrs, nullptr};
  const NodeView view{node, in_types, out_types};
  const KernelImpl& impl = dialect_impl(dialect, op);
  EXPECT_TRUE(impl.supports(view));
  if (impl.prepare) impl.prepare(view);
  std::vector<Tensor> dev_in, dev_out;
  for (const Tensor& t : inputs) dev_in.push_back(cuda::to_device(t));
  for (const TensorType& t : out_types) dev_out.push_back(poisoned_device(t));
  cudaStream_t stream;
  KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  impl.kernel(KernelArgs{attrs, dev_in, dev_out, stream});
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream));
  KILN_CUDA_CHECK(cudaStreamDestroy(stream));
  std::vector<Tensor> out;
  for (const Tensor& t : dev_out) out.push_back(cuda::to_host(t));
  return out;
}

// max |a - b| / max |b|; infinity if a has a NaN (an unwritten or broken element).
inline double scaled_error(const Tensor& a, const Tensor& b) {
  double diff = 0.0, ref = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i), y = b.get(i);
    if (!std::isfinite(x)) return INFINITY;
    diff = std::max(diff, std::abs(x - y));
    ref = std::max(ref, std::abs(y));
  }
  return ref > 0.0 ? diff / ref : diff;
}

}  // namespace kiln::testing

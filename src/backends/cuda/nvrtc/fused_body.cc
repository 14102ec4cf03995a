// The "cuda-body" dialect: runs a fused node on the GPU by running its body node by node with
// the CUDA kernel each body op has. It is the fallback under the nvrtc dialect (which compiles
// one kernel per group but supports only some bodies), so a fusion group never leaves a step
// without a CUDA kernel: it then costs what the unfused nodes cost, plus nothing.
//
// The body's intermediates live in one stream-ordered scratch allocation per call (legal inside
// CUDA-graph capture, no host sync); body outputs computed by a body node are written straight
// into the node's output tensors.
#include <cuda_runtime.h>

#include "analysis/memory_plan.h"
#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/registration.h"

namespace kiln::cuda {
namespace {

std::vector<TensorType> types_of(const Graph& g, const std::vector<ValueId>& ids) {
  std::vector<TensorType> out;
  for (ValueId id : ids) out.push_back(g.type(id));
  return out;
}

const KernelImpl* body_kernel(const Node& node, const Graph& body) {
  if (node.op == Op::kFused) return nullptr;  // fusion never nests
  const std::vector<TensorType> in = types_of(body, node.inputs);
  const std::vector<TensorType> out = types_of(body, node.outputs);
  const NodeView view{node, in, out};
  for (const KernelImpl* impl : kernel_registry().candidates(node.op, Device::kCuda))
    if (!impl->supports || impl->supports(view)) return impl;
  return nullptr;
}

bool supports_body(const NodeView& view) {
  if (!view.node.body) return false;
  for (const Node& node : view.node.body->nodes)
    if (body_kernel(node, *view.node.body) == nullptr) return false;
  return true;
}

void run_body(const KernelArgs& k) {
  KILN_CHECK(k.body != nullptr, "fused: the kernel was called without the node's body");
  const Graph& body = *k.body;
  auto stream = static_cast<cudaStream_t>(k.stream);
  std::vector<Tensor> values(body.values.size());
  for (size_t i = 0; i < body.inputs.size(); ++i) values[body.inputs[i].value] = k.inputs[i];
  // Body outputs a body node computes go straight to the node's output (the first one, when a
  // value is output twice); everything else a node computes goes to the scratch block.
  std::vector<int> output_slot(body.values.size(), -1);
  for (size_t i = 0; i < body.outputs.size(); ++i) {
    const ValueId id = body.outputs[i];
    if (output_slot[id] < 0 && body.input_index(id) < 0) output_slot[id] = static_cast<int>(i);
  }
  std::vector<size_t> offset(body.values.size(), 0);
  size_t scratch_bytes = 0;
  for (const Node& node : body.nodes)
    for (ValueId id : node.outputs)
      if (output_slot[id] < 0) {
        offset[id] = scratch_bytes;
        scratch_bytes += aligned_bytes(body.type(id).bytes());
      }
  void* base = nullptr;
  KILN_CUDA_CHECK(cudaMallocAsync(&base, std::max<size_t>(scratch_bytes, 16), stream));
  // Freed on the stream after every kernel below, when `scratch` goes out of scope.
  std::shared_ptr<std::byte[]> scratch(static_cast<std::byte*>(base),
                                       [stream](std::byte* p) { cudaFreeAsync(p, stream); });
  std::vector<Tensor> ins, outs;
  for (const Node& node : body.nodes) {
    const KernelImpl* impl = body_kernel(node, body);
    KILN_CHECK(impl != nullptr, "fused: body op {} has no CUDA kernel for these types",
               op_name(node.op));
    ins.clear();
    outs.clear();
    for (ValueId id : node.inputs) ins.push_back(values[id]);
    for (ValueId id : node.outputs)
      outs.push_back(output_slot[id] >= 0
                         ? k.outputs[static_cast<size_t>(output_slot[id])]
                         : Tensor(body.type(id), scratch, offset[id], Device::kCuda));
    impl->kernel(KernelArgs{node.attrs, ins, outs, k.stream, nullptr});
    for (size_t i = 0; i < node.outputs.size(); ++i) values[node.outputs[i]] = outs[i];
  }
  // Outputs not written in place: inputs passed through, or a value output twice.
  for (size_t i = 0; i < body.outputs.size(); ++i) {
    const ValueId id = body.outputs[i];
    if (output_slot[id] == static_cast<int>(i) || k.outputs[i].bytes() == 0) continue;
    KILN_CUDA_CHECK(cudaMemcpyAsync(k.outputs[i].raw(), values[id].raw(), k.outputs[i].bytes(),
                                    cudaMemcpyDeviceToDevice, stream));
  }
}

}  // namespace

void register_fused_body_kernels(KernelRegistry& registry) {
  registry.add(Op::kFused,
               KernelImpl{"cuda-body", Device::kCuda, kGenericPriority, supports_body, run_body});
}

}  // namespace kiln::cuda

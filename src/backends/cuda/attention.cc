// The "cuda-attention" dialect: flash-attention kernels (attention.cu) for attention (out, lse)
// and attention_grad (q, k, v, out, dout, lse) on f32, f16 and bf16 (lse f32), head dims up to
// kAttentionMaxHeadDim; tensor cores for 16-bit types with d == dv in {32, 64, 128}.
#include <cmath>
#include <optional>

#include "backends/cuda/attention.cuh"
#include "backends/cuda/registration.h"

namespace kiln::cuda {
namespace {

std::optional<AttentionDType> attention_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return AttentionDType::kF32;
    case DType::kF16: return AttentionDType::kF16;
    case DType::kBF16: return AttentionDType::kBF16;
    default: return std::nullopt;
  }
}

// Leading dims (and heads) flattened into problems, as the reference kernel does (ops/nn.cc).
AttentionShape attention_shape(const Shape& q, const Shape& k, const Shape& v,
                               const Attributes& attrs) {
  const size_t r = q.size();
  const bool bthd = attrs.s("layout") == "bthd";
  const size_t t_axis = bthd ? r - 3 : r - 2;
  AttentionShape s;
  s.heads = bthd ? q[r - 2] : 1;
  s.batch = s.heads;
  for (size_t i = 0; i < t_axis; ++i) s.batch *= q[i];
  s.tq = q[t_axis];
  s.tk = k[t_axis];
  s.d = q[r - 1];
  s.dv = v[r - 1];
  s.causal = attrs.b("causal");
  s.scale = attrs.has("scale") ? attrs.f("scale")
                               : (s.d > 0 ? 1.0 / std::sqrt(static_cast<double>(s.d)) : 1.0);
  return s;
}

}  // namespace

// One dtype for q, k, v (and out, dout) that we handle, an f32 lse (the op's inference checks
// all of that), sizes the launchers index with 32-bit grids.
bool attention_supported(const NodeView& node, bool backward) {
  const auto& in = node.input_types;
  if (in.size() != (backward ? 6u : 3u) || in[0].rank() < 2) return false;
  const auto dtype = attention_dtype(in[0].dtype);
  if (!dtype) return false;
  for (size_t i = 0; i < (backward ? 5u : 3u); ++i)
    if (in[i].dtype != in[0].dtype || in[i].rank() != in[0].rank()) return false;
  if (backward && in[5].dtype != DType::kF32) return false;
  const int r = in[0].rank();
  const bool bthd = node.node.attrs.s("layout") == "bthd";
  const int t_axis = bthd ? r - 3 : r - 2;
  if (t_axis < 0) return false;
  const int64_t d = in[0].shape[r - 1], dv = in[2].shape[r - 1];
  int64_t batch = bthd ? in[0].shape[r - 2] : 1;
  for (int i = 0; i < t_axis; ++i) batch *= in[0].shape[i];
  if (batch > (int64_t{1} << 31) - 1 || (bthd && in[0].shape[r - 2] > (int64_t{1} << 30)))
    return false;
  if ((in[0].shape[t_axis] + 63) / 64 > 65535 || (in[1].shape[t_axis] + 63) / 64 > 65535)
    return false;
  return d >= 1 && dv >= 1 && d <= kAttentionMaxHeadDim && dv <= kAttentionMaxHeadDim;
}

namespace {

void forward_kernel(const KernelArgs& args) {
  const Tensor &q = args.inputs[0], &k = args.inputs[1], &v = args.inputs[2];
  attention_forward(*attention_dtype(q.dtype()), q.raw(), k.raw(), v.raw(),
                    args.outputs[0].raw(), args.outputs[1].data<float>(),
                    attention_shape(q.shape(), k.shape(), v.shape(), args.attrs),
                    static_cast<cudaStream_t>(args.stream));
}

void backward_kernel(const KernelArgs& args) {
  const Tensor &q = args.inputs[0], &k = args.inputs[1], &v = args.inputs[2],
               &out = args.inputs[3], &dout = args.inputs[4], &lse = args.inputs[5];
  attention_backward(*attention_dtype(q.dtype()), q.raw(), k.raw(), v.raw(), out.raw(),
                     dout.raw(), lse.data<float>(), args.outputs[0].raw(),
                     args.outputs[1].raw(), args.outputs[2].raw(),
                     attention_shape(q.shape(), k.shape(), v.shape(), args.attrs),
                     static_cast<cudaStream_t>(args.stream));
}

}  // namespace

void register_attention_kernels(KernelRegistry& registry) {
  registry.add(Op::kAttention,
               KernelImpl{"cuda-attention", Device::kCuda, kLibraryPriority,
                          [](const NodeView& node) { return attention_supported(node, false); },
                          forward_kernel});
  registry.add(Op::kAttentionGrad,
               KernelImpl{"cuda-attention", Device::kCuda, kLibraryPriority,
                          [](const NodeView& node) { return attention_supported(node, true); },
                          backward_kernel});
}

}  // namespace kiln::cuda

// The "cuda-attention" dialect: flash-attention kernels (attention.cu) for attention (out, lse)
// and attention_grad (q, k, v, out, dout, lse) on f32, f16 and bf16 (lse f32), head dims up to
// kAttentionMaxHeadDim; tensor cores for 16-bit types with d == dv in {32, 64, 128}. The packed
// attention_qkv (qkv (..., T, 3, H, D)) and attention_qkv_grad run the same kernels as "bthd"
// attention with q, k, v (dq, dk, dv) read (written) in place at offsets of the one tensor.
// Grouped-query attention (k and v with fewer heads than q) runs the same kernels, both layouts;
// so does a key_bias (a padding mask: the kernels' template parameter B), packed or not.
#include <cmath>
#include <cstddef>
#include <optional>

#include "backends/cuda/attention/attention.cuh"
#include "backends/cuda/registration.h"

namespace kiln::cuda {
namespace {

// Whether the launchers (attention.cuh) take this dtype.
bool launcher_dtype(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
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
  // Grouped-query attention: k and v with fewer heads (axis r - 2 for "bthd", the last leading
  // dim for "bhtd"; the op's inference checked that they divide q's).
  const int h_axis = bthd ? static_cast<int>(r) - 2 : static_cast<int>(r) - 3;
  if (h_axis >= 0 && k[h_axis] > 0) s.group = q[h_axis] / k[h_axis];
  if (h_axis >= 0) s.bias_heads = q[h_axis];  // one key_bias row per batch entry: its heads
  s.d = q[r - 1];
  s.dv = v[r - 1];
  s.causal = attrs.b("causal");
  s.scale = attrs.has("scale") ? attrs.f("scale")
                               : (s.d > 0 ? 1.0 / std::sqrt(static_cast<double>(s.d)) : 1.0);
  return s;
}

// attention_qkv's packed qkv (..., T, 3, H, D): "bthd" problems whose q, k, v rows are
// 3 * H * D elements apart.
AttentionShape packed_shape(const Shape& qkv, const Attributes& attrs) {
  const size_t r = qkv.size();
  AttentionShape s;
  s.heads = qkv[r - 2];
  s.bias_heads = s.heads;
  s.batch = s.heads;
  for (size_t i = 0; i + 4 < r; ++i) s.batch *= qkv[i];
  s.tq = s.tk = qkv[r - 4];
  s.d = s.dv = qkv[r - 1];
  s.qkv_row_stride = 3 * s.heads * s.d;
  s.causal = attrs.b("causal");
  s.scale = attrs.has("scale") ? attrs.f("scale")
                               : (s.d > 0 ? 1.0 / std::sqrt(static_cast<double>(s.d)) : 1.0);
  return s;
}

// Part `which` (0 q, 1 k, 2 v) of a packed (..., T, 3, H, D) device tensor: its first element.
void* packed_part(const Tensor& qkv, const AttentionShape& s, int which) {
  const int64_t offset = which * s.heads * s.d * static_cast<int64_t>(dtype_size(qkv.dtype()));
  return static_cast<std::byte*>(qkv.raw()) + offset;
}

// The size limits of the launchers (32-bit grids, head dims), shared by both node kinds.
bool attention_fits_launchers(int64_t batch, int64_t heads, int64_t tq, int64_t tk, int64_t d,
                              int64_t dv) {
  if (batch > (int64_t{1} << 31) - 1 || heads > (int64_t{1} << 30)) return false;
  if ((tq + 63) / 64 > 65535 || (tk + 63) / 64 > 65535) return false;
  return d >= 1 && dv >= 1 && d <= kAttentionMaxHeadDim && dv <= kAttentionMaxHeadDim;
}

}  // namespace

// One dtype for q, k, v (and out, dout, key_bias) that we handle, an f32 lse (the op's inference
// checks all of that), sizes the launchers index with 32-bit grids.
bool attention_supported(const NodeView& node, bool backward) {
  const auto& in = node.input_types;
  const size_t plain = backward ? 6u : 3u;  // without key_bias
  if ((in.size() != plain && in.size() != plain + 1) || in[0].rank() < 2) return false;
  if (!launcher_dtype(in[0].dtype)) return false;
  for (size_t i = 0; i < (backward ? 5u : 3u); ++i)
    if (in[i].dtype != in[0].dtype || in[i].rank() != in[0].rank()) return false;
  if (in.size() > plain && in[plain].dtype != in[0].dtype) return false;
  if (backward && in[5].dtype != DType::kF32) return false;
  const int r = in[0].rank();
  const bool bthd = node.node.attrs.s("layout") == "bthd";
  const int t_axis = bthd ? r - 3 : r - 2;
  if (t_axis < 0) return false;
  const int64_t heads = bthd ? in[0].shape[r - 2] : 1;
  int64_t batch = heads;
  for (int i = 0; i < t_axis; ++i) batch *= in[0].shape[i];
  return attention_fits_launchers(batch, heads, in[0].shape[t_axis], in[1].shape[t_axis],
                                  in[0].shape[r - 1], in[2].shape[r - 1]);
}

// attention_qkv (qkv) / attention_qkv_grad (qkv, out, dout, lse): the same dtypes and limits
// as attention_supported's "bthd" layout.
bool attention_qkv_supported(const NodeView& node, bool backward) {
  const auto& in = node.input_types;
  const size_t plain = backward ? 4u : 1u;  // without key_bias
  if ((in.size() != plain && in.size() != plain + 1) || in[0].rank() < 4) return false;
  if (!launcher_dtype(in[0].dtype)) return false;
  if (in.size() > plain && in[plain].dtype != in[0].dtype) return false;
  const int r = in[0].rank();
  if (in[0].shape[r - 3] != 3) return false;
  if (backward) {
    for (size_t i = 1; i < 3; ++i)
      if (in[i].dtype != in[0].dtype || in[i].rank() != r - 1) return false;
    if (in[3].dtype != DType::kF32) return false;
  }
  const int64_t heads = in[0].shape[r - 2], t = in[0].shape[r - 4], d = in[0].shape[r - 1];
  int64_t batch = heads;
  for (int i = 0; i + 4 < r; ++i) batch *= in[0].shape[i];
  return attention_fits_launchers(batch, heads, t, t, d, d);
}

namespace {

// Input `index` (key_bias) when the node has it, else null.
const void* key_bias(const KernelArgs& args, size_t index) {
  return args.inputs.size() > index ? args.inputs[index].raw() : nullptr;
}

void forward_kernel(const KernelArgs& args) {
  const Tensor &q = args.inputs[0], &k = args.inputs[1], &v = args.inputs[2];
  attention_forward(q.dtype(), q.raw(), k.raw(), v.raw(), key_bias(args, 3),
                    args.outputs[0].raw(), args.outputs[1].data<float>(),
                    attention_shape(q.shape(), k.shape(), v.shape(), args.attrs),
                    static_cast<cudaStream_t>(args.stream));
}

void backward_kernel(const KernelArgs& args) {
  const Tensor &q = args.inputs[0], &k = args.inputs[1], &v = args.inputs[2],
               &out = args.inputs[3], &dout = args.inputs[4], &lse = args.inputs[5];
  attention_backward(q.dtype(), q.raw(), k.raw(), v.raw(), key_bias(args, 6), out.raw(),
                     dout.raw(), lse.data<float>(), args.outputs[0].raw(),
                     args.outputs[1].raw(), args.outputs[2].raw(),
                     attention_shape(q.shape(), k.shape(), v.shape(), args.attrs),
                     static_cast<cudaStream_t>(args.stream));
}

void qkv_forward_kernel(const KernelArgs& args) {
  const Tensor& qkv = args.inputs[0];
  const AttentionShape s = packed_shape(qkv.shape(), args.attrs);
  attention_forward(qkv.dtype(), packed_part(qkv, s, 0),
                    packed_part(qkv, s, 1), packed_part(qkv, s, 2), key_bias(args, 1), args.outputs[0].raw(),
                    args.outputs[1].data<float>(), s, static_cast<cudaStream_t>(args.stream));
}

void qkv_backward_kernel(const KernelArgs& args) {
  const Tensor &qkv = args.inputs[0], &out = args.inputs[1], &dout = args.inputs[2],
               &lse = args.inputs[3], &dqkv = args.outputs[0];
  const AttentionShape s = packed_shape(qkv.shape(), args.attrs);
  attention_backward(qkv.dtype(), packed_part(qkv, s, 0),
                     packed_part(qkv, s, 1), packed_part(qkv, s, 2), key_bias(args, 4), out.raw(), dout.raw(),
                     lse.data<float>(), packed_part(dqkv, s, 0), packed_part(dqkv, s, 1),
                     packed_part(dqkv, s, 2), s, static_cast<cudaStream_t>(args.stream));
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
  registry.add(Op::kAttentionQkv,
               KernelImpl{"cuda-attention", Device::kCuda, kLibraryPriority,
                          [](const NodeView& node) { return attention_qkv_supported(node, false); },
                          qkv_forward_kernel});
  registry.add(Op::kAttentionQkvGrad,
               KernelImpl{"cuda-attention", Device::kCuda, kLibraryPriority,
                          [](const NodeView& node) { return attention_qkv_supported(node, true); },
                          qkv_backward_kernel});
}

}  // namespace kiln::cuda

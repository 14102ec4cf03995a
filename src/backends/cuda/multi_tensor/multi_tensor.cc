// Grouped optimizer updates and the global gradient norm on the GPU: the fused nodes the
// multi-tensor pass makes (passes/multi_tensor.h; bodies in ops/fused/multi_tensor.h), run by
// the multi-tensor kernels of multi_tensor.cu, dialect "cuda-nn" (hand-written kernels):
//   "multi-tensor-update"  the elementwise optimizers' rules: f32 params and state, f32/bf16/f16 grads, any
//       float scalars: one launch per kMaxTensorsPerLaunch members (GPT-2's 148: one), the
//       per-tensor kernels' expressions (state bit for bit, params within 2 ulp: see
//       multi_tensor.cuh). in_place_ok. Members whose results the memory
//       plan put over another member's operand run in later launches (or read copies of it:
//       multi_tensor::plan_run_order), so one launch never races with itself.
//   "global-norm"  f32/bf16/f16 terms, up to kMaxNormTerms: two launches, deterministic.
//   "multi-tensor-cast"  f32 -> bf16/f16 (mixed): one launch per kMaxTensorsPerLaunch members,
//       the bits of the single cast kernel (movement.cu). Not in_place_ok (nothing to alias:
//       the results are 16-bit, the operands f32).
// Priority kMultiTensorPriority, above the nvrtc dialect and the cuda-body fallback: nvrtc does
// not generate these bodies, and cuda-body would run them member by member (148 launches of the
// per-tensor kernel for GPT-2's updates, 296 reductions and 147 scalar adds for its norm, ~74
// casts under --amp), which is what grouping them is meant to replace.
#include "backends/cuda/multi_tensor/multi_tensor.cuh"

#include <cuda_runtime.h>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/registration.h"
#include "backends/cuda/common/scratch.cuh"
#include "backends/multi_tensor.h"
#include "ops/fused/kind.h"
#include "ops/optimizer/optimizers.h"

namespace kiln::cuda {
namespace {

constexpr int kMultiTensorPriority = kGeneratedPriority + 10;

cudaStream_t stream_of(const KernelArgs& args) { return static_cast<cudaStream_t>(args.stream); }
size_t aligned_bytes_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The members' operand dtypes (param, grad, slots) if all members share them and the kernels
// take them, and every scalar operand is a float.
bool updates_supported(const NodeView& view) {
  if (!is_fused(view.node, FusedKind::kMultiTensorUpdate)) return false;
  const std::optional<kiln::multi_tensor::UpdateBody> body = kiln::multi_tensor::update_body(*view.node.body);
  if (!body || !optim::optimizer_def(body->attrs.s("optimizer")).elementwise) return false;
  const auto& in = view.input_types;
  const auto& first = body->members[0].inputs;
  const size_t scalars_from = first.size() - 2;
  if (scalars_from < 3) return false;
  for (const kiln::multi_tensor::Member& m : body->members) {
    for (size_t i = 0; i < scalars_from; ++i) {
      // The slots share their dtype (state), like param with param and grad with grad.
      const size_t same_as = i > 2 ? 2 : i;
      if (in[static_cast<size_t>(m.inputs[i])].dtype != in[static_cast<size_t>(first[same_as])].dtype)
        return false;
    }
    for (size_t i = scalars_from; i < m.inputs.size(); ++i)
      if (!is_float(in[static_cast<size_t>(m.inputs[i])].dtype)) return false;
  }
  return multi_tensor::update_types_supported(in[static_cast<size_t>(first[0])].dtype,
                                              in[static_cast<size_t>(first[1])].dtype,
                                              in[static_cast<size_t>(first[2])].dtype);
}

// The members' operands, with those plan_run_order says to copy replaced by copies in
// `scratch` (taken on the stream before any update runs).
struct Operands {
  std::vector<std::vector<const void*>> pointers;  // per member, per operand
  std::unique_ptr<Scratch> scratch;
};
Operands prepare_operands(const KernelArgs& args, const std::vector<kiln::multi_tensor::Member>& members,
                          const kiln::multi_tensor::RunOrder& order) {
  Operands out;
  for (const kiln::multi_tensor::Member& m : members) {
    out.pointers.emplace_back();
    for (int i : m.inputs) out.pointers.back().push_back(args.inputs[static_cast<size_t>(i)].raw());
  }
  if (order.copies.empty()) return out;
  size_t bytes = 0;
  for (auto [member, operand] : order.copies)
    bytes += aligned_bytes_256(args.inputs[static_cast<size_t>(members[static_cast<size_t>(member)].inputs[static_cast<size_t>(operand)])].bytes());
  auto stream = stream_of(args);
  out.scratch = std::make_unique<Scratch>(bytes, stream);
  size_t offset = 0;
  for (auto [member, operand] : order.copies) {
    const Tensor& t = args.inputs[static_cast<size_t>(members[static_cast<size_t>(member)].inputs[static_cast<size_t>(operand)])];
    std::byte* copy = out.scratch->as<std::byte>() + offset;
    KILN_CUDA_CHECK(cudaMemcpyAsync(copy, t.raw(), t.bytes(), cudaMemcpyDeviceToDevice, stream));
    out.pointers[static_cast<size_t>(member)][static_cast<size_t>(operand)] = copy;
    offset += aligned_bytes_256(t.bytes());
  }
  return out;
}

void run_updates(const KernelArgs& args) {
  KILN_CHECK(args.body != nullptr, "multi-tensor update: the kernel was called without the node's body");
  std::string why;
  const std::optional<kiln::multi_tensor::UpdateBody> body = kiln::multi_tensor::update_body(*args.body, &why);
  KILN_CHECK(body.has_value(), "multi-tensor update: body @{} is not one: {}", args.body->name, why);
  const auto& members = body->members;
  const kiln::multi_tensor::RunOrder order = kiln::multi_tensor::plan_run_order(
      kiln::multi_tensor::member_regions(members, args.inputs, args.outputs));
  // Freed (stream-ordered) after the launches below: it lives to the end of this call.
  const Operands operands = prepare_operands(args, members, order);
  const std::string& name = body->attrs.s("optimizer");
  const optim::HyperValues h = optim::hyper_values(optim::optimizer_def(name), body->attrs);
  const auto& first = members[0].inputs;
  const size_t scalars_from = first.size() - 2;
  const DType param_t = args.inputs[static_cast<size_t>(first[0])].dtype();
  const DType grad_t = args.inputs[static_cast<size_t>(first[1])].dtype();
  const DType state_t = args.inputs[static_cast<size_t>(first[2])].dtype();
  const Tensor& lr = args.inputs[static_cast<size_t>(first[scalars_from])];
  const Tensor& step = args.inputs[static_cast<size_t>(first[scalars_from + 1])];
  for (const std::vector<int>& wave : order.waves) {
    std::vector<nn::UpdateTensor> tensors;
    for (int k : wave) {
      const auto& m = members[static_cast<size_t>(k)];
      const auto& p = operands.pointers[static_cast<size_t>(k)];
      nn::UpdateTensor x{};
      x.param = p[0];
      x.grad = p[1];
      x.param_out = args.outputs[static_cast<size_t>(m.outputs[0])].raw();
      for (size_t j = 0; 2 + j < scalars_from; ++j) {
        x.slots[j] = p[2 + j];
        x.slots_out[j] = args.outputs[static_cast<size_t>(m.outputs[1 + j])].raw();
      }
      x.n = args.inputs[static_cast<size_t>(m.inputs[0])].numel();
      tensors.push_back(x);
    }
    multi_tensor::update(name.c_str(), h, param_t, grad_t, state_t, tensors.data(),
                         static_cast<int64_t>(tensors.size()), lr.dtype(), lr.raw(), step.dtype(), step.raw(),
                         stream_of(args));
  }
}

bool norm_dtype(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

bool norm_supported(const NodeView& view) {
  if (!is_fused(view.node, FusedKind::kGlobalNorm)) return false;
  for (const TensorType& t : view.input_types)
    if (!norm_dtype(t.dtype)) return false;
  const std::optional<kiln::multi_tensor::NormBody> norm = kiln::multi_tensor::norm_body(*view.node.body);
  return norm && norm->term_input.size() <= static_cast<size_t>(multi_tensor::kMaxNormTerms);
}

void run_norm(const KernelArgs& args) {
  KILN_CHECK(args.body != nullptr, "global-norm: the kernel was called without the node's body");
  std::string why;
  const std::optional<kiln::multi_tensor::NormBody> norm = kiln::multi_tensor::norm_body(*args.body, &why);
  KILN_CHECK(norm.has_value(), "global-norm: body @{} is not one: {}", args.body->name, why);
  std::vector<multi_tensor::NormTensor> tensors;
  for (int input : norm->term_input) {
    const Tensor& x = args.inputs[static_cast<size_t>(input)];
    tensors.push_back(multi_tensor::NormTensor{x.raw(), x.dtype(), x.numel()});
  }
  std::vector<int> adds;
  for (const auto& operands : norm->adds) adds.insert(adds.end(), operands.begin(), operands.end());
  multi_tensor::global_norm(tensors.data(), static_cast<int64_t>(tensors.size()), adds.data(),
                            static_cast<int64_t>(norm->adds.size()), norm->result, args.outputs[0].raw(),
                            stream_of(args));
}

bool cast_supported(const NodeView& view) {
  return is_fused(view.node, FusedKind::kMultiTensorCast) && kiln::multi_tensor::cast_body(*view.node.body).has_value();
}

void run_casts(const KernelArgs& args) {
  KILN_CHECK(args.body != nullptr, "multi-tensor cast: the kernel was called without the node's body");
  std::string why;
  const std::optional<std::vector<kiln::multi_tensor::CastMember>> members =
      kiln::multi_tensor::cast_body(*args.body, &why);
  KILN_CHECK(members.has_value(), "multi-tensor cast: body @{} is not one: {}", args.body->name, why);
  std::vector<multi_tensor::CastTensor> tensors;
  for (const kiln::multi_tensor::CastMember& m : *members) {
    const Tensor& x = args.inputs[static_cast<size_t>(m.input)];
    tensors.push_back(multi_tensor::CastTensor{x.data<float>(),
                                               args.outputs[static_cast<size_t>(m.output)].raw(), m.to,
                                               x.numel()});
  }
  multi_tensor::cast(tensors.data(), static_cast<int64_t>(tensors.size()), stream_of(args));
}

}  // namespace

void register_multi_tensor_kernels(KernelRegistry& registry) {
  registry.add(Op::kFused, KernelImpl{"cuda-nn", Device::kCuda, kMultiTensorPriority, updates_supported,
                                      run_updates, /*in_place_ok=*/true});
  registry.add(Op::kFused,
               KernelImpl{"cuda-nn", Device::kCuda, kMultiTensorPriority, norm_supported, run_norm});
  registry.add(Op::kFused,
               KernelImpl{"cuda-nn", Device::kCuda, kMultiTensorPriority, cast_supported, run_casts});
}

}  // namespace kiln::cuda

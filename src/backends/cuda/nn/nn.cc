// The "cuda-nn" dialect: hand-written CUDA kernels for the memory-bound ops of transformer
// training (kernels in nn.cu, launchers declared in nn.cuh), at kHandWrittenPriority.
//   layer_norm, layer_norm_grad     f32/bf16/f16 (layer_norm_grad: C <= kLayerNormGradMaxCols)
//   softmax, log_softmax (+ grads)  f32/bf16/f16, last axis only
//   cross_entropy (+ grad)          f32/bf16/f16 logits, i32/i64 labels, every reduction
//   gelu, gelu_grad                 f32/bf16/f16, both approximations
//   rotary_embedding                f32/bf16/f16, both layouts, either direction
//   optimizer_update                the elementwise optimizers' rules (ops/optimizer/rules.h), in
//                                   the type combinations nn::update_types_supported accepts
//   gather                          any dtype, any axis, i32/i64 indices
//   scatter_add                     f32/bf16/f16, any axis, i32/i64 indices (deterministic)
// f64 and everything else falls through to the generic "cuda" dialect. The supports()
// predicates see only types and attributes; pointer alignment is handled inside the launchers.
#include "backends/cuda/nn/nn.cuh"

#include <cuda_runtime.h>

#include <algorithm>

#include "backends/cuda/registration.h"
#include "ops/optimizer/optimizers.h"

namespace kiln::cuda {
namespace {

cudaStream_t stream_of(const KernelArgs& args) { return static_cast<cudaStream_t>(args.stream); }

KernelImpl impl(std::function<bool(const NodeView&)> supports, KernelFn kernel,
                bool in_place_ok = false) {
  return KernelImpl{"cuda-nn", Device::kCuda, kHandWrittenPriority, std::move(supports),
                    std::move(kernel), in_place_ok};
}

bool storage_float(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }

// Every input and output of the node has storage dtype `d` (except those in `skip`).
bool all_storage_float(const NodeView& n, std::initializer_list<size_t> skip_inputs = {}) {
  for (size_t i = 0; i < n.input_types.size(); ++i) {
    if (std::find(skip_inputs.begin(), skip_inputs.end(), i) != skip_inputs.end()) continue;
    if (!storage_float(n.input_types[i].dtype)) return false;
  }
  for (const TensorType& t : n.output_types)
    if (!storage_float(t.dtype)) return false;
  return true;
}

int64_t attr_int(const NodeView& n, const char* name, int64_t fallback) {
  return n.node.attrs.has(name) ? n.node.attrs.i(name) : fallback;
}

struct RowsCols {
  int64_t rows, cols;
};
RowsCols rows_cols(const Shape& shape) {
  RowsCols rc{1, shape.empty() ? 1 : shape.back()};
  for (size_t d = 0; d + 1 < shape.size(); ++d) rc.rows *= shape[d];
  return rc;
}

// ---- row ops --------------------------------------------------------------------------------

bool last_axis_supported(const NodeView& n) {
  const TensorType& x = n.input_types[0];
  if (x.rank() < 1 || !all_storage_float(n)) return false;
  return normalize_axis(attr_int(n, "axis", -1), x.rank()) == x.rank() - 1;
}

void softmax_kernel(const KernelArgs& args, bool log) {
  const Tensor& x = args.inputs[0];
  const auto [rows, cols] = rows_cols(x.shape());
  nn::softmax(x.dtype(), x.raw(), args.outputs[0].raw(), rows, cols, log, stream_of(args));
}

void softmax_grad_kernel(const KernelArgs& args, bool log) {
  const Tensor &y = args.inputs[0], &dy = args.inputs[1];
  const auto [rows, cols] = rows_cols(y.shape());
  nn::softmax_grad(y.dtype(), y.raw(), dy.raw(), args.outputs[0].raw(), rows, cols, log,
                   stream_of(args));
}

bool layer_norm_supported(const NodeView& n) {
  return n.input_types[0].rank() >= 1 && all_storage_float(n);
}

bool layer_norm_grad_supported(const NodeView& n) {
  return layer_norm_supported(n) && n.input_types[0].shape.back() <= nn::kLayerNormGradMaxCols;
}

nn::Reduction reduction_of(const Attributes& attrs) {
  const std::string r = attrs.has("reduction") ? attrs.s("reduction") : "mean";
  if (r == "sum") return nn::Reduction::kSum;
  if (r == "none") return nn::Reduction::kNone;
  return nn::Reduction::kMean;
}

bool cross_entropy_supported(const NodeView& n) {
  const TensorType& labels = n.input_types[1];
  return n.input_types[0].rank() >= 1 && all_storage_float(n, {1}) &&
         (labels.dtype == DType::kI32 || labels.dtype == DType::kI64);
}

// ---- optimizer updates ----------------------------------------------------------------------

// (param, grad, slots..., lr, step): the slots share a dtype.
bool update_supported(const NodeView& n) {
  const auto& in = n.input_types;
  const size_t scalars_from = in.size() - 2;
  if (!optim::optimizer_def(n.node.attrs.s("optimizer")).elementwise) return false;
  for (size_t i = 3; i < scalars_from; ++i)
    if (in[i].dtype != in[2].dtype) return false;
  for (size_t i = scalars_from; i < in.size(); ++i)
    if (!is_float(in[i].dtype)) return false;
  return scalars_from > 2 && nn::update_types_supported(in[0].dtype, in[1].dtype, in[2].dtype);
}

// The operands and results of an optimizer_update node (or a member's) as the launchers take them.
nn::UpdateTensor update_tensor(const Tensor* in, size_t inputs, const Tensor* out) {
  nn::UpdateTensor x{};
  x.param = in[0].raw();
  x.grad = in[1].raw();
  x.param_out = out[0].raw();
  for (size_t j = 0; 2 + j + 2 < inputs; ++j) {
    x.slots[j] = in[2 + j].raw();
    x.slots_out[j] = out[1 + j].raw();
  }
  x.n = in[0].numel();
  return x;
}

// ---- gather / scatter_add -------------------------------------------------------------------

struct AxisView {
  int64_t outer, dim, inner;
};
AxisView axis_view(const Shape& shape, int axis) {
  AxisView v{1, shape[axis], 1};
  for (int d = 0; d < axis; ++d) v.outer *= shape[d];
  for (size_t d = axis + 1; d < shape.size(); ++d) v.inner *= shape[d];
  return v;
}

}  // namespace

void register_nn_kernels(KernelRegistry& registry) {
  registry.add(Op::kLayerNorm, impl(layer_norm_supported, [](const KernelArgs& args) {
                 const Tensor& x = args.inputs[0];
                 const auto [rows, cols] = rows_cols(x.shape());
                 nn::layer_norm(x.dtype(), x.raw(), args.inputs[1].raw(),
                                args.inputs[2].raw(), args.outputs[0].raw(), rows, cols,
                                static_cast<float>(args.attrs.f("epsilon")), stream_of(args));
               }));
  registry.add(Op::kLayerNormGrad, impl(layer_norm_grad_supported, [](const KernelArgs& args) {
                 const Tensor& x = args.inputs[0];
                 const auto [rows, cols] = rows_cols(x.shape());
                 nn::layer_norm_grad(x.dtype(), x.raw(), args.inputs[1].raw(),
                                     args.inputs[2].raw(), args.outputs[0].raw(),
                                     args.outputs[1].raw(), args.outputs[2].raw(), rows, cols,
                                     static_cast<float>(args.attrs.f("epsilon")), stream_of(args));
               }));

  registry.add(Op::kSoftmax, impl(last_axis_supported,
                                  [](const KernelArgs& args) { softmax_kernel(args, false); }));
  registry.add(Op::kLogSoftmax, impl(last_axis_supported,
                                     [](const KernelArgs& args) { softmax_kernel(args, true); }));
  registry.add(Op::kSoftmaxGrad, impl(last_axis_supported, [](const KernelArgs& args) {
                 softmax_grad_kernel(args, false);
               }));
  registry.add(Op::kLogSoftmaxGrad, impl(last_axis_supported, [](const KernelArgs& args) {
                 softmax_grad_kernel(args, true);
               }));

  registry.add(Op::kCrossEntropy, impl(cross_entropy_supported, [](const KernelArgs& args) {
                 const Tensor &logits = args.inputs[0], &labels = args.inputs[1];
                 const auto [rows, vocab] = rows_cols(logits.shape());
                 nn::cross_entropy(logits.dtype(), logits.raw(), labels.dtype(),
                                   labels.raw(), args.outputs[0].raw(), rows, vocab,
                                   args.attrs.i("ignore_index"), reduction_of(args.attrs),
                                   stream_of(args));
               }));
  registry.add(Op::kCrossEntropyGrad, impl(cross_entropy_supported, [](const KernelArgs& args) {
                 const Tensor &logits = args.inputs[0], &labels = args.inputs[1];
                 const auto [rows, vocab] = rows_cols(logits.shape());
                 nn::cross_entropy_grad(logits.dtype(), logits.raw(), labels.dtype(),
                                        labels.raw(), args.inputs[2].raw(), args.outputs[0].raw(),
                                        rows, vocab, args.attrs.i("ignore_index"),
                                        reduction_of(args.attrs), stream_of(args));
               }));

  auto elementwise_supported = [](const NodeView& n) { return all_storage_float(n); };
  registry.add(Op::kRotaryEmbedding, impl(elementwise_supported, [](const KernelArgs& args) {
                 const Tensor& x = args.inputs[0];
                 const Shape& shape = x.shape();
                 const size_t r = shape.size();
                 const bool bthd = args.attrs.s("layout") == "bthd";
                 const auto [rows, d] = rows_cols(shape);
                 nn::rotary_embedding(x.dtype(), x.raw(), args.outputs[0].raw(), rows,
                                      shape[bthd ? r - 3 : r - 2], bthd ? shape[r - 2] : 1, d,
                                      args.attrs.f("base"), args.attrs.b("inverse"),
                                      stream_of(args));
               }));
  registry.add(Op::kGelu, impl(elementwise_supported, [](const KernelArgs& args) {
                 const Tensor& x = args.inputs[0];
                 nn::gelu(x.dtype(), x.raw(), args.outputs[0].raw(), x.numel(),
                          args.attrs.s("approximate") == "tanh", stream_of(args));
               }));
  registry.add(Op::kGeluGrad, impl(elementwise_supported, [](const KernelArgs& args) {
                 const Tensor& x = args.inputs[0];
                 nn::gelu_grad(x.dtype(), x.raw(), args.inputs[1].raw(),
                               args.outputs[0].raw(), x.numel(),
                               args.attrs.s("approximate") == "tanh", stream_of(args));
               }));

  registry.add(Op::kOptimizerUpdate, impl(update_supported,
                                          [](const KernelArgs& args) {
                                            const auto& in = args.inputs;
                                            const size_t k = in.size();
                                            const std::string& name = args.attrs.s("optimizer");
                                            nn::optimizer_update(
                                                name.c_str(), optim::hyper_values(optim::optimizer_def(name), args.attrs),
                                                in[0].dtype(), in[1].dtype(), in[2].dtype(),
                                                update_tensor(in.data(), k, args.outputs.data()), in[k - 2].dtype(),
                                                in[k - 2].raw(), in[k - 1].dtype(), in[k - 1].raw(), stream_of(args));
                                          },
                                          /*in_place_ok=*/true));
  registry.add(Op::kGather, impl(nullptr, [](const KernelArgs& args) {
                 const Tensor &table = args.inputs[0], &indices = args.inputs[1];
                 const int axis = normalize_axis(args.attrs.i("axis"), table.rank());
                 const AxisView v = axis_view(table.shape(), axis);
                 nn::gather(table.raw(), static_cast<int64_t>(dtype_size(table.dtype())),
                            indices.dtype(), indices.raw(), args.outputs[0].raw(), v.outer,
                            v.dim, v.inner, indices.numel(), stream_of(args));
               }));
  registry.add(Op::kScatterAdd,
               impl([](const NodeView& n) { return storage_float(n.input_types[0].dtype); },
                    [](const KernelArgs& args) {
                      const Tensor &base = args.inputs[0], &indices = args.inputs[1];
                      const int axis = normalize_axis(args.attrs.i("axis"), base.rank());
                      const AxisView v = axis_view(base.shape(), axis);
                      nn::scatter_add(base.dtype(), base.raw(), indices.dtype(),
                                      indices.raw(), args.inputs[2].raw(), args.outputs[0].raw(),
                                      v.outer, v.dim, v.inner, indices.numel(), stream_of(args));
                    },
                    // Over its base (the only input of the output's type): the rows no index
                    // names are then not copied, and each named row is read and written by the
                    // same thread (GPT-2's tied embedding: no 154 MB copy of the zeros).
                    /*in_place_ok=*/true));
}

}  // namespace kiln::cuda

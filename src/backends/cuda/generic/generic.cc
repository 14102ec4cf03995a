// The "cuda" generic dialect: one simple CUDA kernel per op (kernels in generic.cu), registered
// at kGenericPriority so that every specialised CUDA dialect wins where it supports a node, and
// every node that runs on the GPU has at least this kernel. Each KernelImpl here only reads
// shapes and attributes from KernelArgs and calls a launcher of generic.cuh on args.stream.
//
// Ops without a generic kernel (see tests/cuda/generic_test.cc's list): fused (compiled by the
// nvrtc dialect), conv2d and its gradients, max/avg_pool2d and their gradients (the cuda-conv
// dialect serves them at every float dtype).
// Kernel-time data errors are recorded on the device: see device_errors.h, check_device_errors().
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/generic/generic.cuh"
#include "backends/cuda/runtime/memory.h"
#include "backends/cuda/registration.h"
#include "device/communicator.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/optimizer/optimizers.h"
#include "support/philox.h"

namespace kiln::cuda {
namespace {

using generic::kMaxRank;
using generic::Layout;

int elem_size(const Tensor& t) { return static_cast<int>(dtype_size(t.dtype())); }
cudaStream_t stream_of(const KernelArgs& args) { return static_cast<cudaStream_t>(args.stream); }

// Every tensor of the node has rank <= kMaxRank (the layouts' capacity).
bool ranks_fit(const NodeView& node) {
  for (const TensorType& t : node.input_types)
    if (t.rank() > kMaxRank) return false;
  for (const TensorType& t : node.output_types)
    if (t.rank() > kMaxRank) return false;
  return true;
}

using Supports = std::function<bool(const NodeView&)>;

void add(KernelRegistry& registry, Op op, KernelFn kernel, Supports supports = nullptr,
         bool in_place_ok = false) {
  Supports checked = [supports = std::move(supports)](const NodeView& node) {
    return ranks_fit(node) && (!supports || supports(node));
  };
  registry.add(op, KernelImpl{"cuda", Device::kCuda, kGenericPriority,
                              std::move(checked), std::move(kernel), in_place_ok});
}

// The values of a constant of `type` (its `values` attribute), in page-locked memory that lives
// as long as the process (one copy per distinct constant, looked up by its type and the values'
// exact text). The constant's reference kernel converts them: exact for every dtype.
const Tensor& constant_values(const TensorType& type, const Attributes& attrs) {
  static std::mutex mutex;
  static auto* cache = new std::map<std::pair<std::string, std::string>, Tensor>();
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(to_string(type), to_string(attrs.get("values")));
  auto it = cache->find(key);
  if (it == cache->end()) {
    Tensor pinned = pinned_tensor(type);
    op_def(Op::kConstant).reference(KernelArgs{attrs, {}, std::span<Tensor>(&pinned, 1)});
    it = cache->emplace(std::move(key), std::move(pinned)).first;
  }
  return it->second;
}

void fill_strides(int64_t (&dst)[kMaxRank], const std::vector<int64_t>& src) {
  for (size_t d = 0; d < src.size(); ++d) dst[d] = src[d];
}

// Layout of an elementwise op: operand 0 the (contiguous) output, then each input broadcast.
// Merges adjacent dims that every operand walks as one (stride[d] == stride[d + 1] *
// shape[d + 1]) and drops dims of extent 1: fewer index divisions per element in locate(), and
// a broadcast over leading dims (GPT-2's position embedding added over the batch) becomes
// rank 2, which binary() runs by rows with no division at all.
void collapse(Layout& layout, int operands) {
  int kept = 0;
  for (int d = 0; d < layout.rank; ++d) {
    if (layout.shape[d] == 1) continue;
    bool merge = kept > 0;
    for (int k = 0; merge && k < operands; ++k)
      merge = layout.strides[k][kept - 1] == layout.strides[k][d] * layout.shape[d];
    const int to = merge ? kept - 1 : kept++;
    layout.shape[to] = merge ? layout.shape[to] * layout.shape[d] : layout.shape[d];
    for (int k = 0; k < operands; ++k) layout.strides[k][to] = layout.strides[k][d];
  }
  layout.rank = kept;
}

Layout broadcast_layout(const Shape& out, const std::vector<Shape>& inputs) {
  Layout layout;
  layout.rank = static_cast<int>(out.size());
  fill_strides(layout.shape, out);
  fill_strides(layout.strides[0], strides_of(out));
  layout.contiguous = true;
  for (size_t k = 0; k < inputs.size(); ++k) {
    fill_strides(layout.strides[k + 1], broadcast_strides(inputs[k], out));
    // An input as large as the output that broadcasts to it stretches no dim: same layout.
    layout.contiguous = layout.contiguous && numel(inputs[k]) == numel(out);
  }
  collapse(layout, static_cast<int>(inputs.size()) + 1);
  return layout;
}

// (outer, dim, inner) around `axis` of `shape`.
struct AxisView {
  int64_t outer = 1, dim = 1, inner = 1;
};
AxisView view_around(const Shape& shape, int axis) {
  AxisView v;
  for (int d = 0; d < axis; ++d) v.outer *= shape[d];
  v.dim = shape[axis];
  for (size_t d = axis + 1; d < shape.size(); ++d) v.inner *= shape[d];
  return v;
}

// ---- elementwise ---------------------------------------------------------------------------------

void register_elementwise(KernelRegistry& registry) {
  // Every op that is a line of ops/elementwise_math.h (gelu, gelu_grad: the line of their form).
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    if (!ops::is_math_op(op)) continue;
    add(registry, op, [op](const KernelArgs& a) {
      const math::Fn fn = *ops::elementwise_fn(op, a.attrs);
      const Tensor& x = a.inputs[0];
      Tensor& out = a.outputs[0];
      if (a.inputs.size() == 1) {
        generic::launch_unary(fn, x.dtype(), x.raw(), out.raw(), out.numel(), stream_of(a));
      } else {
        const Tensor& y = a.inputs[1];
        generic::launch_binary(fn, x.dtype(), x.raw(), y.raw(), out.raw(),
                               broadcast_layout(out.shape(), {x.shape(), y.shape()}),
                               out.numel(), stream_of(a));
      }
    }, nullptr, /*in_place_ok=*/true);
  }

  add(registry, Op::kWhere, [](const KernelArgs& a) {
    const Tensor &cond = a.inputs[0], &x = a.inputs[1], &y = a.inputs[2];
    Tensor& out = a.outputs[0];
    generic::launch_where(elem_size(out), cond.raw(), x.raw(), y.raw(), out.raw(),
                          broadcast_layout(out.shape(), {cond.shape(), x.shape(), y.shape()}),
                          out.numel(), stream_of(a));
  }, nullptr, true);

  add(registry, Op::kCast, [](const KernelArgs& a) {
    generic::launch_cast(a.inputs[0].dtype(), a.outputs[0].dtype(), a.inputs[0].raw(),
                         a.outputs[0].raw(), a.outputs[0].numel(), stream_of(a));
  }, nullptr, true);

  add(registry, Op::kDropout, [](const KernelArgs& a) {
    const double p = a.attrs.f("p");
    const int64_t* offset = a.inputs.size() > 1 ? a.inputs[1].data<int64_t>() : nullptr;
    generic::launch_dropout(a.inputs[0].dtype(), a.inputs[0].raw(), a.outputs[0].raw(),
                            a.outputs[0].numel(), p, dropout_threshold(p),
                            static_cast<uint64_t>(a.attrs.i("seed")), offset, stream_of(a));
  }, nullptr, true);
}

// ---- sources and shape ops ---------------------------------------------------------------------

void copy_bytes(const Tensor& from, Tensor& to, cudaStream_t stream) {
  if (from.raw() == to.raw() || to.bytes() == 0) return;
  KILN_CUDA_CHECK(
      cudaMemcpyAsync(to.raw(), from.raw(), to.bytes(), cudaMemcpyDeviceToDevice, stream));
}

// Copies `in` (contiguous) into the block of `out` that starts at `axis_offset` along `axis`
// (concat), or the block of `in` there into `out` (split, `into_out` false).
void copy_block(const Tensor& in, Tensor& out, int axis, int64_t axis_offset, bool into_out,
                cudaStream_t stream) {
  const Tensor& big = into_out ? out : in;
  const Tensor& small = into_out ? in : out;
  Layout layout;
  layout.rank = small.rank();
  fill_strides(layout.shape, small.shape());
  const std::vector<int64_t> big_strides = strides_of(big.shape());
  const int big_operand = into_out ? 0 : 1, small_operand = 1 - big_operand;
  fill_strides(layout.strides[big_operand], big_strides);
  fill_strides(layout.strides[small_operand], strides_of(small.shape()));
  layout.offset[big_operand] = axis_offset * big_strides[axis];
  generic::launch_copy(elem_size(in), in.raw(), out.raw(), layout, small.numel(), stream);
}

void register_shape(KernelRegistry& registry) {
  add(registry, Op::kFull, [](const KernelArgs& a) {
    Tensor& out = a.outputs[0];
    const double value = a.attrs.f("value");
    uint64_t bits = 0;
    visit_dtype(out.dtype(), [&](auto tag) {
      auto v = from_double<decltype(tag)>(value);
      std::memcpy(&bits, &v, sizeof(v));
    });
    generic::launch_fill(elem_size(out), bits, out.raw(), out.numel(), stream_of(a));
  });
  // A constant is copied from its values converted once, at prepare, into page-locked memory
  // kept for the process: a step's captured CUDA graph copies from that same host address at
  // every replay (a temporary buffer, freed once the copy is enqueued, was read back as
  // garbage from the third step on: an imported BERT's position ids).
  registry.add(Op::kConstant,
               KernelImpl{"cuda", Device::kCuda, kGenericPriority, ranks_fit,
                          [](const KernelArgs& a) {
                            Tensor& out = a.outputs[0];
                            if (out.bytes() == 0) return;
                            const Tensor& host = constant_values(out.type(), a.attrs);
                            KILN_CUDA_CHECK(cudaMemcpyAsync(out.raw(), host.raw(), out.bytes(),
                                                            cudaMemcpyHostToDevice, stream_of(a)));
                          },
                          false,
                          [](const NodeView& node) {
                            if (node.output_types[0].bytes() > 0)
                              constant_values(node.output_types[0], node.node.attrs);
                          }});
  add(registry, Op::kIota, [](const KernelArgs& a) {
    Tensor& out = a.outputs[0];
    const int axis = normalize_axis(a.attrs.i("axis"), out.rank());
    generic::launch_iota(out.dtype(), out.raw(), out.numel(), out.shape()[axis],
                         strides_of(out.shape())[axis], stream_of(a));
  });

  // Same bytes, another shape: a copy unless the memory plan put the output over the input.
  add(registry, Op::kReshape,
      [](const KernelArgs& a) { copy_bytes(a.inputs[0], a.outputs[0], stream_of(a)); });

  add(registry, Op::kTranspose, [](const KernelArgs& a) {
    const Tensor& x = a.inputs[0];
    Tensor& y = a.outputs[0];
    const int rank = x.rank();
    std::vector<int64_t> perm = a.attrs.ints("perm");
    if (perm.empty())
      for (int d = rank - 1; d >= 0; --d) perm.push_back(d);
    const std::vector<int64_t> x_strides = strides_of(x.shape());
    Layout layout;
    layout.rank = rank;
    fill_strides(layout.shape, y.shape());
    fill_strides(layout.strides[0], strides_of(y.shape()));
    for (int d = 0; d < rank; ++d) layout.strides[1][d] = x_strides[normalize_axis(perm[d], rank)];
    generic::launch_copy(elem_size(x), x.raw(), y.raw(), layout, y.numel(), stream_of(a));
  });

  add(registry, Op::kBroadcastTo, [](const KernelArgs& a) {
    Layout layout = broadcast_layout(a.outputs[0].shape(), {a.inputs[0].shape()});
    generic::launch_copy(elem_size(a.inputs[0]), a.inputs[0].raw(), a.outputs[0].raw(), layout,
                         a.outputs[0].numel(), stream_of(a));
  });

  add(registry, Op::kSlice, [](const KernelArgs& a) {
    const Tensor& x = a.inputs[0];
    Tensor& y = a.outputs[0];
    const std::vector<int64_t>& starts = a.attrs.ints("starts");
    const std::vector<int64_t>& steps = a.attrs.ints("steps");
    const std::vector<int64_t> x_strides = strides_of(x.shape());
    Layout layout;
    layout.rank = x.rank();
    fill_strides(layout.shape, y.shape());
    fill_strides(layout.strides[0], strides_of(y.shape()));
    for (int d = 0; d < x.rank(); ++d) {
      const int64_t start = starts[d] < 0 ? starts[d] + x.shape()[d] : starts[d];
      const int64_t step = steps.empty() ? 1 : steps[d];
      layout.offset[1] += start * x_strides[d];
      layout.strides[1][d] = step * x_strides[d];
    }
    generic::launch_copy(elem_size(x), x.raw(), y.raw(), layout, y.numel(), stream_of(a));
  });

  add(registry, Op::kConcat, [](const KernelArgs& a) {
    Tensor& y = a.outputs[0];
    const int axis = normalize_axis(a.attrs.i("axis"), y.rank());
    int64_t axis_offset = 0;
    for (const Tensor& x : a.inputs) {
      copy_block(x, y, axis, axis_offset, /*into_out=*/true, stream_of(a));
      axis_offset += x.shape()[axis];
    }
  });

  add(registry, Op::kSplit, [](const KernelArgs& a) {
    const Tensor& x = a.inputs[0];
    const int axis = normalize_axis(a.attrs.i("axis"), x.rank());
    int64_t axis_offset = 0;
    for (Tensor& y : a.outputs) {
      copy_block(x, y, axis, axis_offset, /*into_out=*/false, stream_of(a));
      axis_offset += y.shape()[axis];
    }
  });

  add(registry, Op::kGather, [](const KernelArgs& a) {
    const Tensor &table = a.inputs[0], &indices = a.inputs[1];
    const AxisView v = view_around(table.shape(), normalize_axis(a.attrs.i("axis"), table.rank()));
    generic::launch_gather(elem_size(table), table.raw(), indices.dtype(), indices.raw(),
                           a.outputs[0].raw(), v.outer, v.dim, v.inner, indices.numel(),
                           stream_of(a));
  });

  add(registry, Op::kScatterAdd, [](const KernelArgs& a) {
    const Tensor &base = a.inputs[0], &indices = a.inputs[1], &updates = a.inputs[2];
    const AxisView v = view_around(base.shape(), normalize_axis(a.attrs.i("axis"), base.rank()));
    generic::launch_scatter_add(base.dtype(), base.raw(), indices.dtype(), indices.raw(),
                                updates.raw(), a.outputs[0].raw(), v.outer, v.dim, v.inner,
                                indices.numel(), stream_of(a));
  }, [](const NodeView& node) {
    const DType t = node.input_types[0].dtype;
    return t != DType::kBool && t != DType::kU8;  // no byte-wide atomics
  });

  // gather_elements, scatter_elements: indices' shape and data's strides (ops/indexing.cc).
  const auto elements_layout = [](const Tensor& data, const Tensor& indices, const Attributes& attrs) {
    generic::ElementsLayout layout;
    layout.rank = data.rank();
    layout.axis = normalize_axis(attrs.i("axis"), data.rank());
    layout.dim = data.shape()[layout.axis];
    fill_strides(layout.index_shape, indices.shape());
    fill_strides(layout.data_strides, strides_of(data.shape()));
    return layout;
  };
  add(registry, Op::kGatherElements, [elements_layout](const KernelArgs& a) {
    const Tensor &x = a.inputs[0], &indices = a.inputs[1];
    generic::launch_gather_elements(elem_size(x), x.raw(), indices.dtype(), indices.raw(),
                                    a.outputs[0].raw(), elements_layout(x, indices, a.attrs),
                                    indices.numel(), stream_of(a));
  });
  add(registry, Op::kScatterElements, [elements_layout](const KernelArgs& a) {
    const Tensor &data = a.inputs[0], &indices = a.inputs[1], &updates = a.inputs[2];
    static const std::map<std::string, int> kReductions = {
        {"none", 0}, {"add", 1}, {"mul", 2}, {"max", 3}, {"min", 4}};
    generic::launch_scatter_elements(data.dtype(), data.raw(), data.numel(), indices.dtype(),
                                     indices.raw(), updates.raw(), a.outputs[0].raw(),
                                     elements_layout(data, indices, a.attrs),
                                     kReductions.at(a.attrs.s("reduction")), stream_of(a));
  });

  add(registry, Op::kCumsum, [](const KernelArgs& a) {
    const Tensor& x = a.inputs[0];
    const AxisView v = view_around(x.shape(), normalize_axis(a.attrs.i("axis"), x.rank()));
    generic::launch_cumsum(x.dtype(), x.raw(), a.outputs[0].raw(), v.outer, v.dim, v.inner,
                           a.attrs.b("exclusive"), a.attrs.b("reverse"), stream_of(a));
  });

  add(registry, Op::kTopk, [](const KernelArgs& a) {
    const Tensor& x = a.inputs[0];
    const AxisView v = view_around(x.shape(), normalize_axis(a.attrs.i("axis"), x.rank()));
    generic::launch_topk(x.dtype(), x.raw(), a.outputs[0].raw(), a.outputs[1].data<int64_t>(),
                         v.outer, v.dim, v.inner, a.attrs.i("k"), a.attrs.b("largest"),
                         stream_of(a));
  });

  add(registry, Op::kOneHot, [](const KernelArgs& a) {
    const Tensor& indices = a.inputs[0];
    generic::launch_one_hot(indices.dtype(), indices.raw(), a.outputs[0].dtype(), a.outputs[0].raw(),
                            indices.numel(), a.attrs.i("depth"), stream_of(a));
  });
}

// ---- reductions ----------------------------------------------------------------------------------

generic::ReduceLayout reduce_layout(const Shape& in, const std::vector<int64_t>& axes) {
  const int rank = static_cast<int>(in.size());
  std::vector<bool> reduced(rank, axes.empty());
  for (int64_t axis : axes) reduced[normalize_axis(axis, rank)] = true;
  const std::vector<int64_t> strides = strides_of(in);
  generic::ReduceLayout layout;
  layout.outputs = 1;
  layout.count = 1;
  for (int d = 0; d < rank; ++d) {
    if (reduced[d]) {
      layout.reduced_shape[layout.reduced_rank] = in[d];
      layout.reduced_strides[layout.reduced_rank++] = strides[d];
      layout.count *= in[d];
    } else {
      layout.kept_shape[layout.kept_rank] = in[d];
      layout.kept_strides[layout.kept_rank++] = strides[d];
      layout.outputs *= in[d];
    }
  }
  return layout;
}

void register_reductions(KernelRegistry& registry) {
  for (Op op : {Op::kSum, Op::kMean, Op::kMax, Op::kProd}) {
    add(registry, op, [op](const KernelArgs& a) {
      generic::launch_reduce(op, a.inputs[0].dtype(), a.inputs[0].raw(), a.outputs[0].raw(),
                             reduce_layout(a.inputs[0].shape(), a.attrs.ints("axes")),
                             stream_of(a));
    });
  }
  add(registry, Op::kArgmax, [](const KernelArgs& a) {
    const Tensor& x = a.inputs[0];
    const AxisView v = view_around(x.shape(), normalize_axis(a.attrs.i("axis"), x.rank()));
    generic::launch_argmax(x.dtype(), x.raw(), a.outputs[0].data<int64_t>(), v.outer, v.dim,
                           v.inner, stream_of(a));
  });
}

// ---- nn ------------------------------------------------------------------------------------------

struct Rows {
  int64_t rows = 1, cols = 1;
};
Rows rows_of(const Shape& shape) {
  Rows r;
  r.cols = shape.back();
  for (size_t d = 0; d + 1 < shape.size(); ++d) r.rows *= shape[d];
  return r;
}

int reduction_code(const Attributes& attrs) {
  const std::string& r = attrs.s("reduction");
  return r == "mean" ? 0 : r == "sum" ? 1 : 2;
}

double attention_scale(const Attributes& attrs, int64_t head_dim) {
  if (attrs.has("scale")) return attrs.f("scale");
  return head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
}

struct AttentionDims {
  int64_t batch = 1, tq, tk, d, dv;
  int64_t bias_heads = 1;  // problems sharing a key_bias row: the heads dim before T
};
AttentionDims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int r = q.rank();
  AttentionDims dims{1, q.shape()[r - 2], k.shape()[r - 2], q.shape()[r - 1], v.shape()[r - 1]};
  for (int i = 0; i + 2 < r; ++i) dims.batch *= q.shape()[i];
  if (r >= 3) dims.bias_heads = q.shape()[r - 3];
  return dims;
}
// Input `index` (key_bias) when the node has it, else null.
const void* key_bias(const KernelArgs& a, size_t index) {
  return a.inputs.size() > index ? a.inputs[index].raw() : nullptr;
}

void register_nn(KernelRegistry& registry) {
  add(registry, Op::kMatmul, [](const KernelArgs& a) {
    const Tensor &x = a.inputs[0], &w = a.inputs[1];
    generic::MatmulLayout L;
    L.transpose_a = a.attrs.b("transpose_a");
    L.transpose_b = a.attrs.b("transpose_b");
    const int ra = x.rank(), rb = w.rank();
    L.m = L.transpose_a ? x.shape()[ra - 1] : x.shape()[ra - 2];
    L.k = L.transpose_a ? x.shape()[ra - 2] : x.shape()[ra - 1];
    L.n = L.transpose_b ? w.shape()[rb - 2] : w.shape()[rb - 1];
    const Shape a_batch(x.shape().begin(), x.shape().end() - 2);
    const Shape b_batch(w.shape().begin(), w.shape().end() - 2);
    const Shape batch(a.outputs[0].shape().begin(), a.outputs[0].shape().end() - 2);
    L.batch_rank = static_cast<int>(batch.size());
    fill_strides(L.batch_shape, batch);
    fill_strides(L.a_batch_strides, broadcast_strides(a_batch, batch));
    fill_strides(L.b_batch_strides, broadcast_strides(b_batch, batch));
    L.batch = numel(batch);
    generic::launch_matmul(x.dtype(), x.raw(), w.raw(), a.outputs[0].raw(), L, stream_of(a));
  }, [](const NodeView& node) { return !matmul_fp8(node.node.attrs).on(); });  // fp8: cuBLASLt

  for (bool log : {false, true}) {
    add(registry, log ? Op::kLogSoftmax : Op::kSoftmax, [log](const KernelArgs& a) {
      const Tensor& x = a.inputs[0];
      const AxisView v = view_around(x.shape(), normalize_axis(a.attrs.i("axis"), x.rank()));
      generic::launch_softmax(x.dtype(), log, x.raw(), a.outputs[0].raw(), v.outer, v.dim, v.inner,
                              stream_of(a));
    });
    add(registry, log ? Op::kLogSoftmaxGrad : Op::kSoftmaxGrad, [log](const KernelArgs& a) {
      const Tensor &y = a.inputs[0], &dy = a.inputs[1];
      const AxisView v = view_around(y.shape(), normalize_axis(a.attrs.i("axis"), y.rank()));
      generic::launch_softmax_grad(y.dtype(), log, y.raw(), dy.raw(), a.outputs[0].raw(), v.outer,
                                   v.dim, v.inner, stream_of(a));
    });
  }

  add(registry, Op::kLayerNorm, [](const KernelArgs& a) {
    const Rows r = rows_of(a.inputs[0].shape());
    generic::launch_norm(a.inputs[0].dtype(), a.inputs[0].raw(), a.inputs[1].raw(),
                         a.inputs[2].raw(), a.outputs[0].raw(), r.rows, r.cols,
                         a.attrs.f("epsilon"), stream_of(a));
  });
  add(registry, Op::kRmsNorm, [](const KernelArgs& a) {
    const Rows r = rows_of(a.inputs[0].shape());
    generic::launch_norm(a.inputs[0].dtype(), a.inputs[0].raw(), a.inputs[1].raw(), nullptr,
                         a.outputs[0].raw(), r.rows, r.cols, a.attrs.f("epsilon"), stream_of(a));
  });
  for (Op op : {Op::kLayerNormGrad, Op::kRmsNormGrad}) {
    add(registry, op, [op](const KernelArgs& a) {
      const Rows r = rows_of(a.inputs[0].shape());
      void* dbeta = op == Op::kLayerNormGrad ? a.outputs[2].raw() : nullptr;
      generic::launch_norm_grad(a.inputs[0].dtype(), a.inputs[0].raw(), a.inputs[1].raw(),
                                a.inputs[2].raw(), a.outputs[0].raw(), a.outputs[1].raw(), dbeta,
                                r.rows, r.cols, a.attrs.f("epsilon"), stream_of(a));
    });
  }

  add(registry, Op::kCrossEntropy, [](const KernelArgs& a) {
    const Tensor &logits = a.inputs[0], &labels = a.inputs[1];
    const Rows r = rows_of(logits.shape());
    generic::launch_cross_entropy(logits.dtype(), logits.raw(), labels.dtype(), labels.raw(),
                                  a.outputs[0].raw(), r.rows, r.cols, a.attrs.i("ignore_index"),
                                  reduction_code(a.attrs), stream_of(a));
  });
  add(registry, Op::kCrossEntropyGrad, [](const KernelArgs& a) {
    const Tensor &logits = a.inputs[0], &labels = a.inputs[1];
    const Rows r = rows_of(logits.shape());
    generic::launch_cross_entropy_grad(logits.dtype(), logits.raw(), labels.dtype(), labels.raw(),
                                       a.inputs[2].raw(), a.outputs[0].raw(), r.rows, r.cols,
                                       a.attrs.i("ignore_index"), reduction_code(a.attrs),
                                       stream_of(a));
  });

  // Scores of one query live in shared memory: at most attention_max_keys() keys. Layout
  // "bhtd" only ("bthd" is cuda-attention's), one key/value head per query head (grouped-query
  // attention is cuda-attention's too).
  Supports attention_fits = [](const NodeView& node) {
    if (node.node.attrs.s("layout") != "bhtd") return false;
    const TensorType &q = node.input_types[0], &k = node.input_types[1];
    if (Shape(q.shape.begin(), q.shape.end() - 2) != Shape(k.shape.begin(), k.shape.end() - 2))
      return false;
    return k.shape[k.rank() - 2] <= generic::attention_max_keys();
  };
  add(registry, Op::kAttention, [](const KernelArgs& a) {
    const Tensor &q = a.inputs[0], &k = a.inputs[1], &v = a.inputs[2];
    const AttentionDims d = attention_dims(q, k, v);
    generic::launch_attention(q.dtype(), q.raw(), k.raw(), v.raw(), key_bias(a, 3), a.outputs[0].raw(),
                              a.outputs[1].raw(), d.batch, d.tq, d.tk, d.d, d.dv, d.bias_heads,
                              a.attrs.b("causal"), attention_scale(a.attrs, d.d), stream_of(a));
  }, attention_fits);
  add(registry, Op::kAttentionGrad, [](const KernelArgs& a) {
    const Tensor &q = a.inputs[0], &k = a.inputs[1], &v = a.inputs[2];
    const AttentionDims d = attention_dims(q, k, v);
    // inputs: q, k, v, out, dout, lse [, key_bias].
    generic::launch_attention_grad(q.dtype(), q.raw(), k.raw(), v.raw(), key_bias(a, 6), a.inputs[3].raw(),
                                   a.inputs[4].raw(), a.inputs[5].raw(), a.outputs[0].raw(),
                                   a.outputs[1].raw(), a.outputs[2].raw(), d.batch, d.tq, d.tk,
                                   d.d, d.dv, d.bias_heads, a.attrs.b("causal"), attention_scale(a.attrs, d.d),
                                   stream_of(a));
  }, attention_fits);

  // The simple update kernels read param, gradient and state as one element type; mixed
  // precision (16-bit gradients, f32 state) is cuda-nn's (the conformance sweep found these
  // reading a bf16 gradient as f32).
  const auto one_element_type = [](int count) {
    return [count](const NodeView& node) {
      for (int i = 1; i < count; ++i)
        if (node.input_types[i].dtype != node.input_types[0].dtype) return false;
      return true;
    };
  };
  add(registry, Op::kOptimizerUpdate, [](const KernelArgs& a) {
    const size_t k = a.inputs.size();
    nn::UpdateTensor x{};
    x.param = a.inputs[0].raw();
    x.grad = a.inputs[1].raw();
    x.param_out = a.outputs[0].raw();
    for (size_t j = 0; 2 + j + 2 < k; ++j) {
      x.slots[j] = a.inputs[2 + j].raw();
      x.slots_out[j] = a.outputs[1 + j].raw();
    }
    x.n = a.inputs[0].numel();
    const std::string& name = a.attrs.s("optimizer");
    generic::launch_optimizer_update(name.c_str(), optim::hyper_values(optim::optimizer_def(name), a.attrs),
                                     a.inputs[0].dtype(), x, a.inputs[k - 2].dtype(), a.inputs[k - 2].raw(),
                                     a.inputs[k - 1].dtype(), a.inputs[k - 1].raw(), stream_of(a));
  }, [one_element_type](const NodeView& node) {
    return optim::optimizer_def(node.node.attrs.s("optimizer")).elementwise &&
           one_element_type(static_cast<int>(node.input_types.size()) - 2)(node);
  }, true);
}

// ---- collectives (ops/collective.h) -------------------------------------------------------------

void register_collectives(KernelRegistry& registry) {
  // The op's own kernel calls the communicator (NCCL here), which enqueues on args.stream: the
  // executor's communication stream.
  for (Op op : {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter}) add(registry, op, op_def(op).reference);
  // The join adds no bytes (a view, memory_plan.h); a copy only where the plan keeps one.
  add(registry, Op::kCollectiveWait,
      [](const KernelArgs& a) { copy_bytes(a.inputs[0], a.outputs[0], stream_of(a)); }, nullptr,
      /*in_place_ok=*/true);
  // offload and reload (ops/transfer.cc): one side is pinned host memory (a host-resident state
  // input, or an offload written straight into one); cudaMemcpyDefault lets the pointers say
  // which, and a copy to or from pinned memory is asynchronous and captured into the graph.
  for (Op op : {Op::kOffload, Op::kReload})
    add(registry, op, [](const KernelArgs& a) {
      if (a.inputs[0].raw() == a.outputs[0].raw() || a.outputs[0].bytes() == 0) return;
      KILN_CUDA_CHECK(cudaMemcpyAsync(a.outputs[0].raw(), a.inputs[0].raw(), a.outputs[0].bytes(),
                                      cudaMemcpyDefault, stream_of(a)));
    });
  add(registry, Op::kLocalShard, [](const KernelArgs& a) {
    KILN_CHECK(a.communicator != nullptr, "local_shard needs a process group");
    const Tensor& x = a.inputs[0];
    const Tensor& y = a.outputs[0];
    Tensor from = x.viewed(y.type(), y.bytes() * static_cast<size_t>(a.communicator->rank()));
    Tensor to = y;
    copy_bytes(from, to, stream_of(a));
  });
}

}  // namespace

void register_generic_kernels(KernelRegistry& registry) {
  register_elementwise(registry);
  register_shape(registry);
  register_reductions(registry);
  register_nn(registry);
  register_collectives(registry);
}

}  // namespace kiln::cuda

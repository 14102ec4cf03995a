// The "cuda-movement" dialect: fast data movement on the GPU (kernels in movement.cu, launchers
// declared in movement.cuh), at kHandWrittenPriority, above the generic "cuda" dialect, which
// stays the simple version and the test oracle. What it takes (supports() is false elsewhere,
// and the generic kernel serves the node):
//   reshape                     any: one device-to-device copy (none when the memory plan put
//                               the output over the input)
//   transpose, slice, split,    any dtype, when the copy, after dropping size-1 axes and merging
//   concat, broadcast_to        axes that stay adjacent, is rows of contiguous bytes (the last
//                               axis stays last; slice steps on outer axes only), one element
//                               repeated along rows (broadcast of the innermost axis) or, for a
//                               transpose that moves the last axis, a batch of 2-D transposes
//                               (32x32 shared-memory tiles); concat and split of any shape
//                               (element by element where nothing better fits, e.g. pieces
//                               of width 1); each copy under 4 GiB
//   cast                        between f32, bf16 and f16 (bit-exact with the CPU reference)
//   sum                         f32/bf16/f16, when the reduced axes, after merging, are the
//                               middle of (outer, reduced, inner): column sums, row sums, sums
//                               of everything; f32 accumulation, deterministic (no atomics)
// The supports() predicates see only types and attributes; alignment is the launchers' concern
// (they take the widest access that the pointers, strides and runs allow).
#include "backends/cuda/movement/movement.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <optional>
#include <span>
#include <vector>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/registration.h"

namespace kiln::cuda {
namespace {

using movement::kMaxDims;
using movement::RowCopy;
using movement::TiledCopy;

cudaStream_t stream_of(const KernelArgs& args) { return static_cast<cudaStream_t>(args.stream); }

KernelImpl impl(std::function<bool(const NodeView&)> supports, KernelFn kernel,
                bool in_place_ok = false) {
  return KernelImpl{"cuda-movement", Device::kCuda, kHandWrittenPriority, std::move(supports),
                    std::move(kernel), in_place_ok};
}

bool storage_float(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }

// ---- copies as walks over the destination ----------------------------------------------------

// A copy seen as nested loops over `size` (outermost first): element i reads src at
// src_offset + sum i_d * src[d] and writes dst at dst_offset + sum i_d * dst[d] (elements).
struct Walk {
  std::vector<int64_t> size, src, dst;
  int64_t src_offset = 0, dst_offset = 0;
};

// The same copy with size-1 loops dropped and each loop merged into the one outside it where
// both strides continue it, so that most copies become 1 to 3 loops.
Walk simplify(const Walk& w) {
  Walk out;
  out.src_offset = w.src_offset;
  out.dst_offset = w.dst_offset;
  for (size_t d = 0; d < w.size.size(); ++d) {
    if (w.size[d] == 1) continue;
    if (!out.size.empty() && out.src.back() == w.src[d] * w.size[d] &&
        out.dst.back() == w.dst[d] * w.size[d]) {
      out.size.back() *= w.size[d];
      out.src.back() = w.src[d];
      out.dst.back() = w.dst[d];
    } else {
      out.size.push_back(w.size[d]);
      out.src.push_back(w.src[d]);
      out.dst.push_back(w.dst[d]);
    }
  }
  return out;
}

struct Plan {
  enum Kind { kNone, kEmpty, kRows, kTiled } kind = kNone;
  RowCopy rows;
  TiledCopy tiled;
};

// How the fast kernels do `walk` for elements of `elem_bytes` bytes; kNone: they do not.
// `elements`: when neither rows nor tiles fit, copy element by element through the row kernel
// (rows of one element; still vector-free but with 32-bit index arithmetic). Concat and split
// need it where size-1 trailing axes leave a strided innermost loop (pieces of width 1);
// slice does not take it (a step on the innermost axis goes to the generic kernel).
Plan plan_copy(const Walk& walk, int elem_bytes, bool elements = true) {
  Plan plan;
  int64_t count = 1;
  for (int64_t s : walk.size) count *= s;
  if (count == 0) {
    plan.kind = Plan::kEmpty;
    return plan;
  }
  if (count * elem_bytes >= movement::kMaxCopyBytes) return plan;
  const Walk w = simplify(walk);
  const int rank = static_cast<int>(w.size.size());
  const int64_t e = elem_bytes;
  const int inner = rank - 1;
  // Rows: the innermost loop is contiguous in dst and contiguous (or repeated) in src.
  if (rank == 0 || (w.dst[inner] == 1 && (w.src[inner] == 1 || w.src[inner] == 0))) {
    if (rank - 1 > kMaxDims) return plan;
    RowCopy& r = plan.rows;
    r.dims = std::max(rank - 1, 0);
    for (int d = 0; d < r.dims; ++d) {
      r.size[d] = w.size[d];
      r.src_stride[d] = w.src[d] * e;
      r.dst_stride[d] = w.dst[d] * e;
    }
    r.src_offset = w.src_offset * e;
    r.dst_offset = w.dst_offset * e;
    r.run_bytes = (rank == 0 ? 1 : w.size[inner]) * e;
    r.elem_bytes = elem_bytes;
    r.replicate = rank > 0 && w.src[inner] == 0;
    plan.kind = Plan::kRows;
    return plan;
  }
  // Tiles: dst is contiguous along the innermost loop a, src along another loop b.
  int b = -1;
  for (int d = 0; d < inner; ++d)
    if (w.src[d] == 1) b = d;
  if (w.dst[inner] != 1 || b < 0 || rank - 2 > kMaxDims) {
    if (!elements || rank > kMaxDims) return plan;
    RowCopy& r = plan.rows;
    r.dims = rank;
    for (int d = 0; d < rank; ++d) {
      r.size[d] = w.size[d];
      r.src_stride[d] = w.src[d] * e;
      r.dst_stride[d] = w.dst[d] * e;
    }
    r.src_offset = w.src_offset * e;
    r.dst_offset = w.dst_offset * e;
    r.run_bytes = e;
    r.elem_bytes = elem_bytes;
    plan.kind = Plan::kRows;
    return plan;
  }
  TiledCopy& t = plan.tiled;
  t.size_a = w.size[inner];
  t.src_stride_a = w.src[inner];
  t.size_b = w.size[b];
  t.dst_stride_b = w.dst[b];
  for (int d = 0; d < inner; ++d) {
    if (d == b) continue;
    t.batch_size[t.batch_dims] = w.size[d];
    t.batch_src_stride[t.batch_dims] = w.src[d];
    t.batch_dst_stride[t.batch_dims++] = w.dst[d];
  }
  t.src_offset = w.src_offset;
  t.dst_offset = w.dst_offset;
  t.elem_bytes = elem_bytes;
  plan.kind = Plan::kTiled;
  return plan;
}

void run_plan(const Plan& plan, const void* src, void* dst, cudaStream_t stream) {
  switch (plan.kind) {
    case Plan::kRows: return movement::copy_rows(src, dst, plan.rows, stream);
    case Plan::kTiled: return movement::copy_tiled(src, dst, plan.tiled, stream);
    case Plan::kEmpty: return;
    case Plan::kNone: break;
  }
  fail("cuda-movement: a copy the fast kernels do not take reached them (supports() said yes)");
}

int elem_bytes(DType d) { return static_cast<int>(dtype_size(d)); }
int elem_bytes(const TensorType& t) { return elem_bytes(t.dtype); }

// transpose: output dim d is input dim perm[d] (perm [] reverses the axes).
Walk transpose_walk(const Shape& in, const Shape& out, const Attributes& attrs) {
  const int rank = static_cast<int>(in.size());
  std::vector<int64_t> perm = attrs.ints("perm");
  if (perm.empty())
    for (int d = rank - 1; d >= 0; --d) perm.push_back(d);
  const std::vector<int64_t> in_strides = strides_of(in);
  Walk w{out, {}, strides_of(out)};
  for (int d = 0; d < rank; ++d) w.src.push_back(in_strides[normalize_axis(perm[d], rank)]);
  return w;
}

Walk slice_walk(const Shape& in, const Shape& out, const Attributes& attrs) {
  const std::vector<int64_t>& starts = attrs.ints("starts");
  const std::vector<int64_t>& steps = attrs.ints("steps");
  const std::vector<int64_t> in_strides = strides_of(in);
  Walk w{out, {}, strides_of(out)};
  for (size_t d = 0; d < in.size(); ++d) {
    const int64_t start = starts[d] < 0 ? starts[d] + in[d] : starts[d];
    const int64_t step = steps.empty() ? 1 : steps[d];
    w.src.push_back(step * in_strides[d]);
    // An empty output reads nothing; its start may be the dim itself.
    if (numel(out) > 0) w.src_offset += start * in_strides[d];
  }
  return w;
}

Walk broadcast_walk(const Shape& in, const Shape& out) {
  return Walk{out, broadcast_strides(in, out), strides_of(out)};
}

// concat input (into_big) or split output (!into_big) `small`, at `axis_offset` along `axis`
// of the big tensor.
Walk block_walk(const Shape& small, const Shape& big, int axis, int64_t axis_offset,
                bool into_big) {
  const std::vector<int64_t> big_strides = strides_of(big);
  Walk w{small, strides_of(small), big_strides};
  if (into_big) {
    w.dst_offset = axis_offset * big_strides[axis];
  } else {
    std::swap(w.src, w.dst);
    w.src_offset = axis_offset * big_strides[axis];
  }
  return w;
}

std::vector<Walk> concat_walks(std::span<const TensorType> in, const TensorType& out,
                               const Attributes& attrs) {
  const int axis = normalize_axis(attrs.i("axis"), out.rank());
  std::vector<Walk> walks;
  int64_t offset = 0;
  for (const TensorType& t : in) {
    walks.push_back(block_walk(t.shape, out.shape, axis, offset, /*into_big=*/true));
    offset += t.shape[axis];
  }
  return walks;
}

std::vector<Walk> split_walks(const TensorType& in, std::span<const TensorType> out,
                              const Attributes& attrs) {
  const int axis = normalize_axis(attrs.i("axis"), in.rank());
  std::vector<Walk> walks;
  int64_t offset = 0;
  for (const TensorType& t : out) {
    walks.push_back(block_walk(t.shape, in.shape, axis, offset, /*into_big=*/false));
    offset += t.shape[axis];
  }
  return walks;
}

bool all_planned(const std::vector<Walk>& walks, int elem) {
  for (const Walk& w : walks)
    if (plan_copy(w, elem).kind == Plan::kNone) return false;
  return true;
}

std::vector<TensorType> types_of(std::span<const Tensor> tensors) {
  std::vector<TensorType> types;
  for (const Tensor& t : tensors) types.push_back(t.type());
  return types;
}

// ---- sum ------------------------------------------------------------------------------------------

// x seen as (outer, reduced, inner) with the sum over the middle, or nullopt when the reduced
// axes (after dropping size-1 axes and merging neighbours) are not one middle block.
struct MiddleSum {
  int64_t outer = 1, reduced = 1, inner = 1;
};
std::optional<MiddleSum> middle_sum(const Shape& shape, const std::vector<int64_t>& axes) {
  const int rank = static_cast<int>(shape.size());
  std::vector<bool> is_reduced(rank, axes.empty());
  for (int64_t a : axes) is_reduced[normalize_axis(a, rank)] = true;
  // Runs of equal status, outermost first.
  std::vector<std::pair<bool, int64_t>> runs;
  for (int d = 0; d < rank; ++d) {
    if (shape[d] == 1) continue;
    if (!runs.empty() && runs.back().first == is_reduced[d]) {
      runs.back().second *= shape[d];
    } else {
      runs.emplace_back(is_reduced[d], shape[d]);
    }
  }
  MiddleSum m;
  size_t i = 0;
  if (i < runs.size() && !runs[i].first) m.outer = runs[i++].second;
  if (i < runs.size() && runs[i].first) m.reduced = runs[i++].second;
  if (i < runs.size() && !runs[i].first) m.inner = runs[i++].second;
  if (i != runs.size()) return std::nullopt;
  // Nothing reduced: a copy through the column kernel with one row (all of x in `inner`).
  if (m.reduced == 1 && m.inner == 1) std::swap(m.outer, m.inner);
  return m;
}

bool sum_supported(const NodeView& n) {
  const TensorType& x = n.input_types[0];
  return storage_float(x.dtype) && n.output_types[0].dtype == x.dtype &&
         middle_sum(x.shape, n.node.attrs.ints("axes")).has_value();
}

}  // namespace

void register_movement_kernels(KernelRegistry& registry) {
  // Same bytes, another shape. in_place_ok: when the memory plan puts the output over the
  // input there is nothing to copy.
  registry.add(Op::kReshape, impl(nullptr,
                                  [](const KernelArgs& a) {
                                    const Tensor &x = a.inputs[0], &y = a.outputs[0];
                                    if (x.raw() == y.raw() || y.bytes() == 0) return;
                                    KILN_CUDA_CHECK(cudaMemcpyAsync(y.raw(), x.raw(), y.bytes(),
                                                                    cudaMemcpyDeviceToDevice,
                                                                    stream_of(a)));
                                  },
                                  /*in_place_ok=*/true));

  registry.add(Op::kTranspose,
               impl(
                   [](const NodeView& n) {
                     const TensorType &x = n.input_types[0], &y = n.output_types[0];
                     return plan_copy(transpose_walk(x.shape, y.shape, n.node.attrs),
                                      elem_bytes(x))
                                .kind != Plan::kNone;
                   },
                   [](const KernelArgs& a) {
                     const Tensor &x = a.inputs[0], &y = a.outputs[0];
                     run_plan(plan_copy(transpose_walk(x.shape(), y.shape(), a.attrs),
                                        elem_bytes(x.dtype())),
                              x.raw(), y.raw(), stream_of(a));
                   }));

  registry.add(Op::kSlice,
               impl(
                   [](const NodeView& n) {
                     const TensorType &x = n.input_types[0], &y = n.output_types[0];
                     return plan_copy(slice_walk(x.shape, y.shape, n.node.attrs), elem_bytes(x),
                                      /*elements=*/false)
                                .kind != Plan::kNone;
                   },
                   [](const KernelArgs& a) {
                     const Tensor &x = a.inputs[0], &y = a.outputs[0];
                     run_plan(plan_copy(slice_walk(x.shape(), y.shape(), a.attrs),
                                        elem_bytes(x.dtype()), /*elements=*/false),
                              x.raw(), y.raw(), stream_of(a));
                   }));

  registry.add(Op::kBroadcastTo,
               impl(
                   [](const NodeView& n) {
                     const TensorType &x = n.input_types[0], &y = n.output_types[0];
                     return plan_copy(broadcast_walk(x.shape, y.shape), elem_bytes(x)).kind !=
                            Plan::kNone;
                   },
                   [](const KernelArgs& a) {
                     const Tensor &x = a.inputs[0], &y = a.outputs[0];
                     run_plan(plan_copy(broadcast_walk(x.shape(), y.shape()),
                                        elem_bytes(x.dtype())),
                              x.raw(), y.raw(), stream_of(a));
                   }));

  registry.add(Op::kConcat,
               impl(
                   [](const NodeView& n) {
                     return all_planned(
                         concat_walks(n.input_types, n.output_types[0], n.node.attrs),
                         elem_bytes(n.output_types[0]));
                   },
                   [](const KernelArgs& a) {
                     const Tensor& y = a.outputs[0];
                     const std::vector<Walk> walks =
                         concat_walks(types_of(a.inputs), y.type(), a.attrs);
                     for (size_t k = 0; k < walks.size(); ++k)
                       run_plan(plan_copy(walks[k], elem_bytes(y.dtype())), a.inputs[k].raw(),
                                y.raw(), stream_of(a));
                   }));

  registry.add(Op::kSplit,
               impl(
                   [](const NodeView& n) {
                     return all_planned(
                         split_walks(n.input_types[0], n.output_types, n.node.attrs),
                         elem_bytes(n.input_types[0]));
                   },
                   [](const KernelArgs& a) {
                     const Tensor& x = a.inputs[0];
                     const std::vector<Walk> walks =
                         split_walks(x.type(), types_of(a.outputs), a.attrs);
                     for (size_t k = 0; k < walks.size(); ++k)
                       run_plan(plan_copy(walks[k], elem_bytes(x.dtype())), x.raw(),
                                a.outputs[k].raw(), stream_of(a));
                   }));

  registry.add(Op::kCast, impl(
                              [](const NodeView& n) {
                                const DType from = n.input_types[0].dtype;
                                const DType to = n.output_types[0].dtype;
                                return storage_float(from) && storage_float(to) && from != to;
                              },
                              [](const KernelArgs& a) {
                                const Tensor &x = a.inputs[0], &y = a.outputs[0];
                                movement::cast(x.dtype(), y.dtype(), x.raw(),
                                               y.raw(), x.numel(), stream_of(a));
                              }));

  registry.add(Op::kSum, impl(sum_supported, [](const KernelArgs& a) {
                 const Tensor &x = a.inputs[0], &y = a.outputs[0];
                 const MiddleSum m = *middle_sum(x.shape(), a.attrs.ints("axes"));
                 movement::sum_middle(x.dtype(), x.raw(), y.raw(), m.outer, m.reduced,
                                      m.inner, stream_of(a));
               }));
}

}  // namespace kiln::cuda

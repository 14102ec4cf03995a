// The "cuda-conv" dialect: the CNN ops on NCHW tensors, every float dtype (f32, f64, f16, bf16;
// 16-bit products accumulate in f32), at kLibraryPriority (a cuDNN dialect would go above it).
// No cuDNN needed: the convolutions are im2col (conv.cu) and cuBLASLt products (cublaslt.h),
// one strided-batched product per chunk of images, with P = OH * OW and K = C * KH * KW:
//   conv2d              y[n] (O, P) = W (O, K) @ col[n] (K, P)            (W broadcast over n)
//   conv2d_grad_input   dcol[n] (K, P) = W^T @ dy[n] (O, P), then col2im sums the taps into dx
//                       (dcol in f32 for 16-bit types: one rounding, at the end)
//   conv2d_grad_weight  dW (O, K) = dy (O, n * P) @ col^T (n * P, K) over the chunk's images,
//                       accumulated over the chunks (in f32 for 16-bit types when there are
//                       several, cast to dW's type once at the end)
// A 1x1 convolution with stride 1 and no padding needs no im2col: x[n] (C, H * W) is its own
// column matrix, and dcol[n] is dx[n]. Groups: group g's rows of W, of the column matrix and of
// y are contiguous blocks, so each group is the same products on offsets (O / groups, K / groups);
// a depthwise convolution (groups = C > 1) runs direct kernels instead (conv.cu), products of
// one row per group being launch-bound.
//   max_pool2d, avg_pool2d (+ their grads)   direct kernels (conv.cu), one thread per element
// Scratch (column matrices, dy regrouped per channel, f32 accumulators) comes from the
// stream-ordered allocator (scratch.cuh; legal inside the step's CUDA-graph capture, no host
// synchronization), at most conv::kScratchBytes per chunk of images (always at least one
// image's). f32 products use TF32 only where the matmul dialect does (matmul_allow_tf32()).
#include "backends/cuda/conv/conv.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <optional>
#include <tuple>

#include "backends/cuda/cublaslt/cublaslt.h"
#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/movement/movement.cuh"
#include "backends/cuda/registration.h"
#include "backends/cuda/common/scratch.cuh"

namespace kiln::cuda {
namespace {

using conv::Window;

cudaStream_t stream_of(const KernelArgs& args) { return static_cast<cudaStream_t>(args.stream); }

KernelImpl impl(std::function<bool(const NodeView&)> supports, KernelFn kernel) {
  return KernelImpl{"cuda-conv", Device::kCuda, kLibraryPriority, std::move(supports),
                    std::move(kernel)};
}

// Every input and output is of the first output's float dtype (inference makes them so).
bool one_float_type(const NodeView& n) {
  const DType t = n.output_types[0].dtype;
  if (!is_float(t)) return false;
  for (const TensorType& in : n.input_types)
    if (in.dtype != t) return false;
  return true;
}

std::pair<int64_t, int64_t> pair_attr(const Attributes& attrs, const char* name) {
  const std::vector<int64_t>& v = attrs.ints(name);
  return {v[0], v[1]};
}

// Element `offset` of t's storage (images are contiguous blocks in NCHW).
std::byte* at(const Tensor& t, int64_t offset) {
  return t.raw() + offset * static_cast<int64_t>(dtype_size(t.dtype()));
}

// `p` advanced by `elements` of dtype t.
const void* advance(const void* p, int64_t elements, DType t) {
  return static_cast<const std::byte*>(p) + elements * static_cast<int64_t>(dtype_size(t));
}
void* advance(void* p, int64_t elements, DType t) {
  return static_cast<std::byte*>(p) + elements * static_cast<int64_t>(dtype_size(t));
}

void fill_zeros(const Tensor& t, cudaStream_t stream) {
  if (t.bytes() > 0) KILN_CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.bytes(), stream));
}

// ---- convolution -----------------------------------------------------------------------------

// A convolution node as products: x (N, C, H, W) (the input, or dx), w (O, C / groups, KH, KW),
// y (N, O, OH, OW) (the output, or dy).
struct ConvShape {
  Window win;
  int64_t n, c, o;
  int64_t k;      // C * KH * KW: the column matrix's rows
  int64_t plane;  // OH * OW: an image's columns
  int64_t groups;
  bool identity;  // 1x1, stride 1, no padding: x[n] (C, H * W) is its own column matrix

  int64_t x_image() const { return c * win.h * win.w; }
  int64_t y_image() const { return o * plane; }
  int64_t group_k() const { return k / groups; }  // W's row length: C / groups * KH * KW
  int64_t group_o() const { return o / groups; }  // output channels per group
  bool depthwise() const { return groups > 1 && groups == c; }
};

ConvShape conv_shape(const Shape& x, const Shape& w, const Shape& y, const Attributes& attrs) {
  ConvShape s;
  s.win.h = x[2];
  s.win.w = x[3];
  s.win.oh = y[2];
  s.win.ow = y[3];
  s.win.kh = w[2];
  s.win.kw = w[3];
  std::tie(s.win.sh, s.win.sw) = pair_attr(attrs, "stride");
  std::tie(s.win.ph, s.win.pw) = pair_attr(attrs, "padding");
  s.n = x[0];
  s.c = x[1];
  s.o = w[0];
  s.k = s.c * s.win.kh * s.win.kw;
  s.plane = s.win.oh * s.win.ow;
  s.groups = attrs.i("groups");
  s.identity = s.win.kh == 1 && s.win.kw == 1 && s.win.sh == 1 && s.win.sw == 1 &&
               s.win.ph == 0 && s.win.pw == 0;
  return s;
}

// The kernels' index limits and cuBLASLt's int32 sizes (m, n, k and the batch count; a chunk's
// n * P stays under them through kScratchBytes).
bool conv_supported(const NodeView& node, const Shape& x, const Shape& w, const Shape& y) {
  if (!one_float_type(node)) return false;
  const ConvShape s = conv_shape(x, w, y, node.node.attrs);
  return conv::window_fits(s.win) && s.n <= INT_MAX && s.o <= INT_MAX && s.k <= INT_MAX &&
         s.plane <= INT_MAX;
}

// A product of `in` operands into `out`, TF32 as the matmul dialect has it.
Gemm product(DType in, DType out) {
  Gemm g;
  g.a_type = in;
  g.d_type = out;
  g.tf32 = in == DType::kF32 && matmul_allow_tf32();
  return g;
}

// What 16-bit products accumulate in: f32 (f64 stays f64).
DType wide(DType t) { return t == DType::kF64 ? DType::kF64 : DType::kF32; }

void conv2d_kernel(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &w = args.inputs[1];
  const Tensor& y = args.outputs[0];
  const ConvShape s = conv_shape(x.shape(), w.shape(), y.shape(), args.attrs);
  const cudaStream_t stream = stream_of(args);
  if (y.numel() == 0) return;
  if (s.k == 0) return fill_zeros(y, stream);  // no input channels: an empty sum
  const DType t = x.dtype();
  if (s.depthwise())
    return conv::depthwise_conv(t, x.raw(), w.raw(), y.raw(), s.n, s.c, s.o / s.c, s.win, stream);
  const int64_t per_image = s.identity ? 0 : s.k * s.plane * dtype_size(t);
  const int64_t chunk = conv::images_per_chunk(per_image, s.n);
  std::optional<Scratch> col;
  if (!s.identity) col.emplace(chunk * per_image, stream);
  for (int64_t first = 0; first < s.n; first += chunk) {
    const int64_t count = std::min(chunk, s.n - first);
    Gemm g = product(t, t);
    g.m = s.group_o();
    g.n = s.plane;
    g.k = s.group_k();
    g.batch = count;
    g.stride_a = 0;
    g.stride_c = g.stride_d = s.y_image();  // a group's rows of each image
    const void* b = at(x, first * s.x_image());
    int64_t b_group = g.k * s.plane;  // elements between the groups' blocks of B
    if (s.identity) {
      g.stride_b = s.x_image();
    } else {
      conv::im2col(t, b, col->as<void>(), count, s.c, s.win, stream);
      b = col->as<void>();
      g.ldb = count * s.plane;  // image n's block: columns [n * P, (n + 1) * P)
      g.stride_b = s.plane;
      b_group = g.k * g.ldb;
    }
    for (int64_t group = 0; group < s.groups; ++group)
      g.run(GemmOperands{advance(w.raw(), group * g.m * g.k, t), advance(b, group * b_group, t),
                         nullptr, at(y, first * s.y_image() + group * g.m * s.plane)},
            stream);
  }
}

void conv2d_grad_input_kernel(const KernelArgs& args) {
  const Tensor &dy = args.inputs[0], &w = args.inputs[1];
  const Tensor& dx = args.outputs[0];
  const ConvShape s = conv_shape(dx.shape(), w.shape(), dy.shape(), args.attrs);
  const cudaStream_t stream = stream_of(args);
  if (dx.numel() == 0) return;
  if (s.o == 0) return fill_zeros(dx, stream);  // no output channels: nothing flows back
  const DType t = dy.dtype();
  if (s.depthwise())
    return conv::depthwise_conv_grad_input(t, dy.raw(), w.raw(), dx.raw(), s.n, s.c, s.o / s.c,
                                           s.win, stream);
  const DType col_t = s.identity ? t : wide(t);
  const int64_t per_image = s.identity ? 0 : s.k * s.plane * dtype_size(col_t);
  const int64_t chunk = conv::images_per_chunk(per_image, s.n);
  std::optional<Scratch> dcol;
  if (!s.identity) dcol.emplace(chunk * per_image, stream);
  for (int64_t first = 0; first < s.n; first += chunk) {
    const int64_t count = std::min(chunk, s.n - first);
    Gemm g = product(t, col_t);
    g.m = s.group_k();
    g.n = s.plane;
    g.k = s.group_o();
    g.transpose_a = true;  // W stored (O, K)
    g.batch = count;
    g.stride_a = 0;
    g.stride_b = s.y_image();
    void* d = at(dx, first * s.x_image());
    g.stride_d = g.stride_c = s.x_image();  // C's layout must be D's (C is D, not read)
    int64_t d_group = g.m * s.plane;         // elements between the groups' blocks of D
    if (!s.identity) {
      d = dcol->as<void>();
      g.ldd = g.ldc = count * s.plane;
      g.stride_d = g.stride_c = s.plane;
      d_group = g.m * g.ldd;
    }
    for (int64_t group = 0; group < s.groups; ++group)
      g.run(GemmOperands{advance(w.raw(), group * g.k * g.m, t),
                         at(dy, first * s.y_image() + group * g.k * s.plane), nullptr,
                         advance(d, group * d_group, col_t)},
            stream);
    if (!s.identity)
      conv::col2im(t, col_t, d, at(dx, first * s.x_image()), count, s.c, s.win, stream);
  }
}

// dy's images [first, first + count) (count, O, P) regrouped per channel into (O, count * P).
void channels_first(const Tensor& dy, const ConvShape& s, int64_t first, int64_t count, void* out,
                    cudaStream_t stream) {
  const int64_t e = static_cast<int64_t>(dtype_size(dy.dtype()));
  movement::RowCopy copy;
  copy.dims = 2;
  copy.size[0] = count;
  copy.size[1] = s.o;
  copy.src_stride[0] = s.y_image() * e;
  copy.src_stride[1] = s.plane * e;
  copy.dst_stride[0] = s.plane * e;
  copy.dst_stride[1] = count * s.plane * e;
  copy.run_bytes = s.plane * e;
  copy.elem_bytes = static_cast<int>(e);
  movement::copy_rows(at(dy, first * s.y_image()), out, copy, stream);
}

void conv2d_grad_weight_kernel(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &dy = args.inputs[1];
  const Tensor& dw = args.outputs[0];
  const ConvShape s = conv_shape(x.shape(), dw.shape(), dy.shape(), args.attrs);
  const cudaStream_t stream = stream_of(args);
  if (dw.numel() == 0) return;
  if (s.n == 0) return fill_zeros(dw, stream);  // no images: an empty sum
  const DType t = x.dtype();
  if (s.depthwise())
    return conv::depthwise_conv_grad_weight(t, x.raw(), dy.raw(), dw.raw(), s.n, s.c, s.o / s.c,
                                            s.win, stream);
  const int64_t e = static_cast<int64_t>(dtype_size(t));
  // A chunk of several images needs both operands regrouped: col (K, count * P), dy (O, count * P).
  const int64_t chunk = conv::images_per_chunk((s.k + s.o) * s.plane * e, s.n);
  const int64_t chunks = (s.n + chunk - 1) / chunk;
  const bool needs_col = !s.identity || chunk > 1;
  std::optional<Scratch> col, dy_grouped, acc;
  if (needs_col) col.emplace(chunk * s.k * s.plane * e, stream);
  if (chunk > 1) dy_grouped.emplace(chunk * s.o * s.plane * e, stream);
  // 16-bit sums over several chunks: in f32, rounded once.
  const DType d_t = chunks > 1 ? wide(t) : t;
  if (d_t != t) acc.emplace(dw.numel() * dtype_size(d_t), stream);
  void* d = d_t != t ? acc->as<void>() : dw.raw();
  for (int64_t first = 0; first < s.n; first += chunk) {
    const int64_t count = std::min(chunk, s.n - first);
    const void* a = at(dy, first * s.y_image());
    if (count > 1) {
      channels_first(dy, s, first, count, dy_grouped->as<void>(), stream);
      a = dy_grouped->as<void>();
    }
    const void* b = at(x, first * s.x_image());
    if (needs_col && !(s.identity && count == 1)) {
      conv::im2col(t, b, col->as<void>(), count, s.c, s.win, stream);
      b = col->as<void>();
    }
    // Both operands (rows, count * P): group g's rows are a block of each.
    Gemm g = product(t, d_t);
    g.m = s.group_o();
    g.n = s.group_k();
    g.k = count * s.plane;
    g.transpose_b = true;  // col stored (K, count * P)
    for (int64_t group = 0; group < s.groups; ++group)
      g.run(GemmOperands{advance(a, group * g.m * g.k, t), advance(b, group * g.n * g.k, t),
                         nullptr, advance(d, group * g.m * g.n, d_t), 1.0,
                         first == 0 ? 0.0 : 1.0},
            stream);
  }
  if (d_t != t) movement::cast(d_t, t, d, dw.raw(), dw.numel(), stream);
}

// ---- pooling ---------------------------------------------------------------------------------

// x (N, C, H, W) (the input, or dx), y (N, C, OH, OW) (the output, or dy); stride [] is the
// kernel.
Window pool_window(const Shape& x, const Shape& y, const Attributes& attrs) {
  Window win;
  win.h = x[2];
  win.w = x[3];
  win.oh = y[2];
  win.ow = y[3];
  std::tie(win.kh, win.kw) = pair_attr(attrs, "kernel");
  win.sh = win.kh;
  win.sw = win.kw;
  if (!attrs.ints("stride").empty()) std::tie(win.sh, win.sw) = pair_attr(attrs, "stride");
  std::tie(win.ph, win.pw) = pair_attr(attrs, "padding");
  return win;
}

// `x` is the node's (N, C, H, W) side: input 0 of the forward ops and max_pool2d_grad, the
// output of avg_pool2d_grad; `y` the other.
bool pool_supported(const NodeView& node, const Shape& x, const Shape& y) {
  return one_float_type(node) && conv::window_fits(pool_window(x, y, node.node.attrs));
}

int64_t planes_of(const Shape& x) { return x[0] * x[1]; }

}  // namespace

void register_conv_kernels(KernelRegistry& registry) {
  registry.add(Op::kConv2d, impl(
                                [](const NodeView& n) {
                                  return conv_supported(n, n.input_types[0].shape,
                                                        n.input_types[1].shape,
                                                        n.output_types[0].shape);
                                },
                                conv2d_kernel));
  registry.add(Op::kConv2dGradInput, impl(
                                         [](const NodeView& n) {
                                           return conv_supported(n, n.output_types[0].shape,
                                                                 n.input_types[1].shape,
                                                                 n.input_types[0].shape);
                                         },
                                         conv2d_grad_input_kernel));
  registry.add(Op::kConv2dGradWeight, impl(
                                          [](const NodeView& n) {
                                            return conv_supported(n, n.input_types[0].shape,
                                                                  n.output_types[0].shape,
                                                                  n.input_types[1].shape);
                                          },
                                          conv2d_grad_weight_kernel));

  registry.add(Op::kMaxPool2d, impl(
                                   [](const NodeView& n) {
                                     return pool_supported(n, n.input_types[0].shape,
                                                           n.output_types[0].shape);
                                   },
                                   [](const KernelArgs& a) {
                                     const Tensor &x = a.inputs[0], &y = a.outputs[0];
                                     conv::max_pool(x.dtype(), x.raw(), y.raw(), planes_of(x.shape()),
                                                    pool_window(x.shape(), y.shape(), a.attrs),
                                                    stream_of(a));
                                   }));
  registry.add(Op::kAvgPool2d, impl(
                                   [](const NodeView& n) {
                                     return pool_supported(n, n.input_types[0].shape,
                                                           n.output_types[0].shape);
                                   },
                                   [](const KernelArgs& a) {
                                     const Tensor &x = a.inputs[0], &y = a.outputs[0];
                                     conv::avg_pool(x.dtype(), x.raw(), y.raw(), planes_of(x.shape()),
                                                    pool_window(x.shape(), y.shape(), a.attrs),
                                                    stream_of(a));
                                   }));
  registry.add(Op::kMaxPool2dGrad,
               impl(
                   [](const NodeView& n) {
                     return pool_supported(n, n.input_types[0].shape, n.input_types[1].shape);
                   },
                   [](const KernelArgs& a) {
                     const Tensor &x = a.inputs[0], &dy = a.inputs[1], &dx = a.outputs[0];
                     conv::max_pool_grad(x.dtype(), x.raw(), dy.raw(), dx.raw(), planes_of(x.shape()),
                                         pool_window(x.shape(), dy.shape(), a.attrs), stream_of(a));
                   }));
  registry.add(Op::kAvgPool2dGrad,
               impl(
                   [](const NodeView& n) {
                     return pool_supported(n, n.output_types[0].shape, n.input_types[0].shape);
                   },
                   [](const KernelArgs& a) {
                     const Tensor &dy = a.inputs[0], &dx = a.outputs[0];
                     conv::avg_pool_grad(dy.dtype(), dy.raw(), dx.raw(), planes_of(dx.shape()),
                                         pool_window(dx.shape(), dy.shape(), a.attrs),
                                         stream_of(a));
                   }));
}

}  // namespace kiln::cuda

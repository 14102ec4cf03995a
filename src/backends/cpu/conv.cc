// Convolution and pooling fast paths in f32, NCHW (semantics in src/ops/conv.cc).
//   dialect "openblas": conv2d, conv2d_grad_input, conv2d_grad_weight as im2col / col2im around
//     one cblas_sgemm per group of images.
//   dialect "cpu": max_pool2d, avg_pool2d and their gradients, direct loops over (N * C) planes.
//
// The column matrix of a group of G images is (C * KH * KW, G * OH * OW): row (c, p, q) holds,
// for every output position of every image of the group, the input element that kernel tap
// (c, p, q) multiplies (0 in the padding). Putting the whole group side by side makes each conv
// one large GEMM (M = O, N = G * OH * OW, K = C * KH * KW), which OpenBLAS threads far better
// than G small per-image GEMMs, at the cost of a copy between the (O, G, OH * OW) GEMM layout and
// NCHW. G is bounded so that the column matrix stays near kColumnBudget floats.
//
// Threads: the GEMMs are threaded by OpenBLAS; im2col, col2im and the layout copies run on the
// calling thread, NOT split with support/parallel.h. Measured on a 16-core host with the
// pthread OpenBLAS the build links, batch 32 of 28x28: OpenMP-split im2col made conv2d 10-80x
// slower (layer 1: 19.5 ms vs 0.23 ms; layer 2: 10 ms vs 1.0 ms), because OpenMP's workers
// spin-wait after their region while OpenBLAS's own threads want the same cores (and the other
// way round); with OMP_WAIT_POLICY=passive both versions tie. The pools below have no GEMM and
// are split across threads by (n, c) plane.
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>

#include "backends/cpu/cpu_kernels.h"
#include "support/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {
namespace {

// Floats of column matrix per group: 16 MiB, so a batch of large images is done in pieces
// instead of materializing a column matrix KH * KW times the batch.
constexpr int64_t kColumnBudget = int64_t{1} << 22;

struct ConvGeometry {
  int64_t n, c, h, w;  // input (N, C, H, W)
  int64_t o, kh, kw;   // weight (O, C, KH, KW)
  int64_t oh, ow;      // output spatial size
  int64_t sh, sw, ph, pw;
  int64_t rows() const { return c * kh * kw; }  // of the column matrix
  int64_t plane() const { return oh * ow; }     // output positions per image
  // Images per GEMM.
  int64_t group() const {
    return std::clamp<int64_t>(kColumnBudget / std::max<int64_t>(rows() * plane(), 1), 1, n);
  }
};

// Shapes were checked by the op's inference; this only reads them.
ConvGeometry conv_geometry(const Shape& x, const Shape& w, const Attributes& attrs) {
  const std::vector<int64_t>& stride = attrs.ints("stride");
  const std::vector<int64_t>& padding = attrs.ints("padding");
  ConvGeometry g{x[0], x[1], x[2], x[3], w[0], w[2], w[3], 0, 0,
                 stride[0], stride[1], padding[0], padding[1]};
  g.oh = (g.h + 2 * g.ph - g.kh) / g.sh + 1;
  g.ow = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
  return g;
}

// The smallest j >= 0 with j * stride >= value.
int64_t first_at_least(int64_t value, int64_t stride) {
  return value <= 0 ? 0 : (value + stride - 1) / stride;
}

// Output columns [lo, hi) whose input column j * sw - pw + q lies inside [0, W).
struct Span {
  int64_t lo, hi;
};
Span valid_columns(const ConvGeometry& g, int64_t q) {
  const int64_t lo = std::min(first_at_least(g.pw - q, g.sw), g.ow);
  const int64_t hi = std::clamp(first_at_least(g.w + g.pw - q, g.sw), lo, g.ow);
  return {lo, hi};
}

// Writes the rows (c, *, *) of the column matrix for one image (block `image` of ld columns).
void im2col_channel(const float* x_image, const ConvGeometry& g, int64_t c, float* col,
                    int64_t ld, int64_t image) {
  const float* x_plane = x_image + c * g.h * g.w;
  for (int64_t p = 0; p < g.kh; ++p)
    for (int64_t q = 0; q < g.kw; ++q) {
      float* dst = col + ((c * g.kh + p) * g.kw + q) * ld + image * g.plane();
      const Span cols = valid_columns(g, q);
      for (int64_t i = 0; i < g.oh; ++i, dst += g.ow) {
        const int64_t hh = i * g.sh - g.ph + p;
        if (hh < 0 || hh >= g.h) {
          std::fill(dst, dst + g.ow, 0.0f);
          continue;
        }
        const float* src = x_plane + hh * g.w - g.pw + q;  // src[j * sw] is column j's input
        std::fill(dst, dst + cols.lo, 0.0f);
        if (g.sw == 1) {
          std::memcpy(dst + cols.lo, src + cols.lo, (cols.hi - cols.lo) * sizeof(float));
        } else {
          for (int64_t j = cols.lo; j < cols.hi; ++j) dst[j] = src[j * g.sw];
        }
        std::fill(dst + cols.hi, dst + g.ow, 0.0f);
      }
    }
}

// Adds the rows (c, *, *) of a column-matrix gradient back into one image's dx plane c (which
// must start zeroed): the transpose of im2col_channel.
void col2im_channel(const float* col, int64_t ld, int64_t image, const ConvGeometry& g, int64_t c,
                    float* dx_image) {
  float* dx_plane = dx_image + c * g.h * g.w;
  for (int64_t p = 0; p < g.kh; ++p)
    for (int64_t q = 0; q < g.kw; ++q) {
      const float* src = col + ((c * g.kh + p) * g.kw + q) * ld + image * g.plane();
      const Span cols = valid_columns(g, q);
      for (int64_t i = 0; i < g.oh; ++i, src += g.ow) {
        const int64_t hh = i * g.sh - g.ph + p;
        if (hh < 0 || hh >= g.h) continue;
        float* dst = dx_plane + hh * g.w - g.pw + q;
        for (int64_t j = cols.lo; j < cols.hi; ++j) dst[j * g.sw] += src[j];
      }
    }
}

// Planes per thread chunk, for work of `per_plane` elements each.
int64_t plane_grain(int64_t per_plane) {
  return std::max<int64_t>(1, kGrainCheap / std::max<int64_t>(per_plane, 1));
}

// Column matrix of images [first, first + count) of x.
void im2col_group(const float* x, const ConvGeometry& g, int64_t first, int64_t count,
                  float* col) {
  const int64_t ld = count * g.plane();
  for (int64_t image = 0; image < count; ++image)
    for (int64_t c = 0; c < g.c; ++c)
      im2col_channel(x + (first + image) * g.c * g.h * g.w, g, c, col, ld, image);
}

// Copies between NCHW (images [first, first + count) of t, with `channels` channels) and the
// GEMM layout (channels, count * plane).
void nchw_to_gemm(const float* t, int64_t channels, int64_t plane, int64_t first, int64_t count,
                  float* gemm_layout) {
  for (int64_t image = 0; image < count; ++image)
    for (int64_t k = 0; k < channels; ++k)
      std::memcpy(gemm_layout + (k * count + image) * plane,
                  t + ((first + image) * channels + k) * plane, plane * sizeof(float));
}
void gemm_to_nchw(const float* gemm_layout, int64_t channels, int64_t plane, int64_t first,
                  int64_t count, float* t) {
  for (int64_t image = 0; image < count; ++image)
    for (int64_t k = 0; k < channels; ++k)
      std::memcpy(t + ((first + image) * channels + k) * plane,
                  gemm_layout + (k * count + image) * plane, plane * sizeof(float));
}

// C (m, n) = alpha-free op(A) op(B) + beta C, row-major, as stored.
void sgemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans,
              transpose_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a, static_cast<blasint>(lda),
              b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

// Uninitialized scratch (a std::vector would zero it, which every use overwrites anyway).
std::unique_ptr<float[]> scratch(int64_t count) {
  return std::unique_ptr<float[]>(new float[static_cast<size_t>(count)]);
}

// y (N, O, OH, OW) = conv(x, w): per group, Y (O, G * P) = W (O, C * KH * KW) @ col.
void conv2d_kernel(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &w = args.inputs[1];
  Tensor& y = args.outputs[0];
  const ConvGeometry g = conv_geometry(x.shape(), w.shape(), args.attrs);
  const int64_t group = g.group(), rows = g.rows(), plane = g.plane();
  auto col = scratch(rows * group * plane);
  auto gemm_out = scratch(g.o * group * plane);
  for (int64_t first = 0; first < g.n; first += group) {
    const int64_t count = std::min(group, g.n - first), ld = count * plane;
    im2col_group(x.data<float>(), g, first, count, col.get());
    // One image: the GEMM's (O, P) output already is the image's NCHW block.
    float* out = count == 1 ? y.data<float>() + first * g.o * plane : gemm_out.get();
    sgemm(false, false, g.o, ld, rows, w.data<float>(), rows, col.get(), ld, 0.0f, out, ld);
    if (count > 1) gemm_to_nchw(gemm_out.get(), g.o, plane, first, count, y.data<float>());
  }
}

// dx = col2im(W^T @ dY), per group.
void conv2d_grad_input_kernel(const KernelArgs& args) {
  const Tensor &dy = args.inputs[0], &w = args.inputs[1];
  Tensor& dx = args.outputs[0];
  const ConvGeometry g = conv_geometry(dx.shape(), w.shape(), args.attrs);
  const int64_t group = g.group(), rows = g.rows(), plane = g.plane();
  auto dcol = scratch(rows * group * plane);
  auto dy_gemm = scratch(g.o * group * plane);
  float* dx_data = dx.data<float>();
  for (int64_t first = 0; first < g.n; first += group) {
    const int64_t count = std::min(group, g.n - first), ld = count * plane;
    const float* dy_block = dy.data<float>() + first * g.o * plane;
    if (count > 1) {
      nchw_to_gemm(dy.data<float>(), g.o, plane, first, count, dy_gemm.get());
      dy_block = dy_gemm.get();
    }
    sgemm(true, false, rows, ld, g.o, w.data<float>(), rows, dy_block, ld, 0.0f, dcol.get(), ld);
    // This group's dx is written only here: zero it, then add every tap back.
    float* dx_group = dx_data + first * g.c * g.h * g.w;
    std::fill(dx_group, dx_group + count * g.c * g.h * g.w, 0.0f);
    for (int64_t image = 0; image < count; ++image)
      for (int64_t c = 0; c < g.c; ++c)
        col2im_channel(dcol.get(), ld, image, g, c, dx_group + image * g.c * g.h * g.w);
  }
}

// dW (O, C * KH * KW) = sum over groups of dY (O, G * P) @ col^T.
void conv2d_grad_weight_kernel(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &dy = args.inputs[1];
  Tensor& dw = args.outputs[0];
  const ConvGeometry g = conv_geometry(x.shape(), dw.shape(), args.attrs);
  const int64_t group = g.group(), rows = g.rows(), plane = g.plane();
  auto col = scratch(rows * group * plane);
  auto dy_gemm = scratch(g.o * group * plane);
  for (int64_t first = 0; first < g.n; first += group) {
    const int64_t count = std::min(group, g.n - first), ld = count * plane;
    im2col_group(x.data<float>(), g, first, count, col.get());
    const float* dy_block = dy.data<float>() + first * g.o * plane;
    if (count > 1) {
      nchw_to_gemm(dy.data<float>(), g.o, plane, first, count, dy_gemm.get());
      dy_block = dy_gemm.get();
    }
    sgemm(false, true, g.o, rows, ld, dy_block, ld, col.get(), ld, first == 0 ? 0.0f : 1.0f,
          dw.data<float>(), rows);
  }
}

// f32 everywhere, no empty dimension, and every GEMM dimension within BLAS's int.
bool conv_supported(const NodeView& node, const Shape& x, const Shape& w) {
  if (!all_dtype(node, DType::kF32)) return false;
  for (const Shape* s : {&x, &w, &node.output_types[0].shape})
    for (int64_t d : *s)
      if (d <= 0) return false;
  const ConvGeometry g = conv_geometry(x, w, node.node.attrs);
  return g.rows() <= INT_MAX && g.o <= INT_MAX && g.group() * g.plane() <= INT_MAX;
}

// ---- pooling ----

struct PoolGeometry {
  int64_t planes, h, w;  // planes = N * C
  int64_t oh, ow;
  int64_t kh, kw, sh, sw, ph, pw;
};

PoolGeometry pool_geometry(const Shape& x, const Attributes& attrs) {
  const std::vector<int64_t>& kernel = attrs.ints("kernel");
  std::vector<int64_t> stride = attrs.ints("stride");
  if (stride.empty()) stride = kernel;
  const std::vector<int64_t>& padding = attrs.ints("padding");
  PoolGeometry g{x[0] * x[1], x[2], x[3], 0, 0, kernel[0], kernel[1],
                 stride[0], stride[1], padding[0], padding[1]};
  g.oh = (g.h + 2 * g.ph - g.kh) / g.sh + 1;
  g.ow = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
  return g;
}

// The window of output (i, j) clipped to the input: rows [h0, h1), columns [w0, w1).
struct Clipped {
  int64_t h0, h1, w0, w1;
};
Clipped clip_window(const PoolGeometry& g, int64_t i, int64_t j) {
  const int64_t top = i * g.sh - g.ph, left = j * g.sw - g.pw;
  return {std::max<int64_t>(top, 0), std::min(top + g.kh, g.h), std::max<int64_t>(left, 0),
          std::min(left + g.kw, g.w)};
}

// Offset in the plane of the first (row-major) max of the clipped window; NaN wins, as in the
// reference. Padding <= kernel / 2 (checked by inference) makes every window non-empty.
int64_t plane_argmax(const float* plane, int64_t width, const Clipped& c) {
  int64_t best = c.h0 * width + c.w0;
  float best_value = plane[best];
  for (int64_t hh = c.h0; hh < c.h1; ++hh)
    for (int64_t ww = c.w0; ww < c.w1; ++ww) {
      const float v = plane[hh * width + ww];
      if (v > best_value || (std::isnan(v) && !std::isnan(best_value))) {
        best = hh * width + ww;
        best_value = v;
      }
    }
  return best;
}

// Calls fn(plane) for every (n, c) plane, split across threads.
template <typename Fn>
void for_each_plane(const PoolGeometry& g, Fn&& fn) {
  const int64_t per_plane = std::max(g.h * g.w, g.oh * g.ow * g.kh * g.kw);
  parallel_for(0, g.planes, plane_grain(per_plane), [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) fn(p);
  });
}

void max_pool2d_kernel(const KernelArgs& args) {
  const PoolGeometry g = pool_geometry(args.inputs[0].shape(), args.attrs);
  const float* x = args.inputs[0].data<float>();
  float* y = args.outputs[0].data<float>();
  for_each_plane(g, [&](int64_t p) {
    const float* plane = x + p * g.h * g.w;
    float* out = y + p * g.oh * g.ow;
    for (int64_t i = 0; i < g.oh; ++i)
      for (int64_t j = 0; j < g.ow; ++j)
        out[i * g.ow + j] = plane[plane_argmax(plane, g.w, clip_window(g, i, j))];
  });
}

void max_pool2d_grad_kernel(const KernelArgs& args) {
  const PoolGeometry g = pool_geometry(args.inputs[0].shape(), args.attrs);
  const float* x = args.inputs[0].data<float>();
  const float* dy = args.inputs[1].data<float>();
  float* dx = args.outputs[0].data<float>();
  for_each_plane(g, [&](int64_t p) {
    const float* plane = x + p * g.h * g.w;
    const float* grad = dy + p * g.oh * g.ow;
    float* out = dx + p * g.h * g.w;
    std::fill(out, out + g.h * g.w, 0.0f);
    for (int64_t i = 0; i < g.oh; ++i)
      for (int64_t j = 0; j < g.ow; ++j)
        out[plane_argmax(plane, g.w, clip_window(g, i, j))] += grad[i * g.ow + j];
  });
}

void avg_pool2d_kernel(const KernelArgs& args) {
  const PoolGeometry g = pool_geometry(args.inputs[0].shape(), args.attrs);
  const float* x = args.inputs[0].data<float>();
  float* y = args.outputs[0].data<float>();
  const float inv_divisor = 1.0f / static_cast<float>(g.kh * g.kw);  // padding counts
  for_each_plane(g, [&](int64_t p) {
    const float* plane = x + p * g.h * g.w;
    float* out = y + p * g.oh * g.ow;
    for (int64_t i = 0; i < g.oh; ++i)
      for (int64_t j = 0; j < g.ow; ++j) {
        const Clipped c = clip_window(g, i, j);
        float sum = 0.0f;
        for (int64_t hh = c.h0; hh < c.h1; ++hh)
          for (int64_t ww = c.w0; ww < c.w1; ++ww) sum += plane[hh * g.w + ww];
        out[i * g.ow + j] = sum * inv_divisor;
      }
  });
}

void avg_pool2d_grad_kernel(const KernelArgs& args) {
  const PoolGeometry g = pool_geometry(args.outputs[0].shape(), args.attrs);
  const float* dy = args.inputs[0].data<float>();
  float* dx = args.outputs[0].data<float>();
  const float inv_divisor = 1.0f / static_cast<float>(g.kh * g.kw);
  for_each_plane(g, [&](int64_t p) {
    const float* grad = dy + p * g.oh * g.ow;
    float* out = dx + p * g.h * g.w;
    std::fill(out, out + g.h * g.w, 0.0f);
    for (int64_t i = 0; i < g.oh; ++i)
      for (int64_t j = 0; j < g.ow; ++j) {
        const Clipped c = clip_window(g, i, j);
        const float share = grad[i * g.ow + j] * inv_divisor;
        for (int64_t hh = c.h0; hh < c.h1; ++hh)
          for (int64_t ww = c.w0; ww < c.w1; ++ww) out[hh * g.w + ww] += share;
      }
  });
}

// f32 everywhere and no empty dimension (the reference serves empty tensors).
bool pool_supported(const NodeView& node) {
  if (!all_dtype(node, DType::kF32)) return false;
  for (const TensorType* t : {&node.input_types[0], &node.output_types[0]})
    for (int64_t d : t->shape)
      if (d <= 0) return false;
  return true;
}

}  // namespace

void register_conv_kernels(KernelRegistry& registry) {
  registry.add(Op::kConv2d, KernelImpl{"openblas", Device::kCpu, kOpenBlasPriority,
                                       [](const NodeView& node) {
                                         return conv_supported(node, node.input_types[0].shape,
                                                               node.input_types[1].shape);
                                       },
                                       conv2d_kernel});
  registry.add(Op::kConv2dGradInput,
               KernelImpl{"openblas", Device::kCpu, kOpenBlasPriority,
                          [](const NodeView& node) {
                            return conv_supported(node, node.output_types[0].shape,
                                                  node.input_types[1].shape);
                          },
                          conv2d_grad_input_kernel});
  registry.add(Op::kConv2dGradWeight,
               KernelImpl{"openblas", Device::kCpu, kOpenBlasPriority,
                          [](const NodeView& node) {
                            return conv_supported(node, node.input_types[0].shape,
                                                  node.output_types[0].shape);
                          },
                          conv2d_grad_weight_kernel});
  registry.add(Op::kMaxPool2d,
               KernelImpl{"cpu", Device::kCpu, kFastPriority, pool_supported, max_pool2d_kernel});
  registry.add(Op::kMaxPool2dGrad, KernelImpl{"cpu", Device::kCpu, kFastPriority, pool_supported,
                                              max_pool2d_grad_kernel});
  registry.add(Op::kAvgPool2d,
               KernelImpl{"cpu", Device::kCpu, kFastPriority, pool_supported, avg_pool2d_kernel});
  registry.add(Op::kAvgPool2dGrad, KernelImpl{"cpu", Device::kCpu, kFastPriority, pool_supported,
                                              avg_pool2d_grad_kernel});
}

}  // namespace kiln::cpu

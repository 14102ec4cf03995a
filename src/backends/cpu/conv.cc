// Convolution and pooling fast paths in f32, NCHW (semantics in src/ops/conv.cc).
//   dialect "openblas": conv2d, conv2d_grad_input, conv2d_grad_weight as im2col / col2im around
//     cblas_sgemm, one per chunk of images and group of channels; not the depthwise ones.
//   dialect "cpu": depthwise convolutions (groups = C > 1: one filter plane per output channel)
//     and their gradients as direct loops over (N * O) planes; max_pool2d, avg_pool2d and their
//     gradients, direct loops over (N * C) planes.
//
// The column matrix of a chunk of G images is (C * KH * KW, G * OH * OW): row (c, p, q) holds,
// for every output position of every image of the chunk, the input element that kernel tap
// (c, p, q) multiplies (0 in the padding). Putting the whole chunk side by side makes each conv
// one large GEMM per group (M = O / groups, N = G * OH * OW, K = C / groups * KH * KW), which
// OpenBLAS threads far better than G small per-image GEMMs, at the cost of a copy between the
// (O, G, OH * OW) GEMM layout and NCHW. Group g's rows of the column matrix, of W and of the
// GEMM output are contiguous blocks (channels [g * C / groups, ...)), so a group is a GEMM on
// offsets of the same buffers. G is bounded so that the column matrix stays near kColumnBudget
// floats.
//
// A depthwise convolution is a GEMM of one row per group (K = KH * KW): OpenBLAS's per-call cost
// and im2col's copy dominate it, so the "cpu" dialect runs it directly: per output plane, each
// tap adds a shifted row of the input times one weight (stride 1: contiguous, vectorized).
//
// Threads: the GEMMs are threaded by OpenBLAS; im2col, col2im and the layout copies run on the
// calling thread, NOT split with support/parallel.h. Measured on a 16-core host with the
// pthread OpenBLAS the build links, batch 32 of 28x28: OpenMP-split im2col made conv2d 10-80x
// slower (layer 1: 19.5 ms vs 0.23 ms; layer 2: 10 ms vs 1.0 ms), because OpenMP's workers
// spin-wait after their region while OpenBLAS's own threads want the same cores (and the other
// way round); with OMP_WAIT_POLICY=passive both versions tie. The depthwise convolutions and the
// pools below have no GEMM and are split across threads by plane.
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>

#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/row_ops.h"
#include "support/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {
namespace {

// Floats of column matrix per chunk: 16 MiB, so a batch of large images is done in pieces
// instead of materializing a column matrix KH * KW times the batch.
constexpr int64_t kColumnBudget = int64_t{1} << 22;

struct ConvGeometry {
  int64_t n, c, h, w;  // input (N, C, H, W)
  int64_t o, kh, kw;   // weight (O, C / groups, KH, KW)
  int64_t oh, ow;      // output spatial size
  int64_t sh, sw, ph, pw;
  int64_t groups;
  int64_t rows() const { return c * kh * kw; }                  // of the column matrix
  int64_t group_rows() const { return rows() / groups; }        // one group's: W's row length
  int64_t group_outputs() const { return o / groups; }          // output channels per group
  int64_t plane() const { return oh * ow; }                     // output positions per image
  int64_t in_plane() const { return h * w; }
  // Images per GEMM.
  int64_t chunk() const {
    return std::clamp<int64_t>(kColumnBudget / std::max<int64_t>(rows() * plane(), 1), 1, n);
  }
  // One filter plane per output channel, reading input channel o / (O / C).
  bool depthwise() const { return groups > 1 && groups == c; }
};

// Shapes were checked by the op's inference; this only reads them.
ConvGeometry conv_geometry(const Shape& x, const Shape& w, const Attributes& attrs) {
  const std::vector<int64_t>& stride = attrs.ints("stride");
  const std::vector<int64_t>& padding = attrs.ints("padding");
  ConvGeometry g{x[0],      x[1],      x[2],       x[3],       w[0], w[2], w[3], 0, 0,
                 stride[0], stride[1], padding[0], padding[1], attrs.i("groups")};
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
void im2col_chunk(const float* x, const ConvGeometry& g, int64_t first, int64_t count,
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

// y (N, O, OH, OW) = conv(x, w): per chunk and group, Y_g (O / groups, G * P) =
// W_g (O / groups, C / groups * KH * KW) @ col_g.
void conv2d_kernel(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &w = args.inputs[1];
  Tensor& y = args.outputs[0];
  const ConvGeometry g = conv_geometry(x.shape(), w.shape(), args.attrs);
  const int64_t chunk = g.chunk(), plane = g.plane();
  const int64_t k = g.group_rows(), m = g.group_outputs();
  auto col = scratch(g.rows() * chunk * plane);
  auto gemm_out = scratch(g.o * chunk * plane);
  for (int64_t first = 0; first < g.n; first += chunk) {
    const int64_t count = std::min(chunk, g.n - first), ld = count * plane;
    im2col_chunk(x.data<float>(), g, first, count, col.get());
    // One image: the GEMM's (O, P) output already is the image's NCHW block.
    float* out = count == 1 ? y.data<float>() + first * g.o * plane : gemm_out.get();
    for (int64_t group = 0; group < g.groups; ++group)
      sgemm(false, false, m, ld, k, w.data<float>() + group * m * k, k, col.get() + group * k * ld,
            ld, 0.0f, out + group * m * ld, ld);
    if (count > 1) gemm_to_nchw(gemm_out.get(), g.o, plane, first, count, y.data<float>());
  }
}

// dx = col2im(W^T @ dY), per chunk and group.
void conv2d_grad_input_kernel(const KernelArgs& args) {
  const Tensor &dy = args.inputs[0], &w = args.inputs[1];
  Tensor& dx = args.outputs[0];
  const ConvGeometry g = conv_geometry(dx.shape(), w.shape(), args.attrs);
  const int64_t chunk = g.chunk(), plane = g.plane();
  const int64_t k = g.group_rows(), m = g.group_outputs();
  auto dcol = scratch(g.rows() * chunk * plane);
  auto dy_gemm = scratch(g.o * chunk * plane);
  float* dx_data = dx.data<float>();
  for (int64_t first = 0; first < g.n; first += chunk) {
    const int64_t count = std::min(chunk, g.n - first), ld = count * plane;
    const float* dy_block = dy.data<float>() + first * g.o * plane;
    if (count > 1) {
      nchw_to_gemm(dy.data<float>(), g.o, plane, first, count, dy_gemm.get());
      dy_block = dy_gemm.get();
    }
    for (int64_t group = 0; group < g.groups; ++group)
      sgemm(true, false, k, ld, m, w.data<float>() + group * m * k, k, dy_block + group * m * ld,
            ld, 0.0f, dcol.get() + group * k * ld, ld);
    // This chunk's dx is written only here: zero it, then add every tap back.
    float* dx_chunk = dx_data + first * g.c * g.h * g.w;
    std::fill(dx_chunk, dx_chunk + count * g.c * g.h * g.w, 0.0f);
    for (int64_t image = 0; image < count; ++image)
      for (int64_t c = 0; c < g.c; ++c)
        col2im_channel(dcol.get(), ld, image, g, c, dx_chunk + image * g.c * g.h * g.w);
  }
}

// dW_g (O / groups, C / groups * KH * KW) = sum over chunks of dY_g (O / groups, G * P) @ col_g^T.
void conv2d_grad_weight_kernel(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &dy = args.inputs[1];
  Tensor& dw = args.outputs[0];
  const ConvGeometry g = conv_geometry(x.shape(), dw.shape(), args.attrs);
  const int64_t chunk = g.chunk(), plane = g.plane();
  const int64_t k = g.group_rows(), m = g.group_outputs();
  auto col = scratch(g.rows() * chunk * plane);
  auto dy_gemm = scratch(g.o * chunk * plane);
  for (int64_t first = 0; first < g.n; first += chunk) {
    const int64_t count = std::min(chunk, g.n - first), ld = count * plane;
    im2col_chunk(x.data<float>(), g, first, count, col.get());
    const float* dy_block = dy.data<float>() + first * g.o * plane;
    if (count > 1) {
      nchw_to_gemm(dy.data<float>(), g.o, plane, first, count, dy_gemm.get());
      dy_block = dy_gemm.get();
    }
    for (int64_t group = 0; group < g.groups; ++group)
      sgemm(false, true, m, k, ld, dy_block + group * m * ld, ld, col.get() + group * k * ld, ld,
            first == 0 ? 0.0f : 1.0f, dw.data<float>() + group * m * k, k);
  }
}

// f32 everywhere, no empty dimension.
bool conv_shapes_supported(const NodeView& node, const Shape& x, const Shape& w) {
  if (!all_dtype(node, DType::kF32)) return false;
  for (const Shape* s : {&x, &w, &node.output_types[0].shape})
    for (int64_t d : *s)
      if (d <= 0) return false;
  return true;
}

// The GEMM kernels: every GEMM dimension within BLAS's int; depthwise ones are the cpu
// dialect's.
bool conv_supported(const NodeView& node, const Shape& x, const Shape& w) {
  if (!conv_shapes_supported(node, x, w)) return false;
  const ConvGeometry g = conv_geometry(x, w, node.node.attrs);
  return !g.depthwise() && g.rows() <= INT_MAX && g.o <= INT_MAX &&
         g.chunk() * g.plane() <= INT_MAX;
}

// ---- depthwise convolution ----

bool depthwise_supported(const NodeView& node, const Shape& x, const Shape& w) {
  return conv_shapes_supported(node, x, w) && conv_geometry(x, w, node.node.attrs).depthwise();
}

// Calls fn(plane) for every plane in [0, planes), split across threads; each plane's work is
// about `per_plane` multiply-adds.
template <typename Fn>
void for_each_conv_plane(int64_t planes, int64_t per_plane, Fn&& fn) {
  parallel_for(0, planes, plane_grain(per_plane), [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) fn(p);
  });
}

// Calls fn(i, hh, cols, src_offset) for every output row i of tap (p, q) whose input row hh
// lies inside the plane: output columns cols.lo..cols.hi read input columns j * sw + offset.
template <typename Fn>
void for_each_tap_row(const ConvGeometry& g, int64_t p, int64_t q, Fn&& fn) {
  const Span cols = valid_columns(g, q);
  if (cols.lo >= cols.hi) return;
  for (int64_t i = 0; i < g.oh; ++i) {
    const int64_t hh = i * g.sh - g.ph + p;
    if (hh >= 0 && hh < g.h) fn(i, hh, cols, q - g.pw);
  }
}

// y[n, o] = sum over taps (p, q) of w[o, 0, p, q] * x[n, o / (O / C)] shifted by the tap.
void depthwise_conv2d_kernel(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &w = args.inputs[1];
  Tensor& y = args.outputs[0];
  const ConvGeometry g = conv_geometry(x.shape(), w.shape(), args.attrs);
  const int64_t multiplier = g.o / g.c, taps = g.kh * g.kw, plane = g.plane();
  const float *x_data = x.data<float>(), *w_data = w.data<float>();
  float* y_data = y.data<float>();
  for_each_conv_plane(g.n * g.o, plane * taps, [&](int64_t plane_index) {
    const int64_t image = plane_index / g.o, o = plane_index % g.o;
    const float* x_plane = x_data + (image * g.c + o / multiplier) * g.in_plane();
    const float* w_taps = w_data + o * taps;
    float* out = y_data + plane_index * plane;
    std::fill(out, out + plane, 0.0f);
    for (int64_t p = 0; p < g.kh; ++p)
      for (int64_t q = 0; q < g.kw; ++q) {
        const float weight = w_taps[p * g.kw + q];
        for_each_tap_row(g, p, q, [&](int64_t i, int64_t hh, Span cols, int64_t offset) {
          const float* src = x_plane + hh * g.w + offset;  // src[j * sw]: column j's input
          float* dst = out + i * g.ow;
          if (g.sw == 1) {
            for (int64_t j = cols.lo; j < cols.hi; ++j) dst[j] += weight * src[j];
          } else {
            for (int64_t j = cols.lo; j < cols.hi; ++j) dst[j] += weight * src[j * g.sw];
          }
        });
      }
  });
}

// dx[n, c] = sum over the channel's O / C filters o and their taps of w[o, 0, p, q] * dy[n, o]
// scattered back to the positions the tap read: one thread owns a dx plane.
void depthwise_conv2d_grad_input_kernel(const KernelArgs& args) {
  const Tensor &dy = args.inputs[0], &w = args.inputs[1];
  Tensor& dx = args.outputs[0];
  const ConvGeometry g = conv_geometry(dx.shape(), w.shape(), args.attrs);
  const int64_t multiplier = g.o / g.c, taps = g.kh * g.kw, plane = g.plane();
  const float *dy_data = dy.data<float>(), *w_data = w.data<float>();
  float* dx_data = dx.data<float>();
  for_each_conv_plane(g.n * g.c, multiplier * plane * taps, [&](int64_t plane_index) {
    const int64_t image = plane_index / g.c, c = plane_index % g.c;
    float* out = dx_data + plane_index * g.in_plane();
    std::fill(out, out + g.in_plane(), 0.0f);
    for (int64_t o = c * multiplier; o < (c + 1) * multiplier; ++o) {
      const float* grad = dy_data + (image * g.o + o) * plane;
      const float* w_taps = w_data + o * taps;
      for (int64_t p = 0; p < g.kh; ++p)
        for (int64_t q = 0; q < g.kw; ++q) {
          const float weight = w_taps[p * g.kw + q];
          for_each_tap_row(g, p, q, [&](int64_t i, int64_t hh, Span cols, int64_t offset) {
            float* dst = out + hh * g.w + offset;  // dst[j * sw]: column j's input
            const float* src = grad + i * g.ow;
            if (g.sw == 1) {
              for (int64_t j = cols.lo; j < cols.hi; ++j) dst[j] += weight * src[j];
            } else {
              for (int64_t j = cols.lo; j < cols.hi; ++j) dst[j * g.sw] += weight * src[j];
            }
          });
        }
    }
  });
}

// dw[o, 0, p, q] = sum over images and output positions of dy[n, o] * x[n, o / (O / C)] at the
// tap: one thread owns an output channel's taps. Each row's products are summed in f32
// (vectorized: row_ops.h's blocked_sum), the rows in double: a tap sums N * OH * OW products.
void depthwise_conv2d_grad_weight_kernel(const KernelArgs& args) {
  const Tensor &x = args.inputs[0], &dy = args.inputs[1];
  Tensor& dw = args.outputs[0];
  const ConvGeometry g = conv_geometry(x.shape(), dw.shape(), args.attrs);
  const int64_t multiplier = g.o / g.c, taps = g.kh * g.kw, plane = g.plane();
  const float *x_data = x.data<float>(), *dy_data = dy.data<float>();
  float* dw_data = dw.data<float>();
  for_each_conv_plane(g.o, g.n * plane * taps, [&](int64_t o) {
    for (int64_t p = 0; p < g.kh; ++p)
      for (int64_t q = 0; q < g.kw; ++q) {
        double sum = 0.0;
        for (int64_t image = 0; image < g.n; ++image) {
          const float* x_plane = x_data + (image * g.c + o / multiplier) * g.in_plane();
          const float* grad = dy_data + (image * g.o + o) * plane;
          for_each_tap_row(g, p, q, [&](int64_t i, int64_t hh, Span cols, int64_t offset) {
            const float* src = x_plane + hh * g.w + offset + cols.lo * g.sw;
            const float* row = grad + i * g.ow + cols.lo;
            const int64_t sw = g.sw;
            sum += sw == 1 ? blocked_sum(cols.hi - cols.lo, [&](int64_t j) { return row[j] * src[j]; })
                           : blocked_sum(cols.hi - cols.lo,
                                         [&](int64_t j) { return row[j] * src[j * sw]; });
          });
        }
        dw_data[o * taps + p * g.kw + q] = static_cast<float>(sum);
      }
  });
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
  // Each node's (x, w) shapes: conv2d reads both, its input gradient writes x and reads w, its
  // weight gradient reads x and writes w.
  using Shapes = std::pair<const Shape&, const Shape&>;
  auto conv_shapes = [](const NodeView& n) -> Shapes {
    return {n.input_types[0].shape, n.input_types[1].shape};
  };
  auto grad_input_shapes = [](const NodeView& n) -> Shapes {
    return {n.output_types[0].shape, n.input_types[1].shape};
  };
  auto grad_weight_shapes = [](const NodeView& n) -> Shapes {
    return {n.input_types[0].shape, n.output_types[0].shape};
  };
  auto add = [&](Op op, auto shapes, KernelFn gemm, KernelFn depthwise) {
    registry.add(op, KernelImpl{"openblas", Device::kCpu, kOpenBlasPriority,
                                [shapes](const NodeView& n) {
                                  const auto [x, w] = shapes(n);
                                  return conv_supported(n, x, w);
                                },
                                std::move(gemm)});
    registry.add(op, KernelImpl{"cpu", Device::kCpu, kFastPriority,
                                [shapes](const NodeView& n) {
                                  const auto [x, w] = shapes(n);
                                  return depthwise_supported(n, x, w);
                                },
                                std::move(depthwise)});
  };
  add(Op::kConv2d, conv_shapes, conv2d_kernel, depthwise_conv2d_kernel);
  add(Op::kConv2dGradInput, grad_input_shapes, conv2d_grad_input_kernel,
      depthwise_conv2d_grad_input_kernel);
  add(Op::kConv2dGradWeight, grad_weight_shapes, conv2d_grad_weight_kernel,
      depthwise_conv2d_grad_weight_kernel);
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

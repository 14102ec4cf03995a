// Kernels and launchers of the "cuda-conv" dialect's window ops (declared in conv.cuh;
// registered by conv.cc, which runs the convolutions' products through cuBLASLt).
//
// One thread per output element, at flat index `item` (64-bit; a 1-D grid of 256-thread blocks
// covers every item), except im2col (a 2-D grid, below). Inside a plane, indices are 32-bit
// ints: the launchers check that every size fits. The gradients gather (each input position
// sums the outputs whose windows cover it, found by covering() below) instead of scattering
// with atomics: deterministic, and dx needs no zeroing first.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "backends/cuda/conv/conv.cuh"
#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/common/elements.cuh"
#include "backends/cuda/common/dtype_visit.cuh"

namespace kiln::cuda::conv {
namespace {

using bf16 = __nv_bfloat16;
using f16 = __half;

constexpr int kThreads = 256;

// ---- element types ---------------------------------------------------------------------------

// The arithmetic type of a storage type: f64 for f64, f32 for the rest.
template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

// to_f (f32, bf16, f16 -> f32) and from_f: elements.cuh; f64 passes through.
__device__ __forceinline__ double to_acc(double v) { return v; }
template <class T>
__device__ __forceinline__ float to_acc(T v) {
  return to_f(v);
}
template <class T>
__device__ __forceinline__ T from_acc(Acc<T> v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return from_f<T>(v);
  }
}

template <class Fn>
void visit_float(DType t, Fn&& fn) {
  visit_float_storage(t, "cuda-conv", fn);
}

// ---- geometry --------------------------------------------------------------------------------

// Window in 32-bit ints (the launchers check the sizes).
struct Geom {
  int h, w, oh, ow, kh, kw, sh, sw, ph, pw;
};

Geom geom_of(const Window& win) {
  KILN_CHECK(window_fits(win),
             "cuda-conv: a {}x{} plane (output {}x{}, kernel {}x{}, stride {}x{}, padding "
             "{}x{}) has a size beyond 2^31 - 1",
             win.h, win.w, win.oh, win.ow, win.kh, win.kw, win.sh, win.sw, win.ph, win.pw);
  return {static_cast<int>(win.h),  static_cast<int>(win.w),  static_cast<int>(win.oh),
          static_cast<int>(win.ow), static_cast<int>(win.kh), static_cast<int>(win.kw),
          static_cast<int>(win.sh), static_cast<int>(win.sw), static_cast<int>(win.ph),
          static_cast<int>(win.pw)};
}

// The window of output (i, j) clipped to the input: rows [h0, h1), columns [w0, w1). Never
// empty for pools (inference: padding <= kernel / 2).
struct Clip {
  int h0, h1, w0, w1;
};
__device__ __forceinline__ Clip clip(const Geom& g, int i, int j) {
  const int top = i * g.sh - g.ph, left = j * g.sw - g.pw;
  return {max(top, 0), min(top + g.kh, g.h), max(left, 0), min(left + g.kw, g.w)};
}

// The outputs [lo, hi] along one dim whose windows cover input position `at` (empty when
// lo > hi): window o covers [o * stride - pad, o * stride - pad + kernel), so o * stride lies in
// (at + pad - kernel, at + pad]. The tap of output o is at + pad - o * stride, in [0, kernel).
struct Span {
  int lo, hi;
};
__device__ __forceinline__ Span covering(int at, int pad, int kernel, int stride, int outputs) {
  const int shifted = at + pad;  // >= 0
  return {shifted < kernel ? 0 : (shifted - kernel) / stride + 1,
          min(outputs - 1, shifted / stride)};
}

// Offset in the plane of the first (row-major) maximum of output (i, j)'s window; a NaN wins
// over numbers (the reference's rule: max propagates NaN).
template <class T>
__device__ __forceinline__ int first_max(const T* plane, const Geom& g, int i, int j) {
  const Clip c = clip(g, i, j);
  int best = c.h0 * g.w + c.w0;
  Acc<T> best_value = to_acc(plane[best]);
  for (int hh = c.h0; hh < c.h1; ++hh)
    for (int ww = c.w0; ww < c.w1; ++ww) {
      const Acc<T> v = to_acc(plane[hh * g.w + ww]);
      if (v > best_value || (v != v && best_value == best_value)) {
        best = hh * g.w + ww;
        best_value = v;
      }
    }
  return best;
}

__device__ __forceinline__ int64_t item_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// ---- im2col / col2im -------------------------------------------------------------------------

// A 2-D grid: x over the columns (image, i, j), y over the rows' (c, p) pairs (looped when there
// are more than the grid has); each thread writes the kw rows (c, p, 0..kw-1) of its column, so
// consecutive threads write consecutive addresses.
template <class T>
__global__ void im2col_kernel(const T* __restrict__ x, T* __restrict__ col, Geom g,
                              int channels, int columns) {
  const int column = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (column >= columns) return;
  const int plane_out = g.oh * g.ow;
  const int image = column / plane_out;
  const int pix = column - image * plane_out;
  const int i = pix / g.ow, j = pix - i * g.ow;
  const int top = i * g.sh - g.ph, left = j * g.sw - g.pw;
  const T* x_image = x + static_cast<int64_t>(image) * channels * g.h * g.w;
  const T zero = from_acc<T>(0);
  for (int64_t pair = blockIdx.y; pair < static_cast<int64_t>(channels) * g.kh; pair += gridDim.y) {
    const int cp = static_cast<int>(pair);
    const int c = cp / g.kh, p = cp - c * g.kh;
    const int hh = top + p;
    const bool row_inside = hh >= 0 && hh < g.h;
    const T* src = x_image + (static_cast<int64_t>(c) * g.h + (row_inside ? hh : 0)) * g.w;
    T* dst = col + static_cast<int64_t>(cp) * g.kw * columns + column;
    for (int q = 0; q < g.kw; ++q) {
      const int ww = left + q;
      dst[static_cast<int64_t>(q) * columns] = row_inside && ww >= 0 && ww < g.w ? src[ww] : zero;
    }
  }
}

// Item (image, c, hh, ww) of dx.
template <class T, class C>
__global__ void col2im_kernel(const C* __restrict__ dcol, T* __restrict__ dx, Geom g,
                              int64_t channels, int64_t columns, int64_t items) {
  const int64_t item = item_index();
  if (item >= items) return;
  const int plane_in = g.h * g.w;
  const int64_t plane = item / plane_in;
  const int pix = static_cast<int>(item - plane * plane_in);
  const int hh = pix / g.w, ww = pix - hh * g.w;
  const int64_t image = plane / channels, c = plane - image * channels;
  const Span rows = covering(hh, g.ph, g.kh, g.sh, g.oh);
  const Span cols = covering(ww, g.pw, g.kw, g.sw, g.ow);
  const C* base = dcol + image * g.oh * g.ow;  // this image's first column
  Acc<T> sum = 0;
  for (int i = rows.lo; i <= rows.hi; ++i) {
    const int p = hh + g.ph - i * g.sh;
    for (int j = cols.lo; j <= cols.hi; ++j) {
      const int q = ww + g.pw - j * g.sw;
      sum += to_acc(base[((c * g.kh + p) * g.kw + q) * columns + i * g.ow + j]);
    }
  }
  dx[item] = from_acc<T>(sum);
}

// ---- depthwise convolution -------------------------------------------------------------------

// Item (image, o, i, j) of y: the sum over the taps inside the input.
template <class T>
__global__ void depthwise_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                 T* __restrict__ y, Geom g, int64_t channels, int multiplier,
                                 int64_t items) {
  const int64_t item = item_index();
  if (item >= items) return;
  const int plane_out = g.oh * g.ow;
  const int64_t plane = item / plane_out;  // image * O + o
  const int pix = static_cast<int>(item - plane * plane_out);
  const int i = pix / g.ow, j = pix - i * g.ow;
  const int64_t outputs = channels * multiplier;
  const int64_t image = plane / outputs, o = plane - image * outputs;
  const T* src = x + (image * channels + o / multiplier) * g.h * g.w;
  const T* taps = w + o * g.kh * g.kw;
  const Clip c = clip(g, i, j);
  const int top = i * g.sh - g.ph, left = j * g.sw - g.pw;
  Acc<T> sum = 0;
  for (int hh = c.h0; hh < c.h1; ++hh)
    for (int ww = c.w0; ww < c.w1; ++ww)
      sum += to_acc(src[hh * g.w + ww]) * to_acc(taps[(hh - top) * g.kw + (ww - left)]);
  y[item] = from_acc<T>(sum);
}

// Item (image, c, hh, ww) of dx: over the channel's filters o and the outputs (i, j) whose
// window covers (hh, ww) at tap (p, q), dy[image, o, i, j] * w[o, p, q].
template <class T>
__global__ void depthwise_grad_input_kernel(const T* __restrict__ dy, const T* __restrict__ w,
                                            T* __restrict__ dx, Geom g, int64_t channels,
                                            int multiplier, int64_t items) {
  const int64_t item = item_index();
  if (item >= items) return;
  const int plane_in = g.h * g.w;
  const int64_t plane = item / plane_in;  // image * C + c
  const int pix = static_cast<int>(item - plane * plane_in);
  const int hh = pix / g.w, ww = pix - hh * g.w;
  const int64_t image = plane / channels, c = plane - image * channels;
  const Span rows = covering(hh, g.ph, g.kh, g.sh, g.oh);
  const Span cols = covering(ww, g.pw, g.kw, g.sw, g.ow);
  Acc<T> sum = 0;
  for (int k = 0; k < multiplier; ++k) {
    const int64_t o = c * multiplier + k;
    const T* grad = dy + (image * channels * multiplier + o) * g.oh * g.ow;
    const T* taps = w + o * g.kh * g.kw;
    for (int i = rows.lo; i <= rows.hi; ++i) {
      const int p = hh + g.ph - i * g.sh;
      for (int j = cols.lo; j <= cols.hi; ++j) {
        const int q = ww + g.pw - j * g.sw;
        sum += to_acc(grad[i * g.ow + j]) * to_acc(taps[p * g.kw + q]);
      }
    }
  }
  dx[item] = from_acc<T>(sum);
}

// Block (o, p, q) writes dw[o, 0, p, q]: its threads stride over the (image, i, j) positions,
// then a tree in shared memory adds their partial sums in a fixed order.
template <class T>
__global__ void depthwise_grad_weight_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                             T* __restrict__ dw, Geom g, int64_t images,
                                             int64_t channels, int multiplier) {
  __shared__ Acc<T> partial[kThreads];
  const int taps = g.kh * g.kw;
  const int64_t o = blockIdx.x / taps;
  const int tap = static_cast<int>(blockIdx.x - o * taps);
  const int p = tap / g.kw, q = tap - p * g.kw;
  const int64_t outputs = channels * multiplier, c = o / multiplier;
  const int plane_out = g.oh * g.ow;
  const int64_t positions = images * plane_out;
  Acc<T> sum = 0;
  for (int64_t at = threadIdx.x; at < positions; at += blockDim.x) {
    const int64_t image = at / plane_out;
    const int pix = static_cast<int>(at - image * plane_out);
    const int i = pix / g.ow, j = pix - i * g.ow;
    const int hh = i * g.sh - g.ph + p, ww = j * g.sw - g.pw + q;
    if (hh < 0 || hh >= g.h || ww < 0 || ww >= g.w) continue;
    sum += to_acc(dy[(image * outputs + o) * plane_out + pix]) *
           to_acc(x[((image * channels + c) * g.h + hh) * g.w + ww]);
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) dw[blockIdx.x] = from_acc<T>(partial[0]);
}

// ---- pooling ---------------------------------------------------------------------------------

// Item (plane, i, j) of y.
template <class T>
__global__ void max_pool_kernel(const T* __restrict__ x, T* __restrict__ y, Geom g,
                                int64_t items) {
  const int64_t item = item_index();
  if (item >= items) return;
  const int plane_out = g.oh * g.ow;
  const int64_t plane = item / plane_out;
  const int pix = static_cast<int>(item - plane * plane_out);
  const int i = pix / g.ow, j = pix - i * g.ow;
  const T* src = x + plane * g.h * g.w;
  y[item] = src[first_max(src, g, i, j)];  // the element itself: no rounding
}

template <class T>
__global__ void avg_pool_kernel(const T* __restrict__ x, T* __restrict__ y, Geom g,
                                int64_t items) {
  const int64_t item = item_index();
  if (item >= items) return;
  const int plane_out = g.oh * g.ow;
  const int64_t plane = item / plane_out;
  const int pix = static_cast<int>(item - plane * plane_out);
  const int i = pix / g.ow, j = pix - i * g.ow;
  const T* src = x + plane * g.h * g.w;
  const Clip c = clip(g, i, j);
  Acc<T> sum = 0;
  for (int hh = c.h0; hh < c.h1; ++hh)
    for (int ww = c.w0; ww < c.w1; ++ww) sum += to_acc(src[hh * g.w + ww]);
  y[item] = from_acc<T>(sum / static_cast<Acc<T>>(g.kh * g.kw));
}

// Item (plane, hh, ww) of dx.
template <class T>
__global__ void max_pool_grad_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                     T* __restrict__ dx, Geom g, int64_t items) {
  const int64_t item = item_index();
  if (item >= items) return;
  const int plane_in = g.h * g.w;
  const int64_t plane = item / plane_in;
  const int pix = static_cast<int>(item - plane * plane_in);
  const int hh = pix / g.w, ww = pix - hh * g.w;
  const T* src = x + plane * plane_in;
  const T* grad = dy + plane * g.oh * g.ow;
  const Span rows = covering(hh, g.ph, g.kh, g.sh, g.oh);
  const Span cols = covering(ww, g.pw, g.kw, g.sw, g.ow);
  Acc<T> sum = 0;
  for (int i = rows.lo; i <= rows.hi; ++i)
    for (int j = cols.lo; j <= cols.hi; ++j)
      if (first_max(src, g, i, j) == pix) sum += to_acc(grad[i * g.ow + j]);
  dx[item] = from_acc<T>(sum);
}

template <class T>
__global__ void avg_pool_grad_kernel(const T* __restrict__ dy, T* __restrict__ dx, Geom g,
                                     int64_t items) {
  const int64_t item = item_index();
  if (item >= items) return;
  const int plane_in = g.h * g.w;
  const int64_t plane = item / plane_in;
  const int pix = static_cast<int>(item - plane * plane_in);
  const int hh = pix / g.w, ww = pix - hh * g.w;
  const T* grad = dy + plane * g.oh * g.ow;
  const Span rows = covering(hh, g.ph, g.kh, g.sh, g.oh);
  const Span cols = covering(ww, g.pw, g.kw, g.sw, g.ow);
  Acc<T> sum = 0;
  for (int i = rows.lo; i <= rows.hi; ++i)
    for (int j = cols.lo; j <= cols.hi; ++j) sum += to_acc(grad[i * g.ow + j]);
  dx[item] = from_acc<T>(sum / static_cast<Acc<T>>(g.kh * g.kw));
}

// The depthwise launchers' common check: the filter count fits the kernels' indices.
void check_depthwise(int64_t channels, int64_t multiplier) {
  KILN_CHECK(multiplier >= 1 && multiplier <= INT_MAX && channels * multiplier <= INT_MAX,
             "cuda-conv depthwise: {} channels x {} filters each, expected at least one filter "
             "and fewer than 2^31 in all",
             channels, multiplier);
}

// A 1-D grid with one thread per item.
dim3 grid_of(int64_t items) { return dim3(static_cast<unsigned>((items + kThreads - 1) / kThreads)); }

}  // namespace

bool window_fits(const Window& win) {
  // The largest index arithmetic: i * sh - ph + p stays within [-ph, h + ph], and so on.
  const int64_t values[] = {win.h,  win.w,  win.oh, win.ow, win.kh, win.kw,
                            win.sh, win.sw, win.ph, win.pw, win.h * win.w,
                            win.oh * win.ow, win.kh * win.kw, win.h + 2 * win.ph + win.sh,
                            win.w + 2 * win.pw + win.sw};
  for (int64_t v : values)
    if (v < 0 || v > INT_MAX) return false;
  return true;
}

void im2col(DType t, const void* x, void* col, int64_t images, int64_t channels,
            const Window& win, cudaStream_t stream) {
  const Geom g = geom_of(win);
  const int64_t columns = images * win.oh * win.ow, row_pairs = channels * win.kh;
  if (columns == 0 || row_pairs == 0) return;
  KILN_CHECK(columns <= INT_MAX && row_pairs <= INT_MAX,
             "cuda-conv im2col: {} columns of {} channels x {} kernel rows, expected each below 2^31",
             columns, channels, win.kh);
  const dim3 grid(static_cast<unsigned>((columns + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(row_pairs, 65535)));
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    im2col_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(col),
                                                    g, static_cast<int>(channels),
                                                    static_cast<int>(columns));
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

void col2im(DType t, DType col_t, const void* dcol, void* dx, int64_t images, int64_t channels,
            const Window& win, cudaStream_t stream) {
  const Geom g = geom_of(win);
  const int64_t columns = images * win.oh * win.ow, items = images * channels * win.h * win.w;
  if (items == 0) return;
  KILN_CHECK(col_t == t || col_t == DType::kF32,
             "cuda-conv col2im: a {} column matrix for a {} dx, expected {} or f32",
             dtype_name(col_t), dtype_name(t), dtype_name(t));
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto launch = [&](auto col_tag) {
      using C = typename decltype(col_tag)::type;
      col2im_kernel<T, C><<<grid_of(items), kThreads, 0, stream>>>(
          static_cast<const C*>(dcol), static_cast<T*>(dx), g, channels, columns, items);
    };
    if (col_t == t) {
      launch(tag);
    } else {
      launch(Tag<float>{});
    }
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

void depthwise_conv(DType t, const void* x, const void* w, void* y, int64_t images,
                    int64_t channels, int64_t multiplier, const Window& win, cudaStream_t stream) {
  const Geom g = geom_of(win);
  check_depthwise(channels, multiplier);
  const int64_t items = images * channels * multiplier * win.oh * win.ow;
  if (items == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    depthwise_kernel<T><<<grid_of(items), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), g, channels,
        static_cast<int>(multiplier), items);
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

void depthwise_conv_grad_input(DType t, const void* dy, const void* w, void* dx, int64_t images,
                               int64_t channels, int64_t multiplier, const Window& win,
                               cudaStream_t stream) {
  const Geom g = geom_of(win);
  check_depthwise(channels, multiplier);
  const int64_t items = images * channels * win.h * win.w;
  if (items == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    depthwise_grad_input_kernel<T><<<grid_of(items), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(w), static_cast<T*>(dx), g, channels,
        static_cast<int>(multiplier), items);
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

void depthwise_conv_grad_weight(DType t, const void* x, const void* dy, void* dw, int64_t images,
                                int64_t channels, int64_t multiplier, const Window& win,
                                cudaStream_t stream) {
  const Geom g = geom_of(win);
  check_depthwise(channels, multiplier);
  const int64_t blocks = channels * multiplier * win.kh * win.kw;
  if (blocks == 0) return;
  KILN_CHECK(blocks <= INT_MAX, "cuda-conv depthwise weight gradient: {} filter taps, expected "
             "fewer than 2^31", blocks);
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    depthwise_grad_weight_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dw), g, images,
        channels, static_cast<int>(multiplier));
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

void max_pool(DType t, const void* x, void* y, int64_t planes, const Window& win,
              cudaStream_t stream) {
  const Geom g = geom_of(win);
  const int64_t items = planes * win.oh * win.ow;
  if (items == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    max_pool_kernel<T><<<grid_of(items), kThreads, 0, stream>>>(static_cast<const T*>(x),
                                                               static_cast<T*>(y), g, items);
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

void avg_pool(DType t, const void* x, void* y, int64_t planes, const Window& win,
              cudaStream_t stream) {
  const Geom g = geom_of(win);
  const int64_t items = planes * win.oh * win.ow;
  if (items == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    avg_pool_kernel<T><<<grid_of(items), kThreads, 0, stream>>>(static_cast<const T*>(x),
                                                               static_cast<T*>(y), g, items);
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

void max_pool_grad(DType t, const void* x, const void* dy, void* dx, int64_t planes,
                   const Window& win, cudaStream_t stream) {
  const Geom g = geom_of(win);
  const int64_t items = planes * win.h * win.w;
  if (items == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    max_pool_grad_kernel<T><<<grid_of(items), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dx), g, items);
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

void avg_pool_grad(DType t, const void* dy, void* dx, int64_t planes, const Window& win,
                   cudaStream_t stream) {
  const Geom g = geom_of(win);
  const int64_t items = planes * win.h * win.w;
  if (items == 0) return;
  visit_float(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    avg_pool_grad_kernel<T><<<grid_of(items), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<T*>(dx), g, items);
    KILN_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace kiln::cuda::conv

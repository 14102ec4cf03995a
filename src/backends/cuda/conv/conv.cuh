// Launchers of the "cuda-conv" dialect (backends/cuda/conv/conv.cu): the window kernels of the CNN
// ops on NCHW planes (im2col, col2im, depthwise convolutions, pools). C++17-clean (nvcc compiles conv.cu as C++17): plain pointers, int64_t,
// cudaStream_t and one POD struct. conv.cc maps KernelArgs onto these and runs the
// convolutions' products through cuBLASLt (cublaslt.h): im2col, one GEMM, col2im.
//
// Storage f32, f64, f16 or bf16 (the ops' float dtypes); arithmetic in f32 (f64 for f64).
// Every launcher enqueues on `stream`, never synchronizes, and writes every element of its
// output. No atomics: each output element is one thread's sum in a fixed order (the gradients
// gather from the outputs whose windows cover an input, the transpose of the forward's
// scatter), so the results are deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ir/dtype.h"

namespace kiln::cuda::conv {

// A window sliding over (H, W) planes: output (i, j) covers input rows i * sh - ph + [0, kh)
// and columns j * sw - pw + [0, kw) (negative or >= H / W: the padding). Plane sizes h * w and
// oh * ow are below 2^31 (conv.cc's supports() checks).
struct Window {
  int64_t h = 0, w = 0;    // input plane
  int64_t oh = 0, ow = 0;  // output plane
  int64_t kh = 1, kw = 1;  // kernel
  int64_t sh = 1, sw = 1;  // stride
  int64_t ph = 0, pw = 0;  // padding (both sides)
};

// Whether the kernels here take the window: every plane size and index below 2^31 (they index
// inside a plane with 32-bit ints). The launchers throw kiln::Error otherwise.
bool window_fits(const Window& win);

// The most scratch one chunk of a convolution takes (conv.cc): the column matrices of as many
// images as fit, at least one image's.
inline constexpr int64_t kScratchBytes = int64_t{64} << 20;
// Images per chunk when each needs `per_image_bytes` of scratch (0: no scratch, all at once).
inline int64_t images_per_chunk(int64_t per_image_bytes, int64_t images) {
  const int64_t all = images > 1 ? images : 1;
  if (per_image_bytes <= 0) return all;
  const int64_t fit = kScratchBytes / per_image_bytes;
  return fit < 1 ? 1 : fit > all ? all : fit;
}

// im2col: col (channels * kh * kw, images * oh * ow) from x (images, channels, h, w), both of
// dtype t: row (c, p, q), column (n, i, j) holds x[n, c, i * sh - ph + p, j * sw - pw + q], 0 in
// the padding. Row r starts at col + r * images * oh * ow.
void im2col(DType t, const void* x, void* col, int64_t images, int64_t channels,
            const Window& win, cudaStream_t stream);

// col2im, im2col's transpose: dx (images, channels, h, w) of dtype t, each element the sum of
// the column-matrix entries im2col would have copied it to, read from dcol (layout as im2col's
// col) of dtype col_t (t, or the wider f32 the products accumulated in).
void col2im(DType t, DType col_t, const void* dcol, void* dx, int64_t images, int64_t channels,
            const Window& win, cudaStream_t stream);

// Depthwise convolution (groups = channels): x (images, channels, h, w), w (channels *
// multiplier, 1, kh, kw), y (images, channels * multiplier, oh, ow); output channel o filters
// input channel o / multiplier. Direct kernels: the forward one thread per y element, the input
// gradient one per dx element (gathering from the outputs whose windows cover it, over the
// channel's `multiplier` filters), the weight gradient one block per filter tap (a fixed-order
// tree over the block's partial sums of images * oh * ow products: no atomics).
void depthwise_conv(DType t, const void* x, const void* w, void* y, int64_t images,
                    int64_t channels, int64_t multiplier, const Window& win, cudaStream_t stream);
void depthwise_conv_grad_input(DType t, const void* dy, const void* w, void* dx, int64_t images,
                               int64_t channels, int64_t multiplier, const Window& win,
                               cudaStream_t stream);
void depthwise_conv_grad_weight(DType t, const void* x, const void* dy, void* dw, int64_t images,
                                int64_t channels, int64_t multiplier, const Window& win,
                                cudaStream_t stream);

// Pooling over `planes` (N * C) planes. max_pool: the first (row-major) maximum of each window
// clipped to the input, NaN winning (as the reference). avg_pool: the window's sum divided by
// kh * kw (padding counts as zeros, PyTorch's count_include_pad).
void max_pool(DType t, const void* x, void* y, int64_t planes, const Window& win,
              cudaStream_t stream);
void avg_pool(DType t, const void* x, void* y, int64_t planes, const Window& win,
              cudaStream_t stream);
// Their gradients: dx[h, w] sums dy over the outputs whose window covers (h, w) (max_pool_grad:
// only those whose first maximum is (h, w), found again from x).
void max_pool_grad(DType t, const void* x, const void* dy, void* dx, int64_t planes,
                   const Window& win, cudaStream_t stream);
void avg_pool_grad(DType t, const void* dy, void* dx, int64_t planes, const Window& win,
                   cudaStream_t stream);

}  // namespace kiln::cuda::conv

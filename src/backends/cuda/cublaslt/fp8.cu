#include "backends/cuda/cublaslt/fp8.cuh"

#include <cuda_fp8.h>

#include <algorithm>

#include "backends/cuda/common/cuda_check.h"
#include "backends/cuda/common/dtype_visit.cuh"
#include "backends/cuda/common/elements.cuh"

namespace kiln::cuda::fp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 2048;

// max that keeps NaN (fmaxf drops it).
__device__ __forceinline__ float max_keep_nan(float a, float b) { return (b > a || b != b) ? b : a; }

__device__ __forceinline__ float block_max(float v) {
  __shared__ float warps[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) v = max_keep_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kThreads / 32 ? warps[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o /= 2) v = max_keep_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

// 16-byte loads for the aligned body, single elements for the rest.
template <class T>
__global__ void amax_kernel(const T* x, int64_t n, float* amax) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t vectors = reinterpret_cast<uintptr_t>(x) % 16 == 0 ? n / kVec : 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  float m = 0.0f;
  for (int64_t i = first; i < vectors; i += stride) {
    float v[kVec];
    load<kVec>(x + i * kVec, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = max_keep_nan(m, fabsf(v[j]));
  }
  for (int64_t i = vectors * kVec + first; i < n; i += stride) m = max_keep_nan(m, fabsf(to_f(x[i])));
  m = block_max(m);
  // Non-negative floats (and +NaN) order as their bits do.
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
}

__device__ __forceinline__ float scale_of(const float* amax, Fp8Format format) {
  return fp8_scale(*amax, fp8_max(format));
}

__device__ __forceinline__ uint8_t to_fp8(float x, float s, Fp8Format format) {
  return __nv_cvt_float_to_fp8(__fmul_rn(x, s), __NV_SATFINITE,
                               format == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2);
}

template <class T>
__global__ void quantize_kernel(const T* x, int64_t n, Fp8Format format, const float* amax,
                                uint8_t* q, float* inverse_scale) {
  constexpr int kVec = 16 / sizeof(T);
  const float s = scale_of(amax, format);
  if (blockIdx.x == 0 && threadIdx.x == 0) *inverse_scale = __fdiv_rn(1.0f, s);
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % kVec == 0;
  const int64_t vectors = aligned ? n / kVec : 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < vectors; i += stride) {
    float v[kVec];
    load<kVec>(x + i * kVec, v);
    Chunk<uint8_t, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = to_fp8(v[j], s, format);
    *reinterpret_cast<Chunk<uint8_t, kVec>*>(q + i * kVec) = out;
  }
  for (int64_t i = vectors * kVec + first; i < n; i += stride) q[i] = to_fp8(to_f(x[i]), s, format);
}

// x (rows, cols) -> q (cols, rows), through 32 x 32 tiles in shared memory: reads and writes
// both run along rows of 32.
constexpr int kTile = 32, kTileRows = 8;

template <class T>
__global__ void quantize_transposed_kernel(const T* x, int64_t rows, int64_t cols, Fp8Format format,
                                           const float* amax, uint8_t* q, float* inverse_scale) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const float s = scale_of(amax, format);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0)
    *inverse_scale = __fdiv_rn(1.0f, s);
  const int64_t c0 = int64_t{blockIdx.x} * kTile;
  for (int64_t r0 = int64_t{blockIdx.y} * kTile; r0 < rows; r0 += int64_t{gridDim.y} * kTile) {
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t r = r0 + j, c = c0 + threadIdx.x;
      if (r < rows && c < cols) tile[j][threadIdx.x] = to_fp8(to_f(x[r * cols + c]), s, format);
    }
    __syncthreads();
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t c = c0 + j, r = r0 + threadIdx.x;
      if (r < rows && c < cols) q[c * rows + r] = tile[threadIdx.x][j];
    }
    __syncthreads();
  }
}

// The same through 64 x 64 tiles read and written 16 bytes at a time (each thread reads
// 16-byte runs of a row, quantizes them into a shared byte tile, and writes 16 output bytes of a
// tile column): for rows and cols multiples of 16 and 16-byte aligned x and q, the case of every
// fp8 product kiln makes. The 32 x 32 kernel above reads 64 bytes and writes 32 per warp access.
constexpr int kWideTile = 64, kWideThreads = 256, kWidePitch = kWideTile + 8;

template <class T>
__global__ void quantize_transposed_wide_kernel(const T* x, int64_t rows, int64_t cols, Fp8Format format,
                                                const float* amax, uint8_t* q, float* inverse_scale) {
  constexpr int kVec = 16 / sizeof(T);                      // elements per 16-byte read
  constexpr int kVecsPerRow = kWideTile / kVec;
  constexpr int kLoads = kWideTile * kVecsPerRow / kWideThreads;
  __shared__ __align__(16) uint8_t tile[kWideTile][kWidePitch];
  const float s = scale_of(amax, format);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *inverse_scale = __fdiv_rn(1.0f, s);
  const int64_t c0 = int64_t{blockIdx.x} * kWideTile;
  for (int64_t r0 = int64_t{blockIdx.y} * kWideTile; r0 < rows; r0 += int64_t{gridDim.y} * kWideTile) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int v = threadIdx.x + i * kWideThreads, row = v / kVecsPerRow, col = (v % kVecsPerRow) * kVec;
      if (r0 + row >= rows || c0 + col >= cols) continue;
      float in[kVec];
      load<kVec>(x + (r0 + row) * cols + c0 + col, in);
      Chunk<uint8_t, kVec> bytes;
#pragma unroll
      for (int j = 0; j < kVec; ++j) bytes.v[j] = to_fp8(in[j], s, format);
      *reinterpret_cast<Chunk<uint8_t, kVec>*>(&tile[row][col]) = bytes;
    }
    __syncthreads();
    // Output row c0 + orow holds tile column orow: 4 runs of 16 bytes, one per thread.
    const int orow = threadIdx.x / 4, run = (threadIdx.x % 4) * 16;
    if (c0 + orow < cols && r0 + run < rows) {
      Chunk<uint8_t, 16> out;
#pragma unroll
      for (int j = 0; j < 16; ++j) out.v[j] = tile[run + j][orow];
      *reinterpret_cast<Chunk<uint8_t, 16>*>(q + (c0 + orow) * rows + r0 + run) = out;
    }
    __syncthreads();
  }
}

template <class Fn>
void visit_input(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF32: return fn(Tag<float>{});
    case DType::kBF16: return fn(Tag<__nv_bfloat16>{});
    case DType::kF16: return fn(Tag<__half>{});
    default: fail("fp8 quantization: {} operands, expected f32, bf16 or f16", dtype_name(t));
  }
}

int blocks_for(int64_t work) {
  return static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

}  // namespace

void amax(DType t, const void* x, int64_t n, float* amax, cudaStream_t stream) {
  if (n == 0) return;
  visit_input(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    amax_kernel<T><<<blocks_for(n / (16 / sizeof(T)) + 1), kThreads, 0, stream>>>(
        static_cast<const T*>(x), n, amax);
  });
  KILN_CUDA_CHECK(cudaGetLastError());
}

void quantize(DType t, Fp8Format format, const void* x, int64_t rows, int64_t cols, bool transpose,
              const float* amax, uint8_t* q, float* inverse_scale, cudaStream_t stream) {
  KILN_CHECK(format != Fp8Format::kNone, "fp8 quantization: no format given");
  const int64_t n = rows * cols;
  visit_input(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xs = static_cast<const T*>(x);
    if (!transpose) {
      quantize_kernel<T><<<blocks_for(n / (16 / sizeof(T)) + 1), kThreads, 0, stream>>>(
          xs, n, format, amax, q, inverse_scale);
    } else if (rows % 16 == 0 && cols % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(q) % 16 == 0) {
      const dim3 grid(static_cast<unsigned>((cols + kWideTile - 1) / kWideTile),
                      static_cast<unsigned>(std::clamp<int64_t>((rows + kWideTile - 1) / kWideTile, 1, 65535)));
      quantize_transposed_wide_kernel<T><<<grid, kWideThreads, 0, stream>>>(xs, rows, cols, format, amax, q,
                                                                            inverse_scale);
    } else {
      const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                      static_cast<unsigned>(std::clamp<int64_t>((rows + kTile - 1) / kTile, 1, 65535)));
      quantize_transposed_kernel<T><<<grid, dim3(kTile, kTileRows), 0, stream>>>(
          xs, rows, cols, format, amax, q, inverse_scale);
    }
  });
  KILN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kiln::cuda::fp8

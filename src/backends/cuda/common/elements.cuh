// Device-side element helpers shared by the hand-written kernels (*.cu only): float conversions
// of f32 / bf16 / f16 elements (round to nearest even) and N-element vector loads and stores of
// N * sizeof(T) bytes (the pointer must be that aligned).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kiln::cuda {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}

// N elements loaded or stored as one access of N * sizeof(T) bytes.
template <typename T, int N>
struct alignas(sizeof(T) * N) Chunk {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  const Chunk<T, N> c = *reinterpret_cast<const Chunk<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f(c.v[i]);
}
template <int N, typename T>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  Chunk<T, N> c;
#pragma unroll
  for (int i = 0; i < N; ++i) c.v[i] = from_f<T>(in[i]);
  *reinterpret_cast<Chunk<T, N>*>(p) = c;
}

}  // namespace kiln::cuda

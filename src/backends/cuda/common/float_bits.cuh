// Bit-exact float conversions on the device, shared by the kernels that must agree with the
// host (ir/dtype.h) and the reference kernels' trip through double bit for bit: movement.cu's
// casts and multi_tensor.cu's grouped casts. Round to nearest even; NaNs quieted as the host
// does (bf16: the payload's top bits with the quiet bit set; f16: the canonical 0x7e00, sign
// kept; widening: the payload kept, quieted). C++17-clean, for *.cu files.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace kiln::cuda {

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x400000u;  // the host's f32 -> f64 quiets NaNs
  return __uint_as_float(u);
}
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
  if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0)  // NaN: payload kept, quieted
    return __uint_as_float((static_cast<uint32_t>(h & 0x8000u) << 16) | 0x7fc00000u |
                           (static_cast<uint32_t>(h & 0x3ffu) << 13));
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16);
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)  // NaN: the host's canonical one, sign kept
    return static_cast<unsigned short>(((u >> 16) & 0x8000u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(f));  // round to nearest even, as the host
}

}  // namespace kiln::cuda

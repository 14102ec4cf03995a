// The math policy of the CUDA kernels: the primitives that the lines of ops/elementwise_math.h
// call (M::exp, M::erfc, ...), as CUDA's own functions, overloaded for float and double (f16
// and bf16 compute in float). The generic kernels (generic.cu) use it, and its text is embedded
// in every kernel NVRTC compiles (codegen.cc), so that both run the same code: plain C++17, no
// includes, nothing NVRTC lacks.
#pragma once

namespace kiln {
namespace cuda {

#define KILN_DEVICE_MATH(name, f32, f64)                                              \
  static __device__ __forceinline__ float name(float x) { return ::f32(x); }        \
  static __device__ __forceinline__ double name(double x) { return ::f64(x); }

struct DeviceMath {
  KILN_DEVICE_MATH(abs, fabsf, fabs)
  KILN_DEVICE_MATH(exp, expf, exp)
  KILN_DEVICE_MATH(log, logf, log)
  KILN_DEVICE_MATH(sqrt, sqrtf, sqrt)
  KILN_DEVICE_MATH(rsqrt, rsqrtf, rsqrt)
  KILN_DEVICE_MATH(tanh, tanhf, tanh)
  KILN_DEVICE_MATH(erf, erff, erf)
  KILN_DEVICE_MATH(erfc, erfcf, erfc)
  KILN_DEVICE_MATH(sin, sinf, sin)
  KILN_DEVICE_MATH(cos, cosf, cos)
  KILN_DEVICE_MATH(acos, acosf, acos)
  KILN_DEVICE_MATH(asin, asinf, asin)
  KILN_DEVICE_MATH(atan, atanf, atan)
  KILN_DEVICE_MATH(rint, rintf, rint)  // halves to even
  static __device__ __forceinline__ float pow(float a, float b) { return ::powf(a, b); }
  static __device__ __forceinline__ double pow(double a, double b) { return ::pow(a, b); }
  static __device__ __forceinline__ float fmod(float a, float b) { return ::fmodf(a, b); }
  static __device__ __forceinline__ double fmod(double a, double b) { return ::fmod(a, b); }
  template <class T>
  static __device__ __forceinline__ T select(bool c, T a, T b) {
    return c ? a : b;
  }
};

#undef KILN_DEVICE_MATH

}  // namespace cuda
}  // namespace kiln

// Internal to the CPU backend: f32 transcendental functions written as straight-line
// arithmetic (no calls, no branches, only selects), so that g++ vectorizes the loops that use
// them. libm's expf/tanhf/erff are scalar calls that block vectorization (glibc only offers
// vector variants under -ffast-math, which the project does not use).
//
// The loops that use these are checked to vectorize with -fopt-info-vec (SSE2 baseline, 4 lanes).
//
// Accuracy (relative, checked against the f64 reference in tests/backends/cpu_fast_test.cc):
// exp_f32 within ~2 ulp; tanh_f32 and sigmoid (from exp_f32) within a few ulp; erfc_f32 within
// 2e-6 for z <= 4.3 (rounding of z*z in f32 dominates; erfc(4.3) is 1e-9, so gelu's absolute
// error there is far below f32 resolution of its inputs).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>

namespace kiln::cpu {

// c ? a : b through bit masks. A plain ?: on floats is not vectorized by g++ without
// -ffast-math: it sinks the arithmetic of one side into a branch, then may not if-convert it
// back because that arithmetic could trap (-ftrapping-math).
inline float select(bool c, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return std::bit_cast<float>((std::bit_cast<uint32_t>(a) & mask) |
                              (std::bit_cast<uint32_t>(b) & ~mask));
}

// e^x. Range reduction x = n*ln2 + r with |r| <= ln2/2 (ln2 split in a hi part exact in a
// product with n and a lo part), e^r by its Taylor series to degree 7 (truncation < 1e-8), and
// 2^n built in the exponent bits. x is clamped to [-87, 89]:
// at the bottom n = -126, whose 2^(n-1) built below is 0, so the result is 0 for x below about
// -86.99 (true value < 1.8e-38); at the top the product overflows to +inf as it should (f32
// overflows above 88.72). NaN stays NaN.
inline float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // 355/512: n * kLn2Hi is exact for |n| <= 2^15
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kLow = -87.0f, kHigh = 89.0f;
  const float xc = select(x > kHigh, kHigh, select(x < kLow, kLow, x));
  const float shifted = xc * kLog2e + kRoundMagic;
  const float n = shifted - kRoundMagic;
  // The integer n sits in the low mantissa bits of `shifted`: no float->int conversion.
  const int32_t n_int = std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kRoundMagic);
  float r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^(n-1) * 2 instead of 2^n: n reaches 128 at the top of the range, whose exponent field
  // would read as infinity, and at n = -126 the exponent field 0 gives exactly 0.
  const float half_scale = std::bit_cast<float>(static_cast<uint32_t>(n_int + 126) << 23);
  return p * half_scale * 2.0f;
}

// tanh(x): an odd Taylor polynomial to degree 15 for |x| < 0.5 (where 1 - e^-2|x| would cancel;
// truncation < 1e-8 relative), (1 - e) / (1 + e) with e = e^-2|x| elsewhere.
inline float tanh_f32(float x) {
  const float a = std::abs(x);
  const float x2 = x * x;
  float p = -1.4558343870513183e-3f;
  p = p * x2 + 3.592128036572481e-3f;
  p = p * x2 - 8.863235529902197e-3f;
  p = p * x2 + 2.1869488536155203e-2f;
  p = p * x2 - 5.396825396825397e-2f;
  p = p * x2 + 1.3333333333333333e-1f;
  p = p * x2 - 3.3333333333333333e-1f;
  const float small = x + x * x2 * p;
  const float e = exp_f32(-2.0f * a);
  const float large_abs = (1.0f - e) / (1.0f + e);
  return select(a < 0.5f, small, std::copysign(large_abs, x));
}

// erfc(z) for z >= 0 as t * e^(-z^2 + P(t)), t = 1 / (1 + z/2), P a degree-9 polynomial fitted
// (least squares on Chebyshev points of t, numpy, 2025) to log(erfc(z) / t) + z^2 for z in
// [0, 20]; its own relative error is below 1e-7.
inline float erfc_nonnegative_f32(float z) {
  const float t = 1.0f / (1.0f + 0.5f * z);
  float p = 1.722901259e-01f;
  p = p * t - 8.271750248e-01f;
  p = p * t + 1.494023034e+00f;
  p = p * t - 1.134385803e+00f;
  p = p * t + 2.719049713e-01f;
  p = p * t - 1.796599069e-01f;
  p = p * t + 9.374540910e-02f;
  p = p * t + 3.748309679e-01f;
  p = p * t + 9.999344441e-01f;
  p = p * t - 1.265508144e+00f;
  return t * exp_f32(p - z * z);
}

// erfc(z) for any z: erfc(-z) = 2 - erfc(z).
inline float erfc_f32(float z) {
  const float e = erfc_nonnegative_f32(std::abs(z));
  return select(z < 0.0f, 2.0f - e, e);
}

// erf(x): an odd Taylor polynomial to degree 15 for |x| < 0.5 (where 1 - erfc(|x|) would
// cancel; truncation < 1e-10 relative), 1 - erfc(|x|) with x's sign elsewhere. Within 4e-7.
inline float erf_f32(float x) {
  const float a = std::abs(x);
  const float x2 = x * x;
  float p = -1.492565035840625e-05f;
  p = p * x2 + 1.2055332981789664e-04f;
  p = p * x2 - 8.548327023450852e-04f;
  p = p * x2 + 5.223977625442188e-03f;
  p = p * x2 - 2.6866170645131252e-02f;
  p = p * x2 + 1.1283791670955126e-01f;
  p = p * x2 - 3.7612638903183754e-01f;
  p = p * x2 + 1.1283791670955126f;
  const float small = x * p;
  const float large_abs = 1.0f - erfc_nonnegative_f32(a);
  return select(a < 0.5f, small, std::copysign(large_abs, x));
}

// The primitives of the math lines (ops/elementwise_math.h) in the fast kernels: f32, through
// the functions above where libm's would block vectorization. log and pow stay libm's (scalar).
struct FastMath {
  static float abs(float x) { return std::abs(x); }
  static float exp(float x) { return exp_f32(x); }
  static float log(float x) { return std::log(x); }
  static float sqrt(float x) { return std::sqrt(x); }
  static float rsqrt(float x) { return 1.0f / std::sqrt(x); }
  static float tanh(float x) { return tanh_f32(x); }
  static float erf(float x) { return erf_f32(x); }
  static float erfc(float x) { return erfc_f32(x); }
  // The C library's: exact to an ulp over the whole range (no cheap approximation keeps that).
  static float sin(float x) { return std::sin(x); }
  static float cos(float x) { return std::cos(x); }
  static float pow(float a, float b) { return std::pow(a, b); }
  static float fmod(float a, float b) { return std::fmod(a, b); }
  static float acos(float x) { return std::acos(x); }
  static float asin(float x) { return std::asin(x); }
  static float atan(float x) { return std::atan(x); }
  static float rint(float x) { return std::nearbyint(x); }  // halves to even (default mode)
  static float select(bool c, float a, float b) { return cpu::select(c, a, b); }
};

}  // namespace kiln::cpu

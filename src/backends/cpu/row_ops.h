// Internal to the CPU backend: f32 row primitives shared by the reductions (reduction.cc) and
// the row-wise nn ops (nn.cc): sums and maxima over one contiguous row, vectorized.
//
// Sums are blocked: each block of kSumBlock elements is summed in f32 across the SIMD lanes
// (`omp simd reduction` lets g++ reorder the additions, which it may not do on its own without
// -ffast-math), and the block sums are added in f64. The f32 error thus grows with the block,
// not with the row, which keeps a 16M-element sum close to the f64 reference.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace kiln::cpu {

inline constexpr int64_t kSumBlock = 256;

// Sum over i in [0, n) of value(i), a vectorizable float expression of i.
template <typename ValueFn>
double blocked_sum(int64_t n, ValueFn&& value) {
  double total = 0.0;
  for (int64_t start = 0; start < n; start += kSumBlock) {
    const int64_t end = std::min(n, start + kSumBlock);
    float block = 0.0f;
#pragma omp simd reduction(+ : block)
    for (int64_t i = start; i < end; ++i) block += value(i);
    total += block;
  }
  return total;
}

inline double sum_row(const float* __restrict__ x, int64_t n) {
  return blocked_sum(n, [x](int64_t i) { return x[i]; });
}

// Largest element, NaNs ignored; -inf for an empty row. Sixteen running maxima written as
// `x > m ? x : m`, which is exactly what the SSE/AVX max instruction computes, so g++
// vectorizes it without -ffast-math. (std::max in an `omp simd reduction(max)` compiles to
// compare-and-blend on one dependency chain: 3.6x slower, measured.) For softmax-like uses,
// where a NaN reaches the output through exp anyway.
inline float max_row_ignoring_nan(const float* __restrict__ x, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = -std::numeric_limits<float>::infinity();
  const int64_t full = n - n % kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] = x[i + j] > acc[j] ? x[i + j] : acc[j];
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = full; i < n; ++i) m = x[i] > m ? x[i] : m;
  for (int j = 0; j < kLanes; ++j) m = acc[j] > m ? acc[j] : m;
  return m;
}

// True when some element is NaN. x - x is 0 for finite x and NaN for NaN or +-inf: a
// vectorized sum finds candidates, a scalar scan confirms (rare: only with NaN or inf).
inline bool has_nan(const float* __restrict__ x, int64_t n) {
  float poison = 0.0f;
#pragma omp simd reduction(+ : poison)
  for (int64_t i = 0; i < n; ++i) poison += x[i] - x[i];
  if (poison == poison) return false;
  for (int64_t i = 0; i < n; ++i)
    if (x[i] != x[i]) return true;
  return false;
}

// Largest element; NaN if any element is NaN (like the reference's max); -inf if empty.
inline float max_row(const float* __restrict__ x, int64_t n) {
  return has_nan(x, n) ? std::numeric_limits<float>::quiet_NaN() : max_row_ignoring_nan(x, n);
}

}  // namespace kiln::cpu

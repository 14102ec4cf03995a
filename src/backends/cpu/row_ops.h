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

// Largest element; NaN if any element is NaN (like the reference); -inf for an empty row.
// The NaN test is a separate count because a vector max drops NaNs.
inline float max_row(const float* __restrict__ x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int nans = 0;
#pragma omp simd reduction(max : m) reduction(+ : nans)
  for (int64_t i = 0; i < n; ++i) {
    m = std::max(m, x[i]);
    nans += x[i] != x[i];
  }
  return nans != 0 ? std::numeric_limits<float>::quiet_NaN() : m;
}

}  // namespace kiln::cpu

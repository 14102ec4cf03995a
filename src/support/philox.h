// Philox-4x32-10, the counter-based random generator of Salmon et al., "Parallel Random Numbers:
// As Easy as 1, 2, 3" (SC'11), and the dropout mask built on it. Header-only and usable from
// host and device code, so the CPU reference and the CUDA kernels draw the same numbers for the
// same (seed, offset): a counter-based generator has no state to carry between kernels, and any
// element's number is computed from its index alone.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define KILN_HOST_DEVICE __host__ __device__
#else
#define KILN_HOST_DEVICE
#endif

namespace kiln {

// Four 32-bit words: a Philox counter block or its output.
struct PhiloxBlock {
  uint32_t word[4];
};
// The two-word key.
struct PhiloxKey {
  uint32_t word[2];
};

namespace philox_detail {
inline constexpr uint32_t kMultiplier0 = 0xD2511F53u;
inline constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
inline constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
inline constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1

KILN_HOST_DEVICE inline PhiloxBlock single_round(PhiloxBlock c, PhiloxKey k) {
  uint64_t product0 = uint64_t(kMultiplier0) * c.word[0];
  uint64_t product1 = uint64_t(kMultiplier1) * c.word[2];
  uint32_t hi0 = uint32_t(product0 >> 32), lo0 = uint32_t(product0);
  uint32_t hi1 = uint32_t(product1 >> 32), lo1 = uint32_t(product1);
  return PhiloxBlock{{hi1 ^ c.word[1] ^ k.word[0], lo1, hi0 ^ c.word[3] ^ k.word[1], lo0}};
}
}  // namespace philox_detail

// Philox-4x32 with 10 rounds: a bijection of the counter, keyed by `key`.
KILN_HOST_DEVICE inline PhiloxBlock philox4x32_10(PhiloxBlock counter, PhiloxKey key) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      key.word[0] += philox_detail::kWeyl0;
      key.word[1] += philox_detail::kWeyl1;
    }
    counter = philox_detail::single_round(counter, key);
  }
  return counter;
}

// The random word of element `index` of a stream identified by (seed, offset): the counter is
// (block lo, block hi, offset lo, offset hi) with block = index / 4, the key is (seed lo, seed
// hi), and the element takes word index % 4. Kernels that handle four consecutive elements per
// thread call philox4x32_10 once instead.
KILN_HOST_DEVICE inline uint32_t philox_word(uint64_t seed, uint64_t offset, uint64_t index) {
  uint64_t block = index / 4;
  PhiloxBlock counter{
      {uint32_t(block), uint32_t(block >> 32), uint32_t(offset), uint32_t(offset >> 32)}};
  PhiloxKey key{{uint32_t(seed), uint32_t(seed >> 32)}};
  return philox4x32_10(counter, key).word[index % 4];
}

// A word as a uniform number in [0, 1) on a grid of 2^-24 (exact in f32 and f64).
KILN_HOST_DEVICE inline float philox_uniform(uint32_t word) {
  return float(word >> 8) * (1.0f / 16777216.0f);
}

// Dropout drops an element when philox_uniform(word) < p. The comparison is done on the 24-bit
// integer instead, against this threshold computed once on the host, so that a backend holding
// p as f32 and one holding it as f64 cannot disagree on a grid point lying between the two
// roundings of p: (word >> 8) * 2^-24 < p  <=>  (word >> 8) < ceil(p * 2^24).
inline uint32_t dropout_threshold(double p) {
  double scaled = p * 16777216.0;  // exact: a power-of-two scaling
  auto whole = static_cast<uint32_t>(scaled);
  return double(whole) < scaled ? whole + 1 : whole;  // ceil, for p in [0, 1)
}
KILN_HOST_DEVICE inline bool dropout_drops(uint32_t word, uint32_t threshold) {
  return (word >> 8) < threshold;
}

}  // namespace kiln

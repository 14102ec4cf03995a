#include "ir/dtype.h"

#include <array>

namespace kiln {
namespace {
constexpr std::array<std::string_view, kNumDTypes> kNames = {"f32", "f64", "f16", "bf16",
                                                             "i32", "i64", "bool", "u8"};
constexpr std::array<size_t, kNumDTypes> kSizes = {4, 8, 2, 2, 4, 8, 1, 1};
}  // namespace

std::string_view dtype_name(DType dtype) { return kNames[static_cast<int>(dtype)]; }
size_t dtype_size(DType dtype) { return kSizes[static_cast<int>(dtype)]; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (kNames[i] == name) return static_cast<DType>(i);
  return std::nullopt;
}

float half_to_float(Half h) {
  uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  uint32_t exponent = (h.bits >> 10) & 0x1f;
  uint32_t mantissa = h.bits & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1f) {
    u = sign | 0x7f800000u | (mantissa << 13);  // inf or NaN
  } else if (exponent != 0) {
    u = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    u = sign;
  } else {  // subnormal: normalize
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    mantissa &= 0x3ffu;
    u = sign | (uint32_t(113 - shift) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

Half float_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return Half{uint16_t(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return Half{uint16_t(sign | 0x7c00u)};  // overflows to inf
  if (abs < 0x38800000u) {                                       // result is subnormal or zero
    if (abs < 0x33000000u) return Half{sign};                    // below half the smallest subnormal
    uint32_t exponent = abs >> 23;
    uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exponent;  // 14..24 (value = mantissa * 2^(exponent-150))
    uint32_t rounded = mantissa >> shift;
    uint32_t remainder = mantissa & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (rounded & 1u))) ++rounded;
    return Half{uint16_t(sign | rounded)};
  }
  uint32_t rebased = abs - (112u << 23);  // exponent rebias 127 -> 15
  uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return Half{uint16_t(sign | (rounded >> 13))};
}

}  // namespace kiln

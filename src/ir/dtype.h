// Element types of tensors, their sizes and text names, and the software f16/bf16 conversions
// that the CPU backend uses (it stores 16-bit floats and computes in f32 or f64).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <type_traits>

namespace kiln {

enum class DType : uint8_t { kF32, kF64, kF16, kBF16, kI32, kI64, kBool, kU8 };
inline constexpr int kNumDTypes = 8;

std::string_view dtype_name(DType dtype);  // "f32", "bf16", ...
std::optional<DType> parse_dtype(std::string_view name);
size_t dtype_size(DType dtype);
inline bool is_float(DType d) {
  return d == DType::kF32 || d == DType::kF64 || d == DType::kF16 || d == DType::kBF16;
}
inline bool is_integer(DType d) { return d == DType::kI32 || d == DType::kI64 || d == DType::kU8; }

// IEEE binary16 and bfloat16 storage types. Conversions round to nearest even.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

float half_to_float(Half h);
Half float_to_half(float f);
inline float bfloat16_to_float(BFloat16 b) {
  uint32_t u = uint32_t(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline BFloat16 float_to_bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return BFloat16{uint16_t(u >> 16)};
}

// Calls fn(T{}) with the C++ storage type of `dtype` (float, double, Half, BFloat16, int32_t,
// int64_t, bool, uint8_t): one switch instead of one per kernel.
template <typename Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32: return fn(float{});
    case DType::kF64: return fn(double{});
    case DType::kF16: return fn(Half{});
    case DType::kBF16: return fn(BFloat16{});
    case DType::kI32: return fn(int32_t{});
    case DType::kI64: return fn(int64_t{});
    case DType::kBool: return fn(bool{});
    case DType::kU8: return fn(uint8_t{});
  }
  return fn(float{});
}

// Element conversions through double, the reference kernels' compute type.
template <typename T>
inline double to_double(T v) {
  if constexpr (std::is_same_v<T, Half>) return half_to_float(v);
  else if constexpr (std::is_same_v<T, BFloat16>) return bfloat16_to_float(v);
  else return static_cast<double>(v);
}
template <typename T>
inline T from_double(double v) {
  if constexpr (std::is_same_v<T, Half>) return float_to_half(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, BFloat16>) return float_to_bfloat16(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, bool>) return v != 0.0;
  else return static_cast<T>(v);
}

}  // namespace kiln

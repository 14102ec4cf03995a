// Dispatch on a tensor's dtype in the CUDA .cu files: fn(Tag<T>{}) with T the element's storage
// type (__half and __nv_bfloat16 for the 16-bit floats), so a launcher instantiates its kernel
// once per dtype. One switch for every file instead of one each.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ir/dtype.h"
#include "support/error.h"

namespace kiln::cuda {

template <class T>
struct Tag {
  using type = T;
};

// Every dtype kiln has.
template <class Fn>
void visit_storage(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF32: return fn(Tag<float>{});
    case DType::kF64: return fn(Tag<double>{});
    case DType::kF16: return fn(Tag<__half>{});
    case DType::kBF16: return fn(Tag<__nv_bfloat16>{});
    case DType::kI32: return fn(Tag<int32_t>{});
    case DType::kI64: return fn(Tag<int64_t>{});
    case DType::kBool: return fn(Tag<bool>{});
    case DType::kU8: return fn(Tag<uint8_t>{});
  }
  fail("cuda: unknown dtype code {}", static_cast<int>(t));
}

template <class T>
inline constexpr bool kIsFloatStorage = std::is_floating_point_v<T> || std::is_same_v<T, __half> ||
                                        std::is_same_v<T, __nv_bfloat16>;

// The float dtypes (f32, f64, f16, bf16) only; `who` names the caller in the error for others.
template <class Fn>
void visit_float_storage(DType t, const char* who, Fn&& fn) {
  visit_storage(t, [&](auto tag) {
    if constexpr (kIsFloatStorage<typename decltype(tag)::type>) {
      fn(tag);
    } else {
      fail("{}: a float dtype (f32, f64, f16, bf16) was expected, got {}", who, dtype_name(t));
    }
  });
}

}  // namespace kiln::cuda

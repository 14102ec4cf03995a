// Internal to src/ops/: small helpers shared by the op definitions and their reference kernels.
#pragma once

#include <cmath>
#include <span>
#include <vector>

#include "ir/op_def.h"
#include "ops/registry.h"
#include "support/error.h"
#include "tensor/tensor.h"

namespace kiln::ops {

// Attribute-schema shorthands.
inline AttrSpec required(std::string name, AttrKind kind) { return AttrSpec{std::move(name), kind}; }
inline AttrSpec optional(std::string name, AttrKind kind) {
  return AttrSpec{std::move(name), kind, std::nullopt, true};
}
inline AttrSpec with_default(std::string name, AttrValue value) {
  AttrKind kind = attr_kind(value);
  return AttrSpec{std::move(name), kind, std::move(value)};
}

// A `shape` attribute as a Shape, rejecting negative dimensions.
inline Shape shape_attr(const Attributes& attrs, const std::string& name = "shape") {
  const std::vector<int64_t>& dims = attrs.ints(name);
  for (int64_t d : dims) KILN_CHECK(d >= 0, "attribute '{}' has a negative dimension: {}", name, to_string(Shape(dims)));
  return Shape(dims);
}

// Stores `value` at element `index`; for integer tensors an out-of-range result wraps modulo
// 2^bits (as integer hardware and numpy do) instead of hitting the undefined behavior of
// converting an out-of-range double. Integer-typed results are integers, so fmod is exact.
inline void set_wrapped(Tensor& t, int64_t index, double value) {
  if (is_integer(t.dtype())) {
    if (!std::isfinite(value)) value = 0.0;  // unreachable from integer arithmetic
    double modulus = std::ldexp(1.0, 8 * static_cast<int>(dtype_size(t.dtype())));
    value = std::fmod(value, modulus);
    if (t.dtype() == DType::kU8) {
      if (value < 0) value += modulus;
    } else if (value >= modulus / 2) {
      value -= modulus;
    } else if (value < -modulus / 2) {
      value += modulus;
    }
  }
  t.set(index, value);
}

// Element i of an integer (or bool) tensor as int64, exactly (Tensor::get goes through double,
// which holds integers exactly only below 2^53).
inline int64_t int_at(const Tensor& t, int64_t i) {
  return visit_dtype(t.dtype(), [&](auto tag) -> int64_t {
    using T = decltype(tag);
    if constexpr (std::is_integral_v<T>) {
      return static_cast<int64_t>(t.data<T>()[i]);
    } else {
      fail("int_at: {} is not an integer tensor", dtype_name(t.dtype()));
    }
  });
}
// Stores v modulo 2^bits of t's integer dtype (integer results wrap), exactly.
inline void set_int(Tensor& t, int64_t i, int64_t v) {
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      t.data<T>()[i] = static_cast<T>(static_cast<uint64_t>(v));
    } else {
      fail("set_int: {} is not an integer tensor", dtype_name(t.dtype()));
    }
  });
}

// Calls fn(out_index, offsets) for every element of `out_shape`, where offsets[k] is the flat
// index into input k, whose shape broadcasts to out_shape. The reference kernels' loop.
template <typename Fn>
void for_each_broadcast(const Shape& out_shape, const std::vector<Shape>& in_shapes, Fn&& fn) {
  const int rank = static_cast<int>(out_shape.size());
  const size_t k = in_shapes.size();
  std::vector<std::vector<int64_t>> strides;
  for (const Shape& s : in_shapes) strides.push_back(broadcast_strides(s, out_shape));
  std::vector<int64_t> index(rank, 0), offsets(k, 0);
  const int64_t n = numel(out_shape);
  for (int64_t i = 0; i < n; ++i) {
    fn(i, std::span<const int64_t>(offsets));
    for (int d = rank - 1; d >= 0; --d) {  // odometer increment
      ++index[d];
      for (size_t j = 0; j < k; ++j) offsets[j] += strides[j][d];
      if (index[d] < out_shape[d]) break;
      for (size_t j = 0; j < k; ++j) offsets[j] -= strides[j][d] * index[d];
      index[d] = 0;
    }
  }
}

}  // namespace kiln::ops

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

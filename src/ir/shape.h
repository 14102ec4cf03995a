// Static shapes and tensor types, plus the shape arithmetic shared by ops: numpy broadcasting,
// axis normalization, strides.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/dtype.h"

namespace kiln {

using Shape = std::vector<int64_t>;

struct TensorType {
  DType dtype = DType::kF32;
  Shape shape;

  int rank() const { return static_cast<int>(shape.size()); }
  int64_t numel() const;
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool operator==(const TensorType&) const = default;
};

std::string to_string(const Shape& shape);      // "(2, 3)"
std::string to_string(const TensorType& type);  // "f32[2,3]" (the IR text form)

int64_t numel(const Shape& shape);
// Row-major strides in elements.
std::vector<int64_t> strides_of(const Shape& shape);
// numpy broadcasting of two shapes; throws kiln::Error naming both when they do not broadcast.
Shape broadcast_shapes(const Shape& a, const Shape& b);
// Maps axis in [-rank, rank) to [0, rank); throws kiln::Error otherwise.
int normalize_axis(int64_t axis, int rank);
// Strides for reading a tensor of shape `from` broadcast to `to` (0 where broadcast).
std::vector<int64_t> broadcast_strides(const Shape& from, const Shape& to);

}  // namespace kiln

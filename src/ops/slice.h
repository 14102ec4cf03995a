// A slice's bounds, normalized: what the slice op's shape inference, its gradient rule and the
// memory plan's slice views (analysis/memory_plan.h) all read from its attributes.
#pragma once

#include <cstdint>
#include <vector>

#include "ir/attribute.h"
#include "ir/shape.h"

namespace kiln::ops {

struct SliceBounds {
  std::vector<int64_t> starts, ends, steps;  // normalized: 0 <= start <= end <= dim, step >= 1
  Shape out;
};

// The bounds of slice {starts, ends, steps} of an input of shape `in` (negative bounds count
// from the end; no steps means 1 each). Throws kiln::Error on bounds out of range.
SliceBounds slice_bounds(const Shape& in, const Attributes& attrs);

}  // namespace kiln::ops

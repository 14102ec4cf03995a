// The index check of the gathering and scattering ops' reference kernels (shape.cc, indexing.cc):
// one message for an index outside [0, dim), negative ones included.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace kiln::ops {

// Index `p` of `indices`, checked against [0, dim); a kiln::Error naming `op` otherwise.
int64_t checked_index(const char* op, const Tensor& indices, int64_t p, int64_t dim, int axis);

}  // namespace kiln::ops

#include "ops/common.h"

namespace kiln::ops {
void define_shape_ops(OpRegistry&) {}
}  // namespace kiln::ops

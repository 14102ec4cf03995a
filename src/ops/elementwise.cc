#include "ops/common.h"

namespace kiln::ops {
void define_elementwise_ops(OpRegistry&) {}
}  // namespace kiln::ops

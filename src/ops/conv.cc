#include "ops/common.h"

namespace kiln::ops {
void define_conv_ops(OpRegistry&) {}
}  // namespace kiln::ops

#include "ops/common.h"

namespace kiln::ops {
void define_nn_ops(OpRegistry&) {}
}  // namespace kiln::ops

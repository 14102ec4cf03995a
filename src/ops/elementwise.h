// What backends read of the elementwise ops beyond their OpDef: which line of the math table
// (ops/elementwise_math.h) computes a node. Every kernel of such an op, CPU or CUDA, hand-written
// or generated, evaluates that line.
#pragma once

#include <optional>

#include "ir/attribute.h"
#include "ir/op.h"
#include "ops/elementwise_math.h"

namespace kiln::ops {

// The line that computes `op` with `attrs` (gelu and gelu_grad: the form their `approximate`
// names); nullopt for an op that is not a math line (cast, where, dropout, ...).
std::optional<math::Fn> elementwise_fn(Op op, const Attributes& attrs);

// Whether some line computes `op` (for some attributes).
bool is_math_op(Op op);

}  // namespace kiln::ops

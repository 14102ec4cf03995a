// Helpers shared by the ops' gradient rules (ops/gradient.h).
#include "ops/gradient.h"

#include "support/error.h"

namespace kiln {

Expr reduce_to_shape(Expr grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  const int extra = grad.rank() - static_cast<int>(shape.size());
  KILN_CHECK(extra >= 0, "cannot reduce a gradient of shape {} to {}", to_string(grad.shape()),
             to_string(shape));
  std::vector<int64_t> axes;
  for (int i = 0; i < grad.rank(); ++i) {
    bool added = i < extra;
    bool stretched = !added && shape[i - extra] == 1 && grad.shape()[i] != 1;
    KILN_CHECK(added || stretched || shape[i - extra] == grad.shape()[i],
               "cannot reduce a gradient of shape {} to {}", to_string(grad.shape()), to_string(shape));
    if (added || stretched) axes.push_back(i);
  }
  Expr reduced = axes.empty() ? grad : sum(grad, axes, /*keepdims=*/false);
  return reduced.shape() == shape ? reduced : reshape(reduced, shape);
}

}  // namespace kiln

#include "passes/multi_tensor.h"

namespace kiln {

bool MultiTensorPass::run(Graph&) { return false; }  // stub: filled in by its owner

}  // namespace kiln

#include "passes/classifier.h"

namespace kiln {

bool ClassifierPass::run(Graph&) { return false; }  // stub: filled in by its owner

}  // namespace kiln

#include "passes/pipeline.h"

namespace kiln {

PassManager default_pipeline(PassOptions options) {
  PassManager pm(std::move(options));
  // Passes are added here in order, one line each with a comment saying why it runs there.
  // (simplify, mixed precision, schedule: see their headers in src/passes/.)
  return pm;
}

}  // namespace kiln

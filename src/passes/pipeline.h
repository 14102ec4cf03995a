// The compilation pipeline: the ordered list of passes every training graph goes through.
#pragma once

#include "passes/pass.h"

namespace kiln {

// The default pipeline, one pass per line in passes/pipeline.cc.
PassManager default_pipeline(PassOptions options = {});

}  // namespace kiln

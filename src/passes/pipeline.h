// The compilation pipeline: the ordered list of passes every step goes through; and every
// pass by its name, for `kiln opt --passes a,b` and the .kir pass tests.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "passes/pass.h"

namespace kiln {

// The passes that run on the FORWARD graph, before mixed precision and autodiff (compile_step
// runs them first): recognize (passes/simplify/recognize.h). `options` name passes of both
// pipelines; each takes its own names.
PassManager forward_pipeline(PassOptions options = {});
// The default pipeline, one pass per line in passes/pipeline.cc: on the step's program (the
// training graph, or a forward step's graph).
PassManager default_pipeline(PassOptions options = {});

// The pass named `name` (its Pass::name()), made with what `options` says about it: remat's
// memory budget, classifier-chunks' chunk size, mixed-precision's 16-bit dtype. Throws
// kiln::Error naming the known passes when there is none of that name.
std::unique_ptr<Pass> make_pass(std::string_view name, const PassOptions& options = {});
// Every pass make_pass knows, in pipeline order (recognize and mixed-precision, which run on the
// forward graph before autodiff, first).
std::vector<std::string> pass_names();

}  // namespace kiln

// The compilation pipeline: the ordered list of passes every step goes through; and every
// pass by its name, for `kiln opt --passes a,b` and the .kir pass tests.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "passes/pass.h"

namespace kiln {

// The default pipeline, one pass per line in passes/pipeline.cc.
PassManager default_pipeline(PassOptions options = {});

// The pass named `name` (its Pass::name()), made with what `options` says about it: remat's
// memory budget, classifier-chunks' chunk size, mixed-precision's 16-bit dtype. Throws
// kiln::Error naming the known passes when there is none of that name.
std::unique_ptr<Pass> make_pass(std::string_view name, const PassOptions& options = {});
// Every pass make_pass knows, in pipeline order (mixed-precision, which runs on the forward
// graph before autodiff, first).
std::vector<std::string> pass_names();

}  // namespace kiln

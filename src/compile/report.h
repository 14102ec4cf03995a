// The compile report of a step (`kiln compile --report`, the Python package's step.report()):
// each pipeline pass's time and node counts and notes, the fusion groups (kind, ops, bytes kept
// out of memory) and the planned memory, as text.
#pragma once

#include <string>

#include "compile/compile_step.h"
#include "ir/graph.h"

namespace kiln {

// `what` names the model ("graph @mlp (mlp.kir)"); `source` says how its forward graph came to
// be ("parse", "import", "build forward") in `source_s` seconds; `total_s` is the whole compile.
std::string compile_report(const std::string& what, const std::string& source, const Graph& forward, double source_s,
                           const CompiledStep& step, double total_s);

}  // namespace kiln

// What the nvrtc codegen's kernel writers share: the text every generated kernel starts with,
// its header comment and parameter lists, the statements of micro values, and the column
// reductions' second kernel. One writer per kernel shape (codegen.h says what each looks like):
// elementwise_kernel.cc (with column sums or without) and rows_kernel.cc.
#pragma once

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "backends/cuda/nvrtc/codegen.h"
#include "backends/cuda/nvrtc/lowering.h"

namespace kiln::cuda::codegen {

// Everything a generated kernel starts with: fp16/bf16, the math lines, small helpers.
std::string prelude();
// The comment a generated source starts with: kind, ops, iteration space, the body's types.
std::string header(FusedKind kind, const Lowered& low, const Graph& body);
// The kernel parameters: one pointer per body input, then one per body output; and their names.
std::string params(const Graph& body);
std::string param_names(const Graph& body);
// The variable holding micro value `id`.
std::string var(int id);

// Emits, in order, the statements for `targets` and what they need that is not yet in `done`
// (a value's args first), as `const T vK = ...;`. `load_text` gives a load's expression.
void emit_closure(const std::vector<MVal>& vals, const std::vector<int>& targets,
                  std::set<int>& done, const std::function<bool(int)>& include,
                  const std::function<std::string(int)>& load_text, const std::string& indent,
                  std::string& out);

// ---- column reductions (shared by the elementwise and rows kernels) ----

// Kernel parameters when the body has column reductions: the body's tensors, then the scratch
// buffer of per-tile partial sums.
std::string column_params(const Graph& body, const Lowered& low);
std::string column_param_names(const Graph& body);
// The second kernel: column c of column output o is the sum of the `tiles` partials
// partials[(o' * tiles + t) * N + c] (o' numbering the column outputs), divided by the count for
// a mean. Blocks of 32 columns x 8 threads per column: thread y adds tiles y, y + 8, ... in
// order, then the 8 sums are added in order. A fixed order: the result does not depend on
// scheduling (no atomics).
std::string column_finish(const Graph& body, const Lowered& low, int64_t tiles,
                          GeneratedKernel& k);

// GeneratedKernel::param_element_bytes of `body`'s parameters.
void set_param_bytes(const Graph& body, GeneratedKernel& k);

// ---- the kernel writers, one per kernel shape ----

// FusedKind::kElementwise: one thread per V elements, or with column reductions a 2-D grid of
// column strips over tiles of rows (elementwise_kernel.cc).
GeneratedKernel generate_elementwise(const Graph& body, const Lowered& low);
// FusedKind::kRows: a warp per row, or a block per row past 1024 columns (rows_kernel.cc).
GeneratedKernel generate_rows(const Graph& body, const Lowered& low);

}  // namespace kiln::cuda::codegen

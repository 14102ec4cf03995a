// The IR text form: a printer and a parser that round-trip exactly (print(parse(s)) == s for
// the canonical text that print emits). It is how pass tests are written, how the CLI dumps
// graphs and what a bug report contains.
//
//   graph @mlp(%x: f32[8,784] data, %w: f32[784,128] param, %n: i64[] state, %one: i64[] data) {
//     %0 = matmul(%x, %w) : f32[8,128]
//     %h = gelu(%0) {approximate="tanh"} : f32[8,128]
//     %1, %2 = split(%h) {axis=1, sizes=[64, 64]} : f32[8,64], f32[8,64]
//     %3 = add(%n, %one) : i64[]
//     update %n = %3
//     return %1, %2
//   }
//
// A fused node (ops/fused.cc) is followed by its body, a graph in this same syntax (its own
// value names), inside braces and indented under the node line:
//
//     %5 = fused(%x, %b) {kind="elementwise"} : f32[8,128] {
//       graph @fused_0(%x: f32[8,128] data, %b: f32[128] data) {
//         %0 = add(%x, %b) : f32[8,128]
//         %1 = gelu(%0) : f32[8,128]
//         return %1
//       }
//     }
//
// (`kind` is required, so a fused node's first '{' is always its attribute block.)
//
// `update %target = %value` (Graph::updates, in order, printed just before `return`) says that
// after the step %value replaces the param or state input %target. `return` lists the graph
// outputs, possibly none (a graph may only update), and is the last statement.
//
// Canonical form: 2-space indent, one node per line, attributes sorted by name with those equal
// to their schema default left out, output types always written, trailing newline after '}'.
// Values without a user name are numbered %0, %1, ... in order of definition, skipping numbers
// that user-named values use; purely numeric names of node outputs are not kept by the parser,
// so non-canonical numbering is renumbered. In parsed text, '//' starts a comment, whitespace is
// free between tokens, an empty attribute block is allowed, and output types are optional (when
// given they must equal the inferred ones). Every tensor type, given or inferred, must have
// non-negative dimensions whose product (zeros counted as one) is at most 2^48, so that element
// counts and strides computed downstream cannot overflow.
#pragma once

#include <string>
#include <string_view>

#include "ir/graph.h"

namespace kiln {

// The canonical text of `graph`. Does not verify it (a broken graph can be dumped), but throws
// kiln::Error when it cannot be written as parseable text: a value id out of range, or a graph
// or value name that is empty or not made of [A-Za-z0-9_.-].
std::string print(const Graph& graph);

// Parses and verifies IR text. Throws kiln::ParseError (with the line:column of the offending
// token) for syntax and semantic errors in the text, kiln::Error if the verifier rejects the
// result.
Graph parse(std::string_view text);

}  // namespace kiln

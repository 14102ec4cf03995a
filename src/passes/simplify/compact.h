// Graph-surgery helpers shared by the simplify passes (dead-code, cse, algebraic, ...).
//
// Passes rewrite a Graph by redirecting uses and dropping nodes; afterwards Graph::values holds
// values that nothing defines any more. compact() removes them and renumbers the rest, so every
// pass leaves a graph whose values are exactly its inputs and its node outputs.
#pragma once

#include <span>

#include "ir/graph.h"

namespace kiln {

// Rewrites every use of a value v to replacement[v]: node inputs, graph outputs and update
// values. Update targets and graph inputs are definitions, not uses, and stay. `replacement` has
// one entry per value (the identity where nothing changes) and must already be resolved (no
// chains: replacement[replacement[v]] == replacement[v]).
void replace_uses(Graph& graph, std::span<const ValueId> replacement);

// When `from` is about to be replaced by `to` and only `from` carries a name, moves the name to
// `to` (a graph input's name never moves: inputs are the graph's interface). Keeps names such
// as "loss" visible in dumps after a rewrite.
void move_name(Graph& graph, ValueId from, ValueId to);

// Drops every value that is neither a graph input nor a node output and renumbers the others,
// keeping their relative order. Returns true when a value was dropped. Throws kiln::Error if a
// node input, graph output or update refers to a dropped value (a pass deleted a node that is
// still used).
bool compact(Graph& graph);

}  // namespace kiln

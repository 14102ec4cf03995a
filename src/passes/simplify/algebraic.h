// algebraic: the table of small local rewrite rules (x * 1 -> x, neg(neg(x)) -> x, ...), applied
// to a fixed point by the rule driver (passes/simplify/rewrite.h).
//
// What: each rule replaces one node by a value that is bitwise equal to its output for EVERY
// input, infinities, NaN and signed zeros included: a rule that would change a result on some
// input is written with the condition that excludes it, or left out, and the table says which.
// The rules and their conditions are listed, one per line, in algebraic.cc.
// Why: autodiff, the optimizer and the training rewrites emit such patterns (double negations,
// transposes of transposes, reshapes of reshapes, casts that round-trip); removing them shortens
// the graph and lets fusion see longer chains.
// Expects: a verified graph. Guarantees: outputs and updates bitwise unchanged; replaced nodes
// are removed (the nodes they read may become dead: dead-code removes those); values compacted.
// Each sweep is linear; rules look at most a few producers back.
#pragma once

#include <map>
#include <span>

#include "passes/pass.h"
#include "passes/simplify/rewrite.h"

namespace kiln {

// The rule table, in the order the driver tries them.
std::span<const RewriteRule> algebraic_rules();

class AlgebraicSimplifier : public Pass {
 public:
  std::string name() const override { return "algebraic"; }
  bool run(Graph& graph) override;
  // How often each rule fired in the last run (for tests and reports).
  const std::map<std::string, int>& fired() const { return fired_; }

 private:
  std::map<std::string, int> fired_;
};

}  // namespace kiln

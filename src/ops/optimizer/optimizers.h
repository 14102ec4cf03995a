// The optimizer registry: one entry per optimizer, and everything that knows an optimizer reads
// it from here: its hyperparameters (typed, with defaults: PyTorch's where PyTorch has the
// optimizer), its state slots (shape, shardable, offloadable) and how its update is built into
// the training graph.
//   - the elementwise optimizers (SGD, AdamW, Lion) come from their rules (ops/optimizer/rules.h):
//     the update is one optimizer_update node, evaluated by every kernel from the rule;
//   - Adafactor, whose second moments are factored (row and column means of a 2-D param), is
//     built from ordinary graph ops (reductions, rsqrt, ...), so every backend runs it with the
//     kernels it has.
// Readers: the op's verifier (ops/optimizer.cc), the training graph (state names, sharding,
// parameter groups: compile/training_graph.cc), the trainer (checkpoints, sharded state), the
// memory estimate (train/placement.cc), the CLI flags (tools/cli/) and the Python classes
// (python/kiln/optim.py, through the extension).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ir/builder.h"
#include "ops/optimizer/rules.h"

namespace kiln::optim {

// The shape of a slot's tensor from its param's. Shapes (..., R, C) are a 2-D param's and up.
enum class SlotShape {
  kParam,        // the param's
  kFactoredRow,  // (..., R): params of rank >= 2 only
  kFactoredCol,  // (..., C): params of rank >= 2 only
  kUnfactored,   // the param's: params of rank < 2 only
};
struct StateSlot {
  std::string name;  // the state input is "opt.<name>.<param>" (and so is its checkpoint entry)
  SlotShape shape = SlotShape::kParam;
  // ZeRO-1/2/3 keep one flat shard of it per rank (needs an update that works on any slice).
  bool shardable = true;
  // --offload may keep it in host memory between steps (read by the update node alone).
  bool offloadable = true;
};
// The slot's shape for a param of shape `param`; nullopt when the param has no such slot.
std::optional<Shape> slot_shape(const StateSlot& slot, const Shape& param);

// What an update reads: the param (or its shard), its gradient (the param's dtype), its slots in
// the entry's order (an Expr with id -1 where slot_shape says none), the learning rate and this
// update's number t >= 1 (scalars of the param's dtype) and the hyperparameters (attributes).
struct UpdateInputs {
  Expr param, grad;
  std::vector<Expr> slots;
  Expr lr, step;
  Attributes hyper;
};
// The new param, then the new value of each slot (id -1 where the slot is absent).
using UpdateBuilder = std::function<std::vector<Expr>(const UpdateInputs&)>;

struct OptimizerDef {
  std::string name, help;
  std::vector<HyperSpec> hyper;
  std::vector<StateSlot> slots;
  bool elementwise = false;  // its update is one optimizer_update node (a rule of rules.h)
  UpdateBuilder build;

  const HyperSpec* find_hyper(std::string_view hyper_name) const;  // nullptr if it has none such
  // The state floats per param element (kParam slots; factored slots count as none).
  int state_per_param_element() const;
};

// Every optimizer, in a fixed order (sgd, adamw, lion, adafactor).
const std::vector<OptimizerDef>& optimizers();
// Throws kiln::Error naming the known optimizers when there is no `name`.
const OptimizerDef& optimizer_def(const std::string& name);
// "sgd | adamw | lion | adafactor" (with `separator`).
std::string optimizer_names(std::string_view separator = " | ");
// Every hyperparameter name of any optimizer, each once, in first-seen order.
std::vector<std::string> hyperparameter_names();
// The slot names of every optimizer, each once ("buf", "m", "v", ...); only those of `shape`
// when given.
std::vector<std::string> slot_names(std::optional<SlotShape> shape = std::nullopt);

// The entry's hyperparameters as optimizer_update's attributes (plus "optimizer"): defaults,
// overridden by `values`. Throws kiln::Error on a name the entry lacks or a value out of its range.
Attributes hyper_attributes(const OptimizerDef& def, const std::map<std::string, double>& values);
// Checks a node's attributes: every hyperparameter of the entry present, in range, no other.
void check_hyper_attributes(const OptimizerDef& def, const Attributes& attrs);
// The values a rule's kernels read (kHyper order) from checked attributes.
HyperValues hyper_values(const OptimizerDef& def, const Attributes& attrs);

}  // namespace kiln::optim

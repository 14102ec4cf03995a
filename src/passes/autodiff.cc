#include "passes/autodiff.h"

#include <map>

#include "ir/op_def.h"
#include "ir/verifier.h"
#include "support/error.h"

namespace kiln {

AutodiffResult autodiff(const Graph& forward, ValueId loss, const std::vector<ValueId>& wrt) {
  verify(forward);
  KILN_CHECK(forward.is_valid(loss), "autodiff: loss value id {} does not exist", loss);
  const TensorType& loss_type = forward.type(loss);
  KILN_CHECK(is_float(loss_type.dtype) && loss_type.rank() == 0,
             "autodiff: the loss must be a float scalar, got {}", to_string(loss_type));
  for (ValueId id : wrt) {
    KILN_CHECK(forward.is_valid(id), "autodiff: value id {} does not exist", id);
    KILN_CHECK(is_float(forward.type(id).dtype), "autodiff: cannot differentiate with respect to {} of {}",
               forward.value(id).name, to_string(forward.type(id)));
  }

  // Values on a path from some wrt value: only their gradients are worth building.
  std::vector<bool> depends(forward.values.size(), false);
  for (ValueId id : wrt) depends[id] = true;
  for (const Node& node : forward.nodes) {
    bool any = false;
    for (ValueId in : node.inputs) any = any || depends[in];
    if (any)
      for (ValueId out : node.outputs) depends[out] = is_float(forward.type(out).dtype);
  }

  Builder b(forward);
  std::map<ValueId, Expr> grads;
  auto accumulate = [&](ValueId id, Expr g) {
    auto it = grads.find(id);
    if (it == grads.end()) grads.emplace(id, g);
    else it->second = it->second + g;
  };
  accumulate(loss, b.full({}, 1.0, loss_type.dtype));

  const size_t forward_nodes = forward.nodes.size();
  for (size_t n = forward_nodes; n-- > 0;) {
    // Copy: the builder appends to graph().nodes, which may reallocate.
    const Node node = b.graph().nodes[n];
    bool has_output_grad = false;
    for (ValueId out : node.outputs) has_output_grad = has_output_grad || grads.count(out);
    bool wants_input_grad = false;
    for (ValueId in : node.inputs) wants_input_grad = wants_input_grad || depends[in];
    if (!has_output_grad || !wants_input_grad) continue;

    const OpDef& def = op_def(node.op);
    if (!def.differentiable || !def.gradient)
      fail("autodiff: the loss depends on a parameter through {} (node {}), which is not differentiable",
           op_name(node.op), n);
    GradContext context{b, node, {}, {}, {}};
    for (ValueId in : node.inputs) context.inputs.push_back(b.wrap(in));
    for (ValueId out : node.outputs) {
      context.outputs.push_back(b.wrap(out));
      auto it = grads.find(out);
      context.output_grads.push_back(it != grads.end() ? it->second
                                                       : b.full(b.graph().type(out).shape, 0.0, b.graph().type(out).dtype));
    }
    std::vector<Expr> input_grads = def.gradient(context);
    KILN_CHECK(input_grads.size() == node.inputs.size(),
               "autodiff: gradient rule of {} returned {} gradients for {} inputs", op_name(node.op),
               input_grads.size(), node.inputs.size());
    for (size_t i = 0; i < node.inputs.size(); ++i) {
      ValueId in = node.inputs[i];
      if (!depends[in] || input_grads[i].id() < 0) continue;
      const TensorType& want = b.graph().type(in);
      KILN_CHECK(input_grads[i].type() == want,
                 "autodiff: gradient rule of {} gave {} for input {} of {}", op_name(node.op),
                 to_string(input_grads[i].type()), i, to_string(want));
      accumulate(in, input_grads[i]);
    }
  }

  AutodiffResult result;
  for (ValueId id : wrt) {
    auto it = grads.find(id);
    Expr g = it != grads.end() ? it->second : b.full(forward.type(id).shape, 0.0, forward.type(id).dtype);
    result.gradients.push_back(g.id());
    result.reached.push_back(it != grads.end());
  }
  result.graph = b.take();
  verify(result.graph);
  return result;
}

}  // namespace kiln

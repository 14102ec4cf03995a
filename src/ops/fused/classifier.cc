#include "ops/fused/classifier.h"

#include <vector>

#include "support/error.h"

namespace kiln {
namespace {

bool is_16bit_float(DType d) { return d == DType::kBF16 || d == DType::kF16; }

std::optional<ClassifierBody> refuse(std::string* why, std::string reason) {
  if (why) *why = std::move(reason);
  return std::nullopt;
}

}  // namespace

std::optional<ClassifierBody> match_classifier_body(const Graph& body, std::string* why) {
  if (body.inputs.size() != 3 || body.outputs.size() != 2)
    return refuse(why, fmt::format("{} inputs and {} outputs, expected 3 (logits, labels, dloss) "
                                   "and 2 (loss, dlogits)",
                                   body.inputs.size(), body.outputs.size()));
  if (body.nodes.size() < 2 || body.nodes.size() > 4)
    return refuse(why, fmt::format("{} nodes, expected 2 to 4 ([cast], cross_entropy, "
                                   "cross_entropy_grad, [cast])", body.nodes.size()));
  if (!body.updates.empty()) return refuse(why, "the body has updates");
  const ValueId x = body.inputs[0].value, labels = body.inputs[1].value,
                dloss = body.inputs[2].value;
  size_t n = 0;
  ValueId logits = x;
  if (body.nodes[n].op == Op::kCast) {
    const Node& cast = body.nodes[n++];
    if (cast.inputs[0] != x || !is_16bit_float(body.type(x).dtype))
      return refuse(why, "the first cast is not of 16-bit logits (body input 0)");
    logits = cast.outputs[0];
  }
  if (n + 2 > body.nodes.size()) return refuse(why, "no cross_entropy and cross_entropy_grad");
  const Node& ce = body.nodes[n++];
  const Node& grad = body.nodes[n++];
  if (ce.op != Op::kCrossEntropy || grad.op != Op::kCrossEntropyGrad)
    return refuse(why, fmt::format("{} then {}, expected cross_entropy then cross_entropy_grad",
                                   op_name(ce.op), op_name(grad.op)));
  if (ce.inputs != std::vector<ValueId>{logits, labels} ||
      grad.inputs != std::vector<ValueId>{logits, labels, dloss})
    return refuse(why, "the loss ops do not read (logits, labels[, dloss]) of the body inputs");
  if (!same_values(ce.attrs, grad.attrs))
    return refuse(why, "cross_entropy and cross_entropy_grad have different attributes");
  ValueId g = grad.outputs[0];
  if (n < body.nodes.size()) {
    const Node& cast = body.nodes[n++];
    if (cast.op != Op::kCast || cast.inputs[0] != g ||
        !is_16bit_float(body.type(cast.outputs[0]).dtype))
      return refuse(why, fmt::format("the last node is {}, expected a cast of the gradient to "
                                     "bf16 or f16", op_name(cast.op)));
    g = cast.outputs[0];
  }
  if (n < body.nodes.size()) return refuse(why, "nodes after the gradient's cast");
  if (body.outputs[0] != ce.outputs[0] || body.outputs[1] != g)
    return refuse(why, "the outputs are not (loss, dlogits)");
  const TensorType& logits_type = body.type(logits);
  if (logits_type.dtype != DType::kF32)
    return refuse(why, fmt::format("the loss ops read {} logits, expected f32",
                                   dtype_name(logits_type.dtype)));
  ClassifierBody out;
  out.logits = body.type(x).dtype;
  out.labels = body.type(labels).dtype;
  out.grad = body.type(g).dtype;
  out.ignore_index = ce.attrs.i("ignore_index");
  out.reduction = ce.attrs.s("reduction");
  out.vocab = logits_type.shape.back();
  out.rows = 1;
  for (int64_t d : body.type(labels).shape) out.rows *= d;
  return out;
}

}  // namespace kiln

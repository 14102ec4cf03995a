#include "ops/fused/multi_tensor.h"

#include <algorithm>
#include <limits>

#include "support/error.h"

namespace kiln::multi_tensor {
namespace {

std::optional<UpdateBody> refuse(std::string* why, std::string reason) {
  if (why) *why = std::move(reason);
  return std::nullopt;
}

// Per body value: the index of the body input holding it, or -1.
std::vector<int> input_slots(const Graph& body) {
  std::vector<int> slot(body.values.size(), -1);
  for (size_t i = 0; i < body.inputs.size(); ++i) slot[body.inputs[i].value] = static_cast<int>(i);
  return slot;
}

}  // namespace

std::optional<UpdateBody> update_body(const Graph& body, std::string* why) {
  if (body.nodes.empty()) return refuse(why, "the body has no nodes");
  const std::vector<int> in_slot = input_slots(body);
  std::vector<int> out_slot(body.values.size(), -1);
  for (size_t i = 0; i < body.outputs.size(); ++i) {
    const ValueId id = body.outputs[i];
    if (out_slot[id] >= 0) return refuse(why, fmt::format("body output {} is listed twice", i));
    out_slot[id] = static_cast<int>(i);
  }
  UpdateBody out;
  out.attrs = body.nodes[0].attrs;
  std::vector<int> scalars;
  size_t results = 0;
  for (const Node& node : body.nodes) {
    if (node.op != Op::kOptimizerUpdate) return refuse(why, fmt::format("the body holds a {}", op_name(node.op)));
    if (!same_values(node.attrs, out.attrs))
      return refuse(why, "the members' attributes differ");
    Member m;
    for (ValueId id : node.inputs) {
      if (in_slot[id] < 0) return refuse(why, "a member reads another member's result");
      m.inputs.push_back(in_slot[id]);
    }
    // lr and step, the last two operands
    const std::vector<int> own_scalars(m.inputs.end() - 2, m.inputs.end());
    if (scalars.empty()) scalars = own_scalars;
    if (own_scalars != scalars) return refuse(why, "the members' scalar operands differ");
    for (ValueId id : node.outputs) {
      if (out_slot[id] < 0) return refuse(why, "a member's result is not a body output");
      m.outputs.push_back(out_slot[id]);
    }
    results += node.outputs.size();
    out.members.push_back(std::move(m));
  }
  if (results != body.outputs.size())
    return refuse(why, "a body output is not a member's result");
  return out;
}

std::optional<NormBody> norm_body(const Graph& body, std::string* why) {
  auto no = [&](std::string reason) -> std::optional<NormBody> {
    if (why) *why = std::move(reason);
    return std::nullopt;
  };
  if (body.outputs.size() != 1) return no("the body has more than one output");
  const std::vector<int> in_slot = input_slots(body);
  // Per body value: what computes it so far (a term code >= 0, an add code < 0, or none).
  constexpr int kNone = std::numeric_limits<int>::min();
  std::vector<int> code(body.values.size(), kNone);
  std::vector<int> square_of(body.values.size(), -1);  // value -> body input it squares
  std::vector<int> cast_of(body.values.size(), -1);    // value -> body input cast to f32
  std::vector<int> uses(body.values.size(), 0);
  for (const Node& node : body.nodes)
    for (ValueId id : node.inputs) ++uses[id];
  for (ValueId id : body.outputs) ++uses[id];
  std::vector<bool> input_taken(body.inputs.size(), false);
  NormBody out;
  auto f32_scalar = [&](ValueId id) {
    const TensorType& t = body.type(id);
    return t.dtype == DType::kF32 && t.rank() == 0;
  };
  for (const Node& node : body.nodes) {
    const ValueId x = node.inputs.empty() ? -1 : node.inputs[0];
    const ValueId y = node.outputs.empty() ? -1 : node.outputs[0];
    if (node.op == Op::kCast) {
      if (in_slot[x] < 0 || !is_float(body.type(x).dtype) || body.type(y).dtype != DType::kF32)
        return no("a cast that is not of a body input to f32");
      cast_of[y] = in_slot[x];
    } else if (node.op == Op::kSquare) {
      if (body.type(y).dtype != DType::kF32) return no("a square that is not f32");
      const int source = in_slot[x] >= 0 && body.type(x).dtype == DType::kF32 ? in_slot[x]
                                                                                : cast_of[x];
      if (source < 0 || uses[x] != 1) return no("a square of neither an f32 input nor its cast");
      square_of[y] = source;
    } else if (node.op == Op::kSum) {
      if (square_of[x] < 0 || uses[x] != 1 || !f32_scalar(y))
        return no("a sum that is not a full f32 sum of a square");
      const int input = square_of[x];
      if (input_taken[input]) return no("a body input read by two terms");
      input_taken[input] = true;
      code[y] = static_cast<int>(out.term_input.size());
      out.term_input.push_back(input);
    } else if (node.op == Op::kAdd) {
      if (!f32_scalar(y) || node.inputs.size() != 2) return no("an add that is not of f32 scalars");
      std::array<int, 2> operands{};
      for (int k = 0; k < 2; ++k) {
        const ValueId in = node.inputs[k];
        if (code[in] == kNone || uses[in] != 1)
          return no("an add operand that is not a term or an add used once");
        operands[k] = code[in];
      }
      code[y] = -1 - static_cast<int>(out.adds.size());
      out.adds.push_back(operands);
    } else {
      return no(fmt::format("the body holds a {}", op_name(node.op)));
    }
  }
  if (out.term_input.empty()) return no("the body has no terms");
  if (std::find(input_taken.begin(), input_taken.end(), false) != input_taken.end())
    return no("a body input no term reads");
  const int result = code[body.outputs[0]];
  if (result == kNone) return no("the body output is not a term or an add");
  // Every term and add feeds the result exactly once (each value is used once, and only the
  // tree's values are counted): the tree has terms - 1 adds.
  if (out.adds.size() + 1 != out.term_input.size()) return no("a term or add outside the tree");
  out.result = result;
  return out;
}

std::optional<std::vector<CastMember>> cast_body(const Graph& body, std::string* why) {
  auto no = [&](std::string reason) -> std::optional<std::vector<CastMember>> {
    if (why) *why = std::move(reason);
    return std::nullopt;
  };
  if (body.nodes.empty()) return no("the body has no nodes");
  const std::vector<int> in_slot = input_slots(body);
  std::vector<int> out_slot(body.values.size(), -1);
  for (size_t i = 0; i < body.outputs.size(); ++i) {
    const ValueId id = body.outputs[i];
    if (out_slot[id] >= 0) return no(fmt::format("body output {} is listed twice", i));
    out_slot[id] = static_cast<int>(i);
  }
  if (body.outputs.size() != body.nodes.size())
    return no(fmt::format("{} body outputs for {} casts, expected one per cast", body.outputs.size(),
                          body.nodes.size()));
  std::vector<CastMember> out;
  for (const Node& node : body.nodes) {
    if (node.op != Op::kCast) return no(fmt::format("the body holds a {}", op_name(node.op)));
    if (node.inputs.size() != 1 || node.outputs.size() != 1) return no("a cast without one operand and one result");
    const ValueId x = node.inputs[0], y = node.outputs[0];
    if (in_slot[x] < 0) return no("a cast of a value that is not a body input");
    if (body.type(x).dtype != DType::kF32)
      return no(fmt::format("a cast of a {} input, expected f32", dtype_name(body.type(x).dtype)));
    const DType to = body.type(y).dtype;
    if (to != DType::kBF16 && to != DType::kF16)
      return no(fmt::format("a cast to {}, expected bf16 or f16", dtype_name(to)));
    if (out_slot[y] < 0) return no("a cast's result is not a body output");
    out.push_back(CastMember{in_slot[x], out_slot[y], to});
  }
  return out;
}

}  // namespace kiln::multi_tensor

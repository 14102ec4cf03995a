#include "ops/registry.h"

#include <cmath>

#include "support/error.h"
#include "tensor/tensor.h"

namespace kiln {
namespace ops {

OpDef& OpRegistry::define(Op op, OpDef def) {
  auto& slot = defs_[static_cast<int>(op)];
  KILN_CHECK(!slot.has_value(), "op '{}' is defined twice", op_name(op));
  slot = std::move(def);
  return *slot;
}

const OpDef* OpRegistry::find(Op op) const {
  const auto& slot = defs_[static_cast<int>(op)];
  return slot ? &*slot : nullptr;
}

namespace {
const OpRegistry& registry() {
  static const OpRegistry instance = [] {
    OpRegistry r;
    define_source_ops(r);
    define_elementwise_ops(r);
    define_reduction_ops(r);
    define_shape_ops(r);
    define_indexing_ops(r);
    define_nn_ops(r);
    define_conv_ops(r);
    define_optimizer_ops(r);
    define_collective_ops(r);
    define_transfer_ops(r);
    define_fused_ops(r);
    return r;
  }();
  return instance;
}
}  // namespace
}  // namespace ops

bool has_op_def(Op op) {
  const OpDef* def = ops::registry().find(op);
  return def && def->infer && def->reference;
}

const OpDef& op_def(Op op) {
  const OpDef* def = ops::registry().find(op);
  KILN_CHECK(def != nullptr, "op '{}' has no definition in src/ops/", op_name(op));
  return *def;
}

Attributes normalize_attributes(Op op, Attributes attrs) {
  const OpDef& def = op_def(op);
  for (const auto& [name, value] : attrs.items()) {
    bool known = false;
    for (const AttrSpec& spec : def.attrs) known = known || spec.name == name;
    if (!known) {
      std::vector<std::string> names;
      for (const AttrSpec& spec : def.attrs) names.push_back(spec.name);
      fail("{}: unknown attribute '{}' (expected one of: {})", op_name(op), name,
           names.empty() ? std::string("none") : fmt::format("{}", fmt::join(names, ", ")));
    }
  }
  for (const AttrSpec& spec : def.attrs) {
    if (!attrs.has(spec.name)) {
      if (spec.default_value) attrs.set(spec.name, *spec.default_value);
      else if (!spec.optional) fail("{}: missing required attribute '{}' ({})", op_name(op), spec.name, attr_kind_name(spec.kind));
      continue;
    }
    AttrValue value = attrs.get(spec.name);
    AttrKind kind = attr_kind(value);
    AttrKind wanted = spec.kind;
    if (spec.ints_for_integer_dtype && attrs.has("dtype")) {
      const DType* dtype = std::get_if<DType>(&attrs.get("dtype"));
      if (dtype && !is_float(*dtype)) wanted = AttrKind::kInts;
    }
    if (kind == wanted) continue;
    if (wanted == AttrKind::kInts && kind == AttrKind::kFloats) {
      // Old text and float-minded callers write integers as floats; each must be one exactly.
      std::vector<int64_t> ints;
      for (double v : std::get<std::vector<double>>(value)) {
        if (std::trunc(v) != v || v < -std::ldexp(1.0, 63) || v >= std::ldexp(1.0, 63))
          fail("{}: attribute '{}' holds {}, expected integers for dtype {}", op_name(op),
               spec.name, v, dtype_name(attrs.dtype("dtype")));
        ints.push_back(static_cast<int64_t>(v));
      }
      attrs.set(spec.name, std::move(ints));
    } else if (spec.kind == AttrKind::kFloat && kind == AttrKind::kInt) {
      attrs.set(spec.name, static_cast<double>(std::get<int64_t>(value)));
    } else if (spec.kind == AttrKind::kFloats && kind == AttrKind::kInts) {
      const auto& ints = std::get<std::vector<int64_t>>(value);
      attrs.set(spec.name, std::vector<double>(ints.begin(), ints.end()));
    } else if (spec.kind == AttrKind::kInts && kind == AttrKind::kFloats &&
               std::get<std::vector<double>>(value).empty()) {
      attrs.set(spec.name, std::vector<int64_t>{});
    } else {
      fail("{}: attribute '{}' is {} {}, expected {}", op_name(op), spec.name,
           attr_kind_name(kind), to_string(value), attr_kind_name(wanted));
    }
  }
  if (def.normalize) def.normalize(attrs);
  return attrs;
}

std::vector<TensorType> infer_types(Op op, std::span<const TensorType> inputs,
                                    const Attributes& attrs, const Graph* body) {
  const OpInfo& info = op_info(op);
  int n = static_cast<int>(inputs.size());
  if (n < info.min_inputs || (info.max_inputs >= 0 && n > info.max_inputs)) {
    if (info.max_inputs < 0) fail("{}: got {} inputs, expected at least {}", info.name, n, info.min_inputs);
    if (info.min_inputs == info.max_inputs) fail("{}: got {} inputs, expected {}", info.name, n, info.min_inputs);
    fail("{}: got {} inputs, expected {} to {}", info.name, n, info.min_inputs, info.max_inputs);
  }
  try {
    const OpDef& def = op_def(op);
    if (def.infer_with_body) {
      KILN_CHECK(body != nullptr, "a {} node needs a body (its subgraph), none was given",
                 info.name);
      return def.infer_with_body(inputs, attrs, *body);
    }
    KILN_CHECK(body == nullptr, "only fused nodes have a body; this {} node has one", info.name);
    return def.infer(inputs, attrs);
  } catch (const ParseError&) {
    throw;
  } catch (const Error& e) {
    std::string message = e.what();
    std::string prefix = std::string(info.name) + ":";
    if (message.rfind(prefix, 0) == 0) throw;
    throw Error(fmt::format("{}: {}", info.name, message));
  }
}

}  // namespace kiln

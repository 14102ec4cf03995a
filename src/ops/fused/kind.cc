#include "ops/fused/kind.h"

#include <array>

#include "ir/op_def.h"
#include "ops/fused/classifier.h"
#include "ops/fused/group.h"
#include "ops/fused/multi_tensor.h"
#include "support/error.h"

namespace kiln {
namespace {

constexpr std::array<std::string_view, kFusedKindCount> kNames = {
#define KILN_FUSED_KIND_NAME(name, text) text,
    KILN_FUSED_KINDS(KILN_FUSED_KIND_NAME)
#undef KILN_FUSED_KIND_NAME
};

}  // namespace

std::string_view fused_kind_name(FusedKind kind) { return kNames.at(static_cast<size_t>(kind)); }

std::optional<FusedKind> fused_kind_named(std::string_view name) {
  for (size_t k = 0; k < kNames.size(); ++k)
    if (kNames[k] == name) return static_cast<FusedKind>(k);
  return std::nullopt;
}

std::string known_fused_kinds() { return fmt::format("{}", fmt::join(kNames, ", ")); }

FusedKind fused_kind(const Attributes& attrs) {
  const std::string& name = attrs.s("kind");
  const std::optional<FusedKind> kind = fused_kind_named(name);
  KILN_CHECK(kind.has_value(), "unknown fused kind \"{}\", expected one of: {}", name,
             known_fused_kinds());
  return *kind;
}

bool is_fused(const Node& node, FusedKind kind) {
  if (node.op != Op::kFused || node.body == nullptr || !node.attrs.has("kind")) return false;
  const AttrValue& value = node.attrs.get("kind");
  const std::string* name = std::get_if<std::string>(&value);
  return name != nullptr && fused_kind_named(*name) == kind;
}

Attributes fused_attrs(FusedKind kind) {
  return normalize_attributes(Op::kFused, {{"kind", std::string(fused_kind_name(kind))}});
}

bool is_fusion_group(FusedKind kind) {
  return kind == FusedKind::kElementwise || kind == FusedKind::kRows ||
         kind == FusedKind::kGemmEpilogue;
}

void check_fused_body(FusedKind kind, const Graph& body) {
  std::string why;
  bool ok = false;
  switch (kind) {
    case FusedKind::kElementwise:
    case FusedKind::kRows:
    case FusedKind::kGemmEpilogue:
      ok = match_group_body(kind, body, &why).has_value();
      break;
    case FusedKind::kClassifier:
      ok = match_classifier_body(body, &why).has_value();
      break;
    case FusedKind::kMultiTensorUpdate:
      ok = multi_tensor::update_body(body, &why).has_value();
      break;
    case FusedKind::kGlobalNorm:
      ok = multi_tensor::norm_body(body, &why).has_value();
      break;
    case FusedKind::kMultiTensorCast:
      ok = multi_tensor::cast_body(body, &why).has_value();
      break;
  }
  KILN_CHECK(ok, "the body @{} is not a \"{}\" body: {}", body.name, fused_kind_name(kind), why);
}

}  // namespace kiln

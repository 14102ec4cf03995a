// The kinds of `fused` node (ops/fused.cc), from ONE list. A fused node's kind says what its
// body (Node::body) is, and each kind has a body contract: a matcher, under src/ops/fused/, that
// says what the body must look like and hands the kernels the pieces they need.
//
// The IR text keeps the kind as the string attribute `kind="rows"` (the names below); code asks
// fused_kind(node) and compares enums. The verifier runs the kind's matcher on every fused
// node (the fused op's inference: check_fused_body), so a pass that builds a wrong body fails
// verify() right after it, and a backend can trust the kind instead of pattern-matching a
// string and hoping. An unknown kind is an error, never a fallback.
//
//   kind                  made by                          contract
//   elementwise           fusion (passes/fusion/fusion.h)  ops/fused/group.h
//   rows                  fusion, ones-column              ops/fused/group.h
//   gemm-epilogue         fusion, ones-column, classifier-chunks  ops/fused/group.h
//   classifier            classifier (passes/classifier.h) ops/fused/classifier.h
//   multi-tensor-update   multi-tensor (passes/multi_tensor.h)   ops/fused/multi_tensor.h
//   global-norm           multi-tensor                     ops/fused/multi_tensor.h
//   multi-tensor-cast     multi-tensor                     ops/fused/multi_tensor.h
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ir/graph.h"

namespace kiln {

// X(EnumName, "text name"). A new kind is a line here, a matcher and a case in
// check_fused_body (kind.cc), and a negative verify test (tests/ops/fused_kind_test.cc).
#define KILN_FUSED_KINDS(X)                     \
  X(Elementwise, "elementwise")                 \
  X(Rows, "rows")                               \
  X(GemmEpilogue, "gemm-epilogue")              \
  X(Classifier, "classifier")                   \
  X(MultiTensorUpdate, "multi-tensor-update")   \
  X(GlobalNorm, "global-norm")                  \
  X(MultiTensorCast, "multi-tensor-cast")

enum class FusedKind : uint8_t {
#define KILN_FUSED_KIND_ENUM(name, text) k##name,
  KILN_FUSED_KINDS(KILN_FUSED_KIND_ENUM)
#undef KILN_FUSED_KIND_ENUM
};
#define KILN_FUSED_KIND_COUNT(name, text) +1
inline constexpr int kFusedKindCount = 0 KILN_FUSED_KINDS(KILN_FUSED_KIND_COUNT);
#undef KILN_FUSED_KIND_COUNT

std::string_view fused_kind_name(FusedKind kind);  // "gemm-epilogue", ...
// The kind of a text name, or nullopt for none.
std::optional<FusedKind> fused_kind_named(std::string_view name);
// "elementwise, rows, ...": for errors that list what is known.
std::string known_fused_kinds();

// The kind of a fused node (its `kind` attribute). Throws kiln::Error naming the attribute and
// the known kinds when it is none of them.
FusedKind fused_kind(const Attributes& attrs);
inline FusedKind fused_kind(const Node& node) { return fused_kind(node.attrs); }
// Whether `node` is a fused node with a body, of `kind`. Never throws (supports() asks it of
// any node).
bool is_fused(const Node& node, FusedKind kind);
// The normalized attributes of a fused node of `kind`.
Attributes fused_attrs(FusedKind kind);

// The kinds the fusion pass gives its groups (elementwise, rows, gemm-epilogue): bodies of
// ordinary ops over one iteration space, run by generic fused kernels, which the multi-tensor
// pass may take apart and outline again.
bool is_fusion_group(FusedKind kind);

// Throws kiln::Error, saying why, unless `body` (verified) meets `kind`'s contract.
void check_fused_body(FusedKind kind, const Graph& body);

}  // namespace kiln

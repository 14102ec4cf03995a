// The op table is complete: every op has attributes schema, inference and a reference kernel,
// text names parse back, the CPU backend can run every op, and the elementwise ops agree with
// the math table (ops/elementwise_math.h).
#include <set>

#include "ops/elementwise.h"
#include "test_util.h"

namespace kiln {
namespace {

TEST(OpTable, EveryOpHasDefinitionInferenceAndReference) {
  for (int i = 0; i < kNumOps; ++i) {
    Op op = static_cast<Op>(i);
    EXPECT_TRUE(has_op_def(op)) << "op '" << op_name(op) << "' lacks a definition in src/ops/";
  }
}

TEST(OpTable, EveryOpHasAGradientRuleOrSaysItHasNone) {
  for (int i = 0; i < kNumOps; ++i) {
    Op op = static_cast<Op>(i);
    if (!has_op_def(op)) continue;  // reported above
    const OpDef& def = op_def(op);
    EXPECT_TRUE(!def.differentiable || def.gradient != nullptr)
        << "op '" << op_name(op) << "' is differentiable but has no gradient rule";
  }
}

TEST(OpTable, NamesRoundTrip) {
  for (int i = 0; i < kNumOps; ++i) {
    Op op = static_cast<Op>(i);
    ASSERT_TRUE(parse_op(op_name(op)).has_value()) << op_name(op);
    EXPECT_EQ(*parse_op(op_name(op)), op);
  }
  EXPECT_FALSE(parse_op("no_such_op").has_value());
}

TEST(OpTable, EveryOpHasACpuKernel) {
  for (int i = 0; i < kNumOps; ++i) {
    Op op = static_cast<Op>(i);
    EXPECT_FALSE(kernel_registry().candidates(op, Device::kCpu).empty()) << op_name(op);
  }
}

TEST(OpTable, AttributeSchemasHaveUniqueNames) {
  for (int i = 0; i < kNumOps; ++i) {
    Op op = static_cast<Op>(i);
    if (!has_op_def(op)) continue;
    std::set<std::string> names;
    for (const AttrSpec& spec : op_def(op).attrs) {
      EXPECT_TRUE(names.insert(spec.name).second) << op_name(op) << "." << spec.name;
      if (spec.default_value) {
        EXPECT_EQ(attr_kind(*spec.default_value), spec.kind) << op_name(op) << "." << spec.name;
      }
    }
  }
}

// Each line of the math table is an elementwise op of the line's arity (gelu and gelu_grad: each
// form), and every elementwise op but cast, where and dropout (no math: conversion, selection,
// randomness) is a line.
TEST(OpTable, ElementwiseOpsAreTheLinesOfTheMathTable) {
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    if (!has_flag(op, kElementwise)) {
      EXPECT_FALSE(ops::is_math_op(op)) << op_name(op) << " is a math line but not elementwise";
      continue;
    }
    if (op == Op::kCast || op == Op::kWhere || op == Op::kDropout) continue;
    ASSERT_TRUE(ops::is_math_op(op)) << "elementwise op '" << op_name(op)
                                     << "' has no line in ops/elementwise_math.h";
    for (const char* approximate : {"none", "tanh"}) {
      const Attributes attrs =
          normalize_attributes(op, op_def(op).attrs.empty()
                                       ? Attributes{}
                                       : Attributes{{"approximate", std::string(approximate)}});
      const std::optional<math::Fn> fn = ops::elementwise_fn(op, attrs);
      ASSERT_TRUE(fn.has_value()) << op_name(op);
      math::visit(*fn, [&](auto line) {
        EXPECT_EQ(decltype(line)::arity(), op_info(op).min_inputs) << op_name(op);
        EXPECT_EQ(decltype(line)::arity(), op_info(op).max_inputs) << op_name(op);
      });
    }
  }
}

}  // namespace
}  // namespace kiln

// The op table is complete: every op has attributes schema, inference and a reference kernel,
// text names parse back, and the CPU backend can run every op.
#include <set>

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

}  // namespace
}  // namespace kiln

// The op table is complete: every op has attributes schema, inference and a reference kernel,
// text names parse back, the CPU backend can run every op, the elementwise ops agree with the
// math table (ops/elementwise_math.h), and the traits the passes read (OpTraits) agree with the
// flags and with what the reference kernels do.
#include <algorithm>
#include <cmath>
#include <optional>
#include <set>

#include "conformance.h"
#include "ops/elementwise.h"
#include "ops/fused/group.h"
#include "passes/mixed_precision.h"
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

// What a flag implies, the traits must say: a collective or an update runs once per step (remat
// would repeat a round every rank makes in order, or an update), and an elementwise op's role,
// recomputation and cost are the generic ones the passes derive from the flag.
TEST(OpTraits, AgreeWithTheFlags) {
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    const OpTraits& traits = op_def(op).traits;
    if (has_flag(op, kCollective) || has_flag(op, kOptimizer)) {
      EXPECT_EQ(traits.recompute, Recompute::kNever) << op_name(op) << " must never be recomputed";
    }
    if (has_flag(op, kElementwise)) {
      EXPECT_FALSE(traits.row_op) << op_name(op);
      EXPECT_FALSE(traits.fusion_role) << op_name(op) << ": an elementwise op's role is the flag's";
      EXPECT_EQ(traits.recompute, Recompute::kCheap) << op_name(op);
      EXPECT_FALSE(traits.flops) << op_name(op) << ": an elementwise op costs one FLOP per element";
    }
  }
}

// An op that does a GEMM's work (what mixed precision runs in 16 bits, what remat recomputes
// last) states its FLOPs: the cost model's generic few per element would call it cheap.
TEST(OpTraits, HeavyAndLowPrecisionOpsCountTheirFlops) {
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    const OpTraits& traits = op_def(op).traits;
    if (traits.recompute == Recompute::kHeavy || traits.precision == Precision::kLow) {
      EXPECT_TRUE(traits.flops) << op_name(op) << " has no OpTraits::flops";
    }
  }
}

TEST(OpTraits, DefaultPrecisionPolicyIsTheTables) {
  const PrecisionPolicy policy = default_precision_policy();
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    const Precision precision = op_def(op).traits.precision;
    if (precision == Precision::kFollow) {
      EXPECT_EQ(policy.count(op), 0u) << op_name(op);
    } else {
      ASSERT_EQ(policy.count(op), 1u) << op_name(op);
      EXPECT_EQ(policy.at(op), precision) << op_name(op);
    }
  }
  EXPECT_EQ(policy.at(Op::kMatmul), Precision::kLow);
  EXPECT_EQ(policy.at(Op::kSoftmax), Precision::kF32);
}

// The first row of `t`, where t's leading dims are `lead` (a row input or output: x, dy, labels,
// a per-row loss); nullopt where they are not (gamma, beta: the same for every row).
std::optional<Tensor> first_row(const Tensor& t, const Shape& lead) {
  const Shape& shape = t.shape();
  if (shape.size() < lead.size() || !std::equal(lead.begin(), lead.end(), shape.begin()))
    return std::nullopt;
  Shape row(lead.size(), 1);
  row.insert(row.end(), shape.begin() + static_cast<std::ptrdiff_t>(lead.size()), shape.end());
  Tensor out(TensorType{t.dtype(), row});
  for (int64_t i = 0; i < out.numel(); ++i) out.copy_element(i, t, i);
  return out;
}

// A row op computes each row alone: for every case of the conformance table whose node plays a
// row op in a fusion group, the reference kernel on the first row of its row inputs gives the
// first row of its row outputs (the rows kernels tile rows on that). Every node playing a row op
// is of a row op, and every row op has such a case.
TEST(OpTraits, RowOpsComputeEachRowAlone) {
  namespace conformance = testing::conformance;
  std::set<Op> checked;
  for (const conformance::Case& c : conformance::cases()) {
    if (c.graph) continue;  // fused nodes
    const conformance::Instance instance = conformance::instantiate(c, c.dtypes[0], 7);
    const GroupRole role = group_role(*instance.graph, instance.node());
    if (role != GroupRole::kRowOp) continue;
    const OpDef& def = op_def(c.op);
    ASSERT_TRUE(def.traits.row_op) << instance.name << " plays a row op, but " << op_name(c.op)
                                   << " is no row op (OpTraits::row_op)";
    const Shape& x = instance.input_types[0].shape;
    const Shape lead(x.begin(), x.end() - 1);
    std::vector<Tensor> inputs;
    for (const Tensor& input : instance.inputs)
      inputs.push_back(first_row(input, lead).value_or(input));
    std::vector<Tensor> full, row;
    for (const TensorType& t : instance.output_types) full.emplace_back(t);
    def.reference(KernelArgs{instance.node().attrs, instance.inputs, full});
    const conformance::Instance rows = conformance::instance_of(c.op, inputs, instance.node().attrs);
    for (const TensorType& t : rows.output_types) row.emplace_back(t);
    def.reference(KernelArgs{rows.node().attrs, rows.inputs, row});
    const size_t row_outputs =
        def.column_outputs_from < 0 ? full.size() : static_cast<size_t>(def.column_outputs_from);
    for (size_t k = 0; k < row_outputs; ++k) {
      const std::optional<Tensor> expected = first_row(full[k], lead);
      ASSERT_TRUE(expected.has_value()) << instance.name << ": output " << k << " is not per row";
      ASSERT_EQ(expected->type(), row[k].type()) << instance.name << ": output " << k;
      for (int64_t i = 0; i < row[k].numel(); ++i)
        EXPECT_NEAR(row[k].get(i), expected->get(i), 1e-12 * (1 + std::abs(expected->get(i))))
            << instance.name << ": output " << k << " element " << i;
    }
    checked.insert(c.op);
  }
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    if (op_def(op).traits.row_op) {
      EXPECT_TRUE(checked.count(op)) << op_name(op) << " is a row op, but no conformance case "
                                        "makes a node of it that plays one";
    }
  }
}

}  // namespace
}  // namespace kiln

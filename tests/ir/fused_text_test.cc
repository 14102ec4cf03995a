// The fused op in the IR: its text form (body inline under the node; exact round trip; parse
// errors at line:column), the verifier's rules for bodies, its reference kernel (the body run
// node by node) against the unfused nodes and hand-checked values, and the generic passes and
// runtime pieces that must carry bodies along (cse, dead-code, schedule, memory plan, executor).
#include <gtest/gtest.h>

#include <cstring>

#include "ir/op_def.h"
#include "ir/text.h"
#include "ir/verifier.h"
#include "passes/schedule.h"
#include "passes/simplify/cse.h"
#include "passes/simplify/dead_code.h"
#include "runtime/executor.h"
#include "support/error.h"
#include "test_util.h"

namespace kiln {
namespace {

using testing::make;

// y = relu(x + b) * x, fused; plus an unfused consumer.
constexpr const char* kFusedText =
    "graph @g(%x: f32[4,3] data, %b: f32[3] param) {\n"
    "  %y, %0 = fused(%x, %b) {kind=\"elementwise\"} : f32[4,3], f32[4,3] {\n"
    "    graph @fused_0(%x: f32[4,3] data, %b: f32[3] data) {\n"
    "      %0 = add(%x, %b) : f32[4,3]\n"
    "      %1 = relu(%0) : f32[4,3]\n"
    "      %2 = mul(%1, %x) : f32[4,3]\n"
    "      return %2, %0\n"
    "    }\n"
    "  }\n"
    "  %1 = neg(%y) : f32[4,3]\n"
    "  return %1, %0\n"
    "}\n";

// The same computation, unfused.
constexpr const char* kUnfusedText =
    "graph @g(%x: f32[4,3] data, %b: f32[3] param) {\n"
    "  %0 = add(%x, %b) : f32[4,3]\n"
    "  %1 = relu(%0) : f32[4,3]\n"
    "  %y = mul(%1, %x) : f32[4,3]\n"
    "  %2 = neg(%y) : f32[4,3]\n"
    "  return %2, %0\n"
    "}\n";

void expect_parse_error(std::string_view text, int line, int column, std::string_view fragment) {
  SCOPED_TRACE(std::string(text));
  try {
    parse(text);
    ADD_FAILURE() << "no error";
  } catch (const ParseError& e) {
    EXPECT_EQ(e.line(), line) << e.what();
    EXPECT_EQ(e.column(), column) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

std::vector<Tensor> run(const Graph& g, const std::vector<Tensor>& inputs,
                        ExecutorOptions options = {Device::kCpu, {"reference"}}) {
  Executor executor(g, std::move(options));
  return executor.run(inputs);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.type() == b.type() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

TEST(FusedText, RoundTripsExactly) {
  Graph g = parse(kFusedText);
  ASSERT_EQ(g.nodes.size(), 2u);
  EXPECT_EQ(g.nodes[0].op, Op::kFused);
  ASSERT_NE(g.nodes[0].body, nullptr);
  EXPECT_EQ(g.nodes[0].body->nodes.size(), 3u);
  EXPECT_EQ(g.nodes[0].body->name, "fused_0");
  EXPECT_EQ(g.nodes[1].body, nullptr);
  EXPECT_EQ(print(g), kFusedText);
  EXPECT_EQ(print(parse(print(g))), kFusedText);
}

TEST(FusedText, NonCanonicalTextIsCanonicalized) {
  // Output types left out, free whitespace, comments, non-canonical numbering inside the body.
  Graph g = parse(
      "graph @g(%x: f32[4,3] data, %b: f32[3] param) {\n"
      "  %y, %7 = fused(%x, %b) {kind=\"elementwise\"}   {  // the body\n"
      "  graph @fused_0(%x: f32[4,3] data, %b: f32[3] data) { %9 = add(%x, %b)\n"
      "  %5 = relu(%9) %3 = mul(%5, %x) return %3, %9 } }\n"
      "  %8 = neg(%y)\n"
      "  return %8, %7\n"
      "}\n");
  EXPECT_EQ(print(g), kFusedText);
}

TEST(FusedText, BuiltInCodePrintsAndParsesBack) {
  auto body = std::make_shared<Graph>();
  body->name = "b";
  ValueId a = body->add_input("a", {DType::kF32, {2, 2}}, Role::kData);
  ValueId e = body->add(Op::kExp, {a});
  ValueId s = body->add(Op::kSum, {e}, {{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}});
  ValueId d = body->add(Op::kDiv, {e, s});
  body->outputs = {d};
  Graph g;
  ValueId x = g.add_input("x", {DType::kF32, {2, 2}}, Role::kData);
  std::vector<ValueId> out = g.add_node(Op::kFused, {x}, {{"kind", std::string("rows")}}, body);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(g.type(out[0]), (TensorType{DType::kF32, {2, 2}}));
  g.outputs = out;
  verify(g);
  const std::string text = print(g);
  EXPECT_EQ(text,
            "graph @main(%x: f32[2,2] data) {\n"
            "  %0 = fused(%x) {kind=\"rows\"} : f32[2,2] {\n"
            "    graph @b(%a: f32[2,2] data) {\n"
            "      %0 = exp(%a) : f32[2,2]\n"
            "      %1 = sum(%0) {axes=[-1], keepdims=true} : f32[2,1]\n"
            "      %2 = div(%0, %1) : f32[2,2]\n"
            "      return %2\n"
            "    }\n"
            "  }\n"
            "  return %0\n"
            "}\n");
  EXPECT_EQ(print(parse(text)), text);
}

TEST(FusedText, CopiesShareTheBody) {
  Graph g = parse(kFusedText);
  Graph copy = g;
  EXPECT_EQ(copy.nodes[0].body.get(), g.nodes[0].body.get());
  EXPECT_EQ(print(copy), kFusedText);
}

TEST(FusedText, ParseErrorsAtLineAndColumn) {
  // No body after the types.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"elementwise\"} : f32[2]\n"
      "  return %0\n"
      "}\n",
      3, 3, "expected '{' to open the body of the fused node");
  // No attributes: the body's '{' is taken for the attribute block.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {\n"
      "    graph @b(%a: f32[2] data) {\n",
      3, 11, "expected '=' after attribute name 'graph'");
  // An unknown op inside the body: reported where it is.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"elementwise\"} {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      %1 = frobnicate(%a)\n",
      4, 12, "unknown op 'frobnicate'");
  // The body's names are its own: the outer %x is not visible inside.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"elementwise\"} {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      %1 = neg(%x)\n",
      4, 16, "use of undefined value %x");
  // The body is not closed.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"elementwise\"} {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      return %a\n"
      "    }\n"
      "  return %0\n"
      "}\n",
      6, 3, "expected '}' to close the body of the fused node");
  // Types of the body's inputs differ from the node's inputs: reported at the op.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"elementwise\"} {\n"
      "    graph @b(%a: f32[3] data) {\n"
      "      return %a\n"
      "    }\n"
      "  }\n"
      "  return %0\n"
      "}\n",
      2, 8, "body input 0 (%a) is f32[3], but the node's input 0 is f32[2]");
  // Declared output types must equal the body's.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"elementwise\"} : f16[2] {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      %1 = neg(%a) : f32[2]\n"
      "      return %1\n"
      "    }\n"
      "  }\n"
      "  return %0\n"
      "}\n",
      2, 41, "declared f16[2], inferred f32[2]");
  // Nesting.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"elementwise\"} {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      %1 = fused(%a) {kind=\"elementwise\"} {\n"
      "        graph @c(%c: f32[2] data) {\n"
      "          return %c\n"
      "        }\n"
      "      }\n"
      "      return %1\n"
      "    }\n"
      "  }\n"
      "  return %0\n"
      "}\n",
      2, 8, "fused nodes do not nest");
  // A body input that is not data; a body with updates.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"elementwise\"} {\n"
      "    graph @b(%a: f32[2] param) {\n"
      "      %1 = neg(%a)\n"
      "      update %a = %1\n"
      "      return %1\n"
      "    }\n"
      "  }\n"
      "  return %0\n"
      "}\n",
      2, 8, "has role param, expected data");
  // A body with no outputs; an empty kind; a missing kind.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"rows\"} {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      return\n"
      "    }\n"
      "  }\n"
      "  return\n"
      "}\n",
      2, 8, "has no outputs");
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"\"} {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      return %a\n"
      "    }\n"
      "  }\n"
      "  return %0\n"
      "}\n",
      2, 8, "attribute 'kind' is empty");
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {} {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      return %a\n"
      "    }\n"
      "  }\n"
      "  return %0\n"
      "}\n",
      2, 8, "missing required attribute 'kind'");
  // A body on an op that takes none.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = neg(%x) : f32[2] {\n"
      "    graph @b(%a: f32[2] data) {\n",
      2, 25, "expected a node");
}

TEST(FusedVerifier, RejectsMissingOrMisplacedBodies) {
  Graph g = parse(kFusedText);
  Graph no_body = g;
  no_body.nodes[0].body = nullptr;
  EXPECT_KILN_ERROR(verify(no_body), "node 0 (fused)", "needs a body");
  Graph extra_body = g;
  extra_body.nodes[1].body = g.nodes[0].body;
  EXPECT_KILN_ERROR(verify(extra_body), "node 1 (neg)", "only fused nodes have a body");
  // A body whose output types no longer match the node's outputs.
  auto other = std::make_shared<Graph>(*g.nodes[0].body);
  other->outputs = {other->outputs[0]};
  Graph fewer = g;
  fewer.nodes[0].body = other;
  EXPECT_KILN_ERROR(verify(fewer), "node 0 (fused)", "has 2 outputs, expected 1");
  // A body that is itself broken.
  auto broken = std::make_shared<Graph>(*g.nodes[0].body);
  broken->nodes[2].inputs[0] = 99;
  Graph bad = g;
  bad.nodes[0].body = broken;
  EXPECT_KILN_ERROR(verify(bad), "node 0 (fused)", "body @fused_0", "out of range");
  EXPECT_KILN_ERROR(g.add_node(Op::kFused, {g.inputs[0].value}, {{"kind", std::string("x")}}),
                    "fused", "needs a body");
}

TEST(FusedReference, HandCheckedValues) {
  Graph g = parse(kFusedText);
  // x row r = [1, -2, 3] * (r + 1) * 0.5, b = [0.5, 1, -4].
  std::vector<double> xs;
  for (int r = 0; r < 4; ++r)
    for (double v : {1.0, -2.0, 3.0}) xs.push_back(v * (r + 1) * 0.5);
  Tensor x = make(DType::kF32, {4, 3}, xs);
  Tensor b = make(DType::kF32, {3}, {0.5, 1.0, -4.0});
  std::vector<Tensor> out = run(g, {x, b});
  ASSERT_EQ(out.size(), 2u);
  // Row 0: x = [0.5, -1, 1.5]; x + b = [1, 0, -2.5]; relu = [1, 0, 0]; * x = [0.5, 0, 0];
  // neg = [-0.5, -0, -0].
  EXPECT_EQ(out[0].get(0), -0.5);
  EXPECT_EQ(out[0].get(1), 0.0);
  EXPECT_EQ(out[0].get(2), 0.0);
  EXPECT_EQ(out[1].get(0), 1.0);
  EXPECT_EQ(out[1].get(1), 0.0);
  EXPECT_EQ(out[1].get(2), -2.5);
  // Row 3: x = [2, -4, 6]; x + b = [2.5, -3, 2]; relu * x = [5, 0, 12]; neg = [-5, -0, -12].
  EXPECT_EQ(out[0].get(9), -5.0);
  EXPECT_EQ(out[0].get(10), 0.0);
  EXPECT_EQ(out[0].get(11), -12.0);
  EXPECT_EQ(out[1].get(9), 2.5);
  EXPECT_EQ(out[1].get(11), 2.0);
}

TEST(FusedReference, EqualsTheUnfusedNodesOnRandomInputs) {
  Graph fused = parse(kFusedText);
  Graph unfused = parse(kUnfusedText);
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    std::vector<Tensor> inputs = {testing::rand(DType::kF32, {4, 3}, seed),
                                  testing::rand(DType::kF32, {3}, seed + 100)};
    std::vector<Tensor> a = run(fused, inputs);
    std::vector<Tensor> b = run(unfused, inputs);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << i;
  }
}

TEST(FusedReference, RowsKindInBf16WithPlannedPoisonedArena) {
  // softmax by hand in bf16 inside a body, then an outside consumer: the fused output lives in
  // the executor's arena (poisoned), so the kernel must write every element.
  const char* fused_text =
      "graph @g(%x: bf16[3,5] data) {\n"
      "  %0 = fused(%x) {kind=\"rows\"} : bf16[3,5] {\n"
      "    graph @b(%a: bf16[3,5] data) {\n"
      "      %0 = max(%a) {axes=[-1], keepdims=true} : bf16[3,1]\n"
      "      %1 = sub(%a, %0) : bf16[3,5]\n"
      "      %2 = exp(%1) : bf16[3,5]\n"
      "      %3 = sum(%2) {axes=[-1], keepdims=true} : bf16[3,1]\n"
      "      %4 = div(%2, %3) : bf16[3,5]\n"
      "      return %4\n"
      "    }\n"
      "  }\n"
      "  %1 = square(%0) : bf16[3,5]\n"
      "  return %1\n"
      "}\n";
  const char* unfused_text =
      "graph @g(%x: bf16[3,5] data) {\n"
      "  %0 = max(%x) {axes=[-1], keepdims=true} : bf16[3,1]\n"
      "  %1 = sub(%x, %0) : bf16[3,5]\n"
      "  %2 = exp(%1) : bf16[3,5]\n"
      "  %3 = sum(%2) {axes=[-1], keepdims=true} : bf16[3,1]\n"
      "  %4 = div(%2, %3) : bf16[3,5]\n"
      "  %5 = square(%4) : bf16[3,5]\n"
      "  return %5\n"
      "}\n";
  Tensor x = testing::rand(DType::kBF16, {3, 5}, 7, -3.0, 3.0);
  ExecutorOptions poisoned{Device::kCpu, {"reference"}, true, true};
  std::vector<Tensor> a = run(parse(fused_text), {x}, poisoned);
  std::vector<Tensor> b = run(parse(unfused_text), {x});
  EXPECT_TRUE(bitwise_equal(a[0], b[0]));
}

TEST(FusedPasses, CseMergesOnlyEqualBodies) {
  const char* text =
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = fused(%x) {kind=\"elementwise\"} : f32[2] {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      %0 = neg(%a) : f32[2]\n"
      "      return %0\n"
      "    }\n"
      "  }\n"
      "  %1 = fused(%x) {kind=\"elementwise\"} : f32[2] {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      %0 = exp(%a) : f32[2]\n"
      "      return %0\n"
      "    }\n"
      "  }\n"
      "  %2 = fused(%x) {kind=\"elementwise\"} : f32[2] {\n"
      "    graph @b(%a: f32[2] data) {\n"
      "      %0 = neg(%a) : f32[2]\n"
      "      return %0\n"
      "    }\n"
      "  }\n"
      "  return %0, %1, %2\n"
      "}\n";
  Graph g = parse(text);
  CommonSubexpressionElimination cse;
  EXPECT_TRUE(cse.run(g));
  verify(g);
  ASSERT_EQ(g.nodes.size(), 2u);  // the neg bodies merged, the exp body kept
  EXPECT_EQ(g.nodes[0].body->nodes[0].op, Op::kNeg);
  EXPECT_EQ(g.nodes[1].body->nodes[0].op, Op::kExp);
  EXPECT_EQ(g.outputs[0], g.outputs[2]);
  EXPECT_NE(g.outputs[0], g.outputs[1]);
}

TEST(FusedPasses, DeadCodeAndScheduleKeepBodies) {
  Graph g = parse(
      std::string("graph @g(%x: f32[64,64] data) {\n"
                  "  %0, %1 = fused(%x) {kind=\"elementwise\"} : f32[64,64], f32[64,64] {\n"
                  "    graph @b(%a: f32[64,64] data) {\n"
                  "      %0 = neg(%a) : f32[64,64]\n"
                  "      %1 = exp(%a) : f32[64,64]\n"
                  "      return %0, %1\n"
                  "    }\n"
                  "  }\n"
                  "  %2 = sigmoid(%x) : f32[64,64]\n"
                  "  %3 = add(%0, %1) : f32[64,64]\n"
                  "  return %3\n"
                  "}\n"));
  const Graph* body = g.nodes[0].body.get();
  Tensor x = testing::rand(DType::kF32, {64, 64}, 3);
  std::vector<Tensor> before = run(g, {x});
  DeadCodeElimination dce;
  EXPECT_TRUE(dce.run(g));
  verify(g);
  ASSERT_EQ(g.nodes.size(), 2u);
  EXPECT_EQ(g.nodes[0].body.get(), body);
  SchedulePass schedule;
  schedule.run(g);
  verify(g);
  ASSERT_EQ(g.nodes[0].op, Op::kFused);
  EXPECT_EQ(g.nodes[0].body.get(), body);
  std::vector<Tensor> after = run(g, {x}, ExecutorOptions{Device::kCpu, {"reference"}, true, true});
  EXPECT_TRUE(bitwise_equal(before[0], after[0]));
}

TEST(FusedRuntime, MemoryPlanAndSimpleAllocatorAgree) {
  Graph g = parse(kFusedText);
  std::vector<Tensor> inputs = {testing::rand(DType::kF32, {4, 3}, 11),
                                testing::rand(DType::kF32, {3}, 12)};
  Executor planned(g, ExecutorOptions{Device::kCpu, {"reference"}, true, true});
  ASSERT_NE(planned.memory_plan(), nullptr);
  // %y lives in the arena (only neg reads it); %0 is a graph output, outside it.
  EXPECT_TRUE(planned.memory_plan()->in_arena(g.nodes[0].outputs[0]));
  EXPECT_FALSE(planned.memory_plan()->in_arena(g.nodes[0].outputs[1]));
  EXPECT_EQ(planned.node_dialects()[0], "reference");
  std::vector<Tensor> a = planned.run(inputs);
  std::vector<Tensor> b = run(g, inputs, ExecutorOptions{Device::kCpu, {"reference"}, false});
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << i;
}

}  // namespace
}  // namespace kiln

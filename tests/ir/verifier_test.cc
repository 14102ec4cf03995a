// The verifier: a well-formed graph passes, and each invariant it checks, broken by hand on a
// built graph, gives a kiln::Error whose message names the broken invariant and the value or
// node involved.
#include "ir/verifier.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "ir/op_def.h"
#include "support/error.h"

namespace kiln {
namespace {

using Ints = std::vector<int64_t>;

// x: f32[2,3], w: f32[3,4]                               values: x=0, w=1
//   node 0: matmul(x, w)              -> f32[2,4]                m=2
//   node 1: split(m) {axis=1, [1, 3]} -> f32[2,1], f32[2,3]      s0=3, s1=4
//   node 2: %h = relu(s1)             -> f32[2,3]                h=5
//   return %h, s0
struct Sample {
  Graph graph;
  ValueId x, w, m, s0, s1, h;
};

Sample sample() {
  Sample s;
  Graph& g = s.graph;
  s.x = g.add_input("x", {DType::kF32, {2, 3}}, Role::kData);
  s.w = g.add_input("w", {DType::kF32, {3, 4}}, Role::kParam);
  s.m = g.add(Op::kMatmul, {s.x, s.w});
  std::vector<ValueId> parts =
      g.add_node(Op::kSplit, {s.m}, {{"axis", int64_t{1}}, {"sizes", Ints{1, 3}}});
  s.s0 = parts[0];
  s.s1 = parts[1];
  s.h = g.add(Op::kRelu, {s.s1});
  g.values[s.h].name = "h";
  g.outputs = {s.h, s.s0};
  return s;
}

void expect_verify_error(const Graph& g, std::string_view fragment) {
  try {
    verify(g);
    ADD_FAILURE() << "verified, expected an error containing: " << fragment;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << fragment;
  }
}

TEST(Verifier, AcceptsAWellFormedGraph) {
  Sample s = sample();
  ASSERT_EQ(s.x, 0);
  ASSERT_EQ(s.h, 5);
  EXPECT_NO_THROW(verify(s.graph));
}

TEST(Verifier, ValueUsedBeforeDefinition) {
  Sample s = sample();
  std::swap(s.graph.nodes[1], s.graph.nodes[2]);  // relu now reads s1 before split defines it
  expect_verify_error(s.graph, "node 1 (relu): input value #4 is used before it is defined");
}

TEST(Verifier, ValueUsedButNeverDefined) {
  Sample s = sample();
  s.graph.values.push_back(Value{"ghost", {DType::kF32, {2, 3}}});
  s.graph.nodes[2].inputs[0] = 6;
  expect_verify_error(s.graph, "node 2 (relu): input %ghost is used before it is defined");
}

TEST(Verifier, ValueDefinedTwice) {
  {
    Sample s = sample();
    s.graph.nodes[0].outputs[0] = s.x;  // matmul redefines the graph input
    expect_verify_error(s.graph, "node 0 (matmul): %x is defined twice");
  }
  {
    Sample s = sample();
    s.graph.nodes[2].outputs[0] = s.s0;  // two nodes define the same value
    expect_verify_error(s.graph, "node 2 (relu): value #3 is defined twice");
  }
  {
    Sample s = sample();
    s.graph.inputs.push_back(s.graph.inputs[1]);
    expect_verify_error(s.graph, "graph input: %w is defined twice");
  }
}

TEST(Verifier, ValueIdsOutOfRange) {
  {
    Sample s = sample();
    s.graph.nodes[2].inputs[0] = 77;
    expect_verify_error(s.graph, "node 2 (relu): input value id 77 is out of range");
  }
  {
    Sample s = sample();
    s.graph.nodes[2].inputs[0] = -1;
    expect_verify_error(s.graph, "node 2 (relu): input value id -1 is out of range");
  }
  {
    Sample s = sample();
    s.graph.nodes[2].outputs[0] = 50;
    expect_verify_error(s.graph, "node 2 (relu): value id 50 is out of range (6 values)");
  }
  {
    Sample s = sample();
    s.graph.inputs[0].value = 100;
    expect_verify_error(s.graph, "graph input: value id 100 is out of range (6 values)");
  }
}

TEST(Verifier, WrongOutputType) {
  {
    Sample s = sample();
    s.graph.values[s.m].type = TensorType{DType::kF32, {2, 5}};
    expect_verify_error(
        s.graph, "node 0 (matmul): output value #2 has type f32[2,5], inference gives f32[2,4]");
  }
  {
    Sample s = sample();
    s.graph.values[s.h].type.dtype = DType::kF64;
    expect_verify_error(s.graph,
                        "node 2 (relu): output %h has type f64[2,3], inference gives f32[2,3]");
  }
}

TEST(Verifier, WrongNumberOfOutputs) {
  Sample s = sample();
  s.graph.nodes[1].outputs.pop_back();
  expect_verify_error(s.graph, "node 1 (split): has 1 outputs, expected 2");
}

TEST(Verifier, WrongNumberOfInputs) {
  Sample s = sample();
  s.graph.nodes[0].inputs.pop_back();
  expect_verify_error(s.graph, "node 0 (matmul): matmul: got 1 inputs, expected 2");
}

TEST(Verifier, InputsInferenceRejects) {
  Sample s = sample();
  s.graph.nodes[1].attrs.set("sizes", Ints{1, 2});  // sums to 3, the axis has 4
  expect_verify_error(s.graph, "node 1 (split): split:");
}

TEST(Verifier, BadAttributes) {
  {
    Sample s = sample();
    s.graph.nodes[1].attrs.set("bogus", int64_t{1});
    expect_verify_error(s.graph, "node 1 (split): split: unknown attribute 'bogus'");
  }
  {
    Sample s = sample();
    s.graph.nodes[1].attrs.set("sizes", 1.5);
    expect_verify_error(s.graph,
                        "node 1 (split): split: attribute 'sizes' is float 1.5, expected ints");
  }
  {
    Sample s = sample();
    s.graph.nodes[1].attrs.erase("sizes");
    expect_verify_error(s.graph, "node 1 (split): split: missing required attribute 'sizes'");
  }
  {
    Sample s = sample();
    s.graph.nodes[0].attrs.erase("transpose_a");  // a default left out: not normalized
    expect_verify_error(s.graph, "node 0 (matmul): attributes are not normalized");
  }
}

TEST(Verifier, UnconvertedAttributeKind) {
  Graph g;
  ValueId c = g.add(Op::kFull, {}, {{"dtype", DType::kF32}, {"shape", Ints{2}}, {"value", 2.0}});
  g.outputs = {c};
  EXPECT_NO_THROW(verify(g));
  g.nodes[0].attrs.set("value", int64_t{2});  // normalization would turn it into 2.0
  expect_verify_error(g, "node 0 (full): attributes are not normalized");
}

TEST(Verifier, NanAttributeIsNormalized) {
  // NaN != NaN; the verifier must still see that normalization left the attribute unchanged.
  Graph g;
  ValueId c = g.add(Op::kFull, {},
                    {{"dtype", DType::kF32},
                     {"shape", Ints{2}},
                     {"value", std::numeric_limits<double>::quiet_NaN()}});
  g.outputs = {c};
  EXPECT_NO_THROW(verify(g));
}

TEST(Verifier, UndefinedGraphOutput) {
  {
    Sample s = sample();
    s.graph.outputs.push_back(99);
    expect_verify_error(s.graph, "graph output value #99 is not defined");
  }
  {
    Sample s = sample();
    s.graph.values.push_back(Value{"ghost", {DType::kF32, {1}}});
    s.graph.outputs.push_back(6);
    expect_verify_error(s.graph, "graph output %ghost is not defined");
  }
}

TEST(Verifier, DuplicateNames) {
  {
    Sample s = sample();
    s.graph.values[s.s0].name = "h";
    expect_verify_error(s.graph, "value name '%h' is used twice");
  }
  {
    Sample s = sample();
    s.graph.values[s.m].name = "x";  // a node output named like a graph input
    expect_verify_error(s.graph, "value name '%x' is used twice");
  }
}

// w: f32[3] param, buf: f32[3] state, x: f32[3] data, lr: f32[] state
//   %0, %1 = optimizer_update(w, x, buf, lr, lr) {optimizer="sgd", momentum=0.5};
//   update w = %0, buf = %1
struct Step {
  Graph graph;
  ValueId w, buf, x, lr, new_w, new_buf;
};

Step step() {
  Step s;
  Graph& g = s.graph;
  s.w = g.add_input("w", {DType::kF32, {3}}, Role::kParam);
  s.buf = g.add_input("buf", {DType::kF32, {3}}, Role::kState);
  s.x = g.add_input("x", {DType::kF32, {3}}, Role::kData);
  s.lr = g.add_input("lr", {DType::kF32, {}}, Role::kState);
  std::vector<ValueId> out =
      g.add_node(Op::kOptimizerUpdate, {s.w, s.x, s.buf, s.lr, s.lr}, {{"optimizer", "sgd"}, {"momentum", 0.5}});
  s.new_w = out[0];
  s.new_buf = out[1];
  g.updates = {{s.w, s.new_w}, {s.buf, s.new_buf}};
  return s;
}

TEST(Verifier, AcceptsUpdatesOfParamsAndState) {
  Step s = step();
  EXPECT_NO_THROW(verify(s.graph));
}

TEST(Verifier, UpdateOfADataInputOrANodeOutput) {
  {
    Step s = step();
    s.graph.updates.push_back({s.x, s.new_w});
    expect_verify_error(s.graph, "update target %x is not a param or state input");
  }
  {
    Step s = step();
    s.graph.updates[0].target = s.new_buf;
    expect_verify_error(s.graph, "update target value #5 is not a param or state input");
  }
}

TEST(Verifier, InputUpdatedTwice) {
  Step s = step();
  s.graph.updates.push_back({s.w, s.new_w});
  expect_verify_error(s.graph, "%w is updated twice");
}

TEST(Verifier, UpdateWithUndefinedValue) {
  {
    Step s = step();
    s.graph.updates[1].value = 40;
    expect_verify_error(s.graph, "update of %buf: value is not defined");
  }
  {
    Step s = step();
    s.graph.values.push_back(Value{"", {DType::kF32, {3}}});
    s.graph.updates[1].value = 6;
    expect_verify_error(s.graph, "update of %buf: value is not defined");
  }
}

TEST(Verifier, UpdateWithWrongType) {
  Step s = step();
  s.graph.updates[0].value = s.lr;
  expect_verify_error(s.graph, "update of %w: value has type f32[], expected f32[3]");
}

}  // namespace
}  // namespace kiln

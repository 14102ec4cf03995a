// The IR text form: exact round-trips (text -> graph -> text and graph -> text -> graph), value
// renumbering, default attributes, float and string attribute values, one sample line per op of
// the op table, and every parse error with its line:column.
#include "ir/text.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "ir/op_def.h"
#include "ir/verifier.h"
#include "support/error.h"

namespace kiln {
namespace {

using Ints = std::vector<int64_t>;
using Floats = std::vector<double>;

// Structural equality up to value ids: values are matched by definition order (inputs, then
// node outputs), so a graph built with inputs added between nodes still compares equal.
void expect_same_structure(const Graph& a, const Graph& b) {
  EXPECT_EQ(a.name, b.name);
  ASSERT_EQ(a.inputs.size(), b.inputs.size());
  ASSERT_EQ(a.nodes.size(), b.nodes.size());
  std::map<ValueId, ValueId> a_to_b;
  auto match = [&](ValueId va, ValueId vb) {
    EXPECT_EQ(a.value(va).name, b.value(vb).name);
    EXPECT_EQ(a.type(va), b.type(vb)) << to_string(a.type(va)) << " vs " << to_string(b.type(vb));
    a_to_b[va] = vb;
  };
  for (size_t i = 0; i < a.inputs.size(); ++i) {
    EXPECT_EQ(a.inputs[i].role, b.inputs[i].role);
    match(a.inputs[i].value, b.inputs[i].value);
  }
  for (size_t n = 0; n < a.nodes.size(); ++n) {
    const Node& na = a.nodes[n];
    const Node& nb = b.nodes[n];
    EXPECT_EQ(na.op, nb.op) << "node " << n;
    EXPECT_TRUE(same_values(na.attrs, nb.attrs)) << "node " << n;
    ASSERT_EQ(na.inputs.size(), nb.inputs.size());
    for (size_t i = 0; i < na.inputs.size(); ++i) EXPECT_EQ(a_to_b.at(na.inputs[i]), nb.inputs[i]);
    ASSERT_EQ(na.outputs.size(), nb.outputs.size());
    for (size_t i = 0; i < na.outputs.size(); ++i) match(na.outputs[i], nb.outputs[i]);
  }
  ASSERT_EQ(a.outputs.size(), b.outputs.size());
  for (size_t i = 0; i < a.outputs.size(); ++i) EXPECT_EQ(a_to_b.at(a.outputs[i]), b.outputs[i]);
  ASSERT_EQ(a.updates.size(), b.updates.size());
  for (size_t i = 0; i < a.updates.size(); ++i) {
    EXPECT_EQ(a_to_b.at(a.updates[i].target), b.updates[i].target);
    EXPECT_EQ(a_to_b.at(a.updates[i].value), b.updates[i].value);
  }
}

// Parsing `text` throws a ParseError at line:column whose message contains `fragment`.
void expect_parse_error(std::string_view text, int line, int column, std::string_view fragment) {
  SCOPED_TRACE(std::string(text));
  try {
    parse(text);
    ADD_FAILURE() << "parsed without error, expected: " << fragment;
  } catch (const ParseError& e) {
    EXPECT_EQ(e.line(), line) << e.what();
    EXPECT_EQ(e.column(), column) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << fragment;
    std::string prefix = std::to_string(line) + ":" + std::to_string(column) + ": ";
    EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << e.what();
  }
}

constexpr std::string_view kMlp =
    "graph @mlp(%x: f32[8,784] data, %w1: f32[784,128] param, %b1: f32[128] param, %step: i64[] "
    "state) {\n"
    "  %0 = matmul(%x, %w1) : f32[8,128]\n"
    "  %1 = add(%0, %b1) : f32[8,128]\n"
    "  %h = gelu(%1) {approximate=\"tanh\"} : f32[8,128]\n"
    "  %2, %3 = split(%h) {axis=1, sizes=[64, 64]} : f32[8,64], f32[8,64]\n"
    "  %c = full() {dtype=f32, shape=[2, 3], value=0.5} : f32[2,3]\n"
    "  return %2, %3\n"
    "}\n";

// A transformer-like block: names with '.' and '-', multi-output split, optional dropout input,
// a scalar loss.
constexpr std::string_view kBlock =
    "graph @block.0-test(%x: f32[2,4,8] data, %g: f32[8] param, %b: f32[8] param, %wqkv: "
    "f32[8,24] param, %labels: i64[2,4] data, %seed: i64[] state) {\n"
    "  %0 = layer_norm(%x, %g, %b) : f32[2,4,8]\n"
    "  %1 = matmul(%0, %wqkv) : f32[2,4,24]\n"
    "  %q, %k, %v = split(%1) {axis=2, sizes=[8, 8, 8]} : f32[2,4,8], f32[2,4,8], f32[2,4,8]\n"
    "  %2, %3 = attention(%q, %k, %v) {causal=true} : f32[2,4,8], f32[2,4]\n"
    "  %4 = dropout(%2, %seed) {p=0.25, seed=42} : f32[2,4,8]\n"
    "  %res.1-a = add(%x, %4) : f32[2,4,8]\n"
    "  %loss = cross_entropy(%res.1-a, %labels) : f32[]\n"
    "  return %loss, %res.1-a\n"
    "}\n";

// Integers, bools, casts, reductions, shape ops and sources.
constexpr std::string_view kMisc =
    "graph @misc(%a: i32[3,1] data, %b: i32[4] data, %t: bf16[10,6] param, %i: i64[5] data) {\n"
    "  %0 = lt(%a, %b) : bool[3,4]\n"
    "  %1 = cast(%a) {dtype=f32} : f32[3,1]\n"
    "  %2 = broadcast_to(%1) {shape=[3, 4]} : f32[3,4]\n"
    "  %3 = neg(%2) : f32[3,4]\n"
    "  %4 = where(%0, %2, %3) : f32[3,4]\n"
    "  %5 = transpose(%4) : f32[4,3]\n"
    "  %6 = reshape(%5) {shape=[2, -1]} : f32[2,6]\n"
    "  %7 = gather(%t, %i) : bf16[5,6]\n"
    "  %8 = iota() {dtype=i64, shape=[4]} : i64[4]\n"
    "  %9 = argmax(%7) {keepdims=true} : i64[5,1]\n"
    "  %10 = sum(%6) {axes=[0, 1]} : f32[]\n"
    "  return %10, %9, %8\n"
    "}\n";

TEST(IrText, RoundTripsCanonicalText) {
  for (std::string_view text : {kMlp, kBlock, kMisc}) {
    SCOPED_TRACE(std::string(text));
    Graph g = parse(text);
    EXPECT_EQ(print(g), text);
  }
}

TEST(IrText, ParsedGraphHasTheWrittenStructure) {
  Graph g = parse(kMlp);
  EXPECT_EQ(g.name, "mlp");
  ASSERT_EQ(g.inputs.size(), 4u);
  EXPECT_EQ(g.value(g.inputs[1].value).name, "w1");
  EXPECT_EQ(g.inputs[1].role, Role::kParam);
  EXPECT_EQ(g.inputs[3].role, Role::kState);
  EXPECT_EQ(g.type(g.inputs[3].value), (TensorType{DType::kI64, {}}));
  ASSERT_EQ(g.nodes.size(), 5u);
  EXPECT_EQ(g.nodes[0].op, Op::kMatmul);
  EXPECT_EQ(g.nodes[0].inputs, (std::vector<ValueId>{g.inputs[0].value, g.inputs[1].value}));
  // Numeric names are labels, not kept; user names are.
  EXPECT_EQ(g.value(g.nodes[0].outputs[0]).name, "");
  EXPECT_EQ(g.value(g.nodes[2].outputs[0]).name, "h");
  EXPECT_EQ(g.nodes[2].attrs.s("approximate"), "tanh");
  EXPECT_EQ(g.nodes[3].attrs.ints("sizes"), (Ints{64, 64}));
  EXPECT_EQ(g.nodes[3].attrs.i("axis"), 1);
  EXPECT_EQ(g.nodes[4].attrs.f("value"), 0.5);
  EXPECT_EQ(g.nodes[4].attrs.dtype("dtype"), DType::kF32);
  // Defaults are filled in: matmul's transposes were not written.
  EXPECT_FALSE(g.nodes[0].attrs.b("transpose_a"));
  EXPECT_EQ(g.outputs, g.nodes[3].outputs);
}

TEST(IrText, BuiltGraphSurvivesPrintAndParse) {
  Graph g;
  g.name = "built";
  ValueId x = g.add_input("x", {DType::kF32, {4, 16}}, Role::kData);
  ValueId w = g.add_input("w", {DType::kF32, {16, 8}}, Role::kParam);
  ValueId m = g.add(Op::kMatmul, {x, w});
  ValueId r = g.add(Op::kRelu, {m});
  g.values[r].name = "act";
  ValueId s = g.add(Op::kSum, {r}, {{"axes", Ints{1}}});
  ValueId c =
      g.add(Op::kConstant, {},
            {{"dtype", DType::kF64}, {"shape", Ints{3}}, {"values", Floats{0.1, -2.5, 1e-30}}});
  ValueId l = g.add(Op::kSoftmax, {m}, {{"axis", int64_t{0}}});
  g.outputs = {s, c, r, l};
  verify(g);
  std::string text = print(g);
  Graph back = parse(text);
  expect_same_structure(g, back);
  EXPECT_EQ(print(back), text);
}

TEST(IrText, BuiltGraphWithInputsAddedBetweenNodes) {
  // Value ids differ from the parsed graph's (which defines all inputs first); the printer
  // numbers by definition order, so the text and the structure still match.
  Graph g;
  g.name = "interleaved";
  ValueId a = g.add_input("a", {DType::kF32, {2, 2}}, Role::kData);
  ValueId e = g.add(Op::kExp, {a});
  ValueId b = g.add_input("b", {DType::kF32, {2, 2}}, Role::kParam);
  ValueId sum = g.add(Op::kAdd, {e, b});
  g.outputs = {sum};
  verify(g);
  std::string text = print(g);
  EXPECT_EQ(text,
            "graph @interleaved(%a: f32[2,2] data, %b: f32[2,2] param) {\n"
            "  %0 = exp(%a) : f32[2,2]\n"
            "  %1 = add(%0, %b) : f32[2,2]\n"
            "  return %1\n"
            "}\n");
  expect_same_structure(g, parse(text));
}

TEST(IrText, RenumbersNonCanonicalNumericNames) {
  Graph g = parse(
      "graph @g(%x: f32[2] data) {\n"
      "  %17 = neg(%x) : f32[2]\n"
      "  %named = exp(%17) : f32[2]\n"
      "  %3 = abs(%named) : f32[2]\n"
      "  return %3, %17\n"
      "}\n");
  EXPECT_EQ(print(g),
            "graph @g(%x: f32[2] data) {\n"
            "  %0 = neg(%x) : f32[2]\n"
            "  %named = exp(%0) : f32[2]\n"
            "  %1 = abs(%named) : f32[2]\n"
            "  return %1, %0\n"
            "}\n");
}

TEST(IrText, NumberingSkipsNumbersThatNamedValuesUse) {
  // Graph inputs always keep their name, numeric or not; unnamed values step around it.
  Graph g = parse(
      "graph @g(%1: f32[2] data) {\n"
      "  %5 = neg(%1)\n"
      "  %6 = exp(%5)\n"
      "  %7 = abs(%6)\n"
      "  return %7, %6\n"
      "}\n");
  EXPECT_EQ(g.value(g.inputs[0].value).name, "1");
  EXPECT_EQ(print(g),
            "graph @g(%1: f32[2] data) {\n"
            "  %0 = neg(%1) : f32[2]\n"
            "  %2 = exp(%0) : f32[2]\n"
            "  %3 = abs(%2) : f32[2]\n"
            "  return %3, %2\n"
            "}\n");
}

TEST(IrText, FreeFormWhitespaceCommentsAndOptionalTypes) {
  Graph g = parse(
      "// a comment before the graph\n"
      "graph   @g ( %x :f32[ 2 , 3 ]data,%y: f32[3]   param )\n"
      "{  // the body\n"
      "\t%s=add( %x,%y ) {}   // empty attribute block, no output type\n"
      "  %t = concat(%s, %s) {axis=-1} :\n"
      "      f32[2,6]\n"
      "  return %t , %s}");
  EXPECT_EQ(print(g),
            "graph @g(%x: f32[2,3] data, %y: f32[3] param) {\n"
            "  %s = add(%x, %y) : f32[2,3]\n"
            "  %t = concat(%s, %s) {axis=-1} : f32[2,6]\n"
            "  return %t, %s\n"
            "}\n");
}

TEST(IrText, GraphWithoutInputs) {
  std::string_view text =
      "graph @const(%c: f64[] state) {\n"
      "  %0 = full() {dtype=f64, shape=[], value=2.0} : f64[]\n"
      "  return %0, %c\n"
      "}\n";
  EXPECT_EQ(print(parse(text)), text);
  std::string_view no_inputs =
      "graph @g() {\n"
      "  %0 = iota() {dtype=i32, shape=[3]} : i32[3]\n"
      "  return %0\n"
      "}\n";
  EXPECT_EQ(print(parse(no_inputs)), no_inputs);
}

TEST(IrText, DefaultAttributesAreOmitted) {
  Graph g = parse(
      "graph @g(%x: f32[2,3] data, %g: f32[2] param) {\n"
      "  %0 = gelu(%x) {approximate=\"none\"}\n"
      "  %1 = concat(%0, %0) {axis=0}\n"
      "  %2 = sum(%1) {axes=[], keepdims=false}\n"
      "  %3 = matmul(%x, %x) {transpose_a=false, transpose_b=true}\n"
      "  %4 = layer_norm(%3, %g, %g) {epsilon=1e-5}\n"
      "  return %2, %4\n"
      "}\n");
  // The defaults are in the graph...
  EXPECT_EQ(g.nodes[0].attrs.s("approximate"), "none");
  EXPECT_EQ(g.nodes[2].attrs.ints("axes"), Ints{});
  EXPECT_DOUBLE_EQ(g.nodes[4].attrs.f("epsilon"), 1e-5);
  // ...and not in the text; a non-default value stays.
  EXPECT_EQ(print(g),
            "graph @g(%x: f32[2,3] data, %g: f32[2] param) {\n"
            "  %0 = gelu(%x) : f32[2,3]\n"
            "  %1 = concat(%0, %0) : f32[4,3]\n"
            "  %2 = sum(%1) : f32[]\n"
            "  %3 = matmul(%x, %x) {transpose_b=true} : f32[2,2]\n"
            "  %4 = layer_norm(%3, %g, %g) : f32[2,2]\n"
            "  return %2, %4\n"
            "}\n");
}

TEST(IrText, NonCanonicalAttributeSpellingsAreNormalized) {
  // An int for a float attribute, an upper-case exponent, attributes out of order.
  Graph g = parse(
      "graph @g() {\n"
      "  %0 = full() {value=2, shape=[2], dtype=f32}\n"
      "  %1 = full() {dtype=f32, shape=[2], value=1E-1}\n"
      "  %2 = constant() {dtype=f32, shape=[3], values=[1, 2.5, 3]}\n"
      "  %3 = constant() {dtype=f32, shape=[0], values=[]}\n"
      "  return %0, %1, %2, %3\n"
      "}\n");
  EXPECT_EQ(g.nodes[0].attrs.f("value"), 2.0);
  EXPECT_EQ(g.nodes[1].attrs.f("value"), 0.1);
  EXPECT_EQ(g.nodes[2].attrs.floats("values"), (Floats{1.0, 2.5, 3.0}));
  EXPECT_EQ(g.nodes[3].attrs.floats("values"), Floats{});
  EXPECT_EQ(print(g),
            "graph @g() {\n"
            "  %0 = full() {dtype=f32, shape=[2], value=2.0} : f32[2]\n"
            "  %1 = full() {dtype=f32, shape=[2], value=0.1} : f32[2]\n"
            "  %2 = constant() {dtype=f32, shape=[3], values=[1.0, 2.5, 3.0]} : f32[3]\n"
            "  %3 = constant() {dtype=f32, shape=[0], values=[]} : f32[0]\n"
            "  return %0, %1, %2, %3\n"
            "}\n");
}

// Integer and bool constants hold ints: int64 values a double does not hold (2^62 + 1, the
// extremes) print and parse back exactly, and old text that wrote them as floats still parses.
TEST(IrText, IntegerConstantsRoundTripExactly) {
  std::string_view text =
      "graph @ints() {\n"
      "  %0 = constant() {dtype=i64, shape=[4], values=[4611686018427387905, -9223372036854775808, "
      "9223372036854775807, 9007199254740993]} : i64[4]\n"
      "  %1 = constant() {dtype=i32, shape=[2], values=[-2147483648, 2147483647]} : i32[2]\n"
      "  %2 = constant() {dtype=bool, shape=[3], values=[1, 0, 1]} : bool[3]\n"
      "  %3 = constant() {dtype=u8, shape=[2], values=[0, 255]} : u8[2]\n"
      "  %4 = constant() {dtype=i64, shape=[0], values=[]} : i64[0]\n"
      "  return %0, %1, %2, %3, %4\n"
      "}\n";
  Graph g = parse(text);
  EXPECT_EQ(print(g), text);
  EXPECT_EQ(g.nodes[0].attrs.ints("values"),
            (Ints{(int64_t{1} << 62) + 1, INT64_MIN, INT64_MAX, (int64_t{1} << 53) + 1}));
  EXPECT_EQ(g.nodes[2].attrs.ints("values"), (Ints{1, 0, 1}));

  // Float spellings of integers normalize to ints.
  Graph old = parse(
      "graph @g() {\n"
      "  %0 = constant() {dtype=bool, shape=[2], values=[0.0, 1.0]}\n"
      "  %1 = constant() {dtype=i64, shape=[2], values=[3.0, -4.0]}\n"
      "  return %0, %1\n"
      "}\n");
  EXPECT_EQ(old.nodes[0].attrs.ints("values"), (Ints{0, 1}));
  EXPECT_EQ(print(old),
            "graph @g() {\n"
            "  %0 = constant() {dtype=bool, shape=[2], values=[0, 1]} : bool[2]\n"
            "  %1 = constant() {dtype=i64, shape=[2], values=[3, -4]} : i64[2]\n"
            "  return %0, %1\n"
            "}\n");
}

TEST(IrText, IntegerConstantsRefuseWhatTheirDtypeCannotHold) {
  auto error_of = [](const std::string& constant) {
    try {
      parse("graph @g() {\n  %0 = " + constant + "\n  return %0\n}\n");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of("constant() {dtype=i64, shape=[1], values=[1.5]}").find("expected integers for dtype i64"),
            std::string::npos);
  EXPECT_NE(error_of("constant() {dtype=u8, shape=[1], values=[256]}").find("out of range for u8"),
            std::string::npos);
  EXPECT_NE(error_of("constant() {dtype=bool, shape=[1], values=[2]}").find("out of range for bool"),
            std::string::npos);
  EXPECT_NE(error_of("constant() {dtype=i32, shape=[1], values=[2147483648]}").find("out of range for i32"),
            std::string::npos);
  EXPECT_NE(error_of("full() {dtype=i64, shape=[1], value=0.5}").find("not an integer of i64"),
            std::string::npos);
}

TEST(IrText, TrickyFloatAttributesRoundTripBitForBit) {
  std::string_view text =
      "graph @floats() {\n"
      "  %0 = full() {dtype=f64, shape=[], value=0.1} : f64[]\n"
      "  %1 = full() {dtype=f64, shape=[], value=1e-30} : f64[]\n"
      "  %2 = full() {dtype=f64, shape=[], value=-0.0} : f64[]\n"
      "  %3 = full() {dtype=f64, shape=[], value=inf} : f64[]\n"
      "  %4 = full() {dtype=f64, shape=[], value=-inf} : f64[]\n"
      "  %5 = full() {dtype=f64, shape=[], value=nan} : f64[]\n"
      "  %6 = full() {dtype=f64, shape=[], value=5e-324} : f64[]\n"
      "  %7 = full() {dtype=f64, shape=[], value=1.7976931348623157e+308} : f64[]\n"
      "  %8 = constant() {dtype=f32, shape=[5], values=[0.1, -0.0, 1e-30, -inf, nan]} : f32[5]\n"
      "  return %0, %1, %2, %3, %4, %5, %6, %7, %8\n"
      "}\n";
  Graph g = parse(text);
  EXPECT_EQ(print(g), text);
  auto value = [&](int n) { return g.nodes[n].attrs.f("value"); };
  EXPECT_EQ(value(0), 0.1);
  EXPECT_EQ(value(1), 1e-30);
  EXPECT_EQ(value(2), 0.0);
  EXPECT_TRUE(std::signbit(value(2)));
  EXPECT_EQ(value(3), HUGE_VAL);
  EXPECT_EQ(value(4), -HUGE_VAL);
  EXPECT_TRUE(std::isnan(value(5)));
  EXPECT_EQ(value(6), 4.9406564584124654e-324);  // the smallest subnormal
  EXPECT_EQ(value(7), 1.7976931348623157e308);   // the largest finite double
  const Floats& values = g.nodes[8].attrs.floats("values");
  ASSERT_EQ(values.size(), 5u);
  EXPECT_EQ(values[0], 0.1);
  EXPECT_TRUE(std::signbit(values[1]) && values[1] == 0.0);
  EXPECT_EQ(values[2], 1e-30);
  EXPECT_EQ(values[3], -HUGE_VAL);
  EXPECT_TRUE(std::isnan(values[4]));
}

TEST(IrText, StringAttributesAreEscapedAndUnescaped) {
  // No op accepts an arbitrary string, so the printer is checked on a hand-made node and the
  // parser through the messages that quote the parsed value.
  Graph g;
  g.name = "strings";
  ValueId x = g.add_input("x", {DType::kF32, {2}}, Role::kData);
  ValueId y = g.add(Op::kGelu, {x});
  g.nodes[0].attrs.set("approximate", std::string("a\"b\\c\nd\te"));
  g.outputs = {y};
  std::string text = print(g);
  EXPECT_NE(text.find("  %0 = gelu(%x) {approximate=\"a\\\"b\\\\c\\nd\te\"} : f32[2]\n"),
            std::string::npos)
      << text;
  // gelu's inference quotes the unescaped value in its message.
  expect_parse_error(text, 2, 8, "\"a\"b\\c\nd\te\"");
  // concat's axis must be an int: normalize_attributes re-prints the parsed string escaped.
  expect_parse_error(
      "graph @g(%x: f32[2] data) {\n"
      "  %0 = concat(%x) {axis=\"q\\\"\\\\\\n\"}\n"
      "  return %0\n"
      "}\n",
      2, 25, "attribute 'axis' is string \"q\\\"\\\\\\n\", expected int");
}

// A training step: the optimizer's outputs replace the param and its momentum buffer.
constexpr std::string_view kTrain =
    "graph @train(%x: f32[4,3] data, %w: f32[3,2] param, %buf: f32[3,2] state, %lr: f32[] state, "
    "%t: f32[] state, %g: f32[3,2] data) {\n"
    "  %y = matmul(%x, %w) : f32[4,2]\n"
    "  %0, %1 = optimizer_update(%w, %g, %buf, %lr, %t) {momentum=0.9, optimizer=\"sgd\"} : f32[3,2], f32[3,2]\n"
    "  update %w = %0\n"
    "  update %buf = %1\n"
    "  return %y\n"
    "}\n";

TEST(IrText, UpdatesRoundTrip) {
  Graph g = parse(kTrain);
  EXPECT_EQ(print(g), kTrain);
  ASSERT_EQ(g.updates.size(), 2u);
  EXPECT_EQ(g.updates[0].target, g.inputs[1].value);
  EXPECT_EQ(g.updates[0].value, g.nodes[1].outputs[0]);
  EXPECT_EQ(g.updates[1].target, g.inputs[2].value);
  EXPECT_EQ(g.updates[1].value, g.nodes[1].outputs[1]);
}

TEST(IrText, UpdatesAnywhereInTheBodyArePrintedBeforeReturn) {
  // Update order is kept (it is Graph::updates' order), placement is canonicalized.
  Graph g = parse(
      "graph @g(%a: f32[2] param, %b: f32[2] state) {\n"
      "  %0 = neg(%b)\n"
      "  update %b = %0\n"
      "  %1 = neg(%a)\n"
      "  update %a = %1\n"
      "  return\n"
      "}\n");
  EXPECT_EQ(print(g),
            "graph @g(%a: f32[2] param, %b: f32[2] state) {\n"
            "  %0 = neg(%b) : f32[2]\n"
            "  %1 = neg(%a) : f32[2]\n"
            "  update %b = %0\n"
            "  update %a = %1\n"
            "  return\n"
            "}\n");
}

TEST(IrText, GraphMayReturnNothing) {
  std::string_view text =
      "graph @only_updates(%n: i64[] state) {\n"
      "  %0 = full() {dtype=i64, shape=[], value=1.0} : i64[]\n"
      "  %1 = add(%n, %0) : i64[]\n"
      "  update %n = %1\n"
      "  return\n"
      "}\n";
  Graph g = parse(text);
  EXPECT_TRUE(g.outputs.empty());
  EXPECT_EQ(print(g), text);
}

TEST(IrText, BuiltGraphWithUpdatesSurvivesPrintAndParse) {
  Graph g;
  g.name = "adamw";
  TensorType t{DType::kF32, {4}};
  TensorType scalar{DType::kF32, {}};
  ValueId p = g.add_input("p", t, Role::kParam);
  ValueId m = g.add_input("m", t, Role::kState);
  ValueId v = g.add_input("v", t, Role::kState);
  ValueId lr = g.add_input("lr", scalar, Role::kState);
  ValueId step = g.add_input("step", scalar, Role::kState);
  ValueId grad = g.add(Op::kSquare, {p});
  std::vector<ValueId> out =
      g.add_node(Op::kOptimizerUpdate, {p, grad, m, v, lr, step}, {{"optimizer", "adamw"}, {"weight_decay", 0.0}});
  g.updates = {{v, out[2]}, {p, out[0]}, {m, out[1]}};
  g.outputs = {grad};
  verify(g);
  std::string text = print(g);
  Graph back = parse(text);
  expect_same_structure(g, back);
  EXPECT_EQ(print(back), text);
}

// ---------------------------------------------------------------------------------------------
// One sample node line per op of the op table.

struct OpSample {
  std::string_view op;
  std::string_view inputs;  // the graph's input list
  std::string_view line;    // the node line, canonical
  std::string_view returns;
};

constexpr std::string_view kX = "%x: f32[2,3] data";
constexpr std::string_view kXY = "%x: f32[2,3] data, %y: f32[3] data";

const std::vector<OpSample>& op_samples() {
  static const std::vector<OpSample> samples = {
      {"abs", kX, "%0 = abs(%x) : f32[2,3]", "%0"},
      {"acos", kX, "%0 = acos(%x) : f32[2,3]", "%0"},
      {"add", kXY, "%0 = add(%x, %y) : f32[2,3]", "%0"},
      {"argmax", kX, "%0 = argmax(%x) {axis=0} : i64[3]", "%0"},
      {"asin", kX, "%0 = asin(%x) : f32[2,3]", "%0"},
      {"atan", kX, "%0 = atan(%x) : f32[2,3]", "%0"},
      {"attention", "%q: f32[2,4,8] data, %k: f32[2,6,8] data, %v: f32[2,6,16] data",
       "%0, %1 = attention(%q, %k, %v) {scale=0.25} : f32[2,4,16], f32[2,4]", "%0, %1"},
      {"attention_grad",
       "%q: f32[2,4,8] data, %k: f32[2,6,8] data, %v: f32[2,6,16] data, %o: f32[2,4,16] data, "
       "%d: f32[2,4,16] data, %l: f32[2,4] data",
       "%0, %1, %2 = attention_grad(%q, %k, %v, %o, %d, %l) {causal=true} : f32[2,4,8], "
       "f32[2,6,8], f32[2,6,16]",
       "%0, %1, %2"},
      {"attention_qkv", "%x: f32[2,4,3,2,8] data",
       "%0, %1 = attention_qkv(%x) {causal=true} : f32[2,4,2,8], f32[2,4,2]", "%0, %1"},
      {"attention_qkv_grad",
       "%x: f32[2,4,3,2,8] data, %o: f32[2,4,2,8] data, %d: f32[2,4,2,8] data, "
       "%l: f32[2,4,2] data",
       "%0 = attention_qkv_grad(%x, %o, %d, %l) {scale=0.25} : f32[2,4,3,2,8]", "%0"},
      {"avg_pool2d", "%x: f32[1,2,5,5] data",
       "%0 = avg_pool2d(%x) {kernel=[3, 3], padding=[1, 1], stride=[2, 2]} : f32[1,2,3,3]", "%0"},
      {"avg_pool2d_grad", "%d: f32[1,2,3,3] data",
       "%0 = avg_pool2d_grad(%d) {input_shape=[1, 2, 5, 5], kernel=[3, 3], padding=[1, 1], "
       "stride=[2, 2]} : f32[1,2,5,5]",
       "%0"},
      {"broadcast_to", "%y: f32[3] data", "%0 = broadcast_to(%y) {shape=[2, 3]} : f32[2,3]", "%0"},
      {"cast", kX, "%0 = cast(%x) {dtype=bf16} : bf16[2,3]", "%0"},
      {"concat", kX, "%0 = concat(%x, %x) {axis=1} : f32[2,6]", "%0"},
      {"constant", "", "%0 = constant() {dtype=f32, shape=[2], values=[1.5, -2.0]} : f32[2]", "%0"},
      {"conv2d", "%x: f32[1,2,5,5] data, %w: f32[3,2,3,3] param",
       "%0 = conv2d(%x, %w) {padding=[1, 1], stride=[2, 2]} : f32[1,3,3,3]", "%0"},
      {"conv2d_grad_input", "%d: f32[1,3,3,3] data, %w: f32[3,2,3,3] param",
       "%0 = conv2d_grad_input(%d, %w) {input_shape=[1, 2, 5, 5], padding=[1, 1], stride=[2, 2]} : "
       "f32[1,2,5,5]",
       "%0"},
      {"conv2d_grad_weight", "%x: f32[1,2,5,5] data, %d: f32[1,3,3,3] data",
       "%0 = conv2d_grad_weight(%x, %d) {padding=[1, 1], stride=[2, 2], weight_shape=[3, 2, 3, 3]} "
       ": f32[3,2,3,3]",
       "%0"},
      {"cross_entropy", "%l: f32[4,10] data, %t: i64[4] data",
       "%0 = cross_entropy(%l, %t) {ignore_index=0, reduction=\"sum\"} : f32[]", "%0"},
      {"cross_entropy_grad", "%l: f32[4,10] data, %t: i64[4] data, %d: f32[4] data",
       "%0 = cross_entropy_grad(%l, %t, %d) {reduction=\"none\"} : f32[4,10]", "%0"},
      {"div", kXY, "%0 = div(%x, %y) : f32[2,3]", "%0"},
      {"dropout", "%x: f32[2,3] data, %o: i64[] state",
       "%0 = dropout(%x, %o) {p=0.5, seed=7} : f32[2,3]", "%0"},
      {"eq", kXY, "%0 = eq(%x, %y) : bool[2,3]", "%0"},
      {"cos", kX, "%0 = cos(%x) : f32[2,3]", "%0"},
      {"erf", kX, "%0 = erf(%x) : f32[2,3]", "%0"},
      {"cumsum", kX, "%0 = cumsum(%x) {axis=1, reverse=true} : f32[2,3]", "%0"},
      {"exp", kX, "%0 = exp(%x) : f32[2,3]", "%0"},
      {"fmod", kXY, "%0 = fmod(%x, %y) : f32[2,3]", "%0"},
      {"full", "", "%0 = full() {dtype=i32, shape=[2, 3], value=7.0} : i32[2,3]", "%0"},
      {"fused", kX,
       "%0 = fused(%x) {kind=\"elementwise\"} : f32[2,3] {\n"
       "    graph @body(%a: f32[2,3] data) {\n"
       "      %0 = neg(%a) : f32[2,3]\n"
       "      return %0\n"
       "    }\n"
       "  }",
       "%0"},
      {"gather_elements", "%x: f32[2,3] data, %i: i64[2,2] data",
       "%0 = gather_elements(%x, %i) {axis=1} : f32[2,2]", "%0"},
      {"gather", "%t: f32[10,4] param, %i: i64[2,3] data", "%0 = gather(%t, %i) : f32[2,3,4]",
       "%0"},
      {"ge", kXY, "%0 = ge(%x, %y) : bool[2,3]", "%0"},
      {"gelu", kX, "%0 = gelu(%x) {approximate=\"tanh\"} : f32[2,3]", "%0"},
      {"gelu_grad", "%x: f32[2,3] data, %d: f32[2,3] data",
       "%0 = gelu_grad(%x, %d) {approximate=\"tanh\"} : f32[2,3]", "%0"},
      {"gt", kXY, "%0 = gt(%x, %y) : bool[2,3]", "%0"},
      {"iota", "", "%0 = iota() {axis=1, dtype=i64, shape=[2, 3]} : i64[2,3]", "%0"},
      {"layer_norm", "%x: f32[2,3] data, %g: f32[3] param, %b: f32[3] param",
       "%0 = layer_norm(%x, %g, %b) {epsilon=0.001} : f32[2,3]", "%0"},
      {"layer_norm_grad", "%x: f32[2,3] data, %g: f32[3] param, %d: f32[2,3] data",
       "%0, %1, %2 = layer_norm_grad(%x, %g, %d) : f32[2,3], f32[3], f32[3]", "%0, %1, %2"},
      {"le", kXY, "%0 = le(%x, %y) : bool[2,3]", "%0"},
      {"log", kX, "%0 = log(%x) : f32[2,3]", "%0"},
      {"log_softmax", kX, "%0 = log_softmax(%x) {axis=0} : f32[2,3]", "%0"},
      {"log_softmax_grad", "%y: f32[2,3] data, %d: f32[2,3] data",
       "%0 = log_softmax_grad(%y, %d) : f32[2,3]", "%0"},
      {"lt", kXY, "%0 = lt(%x, %y) : bool[2,3]", "%0"},
      {"matmul", "%x: f32[2,3] data, %w: f32[4,3] param",
       "%0 = matmul(%x, %w) {transpose_b=true} : f32[2,4]", "%0"},
      {"max", kX, "%0 = max(%x) {axes=[1], keepdims=true} : f32[2,1]", "%0"},
      {"max_pool2d", "%x: f32[1,2,4,4] data", "%0 = max_pool2d(%x) {kernel=[2, 2]} : f32[1,2,2,2]",
       "%0"},
      {"max_pool2d_grad", "%x: f32[1,2,4,4] data, %d: f32[1,2,2,2] data",
       "%0 = max_pool2d_grad(%x, %d) {kernel=[2, 2]} : f32[1,2,4,4]", "%0"},
      {"maximum", kXY, "%0 = maximum(%x, %y) : f32[2,3]", "%0"},
      {"mean", kX, "%0 = mean(%x) : f32[]", "%0"},
      {"minimum", kXY, "%0 = minimum(%x, %y) : f32[2,3]", "%0"},
      {"mod", kXY, "%0 = mod(%x, %y) : f32[2,3]", "%0"},
      {"mul", kXY, "%0 = mul(%x, %y) : f32[2,3]", "%0"},
      {"ne", kXY, "%0 = ne(%x, %y) : bool[2,3]", "%0"},
      {"neg", kX, "%0 = neg(%x) : f32[2,3]", "%0"},
      {"offload", kX, "%0 = offload(%x) : f32[2,3]", "%0"},
      {"reload", kX, "%0 = reload(%x) : f32[2,3]", "%0"},
      {"one_hot", "%i: i64[2,3] data", "%0 = one_hot(%i) {depth=5, dtype=bf16} : bf16[2,3,5]",
       "%0"},
      {"optimizer_update",
       "%p: f32[3,4] param, %g: f32[3,4] data, %m: f32[3,4] state, %v: f32[3,4] state, "
       "%lr: f32[] state, %t: f32[] state",
       "%0, %1, %2 = optimizer_update(%p, %g, %m, %v, %lr, %t) {beta2=0.95, optimizer=\"adamw\", "
       "weight_decay=0.1} : f32[3,4], f32[3,4], f32[3,4]",
       "%0, %1, %2"},
      {"pow", kXY, "%0 = pow(%x, %y) : f32[2,3]", "%0"},
      {"prod", kX, "%0 = prod(%x) {axes=[0], keepdims=true} : f32[1,3]", "%0"},
      {"reciprocal", kX, "%0 = reciprocal(%x) : f32[2,3]", "%0"},
      {"relu", kX, "%0 = relu(%x) : f32[2,3]", "%0"},
      {"reshape", kX, "%0 = reshape(%x) {shape=[3, 2]} : f32[3,2]", "%0"},
      {"rms_norm", "%x: f32[2,3] data, %g: f32[3] param", "%0 = rms_norm(%x, %g) : f32[2,3]", "%0"},
      {"rms_norm_grad", "%x: f32[2,3] data, %g: f32[3] param, %d: f32[2,3] data",
       "%0, %1 = rms_norm_grad(%x, %g, %d) {epsilon=0.001} : f32[2,3], f32[3]", "%0, %1"},
      {"rotary_embedding", "%x: bf16[2,5,3,4] data",
       "%0 = rotary_embedding(%x) {inverse=true, layout=\"bthd\"} : bf16[2,5,3,4]", "%0"},
      {"round", kX, "%0 = round(%x) : f32[2,3]", "%0"},
      {"rsqrt", kX, "%0 = rsqrt(%x) : f32[2,3]", "%0"},
      {"scatter_add", "%b: f32[10,4] param, %i: i64[3] data, %u: f32[3,4] data",
       "%0 = scatter_add(%b, %i, %u) : f32[10,4]", "%0"},
      {"scatter_elements", "%b: f32[4,3] param, %i: i64[2,3] data, %u: f32[2,3] data",
       "%0 = scatter_elements(%b, %i, %u) {reduction=\"max\"} : f32[4,3]", "%0"},
      {"all_gather", "%s: f32[3] param",
       "%0 = all_gather(%s) {world_size=2} : f32[6]\n  %1 = collective_wait(%0) : f32[6]", "%1"},
      {"all_reduce", kX, "%0 = all_reduce(%x) {reduce=\"avg\", world_size=4} : f32[2,3]\n  %1 = collective_wait(%0) : f32[2,3]", "%1"},
      {"collective_wait", kX, "%0 = all_reduce(%x) {world_size=2} : f32[2,3]\n  %1 = collective_wait(%0) : f32[2,3]", "%1"},
      {"local_shard", "%s: f32[6] param", "%0 = local_shard(%s) {world_size=3} : f32[2]", "%0"},
      {"reduce_scatter", "%s: f32[6] param",
       "%0 = reduce_scatter(%s) {world_size=2} : f32[3]\n  %1 = collective_wait(%0) : f32[3]", "%1"},
      {"sigmoid", kX, "%0 = sigmoid(%x) : f32[2,3]", "%0"},
      {"silu", kX, "%0 = silu(%x) : f32[2,3]", "%0"},
      {"sin", kX, "%0 = sin(%x) : f32[2,3]", "%0"},
      {"slice", kX, "%0 = slice(%x) {ends=[2, 3], starts=[0, 1]} : f32[2,2]", "%0"},
      {"softmax", kX, "%0 = softmax(%x) : f32[2,3]", "%0"},
      {"softmax_grad", "%y: f32[2,3] data, %d: f32[2,3] data",
       "%0 = softmax_grad(%y, %d) {axis=0} : f32[2,3]", "%0"},
      {"split", kX, "%0, %1 = split(%x) {axis=1, sizes=[1, 2]} : f32[2,1], f32[2,2]", "%0, %1"},
      {"sqrt", kX, "%0 = sqrt(%x) : f32[2,3]", "%0"},
      {"square", kX, "%0 = square(%x) : f32[2,3]", "%0"},
      {"stop_gradient", kX, "%0 = stop_gradient(%x) : f32[2,3]", "%0"},
      {"sub", kXY, "%0 = sub(%x, %y) : f32[2,3]", "%0"},
      {"sum", kX, "%0 = sum(%x) {axes=[-1]} : f32[2]", "%0"},
      {"tanh", kX, "%0 = tanh(%x) : f32[2,3]", "%0"},
      {"topk", kX, "%0, %1 = topk(%x) {k=2, largest=false} : f32[2,2], i64[2,2]", "%0, %1"},
      {"transpose", kX, "%0 = transpose(%x) : f32[3,2]", "%0"},
      {"where", "%c: bool[2,3] data, %x: f32[2,3] data, %y: f32[3] data",
       "%0 = where(%c, %x, %y) : f32[2,3]", "%0"},
  };
  return samples;
}

TEST(IrText, EveryOpRoundTrips) {
  for (int i = 0; i < kNumOps; ++i) {
    Op op = static_cast<Op>(i);
    const OpSample* sample = nullptr;
    for (const OpSample& s : op_samples())
      if (s.op == op_name(op)) sample = &s;
    if (!sample) {
      ADD_FAILURE() << "op '" << op_name(op) << "' has no sample line in text_test.cc";
      continue;
    }
    std::string text = fmt::format("graph @{}({}) {{\n  {}\n  return {}\n}}\n", sample->op,
                                   sample->inputs, sample->line, sample->returns);
    try {
      Graph g = parse(text);
      // One node, or a collective and its wait (a collective is read only through one).
      ASSERT_EQ(g.nodes.size(), sample->line.find("= collective_wait(") == std::string::npos ? 1u : 2u) << sample->op;
      EXPECT_TRUE(g.nodes.front().op == op || g.nodes.back().op == op);
      EXPECT_EQ(print(g), text);
    } catch (const Error& e) {
      ADD_FAILURE() << "op '" << op_name(op) << "': " << e.what() << "\n" << text;
    }
  }
}

TEST(IrText, OpSamplesNameRealOps) {
  for (const OpSample& s : op_samples())
    EXPECT_TRUE(parse_op(s.op).has_value()) << "sample for unknown op '" << s.op << "'";
}

// ---------------------------------------------------------------------------------------------
// Errors. Columns are 1-based; node lines below are indented by two spaces, so in
// "  %0 = neg(%x)" the op starts at column 8 and %x at column 12.

constexpr std::string_view kHeader = "graph @g(%x: f32[2,3] data, %y: f32[3] data) {\n";

std::string with_body(std::string_view body) { return std::string(kHeader) + std::string(body); }

TEST(IrTextErrors, Syntax) {
  expect_parse_error("graph @g(%x: f32[2] data {\n}\n", 1, 26,
                     "expected ')' after inputs, found '{'");
  expect_parse_error(with_body("  %0 = add(%x %y)\n  return %0\n}\n"), 2, 15,
                     "expected ')' after inputs, found '%y'");
  expect_parse_error("grph @g() {\n", 1, 1,
                     "expected 'graph' at the start of the text, found 'grph'");
  expect_parse_error("graph g() {\n", 1, 7,
                     "expected the graph name '@name' after 'graph', found 'g'");
  expect_parse_error("", 1, 1, "expected 'graph' at the start of the text, found end of input");
  expect_parse_error("graph @g(%x f32[2] data) {\n", 1, 13,
                     "expected ':' after input %x, found 'f32'");
  expect_parse_error(with_body("  %0 neg(%x)\n"), 2, 6,
                     "expected '=' after the output names, found 'neg'");
  expect_parse_error(with_body("  %0 = (%x)\n"), 2, 8, "expected an op name after '=', found '('");
  expect_parse_error(with_body("  %0 = neg %x\n"), 2, 12,
                     "expected '(' after op name 'neg', found '%x'");
  expect_parse_error(with_body("  %0 = concat(%x) {axis 1}\n"), 2, 25,
                     "expected '=' after attribute name 'axis', found '1'");
  expect_parse_error(with_body("  %0 = concat(%x) {axis=1\n  return %0\n}\n"), 3, 3,
                     "expected '}' after attributes, found 'return'");
  expect_parse_error(with_body("  %0 = concat(%x) {1=1}\n"), 2, 20,
                     "expected an attribute name, found '1'");
  expect_parse_error(with_body("  %0, = neg(%x)\n"), 2, 7,
                     "expected an output name after ',' ('%name'), found '='");
  expect_parse_error(with_body("  %0 = neg(%x) : f32[2,3]\n  %0\n"), 4, 1,
                     "expected '=' after the output names, found end of input");
}

TEST(IrTextErrors, BodyStructure) {
  expect_parse_error("graph @g(%x: f32[2] data) {\n}\n", 2, 1,
                     "expected a node ('%name = op(...)'), 'update' or 'return', found '}'");
  expect_parse_error(with_body("  return %x,\n}\n"), 3, 1, "expected a value after ',', found '}'");
  expect_parse_error(with_body("  return %x\n  %0 = neg(%x)\n}\n"), 3, 3,
                     "expected '}' after the return values, found '%0'");
  expect_parse_error(with_body("  return %x\n}\nextra\n"), 4, 1,
                     "expected end of input after '}', found 'extra'");
  expect_parse_error(with_body("  return %x\n"), 3, 1,
                     "expected '}' after the return values, found end of input");
  expect_parse_error(with_body("  return %nope\n}\n"), 2, 10, "use of undefined value %nope");
}

TEST(IrTextErrors, Lexical) {
  expect_parse_error(with_body("  %0 = neg(%x) ;\n"), 2, 16, "unexpected character ';'");
  expect_parse_error(with_body("  %0 = neg(%x) \x01\n"), 2, 16, "unexpected character '\\x01'");
  expect_parse_error(with_body("  % = neg(%x)\n"), 2, 3, "expected a name after '%'");
  expect_parse_error("graph @ () {\n", 1, 7, "expected a name after '@'");
  expect_parse_error(with_body("  %0 = gelu(%x) {approximate=\"tanh\n"), 2, 30,
                     "string is not closed before the end of the line");
  expect_parse_error(with_body("  %0 = gelu(%x) {approximate=\"a\\tb\"}\n"), 2, 32,
                     "unknown escape '\\' followed by 't' in string");
  expect_parse_error("graph @g(%x: f32[99999999999999999999] data) {\n", 1, 18,
                     "integer literal 99999999999999999999 is out of range for int64");
  expect_parse_error(with_body("  %0 = full() {dtype=f32, shape=[], value=1e999}\n"), 2, 43,
                     "float literal 1e999 is out of range for f64");
  // A comment hides what would be an error.
  EXPECT_NO_THROW(parse(with_body("  return %x // ; \x01 \"\n}\n")));
}

TEST(IrTextErrors, Types) {
  expect_parse_error("graph @g(%x: f33[2] data) {\n", 1, 14,
                     "unknown dtype 'f33' (expected f32, f64, f16, bf16, i32, i64, bool or u8)");
  expect_parse_error("graph @g(%x: f32[2,-1] data) {\n", 1, 20,
                     "expected a dimension (a non-negative integer), found '-1'");
  expect_parse_error("graph @g(%x: f32[2.5] data) {\n", 1, 18,
                     "expected a dimension (a non-negative integer), found '2.5'");
  expect_parse_error("graph @g(%x: f32 data) {\n", 1, 18,
                     "expected '[' after dtype 'f32', found 'data'");
  expect_parse_error("graph @g(%x: [2] data) {\n", 1, 14,
                     "expected a type such as f32[2,3], found '['");
  expect_parse_error("graph @g(%x: f32[2] input) {\n", 1, 21,
                     "expected the role of input %x (param, state or data), found 'input'");
  // 2^24 * 2^24 = 2^48 is the largest allowed product; twice that is rejected.
  EXPECT_NO_THROW(parse("graph @g(%x: f32[16777216,16777216] data) {\n  return %x\n}\n"));
  expect_parse_error("graph @g(%x: f32[16777216,16777216,2] data) {\n", 1, 14,
                     "type f32[16777216,16777216,2] is too large: its dimensions multiply to more "
                     "than 2^48");
  // Zero dimensions count as one, so huge strides of an empty tensor are rejected too.
  expect_parse_error("graph @g(%x: f32[0,16777216,16777216,2] data) {\n", 1, 14, "too large");
  EXPECT_NO_THROW(parse("graph @g(%x: f32[0,3] data) {\n  return %x\n}\n"));
}

TEST(IrTextErrors, Names) {
  expect_parse_error(with_body("  %0 = neg(%q)\n"), 2, 12, "use of undefined value %q");
  expect_parse_error(with_body("  %h = neg(%x)\n  %h = abs(%x)\n"), 3, 3,
                     "value %h is defined twice");
  expect_parse_error(with_body("  %x = neg(%x)\n"), 2, 3, "value %x is defined twice");
  expect_parse_error(with_body("  %a, %a = split(%x) {sizes=[1, 1]}\n"), 2, 7,
                     "value %a is defined twice");
  expect_parse_error("graph @g(%x: f32[2] data, %x: f32[2] param) {\n", 1, 27,
                     "value %x is defined twice");
  // Numeric labels are names within the text too.
  expect_parse_error(with_body("  %0 = neg(%x)\n  %0 = abs(%x)\n"), 3, 3,
                     "value %0 is defined twice");
  // A value cannot be used before (or by) its own definition.
  expect_parse_error(with_body("  %a = neg(%b)\n  %b = neg(%x)\n"), 2, 12,
                     "use of undefined value %b");
}

TEST(IrTextErrors, OpsAndAttributes) {
  expect_parse_error(with_body("  %0 = gelux(%x)\n"), 2, 8, "unknown op 'gelux'");
  expect_parse_error(with_body("  %0 = add(%x, %z)\n"), 2, 16, "use of undefined value %z");
  // Inference errors are reported at the op, prefixed by its name.
  expect_parse_error(
      "graph @g(%x: f32[2,3] data, %z: f32[4] data) {\n  %0 = add(%x, %z)\n  return %0\n}\n", 2, 8,
      "add: shapes (2, 3) and (4,) do not broadcast");
  expect_parse_error(with_body("  %0 = add(%x)\n"), 2, 8, "add: got 1 inputs, expected 2");
  expect_parse_error(with_body("  %0 = concat(%x) {axis=1, bogus=2}\n"), 2, 28,
                     "concat: unknown attribute 'bogus' (expected one of: axis)");
  expect_parse_error(with_body("  %0 = concat(%x) {axis=1.5}\n"), 2, 25,
                     "concat: attribute 'axis' is float 1.5, expected int");
  expect_parse_error(with_body("  %0 = reshape(%x)\n"), 2, 8,
                     "reshape: missing required attribute 'shape' (ints)");
  expect_parse_error(with_body("  %0 = concat(%x) {axis=1, axis=0}\n"), 2, 28,
                     "attribute 'axis' is given twice");
  expect_parse_error(with_body("  %0 = gelu(%x) {approximate=tanh}\n"), 2, 30,
                     "expected an attribute value (a number, \"string\", true, false, dtype or "
                     "[list]), found 'tanh'");
  expect_parse_error(with_body("  %0 = reshape(%x) {shape=[2, f32]}\n"), 2, 31,
                     "expected a number in the list, found 'f32'");
  expect_parse_error(with_body("  %0 = reshape(%x) {shape=[[2]]}\n"), 2, 28,
                     "expected a number in the list, found '['");
  expect_parse_error(with_body("  %a = split(%x) {axis=1, sizes=[1, 2]}\n"), 2, 8,
                     "split produces 2 outputs, but 1 name is given");
  expect_parse_error(with_body("  %a, %b = neg(%x)\n"), 2, 12,
                     "neg produces 1 output, but 2 names are given");
}

TEST(IrTextErrors, Updates) {
  std::string header = "graph @g(%x: f32[2] data, %w: f32[2] param, %s: f32[3] state) {\n";
  expect_parse_error(header + "  update %x = %w\n", 2, 10,
                     "update target %x is a data input, expected param or state");
  expect_parse_error(header + "  %0 = neg(%w)\n  update %0 = %w\n", 3, 10,
                     "update target %0 is not a graph input (only param and state inputs can be "
                     "updated)");
  expect_parse_error(header + "  update %w = %x\n  update %w = %x\n", 3, 10, "%w is updated twice");
  expect_parse_error(header + "  update %s = %w\n", 2, 15,
                     "update of %s: %w has type f32[2], expected f32[3]");
  expect_parse_error(header + "  update %q = %w\n", 2, 10, "use of undefined value %q");
  expect_parse_error(header + "  update %w = %q\n", 2, 15, "use of undefined value %q");
  expect_parse_error(header + "  update %w %x\n", 2, 13,
                     "expected '=' after update target %w, found '%x'");
  expect_parse_error(header + "  update = %x\n", 2, 10,
                     "expected the updated input after 'update' ('%name'), found '='");
  expect_parse_error(header + "  return %x\n  update %w = %x\n}\n", 3, 3,
                     "expected '}' after the return values, found 'update'");
}

TEST(IrTextErrors, DeclaredTypes) {
  expect_parse_error(with_body("  %0 = neg(%x) : f32[3,2]\n"), 2, 18,
                     "declared f32[3,2], inferred f32[2,3]");
  expect_parse_error(with_body("  %0 = neg(%x) : f64[2,3]\n"), 2, 18,
                     "declared f64[2,3], inferred f32[2,3]");
  expect_parse_error(
      with_body("  %0, %1 = split(%x) {axis=1, sizes=[1, 2]} : f32[2,1], f32[2,1]\n"), 2, 57,
      "declared f32[2,1], inferred f32[2,2]");
  expect_parse_error(with_body("  %0 = neg(%x) : f32[2,3], f32[2,3]\n"), 2, 16,
                     "2 types declared for the 1 output of neg");
  expect_parse_error(with_body("  %0 = neg(%x) : f32[2,3]]\n"), 2, 26,
                     "expected a node ('%name = op(...)'), 'update' or 'return', found ']'");
}

TEST(IrTextErrors, HugeShapesAreRejected) {
  // A `shape` attribute is bounded before inference multiplies it out.
  expect_parse_error(with_body("  %0 = broadcast_to(%y) {shape=[16777216, 16777216, 3]}\n"), 2, 32,
                     "broadcast_to: attribute 'shape' [16777216, 16777216, 3] is too large");
  expect_parse_error(
      with_body("  %0 = reshape(%x) {shape=[-9223372036854775808, 9223372036854775807]}\n"), 2, 27,
      "too large");
  // Inferred types are bounded too: each input is within the limit, the gather output is not.
  expect_parse_error(
      "graph @g(%t: f32[16777216,4] param, %i: i64[16777216,16777216] data) {\n"
      "  %e = gather(%t, %i)\n",
      2, 8, "gather: output %e has type f32[16777216,16777216,4], too large");
}

TEST(IrTextErrors, MessagesAreParseErrorsAndKilnErrors) {
  // ParseError is a kiln::Error, so callers may catch either.
  EXPECT_THROW(parse("graph"), ParseError);
  EXPECT_THROW(parse("graph"), Error);
}

// ---------------------------------------------------------------------------------------------
// Printer edge cases.

TEST(IrTextPrint, RejectsNamesThatCannotBeParsedBack) {
  Graph g;
  g.name = "bad name";
  ValueId x = g.add_input("x", {DType::kF32, {2}}, Role::kData);
  g.outputs = {x};
  try {
    print(g);
    ADD_FAILURE() << "printed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("graph name 'bad name'"), std::string::npos) << e.what();
  }
  g.name = "ok";
  g.values[x].name = "x y";
  try {
    print(g);
    ADD_FAILURE() << "printed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("value name 'x y'"), std::string::npos) << e.what();
  }
}

TEST(IrTextPrint, RejectsValueIdsOutOfRange) {
  Graph g;
  ValueId x = g.add_input("x", {DType::kF32, {2}}, Role::kData);
  g.add(Op::kNeg, {x});
  g.nodes[0].inputs[0] = 42;
  try {
    print(g);
    ADD_FAILURE() << "printed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("node 0 (neg) refers to value id 42"), std::string::npos)
        << e.what();
  }
}

TEST(IrTextPrint, PrintsUnverifiedGraphsForDebugging) {
  // A broken graph (an output type that inference disagrees with) still prints, so that a
  // failing pass can dump it; parsing it back reports the disagreement.
  Graph g;
  ValueId x = g.add_input("x", {DType::kF32, {2}}, Role::kData);
  ValueId y = g.add(Op::kNeg, {x});
  g.values[y].type = TensorType{DType::kF32, {3}};
  g.outputs = {y};
  std::string text = print(g);
  EXPECT_EQ(text,
            "graph @main(%x: f32[2] data) {\n"
            "  %0 = neg(%x) : f32[3]\n"
            "  return %0\n"
            "}\n");
  expect_parse_error(text, 2, 18, "declared f32[3], inferred f32[2]");
}

}  // namespace
}  // namespace kiln

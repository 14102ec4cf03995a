// Fused kinds (ops/fused/kind.h): the one list and its text names, and the verifier holding
// every fused node to its kind's body contract (ops/fused/group.h, classifier.h,
// multi_tensor.h). Per kind: a body of the right form verifies and round-trips through the IR
// text exactly, and a wrong body is an error saying why; an unknown kind is an error naming the
// known ones; a pass that builds a wrong body fails right after it, named.
#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>

#include "ir/text.h"
#include "ir/verifier.h"
#include "ops/fused/group.h"
#include "ops/fused/kind.h"
#include "passes/pass.h"
#include "test_util.h"

namespace kiln {
namespace {

// A graph of one fused node of `kind` whose body is `body_text` (a graph in IR text, inputs of
// role data), the node reading graph inputs of the body's input types. Adding the node runs the
// fused op's inference: the checks verify() runs.
Graph with_fused(const std::string& kind, const std::string& body_text) {
  auto body = std::make_shared<Graph>(parse(body_text));
  Graph g;
  std::vector<ValueId> inputs;
  for (const GraphInput& in : body->inputs)
    inputs.push_back(g.add_input(body->value(in.value).name, body->type(in.value), Role::kData));
  g.outputs = g.add_node(Op::kFused, inputs, {{"kind", kind}}, body);
  verify(g);
  return g;
}

// Verifies, and prints and parses back to the same text.
void expect_accepted(const std::string& kind, const std::string& body_text) {
  SCOPED_TRACE(kind + ":\n" + body_text);
  Graph g;
  ASSERT_NO_THROW(g = with_fused(kind, body_text));
  const std::string text = print(g);
  EXPECT_NE(text.find("{kind=\"" + kind + "\"}"), std::string::npos) << text;
  EXPECT_EQ(print(parse(text)), text);
  EXPECT_EQ(fused_kind(g.nodes[0]), *fused_kind_named(kind));
}

// ---- bodies of the right form -----------------------------------------------------------------

constexpr const char* kElementwise =
    "graph @b(%x: f32[4,3] data, %b: f32[3] data) {\n"
    "  %0 = add(%x, %b) : f32[4,3]\n"
    "  %1 = relu(%0) : f32[4,3]\n"
    "  %2 = sum(%1) {axes=[0]} : f32[3]\n"  // a column reduction, only an output
    "  return %1, %2\n"
    "}\n";

constexpr const char* kRows =
    "graph @b(%x: bf16[4,6] data) {\n"
    "  %0 = softmax(%x) : bf16[4,6]\n"
    "  %1 = mul(%0, %x) : bf16[4,6]\n"
    "  return %1\n"
    "}\n";

// ones-column's padded output: concat(x, ones) along the last axis.
constexpr const char* kRowsPadded =
    "graph @b(%x: bf16[4,6] data) {\n"
    "  %0 = softmax(%x) : bf16[4,6]\n"
    "  %1 = full() {dtype=bf16, shape=[4,2], value=1} : bf16[4,2]\n"
    "  %2 = concat(%0, %1) {axis=-1} : bf16[4,8]\n"
    "  return %2\n"
    "}\n";

constexpr const char* kGemmEpilogue =
    "graph @b(%x: f32[2,5,8] data, %w: f32[8,6] data, %c: f32[6] data) {\n"
    "  %0 = matmul(%x, %w) : f32[2,5,6]\n"
    "  %1 = add(%0, %c) : f32[2,5,6]\n"
    "  %2 = gelu(%1) : f32[2,5,6]\n"
    "  %3 = layer_norm(%2, %c, %c) : f32[2,5,6]\n"
    "  return %1, %3\n"
    "}\n";

// ones-column's forward product: A is x[..., :K] of the padded X'.
constexpr const char* kGemmEpilogueSliced =
    "graph @b(%xp: f32[5,12] data, %w: f32[8,6] data) {\n"
    "  %0 = slice(%xp) {ends=[5,8], starts=[0,0]} : f32[5,8]\n"
    "  %1 = matmul(%0, %w) : f32[5,6]\n"
    "  %2 = relu(%1) : f32[5,6]\n"
    "  return %2\n"
    "}\n";

constexpr const char* kClassifier =
    "graph @b(%x: bf16[3,9] data, %t: i64[3] data, %d: f32[] data) {\n"
    "  %l = cast(%x) {dtype=f32} : f32[3,9]\n"
    "  %loss = cross_entropy(%l, %t) : f32[]\n"
    "  %g = cross_entropy_grad(%l, %t, %d) : f32[3,9]\n"
    "  %gc = cast(%g) {dtype=bf16} : bf16[3,9]\n"
    "  return %loss, %gc\n"
    "}\n";

constexpr const char* kAdamw =
    "graph @b(%w: f32[5] data, %gw: f32[5] data, %mw: f32[5] data, %vw: f32[5] data, "
    "%lr: f32[] data, %step: f32[] data, %v: f32[2,3] data, %gv: bf16[2,3] data, "
    "%mv: f32[2,3] data, %vv: f32[2,3] data) {\n"
    "  %w1, %mw1, %vw1 = optimizer_update(%w, %gw, %mw, %vw, %lr, %step) {optimizer=\"adamw\"} : f32[5], "
    "f32[5], f32[5]\n"
    "  %v1, %mv1, %vv1 = optimizer_update(%v, %gv, %mv, %vv, %lr, %step) {optimizer=\"adamw\"} : f32[2,3], "
    "f32[2,3], f32[2,3]\n"
    "  return %w1, %mw1, %vw1, %v1, %mv1, %vv1\n"
    "}\n";

constexpr const char* kSgd =
    "graph @b(%w: f32[5] data, %gw: f32[5] data, %bw: f32[5] data, %lr: f32[] data, %step: f32[] data, "
    "%v: f32[7] data, %gv: f32[7] data, %bv: f32[7] data) {\n"
    "  %w1, %bw1 = optimizer_update(%w, %gw, %bw, %lr, %step) {momentum=0.9, optimizer=\"sgd\"} : f32[5], f32[5]\n"
    "  %v1, %bv1 = optimizer_update(%v, %gv, %bv, %lr, %step) {momentum=0.9, optimizer=\"sgd\"} : f32[7], f32[7]\n"
    "  return %w1, %bw1, %v1, %bv1\n"
    "}\n";

constexpr const char* kGlobalNorm =
    "graph @b(%ga: f32[4,3] data, %gb: bf16[5] data) {\n"
    "  %0 = square(%ga) : f32[4,3]\n"
    "  %1 = sum(%0) : f32[]\n"
    "  %2 = cast(%gb) {dtype=f32} : f32[5]\n"
    "  %3 = square(%2) : f32[5]\n"
    "  %4 = sum(%3) : f32[]\n"
    "  %5 = add(%1, %4) : f32[]\n"
    "  return %5\n"
    "}\n";

constexpr const char* kCast =
    "graph @b(%w: f32[5] data, %v: f32[2,3] data) {\n"
    "  %0 = cast(%w) {dtype=bf16} : bf16[5]\n"
    "  %1 = cast(%v) {dtype=f16} : f16[2,3]\n"
    "  %2 = cast(%w) {dtype=f16} : f16[5]\n"
    "  return %0, %1, %2\n"
    "}\n";

TEST(FusedKind, EveryKindHasOneNameThatParsesBack) {
  std::set<std::string_view> names;
  for (int k = 0; k < kFusedKindCount; ++k) {
    const auto kind = static_cast<FusedKind>(k);
    const std::string_view name = fused_kind_name(kind);
    EXPECT_TRUE(names.insert(name).second) << name;
    EXPECT_EQ(fused_kind_named(name), kind) << name;
    EXPECT_NE(known_fused_kinds().find(name), std::string::npos) << name;
  }
  EXPECT_EQ(kFusedKindCount, 7);
  EXPECT_FALSE(fused_kind_named("Rows").has_value());
  EXPECT_FALSE(fused_kind_named("").has_value());
}

TEST(FusedKind, BodiesOfEachKindVerifyAndRoundTrip) {
  expect_accepted("elementwise", kElementwise);
  expect_accepted("rows", kRows);
  expect_accepted("rows", kRowsPadded);
  expect_accepted("gemm-epilogue", kGemmEpilogue);
  expect_accepted("gemm-epilogue", kGemmEpilogueSliced);
  expect_accepted("classifier", kClassifier);
  expect_accepted("multi-tensor-update", kAdamw);
  expect_accepted("multi-tensor-update", kSgd);
  expect_accepted("global-norm", kGlobalNorm);
  expect_accepted("multi-tensor-cast", kCast);
}

TEST(FusedKind, MatchersHandTheKernelsTheirPieces) {
  const Graph gemm = parse(kGemmEpilogue);
  const std::optional<GroupBody> g = match_group_body(FusedKind::kGemmEpilogue, gemm);
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->matmul, 0);
  EXPECT_EQ(g->row_ops, 1);
  const std::optional<GroupBody> e = match_group_body(FusedKind::kElementwise, parse(kElementwise));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->matmul, -1);
  EXPECT_EQ(e->column_reductions, 1);
}

TEST(FusedKind, UnknownKindIsAnErrorNamingTheKnownOnes) {
  EXPECT_KILN_ERROR(with_fused("elementwize", kElementwise), "unknown fused kind \"elementwize\"",
                    "elementwise, rows, gemm-epilogue, classifier");
  // In the text form too, where the node is.
  std::string text = print(with_fused("rows", kRows));
  text.replace(text.find("\"rows\""), 6, "\"row\"");
  EXPECT_KILN_ERROR(parse(text), "unknown fused kind \"row\"", "multi-tensor-cast");
  Node node{Op::kFused, {}, {}, Attributes{{"kind", std::string("row")}}, nullptr};
  EXPECT_KILN_ERROR(fused_kind(node), "unknown fused kind \"row\"");
  EXPECT_FALSE(is_fused(node, FusedKind::kRows));
}

// ---- wrong bodies: one test per kind, named for why -------------------------------------------

TEST(FusedKind, ElementwiseKindRejectsRowOpsAndMatmuls) {
  EXPECT_KILN_ERROR(with_fused("elementwise", kRows), "not a \"elementwise\" body",
                    "node 0 (softmax) is a row op");
  EXPECT_KILN_ERROR(with_fused("elementwise", kGemmEpilogue), "node 0 (matmul) is a matmul");
}

TEST(FusedKind, RowsKindRejectsBodyWithoutRowOp) {
  EXPECT_KILN_ERROR(with_fused("rows", kElementwise), "not a \"rows\" body", "no row op");
}

TEST(FusedKind, FusionKindsRejectColumnValuesReadInsideTheBody) {
  // A column sum is complete only after the last tile: nothing in the group may read it.
  EXPECT_KILN_ERROR(with_fused("elementwise",
                               "graph @b(%x: f32[4,3] data) {\n"
                               "  %0 = sum(%x) {axes=[0], keepdims=true} : f32[1,3]\n"
                               "  %1 = sub(%x, %0) : f32[4,3]\n"
                               "  return %1\n"
                               "}\n"),
                    "node 0 (sum) is a column reduction read inside the body");
  // layer_norm_grad's dgamma (output 1) likewise.
  EXPECT_KILN_ERROR(with_fused("rows",
                               "graph @b(%x: f32[4,3] data, %g: f32[3] data, "
                               "%dy: f32[4,3] data) {\n"
                               "  %dx, %dg, %db = layer_norm_grad(%x, %g, %dy) : f32[4,3], f32[3], "
                               "f32[3]\n"
                               "  %1 = mul(%dx, %dg) : f32[4,3]\n"
                               "  return %1, %db\n"
                               "}\n"),
                    "column output 1 is read inside the body");
}

TEST(FusedKind, FusionKindsRejectOpsNoFusedKernelRuns) {
  EXPECT_KILN_ERROR(with_fused("rows",
                               "graph @b(%x: f32[4,3] data) {\n"
                               "  %0 = softmax(%x) : f32[4,3]\n"
                               "  %1 = transpose(%0) {perm=[1,0]} : f32[3,4]\n"
                               "  return %1\n"
                               "}\n"),
                    "node 1 (transpose) cannot be part of a rows body");
  // Dropout is elementwise but indexed by global position: never in a group.
  EXPECT_KILN_ERROR(with_fused("elementwise",
                               "graph @b(%x: f32[4,3] data) {\n"
                               "  %0 = dropout(%x) {p=0.5, seed=3} : f32[4,3]\n"
                               "  %1 = neg(%0) : f32[4,3]\n"
                               "  return %1\n"
                               "}\n"),
                    "node 0 (dropout) cannot be part of a elementwise body");
  // ones-column's padding is for rows and gemm-epilogue bodies only.
  std::string padded_elementwise = kRowsPadded;
  padded_elementwise.replace(padded_elementwise.find("softmax"), 7, "exp");
  EXPECT_KILN_ERROR(with_fused("elementwise", padded_elementwise),
                    "node 1 (full) cannot be part of a elementwise body");
}

TEST(FusedKind, GemmEpilogueKindRejectsBodyWithoutExactlyOneMatmulOfItsInputs) {
  EXPECT_KILN_ERROR(with_fused("gemm-epilogue", kRows), "not a \"gemm-epilogue\" body",
                    "no matmul");
  EXPECT_KILN_ERROR(with_fused("gemm-epilogue",
                               "graph @b(%x: f32[5,8] data, %w: f32[8,6] data, "
                               "%v: f32[8,6] data) {\n"
                               "  %0 = matmul(%x, %w) : f32[5,6]\n"
                               "  %1 = matmul(%x, %v) : f32[5,6]\n"
                               "  %2 = add(%0, %1) : f32[5,6]\n"
                               "  return %2\n"
                               "}\n"),
                    "node 1 (matmul) is a second matmul");
  // The nucleus reads nothing computed in the group (a prologue is no epilogue).
  EXPECT_KILN_ERROR(with_fused("gemm-epilogue",
                               "graph @b(%x: f32[5,8] data, %w: f32[8,6] data) {\n"
                               "  %0 = relu(%x) : f32[5,8]\n"
                               "  %1 = matmul(%0, %w) : f32[5,6]\n"
                               "  return %1\n"
                               "}\n"),
                    "reads its operand a from inside the body");
  // ones-column's slice feeds the matmul's A alone.
  EXPECT_KILN_ERROR(with_fused("gemm-epilogue",
                               "graph @b(%xp: f32[5,12] data, %w: f32[8,6] data) {\n"
                               "  %0 = slice(%xp) {ends=[5,8], starts=[0,0]} : f32[5,8]\n"
                               "  %1 = matmul(%0, %w) : f32[5,6]\n"
                               "  return %1, %0\n"
                               "}\n"),
                    "node 0 (slice) is read by more than the matmul's a");
}

TEST(FusedKind, ClassifierKindRejectsBodyWithoutLoss) {
  std::string no_loss = kClassifier;
  no_loss.replace(no_loss.find("cross_entropy(%l, %t)"), 21, "neg(%d)");
  EXPECT_KILN_ERROR(with_fused("classifier", no_loss), "not a \"classifier\" body",
                    "neg then cross_entropy_grad, expected cross_entropy then cross_entropy_grad");
  EXPECT_KILN_ERROR(with_fused("classifier", kRows), "1 inputs and 1 outputs, expected 3");
}

TEST(FusedKind, MultiTensorUpdateKindRejectsOtherOps) {
  EXPECT_KILN_ERROR(with_fused("multi-tensor-update", kCast), "not a \"multi-tensor-update\" body",
                    "the body holds a cast");
}

TEST(FusedKind, MultiTensorUpdateKindRejectsMembersWithDifferentAttributes) {
  std::string mixed = kSgd;
  mixed.replace(mixed.rfind("momentum=0.9, "), 14, "");
  EXPECT_KILN_ERROR(with_fused("multi-tensor-update", mixed), "not a \"multi-tensor-update\" body",
                    "the members' attributes differ");
}

TEST(FusedKind, GlobalNormKindRejectsTermsThatAreNotSumsOfSquares) {
  std::string no_square = kGlobalNorm;
  no_square.replace(no_square.find("square(%ga)"), 11, "neg(%ga)");
  EXPECT_KILN_ERROR(with_fused("global-norm", no_square), "not a \"global-norm\" body",
                    "the body holds a neg");
}

TEST(FusedKind, MultiTensorCastKindRejectsWideningCasts) {
  EXPECT_KILN_ERROR(with_fused("multi-tensor-cast",
                               "graph @b(%w: bf16[5] data) {\n"
                               "  %0 = cast(%w) {dtype=f32} : f32[5]\n"
                               "  return %0\n"
                               "}\n"),
                    "not a \"multi-tensor-cast\" body", "a cast of a bf16 input, expected f32");
}

// A pass that labels a softmax "elementwise": the pass manager's verify after every pass names
// it and the broken contract.
class MislabelingPass : public Pass {
 public:
  std::string name() const override { return "mislabel"; }
  bool run(Graph& graph) override {
    graph.nodes[0].attrs = fused_attrs(FusedKind::kElementwise);
    return true;
  }
};

TEST(FusedKind, WrongBodyFailsRightAfterThePassThatBuiltIt) {
  Graph g = with_fused("rows", kRows);
  PassManager pm;
  pm.add(std::make_unique<MislabelingPass>());
  EXPECT_KILN_ERROR(pm.run(g), "pass mislabel", "not a \"elementwise\" body", "is a row op");
}

}  // namespace
}  // namespace kiln

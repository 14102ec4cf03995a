// The shape of what the importer's decompositions write (src/frontend/onnx/ops_einsum.cc,
// ops_resize.cc, ops_rnn.cc): an attention-style Einsum is one matmul reading its operands as
// stored (no transposes), a nearest Resize only gathers, a recurrent layer's input projection is
// one matmul for all steps. Their numbers are checked against numpy, torch and the ONNX
// reference in tests/python/test_onnx_ops.py and by the node tests (OnnxConformance).
#include <gtest/gtest.h>

#ifdef KILN_HAVE_ONNX
#include <onnx/onnx_pb.h>
#endif

#include "frontend/onnx/onnx_import.h"
#include "ir/text.h"

namespace kiln::testing {
namespace {

#ifdef KILN_HAVE_ONNX

// A one-node model over float inputs of the given shapes (int64 constants as initializers).
struct OneNode {
  ::onnx::ModelProto model;
  ::onnx::NodeProto* node;

  OneNode(const std::string& op, int64_t opset) {
    model.set_ir_version(8);
    auto* id = model.add_opset_import();
    id->set_domain("");
    id->set_version(opset);
    node = model.mutable_graph()->add_node();
    node->set_op_type(op);
    node->add_output("y");
    model.mutable_graph()->add_output()->set_name("y");
  }
  void input(const std::string& name, const Shape& shape) {
    node->add_input(name);
    auto* info = model.mutable_graph()->add_input();
    info->set_name(name);
    auto* type = info->mutable_type()->mutable_tensor_type();
    type->set_elem_type(::onnx::TensorProto::FLOAT);
    for (int64_t d : shape) type->mutable_shape()->add_dim()->set_dim_value(d);
  }
  void constant(const std::string& name, ::onnx::TensorProto::DataType dtype, const std::vector<double>& values) {
    node->add_input(name);
    auto* t = model.mutable_graph()->add_initializer();
    t->set_name(name);
    t->set_data_type(dtype);
    t->add_dims(static_cast<int64_t>(values.size()));
    for (double v : values) {
      if (dtype == ::onnx::TensorProto::INT64) t->add_int64_data(static_cast<int64_t>(v));
      else t->add_float_data(static_cast<float>(v));
    }
  }
  void attr(const std::string& name, const std::string& value) {
    auto* a = node->add_attribute();
    a->set_name(name);
    a->set_type(::onnx::AttributeProto::STRING);
    a->set_s(value);
  }
  void attr(const std::string& name, int64_t value) {
    auto* a = node->add_attribute();
    a->set_name(name);
    a->set_type(::onnx::AttributeProto::INT);
    a->set_i(value);
  }
  std::string imported() {
    onnx::ImportOptions options;
    options.freeze = {"*"};  // float initializers (scales) stay constants
    return print(onnx::import_onnx_bytes(model.SerializeAsString(), ".", options, "one-node").graph);
  }
};

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(OnnxDecompose, AttentionEinsumsAreOneMatmulOnTheOperandsAsStored) {
  if (!onnx::onnx_available()) GTEST_SKIP() << "no ONNX front end";
  for (const auto& [equation, a, b] : {std::tuple{"bhqd,bhkd->bhqk", Shape{2, 3, 4, 8}, Shape{2, 3, 5, 8}},
                                       std::tuple{"bhqk,bhkd->bhqd", Shape{2, 3, 4, 5}, Shape{2, 3, 5, 8}},
                                       std::tuple{"bij,bjk->bik", Shape{2, 3, 4}, Shape{2, 4, 5}}}) {
    OneNode m("Einsum", 12);
    m.input("a", a);
    m.input("b", b);
    m.attr("equation", std::string(equation));
    const std::string text = m.imported();
    EXPECT_EQ(count(text, "matmul("), 1) << equation << "\n" << text;
    EXPECT_EQ(count(text, "transpose("), 0) << equation << "\n" << text;
    EXPECT_EQ(count(text, "reshape("), 0) << equation << "\n" << text;
  }
}

TEST(OnnxDecompose, OuterProductEinsumIsAMultiplyNotAMatmul) {
  if (!onnx::onnx_available()) GTEST_SKIP() << "no ONNX front end";
  OneNode m("Einsum", 12);
  m.input("t", {16});
  m.input("f", {4});
  m.attr("equation", std::string("i,j->ij"));
  const std::string text = m.imported();
  EXPECT_EQ(count(text, "matmul("), 0) << text;
  EXPECT_EQ(count(text, "mul("), 1) << text;
}

TEST(OnnxDecompose, NearestResizeOnlyGathersAndLinearWeighsTwoTapsPerAxis) {
  if (!onnx::onnx_available()) GTEST_SKIP() << "no ONNX front end";
  for (const std::string mode : {"nearest", "linear"}) {
    OneNode m("Resize", 13);
    m.input("x", {2, 3, 4, 5});
    m.node->add_input("");  // no roi
    m.constant("scales", ::onnx::TensorProto::FLOAT, {1, 1, 2, 2});
    m.attr("mode", mode);
    const std::string text = m.imported();
    // N and C keep their positions: only H and W are gathered.
    EXPECT_EQ(count(text, "gather("), mode == "nearest" ? 2 : 4) << text;
    EXPECT_EQ(count(text, "mul("), mode == "nearest" ? 0 : 4) << text;
  }
}

TEST(OnnxDecompose, RecurrentInputProjectionIsOneMatmulForAllSteps) {
  if (!onnx::onnx_available()) GTEST_SKIP() << "no ONNX front end";
  const int64_t steps = 6, batch = 2, width = 3, hidden = 4;
  OneNode m("LSTM", 14);
  m.input("x", {steps, batch, width});
  m.input("w", {1, 4 * hidden, width});
  m.input("r", {1, 4 * hidden, hidden});
  m.attr("hidden_size", hidden);
  const std::string text = m.imported();
  // One projection of the (T, B, I) input, one product by R per step.
  EXPECT_EQ(count(text, "matmul("), 1 + steps) << text;
}

TEST(OnnxDecompose, UnsupportedResizeModeSaysWhich) {
  if (!onnx::onnx_available()) GTEST_SKIP() << "no ONNX front end";
  OneNode m("Resize", 13);
  m.input("x", {1, 1, 4, 4});
  m.node->add_input("");
  m.constant("scales", ::onnx::TensorProto::FLOAT, {1, 1, 2, 2});
  m.attr("mode", std::string("area"));
  try {
    m.imported();
    FAIL() << "imported mode 'area'";
  } catch (const onnx::OnnxUnsupported& e) {
    EXPECT_NE(std::string(e.what()).find("mode 'area'"), std::string::npos) << e.what();
  }
}

#else
TEST(OnnxDecompose, NeedsTheOnnxFrontEnd) { GTEST_SKIP() << "no ONNX front end"; }
#endif

}  // namespace
}  // namespace kiln::testing

// The ONNX importer on bad input: missing, truncated, garbage and mutated model files, unknown
// ops, dynamic dims without sizes. Each is one kiln::Error (OnnxUnsupported for what kiln
// cannot run), never a crash; and a model built here imports to the graph it says.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#ifdef KILN_HAVE_ONNX
#include <onnx/onnx_pb.h>
#endif

#include "frontend/onnx/onnx_import.h"
#include "ir/text.h"
#include "test_util.h"
#include "train/trainer.h"

namespace kiln::testing {
namespace {

constexpr const char* kRelu = "/usr/share/libonnx-testdata/data/node/test_relu/model.onnx";
constexpr const char* kConv = "/usr/share/libonnx-testdata/data/node/test_basic_conv_with_padding/model.onnx";

std::string read(const char* path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool have_data() { return onnx::onnx_available() && std::filesystem::exists(kConv); }

TEST(OnnxImport, ImportsAModelOfTheTestData) {
  if (!have_data()) GTEST_SKIP() << "no ONNX front end or no libonnx-testdata";
  onnx::ImportedModel m = onnx::import_onnx(kConv);
  EXPECT_NE(print(m.graph).find("conv2d("), std::string::npos) << print(m.graph);
  EXPECT_EQ(m.graph.inputs.size(), 2u);  // x and W, both graph inputs of the test
}

TEST(OnnxImport, MissingTruncatedAndGarbageFilesAreOneError) {
  if (!have_data()) GTEST_SKIP() << "no ONNX front end or no libonnx-testdata";
  EXPECT_THROW(onnx::import_onnx("/nonexistent/model.onnx"), Error);
  const std::string bytes = read(kConv);
  for (size_t keep : {size_t{0}, size_t{3}, bytes.size() / 2, bytes.size() - 1}) {
    try {
      onnx::import_onnx_bytes(bytes.substr(0, keep), ".", {}, "truncated");
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(onnx::import_onnx_bytes(std::string(1000, '\xff'), ".", {}, "garbage"), Error);
}

// A tensor file whose dims promise far more data than it holds is one error, decided before
// anything is allocated: a SequenceProto read as a TensorProto parses to such dims, and
// allocating them first paged in memory for minutes on a machine large enough not to fail.
TEST(OnnxImport, TensorWithAbsurdDimsIsOneErrorWithoutAllocating) {
#ifdef KILN_HAVE_ONNX
  if (!onnx::onnx_available()) GTEST_SKIP() << "no ONNX front end";
  const auto dir = std::filesystem::temp_directory_path() / "kiln_onnx_absurd_dims";
  std::filesystem::create_directories(dir);
  auto write = [&](const ::onnx::TensorProto& proto, const char* name) {
    const auto path = (dir / name).string();
    std::ofstream(path, std::ios::binary) << proto.SerializeAsString();
    return path;
  };
  ::onnx::TensorProto raw;
  raw.set_data_type(::onnx::TensorProto::FLOAT);
  for (int64_t d : {int64_t{1} << 20, int64_t{1} << 20, int64_t{1} << 10}) raw.add_dims(d);  // 4 PiB
  raw.set_raw_data(std::string(16, '\1'));
  ::onnx::TensorProto typed = raw;
  typed.clear_raw_data();
  for (int i = 0; i < 4; ++i) typed.add_float_data(1.0f);
  ::onnx::TensorProto overflowing = typed;
  overflowing.add_dims(int64_t{1} << 40);  // numel past int64
  for (const auto& [proto, name, says] : {std::tuple{raw, "raw.pb", "bytes of data"},
                                          std::tuple{typed, "typed.pb", "values for"},
                                          std::tuple{overflowing, "overflow.pb", "too large"}}) {
    try {
      onnx::load_onnx_tensor(write(proto, name));
      ADD_FAILURE() << name << " loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove_all(dir);
#else
  GTEST_SKIP() << "no ONNX front end";
#endif
}

// Mutated model files: the importer either imports them or throws kiln::Error; nothing else.
TEST(OnnxImport, FuzzedModelsNeverCrash) {
  if (!have_data()) GTEST_SKIP() << "no ONNX front end or no libonnx-testdata";
  std::mt19937 rng(7);
  int errors = 0, imported = 0;
  for (const char* path : {kRelu, kConv}) {
    const std::string bytes = read(path);
    for (int trial = 0; trial < 300; ++trial) {
      std::string mutated = bytes;
      const int flips = 1 + static_cast<int>(rng() % 4);
      for (int f = 0; f < flips; ++f) mutated[rng() % mutated.size()] = static_cast<char>(rng() % 256);
      try {
        onnx::ImportOptions options;
        options.shapes = {{"x", {1, 1, 5, 5}}, {"W", {1, 1, 3, 3}}};
        onnx::import_onnx_bytes(mutated, ".", options, "fuzzed");
        ++imported;
      } catch (const Error&) {
        ++errors;
      }
    }
  }
  EXPECT_GT(errors, 0);
  EXPECT_EQ(errors + imported, 600);
}

TEST(OnnxImport, DynamicDimTakesItsSizeFromShapeOrSaysWhichFlag) {
#ifdef KILN_HAVE_ONNX
  if (!have_data()) GTEST_SKIP() << "no libonnx-testdata";
  // test_relu with x's first dim made dynamic ("batch").
  ::onnx::ModelProto model;
  ASSERT_TRUE(model.ParseFromString(read(kRelu)));
  auto* dim = model.mutable_graph()->mutable_input(0)->mutable_type()->mutable_tensor_type()->mutable_shape()->mutable_dim(0);
  dim->set_dim_param("batch");
  const std::string bytes = model.SerializeAsString();
  try {
    onnx::import_onnx_bytes(bytes, ".", {}, "dynamic");
    FAIL() << "imported without a size for the dynamic dim";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--shape batch=N"), std::string::npos) << e.what();
  }
  onnx::ImportOptions by_dim, by_input;
  by_dim.shapes = {{"batch", {6}}};
  by_input.shapes = {{"x", {6, 4, 5}}};
  for (const auto& options : {by_dim, by_input}) {
    onnx::ImportedModel m = onnx::import_onnx_bytes(bytes, ".", options, "dynamic");
    EXPECT_EQ(m.graph.type(m.graph.inputs[0].value).shape, (Shape{6, 4, 5}));
  }
#else
  GTEST_SKIP() << "no ONNX front end";
#endif
}

// PyTorch's exporter names Dropout's mask in training mode although nothing reads it
// (torchvision's MobileNetV2): an output nothing reads need not be made, one read is still
// refused.
TEST(OnnxImport, DropoutMaskNothingReadsIsNotNeeded) {
#ifdef KILN_HAVE_ONNX
  if (!onnx::onnx_available()) GTEST_SKIP() << "no ONNX front end";
  auto model_with = [](bool mask_is_output) {
    ::onnx::ModelProto model;
    model.set_ir_version(8);
    model.add_opset_import()->set_version(17);
    ::onnx::GraphProto* g = model.mutable_graph();
    g->set_name("dropout");
    auto typed = [](::onnx::ValueInfoProto* v, const char* name, int elem_type, std::vector<int64_t> dims) {
      v->set_name(name);
      auto* t = v->mutable_type()->mutable_tensor_type();
      t->set_elem_type(elem_type);
      auto* shape = t->mutable_shape();
      for (int64_t d : dims) shape->add_dim()->set_dim_value(d);
    };
    typed(g->add_input(), "x", ::onnx::TensorProto::FLOAT, {3, 4});
    auto constant = [&](const char* name, int elem_type, float value) {
      ::onnx::NodeProto* c = g->add_node();
      c->set_op_type("Constant");
      c->add_output(name);
      ::onnx::AttributeProto* a = c->add_attribute();
      a->set_name("value");
      a->set_type(::onnx::AttributeProto::TENSOR);
      ::onnx::TensorProto* t = a->mutable_t();
      t->set_data_type(elem_type);
      if (elem_type == ::onnx::TensorProto::FLOAT) t->add_float_data(value);
      else t->add_int32_data(static_cast<int32_t>(value));
    };
    constant("ratio", ::onnx::TensorProto::FLOAT, 0.25f);
    constant("training", ::onnx::TensorProto::BOOL, 1);
    ::onnx::NodeProto* n = g->add_node();
    n->set_op_type("Dropout");
    for (const char* in : {"x", "ratio", "training"}) n->add_input(in);
    n->add_output("y");
    n->add_output("mask");
    typed(g->add_output(), "y", ::onnx::TensorProto::FLOAT, {3, 4});
    if (mask_is_output) typed(g->add_output(), "mask", ::onnx::TensorProto::BOOL, {3, 4});
    return model.SerializeAsString();
  };
  onnx::ImportedModel m = onnx::import_onnx_bytes(model_with(false), ".", {}, "dropout");
  EXPECT_NE(print(m.graph).find("dropout("), std::string::npos) << print(m.graph);
  try {
    onnx::import_onnx_bytes(model_with(true), ".", {}, "dropout");
    FAIL() << "imported a training-mode Dropout's mask";
  } catch (const onnx::OnnxUnsupported& e) {
    EXPECT_NE(std::string(e.what()).find("the mask output in training mode"), std::string::npos) << e.what();
  }
#else
  GTEST_SKIP() << "no ONNX front end";
#endif
}

TEST(OnnxImport, UnsupportedOpIsOneLineNamingTheNodeAndOp) {
  const char* path = "/usr/share/libonnx-testdata/data/node/test_det_2d/model.onnx";
  if (!onnx::onnx_available() || !std::filesystem::exists(path)) GTEST_SKIP() << "no ONNX front end or test data";
  try {
    onnx::import_onnx(path);
    FAIL() << "Det imported";
  } catch (const onnx::OnnxUnsupported& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("(Det): op Det is not supported"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

#ifdef KILN_HAVE_ONNX
// A model whose loss is the sum of the rows of `table` (5, 3) (an initializer, so a param) at
// `ids` (i64 (4,), the data): Gather then ReduceSum, written by `producer`, the Gather's axis 0
// given as an attribute or left to its default.
std::string lookup_model(const std::string& producer, bool axis_given, const std::vector<float>& table) {
  ::onnx::ModelProto model;
  model.set_ir_version(8);
  model.set_producer_name(producer);
  model.add_opset_import()->set_version(17);
  ::onnx::GraphProto* g = model.mutable_graph();
  g->set_name("lookup");
  ::onnx::TensorProto* init = g->add_initializer();
  init->set_name("table");
  init->set_data_type(::onnx::TensorProto::FLOAT);
  init->add_dims(5);
  init->add_dims(3);
  for (float v : table) init->add_float_data(v);
  auto value_info = [](::onnx::ValueInfoProto* info, const char* name, int type, std::vector<int64_t> dims) {
    info->set_name(name);
    auto* tensor = info->mutable_type()->mutable_tensor_type();
    tensor->set_elem_type(type);
    auto* shape = tensor->mutable_shape();
    for (int64_t d : dims) shape->add_dim()->set_dim_value(d);
  };
  value_info(g->add_input(), "ids", ::onnx::TensorProto::INT64, {4});
  value_info(g->add_output(), "loss", ::onnx::TensorProto::FLOAT, {});
  ::onnx::NodeProto* gather = g->add_node();
  gather->set_op_type("Gather");
  gather->set_name("/embed/Gather");
  gather->add_input("table");
  gather->add_input("ids");
  gather->add_output("rows");
  if (axis_given) {
    ::onnx::AttributeProto* axis = gather->add_attribute();
    axis->set_name("axis");
    axis->set_type(::onnx::AttributeProto::INT);
    axis->set_i(0);
  }
  ::onnx::NodeProto* sum = g->add_node();
  sum->set_op_type("ReduceSum");
  sum->set_name("/ReduceSum");
  sum->add_input("rows");
  sum->add_output("loss");
  ::onnx::AttributeProto* keepdims = sum->add_attribute();
  keepdims->set_name("keepdims");
  keepdims->set_type(::onnx::AttributeProto::INT);
  keepdims->set_i(0);
  return model.SerializeAsString();
}
#endif

// ONNX counts a negative Gather index from the end; PyTorch's embedding (exported as a Gather
// without an axis attribute) refuses a negative id. From PyTorch such a lookup is a kiln::Error
// naming the id, and the step changes nothing (params, optimizer state, step count); ONNX's
// Gather (another producer, or PyTorch's indexing, which gives the axis) still wraps.
TEST(OnnxImport, TorchEmbeddingRefusesNegativeIdsWhereOnnxGatherCountsFromTheEnd) {
#ifdef KILN_HAVE_ONNX
  if (!onnx::onnx_available()) GTEST_SKIP() << "no ONNX front end";
  const Tensor table_values = rand(DType::kF32, {5, 3}, 71);
  std::vector<float> table(15);
  for (int i = 0; i < 15; ++i) table[i] = static_cast<float>(table_values.get(i));
  const Tensor ids = make(DType::kI64, {4}, {0, 4, -1, 2});
  for (const auto& [producer, axis_given, wraps] :
       {std::tuple{"pytorch", false, false}, std::tuple{"pytorch", true, true},
        std::tuple{"backend-test", false, true}}) {
    SCOPED_TRACE(fmt::format("producer {}, axis {}", producer, axis_given ? "given" : "default"));
    onnx::ImportedModel m = onnx::import_onnx_bytes(lookup_model(producer, axis_given, table), ".", {}, "lookup");
    ASSERT_EQ(m.initial_values.count("table"), 1u);
    train::Trainer trainer(m.graph, OptimizerConfig{}, {m.initial_values.at("table")});
    if (wraps) {
      // -1 is row 4: rows 0, 4, 4, 2.
      double want = 0;
      for (int row : {0, 4, 4, 2})
        for (int c = 0; c < 3; ++c) want += table[row * 3 + c];
      EXPECT_NEAR(trainer.step({ids})[0].get(0), want, 1e-5);
      continue;
    }
    const std::map<std::string, Tensor> before = trainer.named_tensors();
    std::map<std::string, Tensor> copies;
    for (const auto& [name, t] : before) copies[name] = t.clone();
    EXPECT_KILN_ERROR(trainer.step({ids}), "gather: index -1 (at position 2 of indices)", "expected 0..4");
    EXPECT_KILN_ERROR(trainer.step({make(DType::kI64, {4}, {0, 5, 1, 2})}), "gather: index 5 ", "expected 0..4");
    EXPECT_EQ(trainer.steps_done(), 0);
    for (const auto& [name, t] : trainer.named_tensors())
      EXPECT_TRUE(all_close(t, copies.at(name), 0, 0)) << name << " changed";
    // In range, the same step trains.
    EXPECT_NO_THROW(trainer.step({make(DType::kI64, {4}, {0, 4, 3, 2})}));
    EXPECT_EQ(trainer.steps_done(), 1);
  }
#else
  GTEST_SKIP() << "no ONNX front end";
#endif
}

}  // namespace
}  // namespace kiln::testing

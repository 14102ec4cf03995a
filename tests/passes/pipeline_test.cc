// The pipeline's list and the passes by name (make_pass, what `kiln opt` runs): every pass the
// pipeline can hold is made by its name, names are unique, an unknown name lists the known ones,
// and a pass made by name takes its settings from PassOptions.
#include "passes/pipeline.h"

#include <gtest/gtest.h>

#include <set>

#include "ir/text.h"
#include "test_util.h"

namespace kiln {
namespace {

TEST(Pipeline, EveryPipelinePassIsMadeByItsName) {
  PassOptions options;
  options.memory_budget = size_t{1} << 30;  // remat joins the pipeline
  for (Device target : {Device::kCpu, Device::kCuda}) {
    options.target = target;
    for (const std::string& name : default_pipeline(options).names()) EXPECT_EQ(make_pass(name)->name(), name);
  }
}

TEST(Pipeline, PassNamesAreUniqueAndKebabCase) {
  const std::vector<std::string> names = pass_names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size());
  // The passes on the forward graph come first: recognize and align-matmul, then mixed precision.
  ASSERT_GE(names.size(), 3u);
  EXPECT_EQ(names[0], "recognize");
  EXPECT_EQ(names[1], "align-matmul");
  EXPECT_EQ(names[2], "mixed-precision");
  for (const std::string& name : names)
    for (char c : name) EXPECT_TRUE((c >= 'a' && c <= 'z') || c == '-') << name;
}

TEST(Pipeline, UnknownPassNameListsTheKnownOnes) {
  const std::string message = testing::error_of([] { make_pass("no-such-pass"); });
  EXPECT_NE(message.find("unknown pass 'no-such-pass'"), std::string::npos) << message;
  for (const std::string& name : pass_names()) EXPECT_NE(message.find(name), std::string::npos) << name;
}

TEST(Pipeline, PassesMadeByNameTakeTheirSettings) {
  const std::string text =
      "graph @g(%x: f32[4,8] data, %w: f32[8,8] param) {\n"
      "  %0 = matmul(%x, %w) : f32[4,8]\n"
      "  return %0\n"
      "}\n";
  for (DType low : {DType::kBF16, DType::kF16}) {
    PassOptions options;
    options.low_precision = low;
    Graph g = parse(text);
    EXPECT_TRUE(make_pass("mixed-precision", options)->run(g));
    // The product runs in the 16-bit dtype asked for.
    const std::string product = fmt::format(") : {}[4,8]", dtype_name(low));
    const std::string printed = print(g);
    const size_t matmul = printed.find("matmul(");
    ASSERT_NE(matmul, std::string::npos) << printed;
    EXPECT_EQ(printed.substr(printed.find(')', matmul), product.size()), product) << printed;
  }
}

TEST(Pipeline, DisablingAllSkipsEveryPass) {
  PassOptions options;
  options.disabled = {"all"};
  Graph g = parse(
      "graph @g(%x: f32[4] data) {\n"
      "  %0 = exp(%x) : f32[4]\n"
      "  %1 = exp(%x) : f32[4]\n"
      "  %2 = add(%0, %1) : f32[4]\n"
      "  return %2\n"
      "}\n");
  const std::string before = print(g);
  for (const PassRecord& r : default_pipeline(options).run(g)) EXPECT_FALSE(r.ran) << r.name;
  EXPECT_EQ(print(g), before);
}

}  // namespace
}  // namespace kiln

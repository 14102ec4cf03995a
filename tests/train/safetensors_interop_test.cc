// Interop with Hugging Face's safetensors (Python package): a file kiln writes must load there
// with the same dtypes, shapes, values and metadata, and a file it writes must load here. The
// Python side is tests/train/check_safetensors.py; both sides describe the expected contents
// in a small text file (format in that script's docstring). Skipped, with the pip command,
// when python3 cannot import safetensors and numpy.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "train/checkpoint/safetensors.h"
#include "train/temp_dir.h"

namespace kiln::train {
namespace {

using kiln::testing::read_bytes;
using kiln::testing::TempDir;

const std::string kScript = std::string(KILN_SOURCE_DIR) + "/tests/train/check_safetensors.py";

bool python_has_safetensors() {
  return std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") == 0;
}

// Runs the script; returns its exit status and puts its output in `log`.
int run_script(const std::string& mode, const std::string& file, const std::string& expected,
               const TempDir& dir, std::string* log) {
  std::string log_path = dir.file("python.log");
  std::string command = "python3 '" + kScript + "' " + mode + " '" + file + "' '" + expected +
                        "' > '" + log_path + "' 2>&1";
  int status = std::system(command.c_str());
  *log = read_bytes(log_path);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// One element as the side file writes it: exact decimal for floats, integers as integers.
std::string value_text(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kI64:
      return std::to_string(t.data<int64_t>()[i]);
    case DType::kI32:
      return std::to_string(t.data<int32_t>()[i]);
    case DType::kU8:
      return std::to_string(t.data<uint8_t>()[i]);
    case DType::kBool:
      return t.data<bool>()[i] ? "1" : "0";
    default:
      return fmt::format("{}", t.get(i));  // shortest text that reads back exactly
  }
}

#define SKIP_WITHOUT_PYTHON_SAFETENSORS()                                              \
  if (!python_has_safetensors()) {                                                     \
    GTEST_SKIP() << "python3 cannot import safetensors and numpy; install them with: " \
                    "pip install safetensors numpy";                                   \
  }

TEST(TrainSafetensorsInterop, KilnFileLoadsInHuggingFaceSafetensors) {
  SKIP_WITHOUT_PYTHON_SAFETENSORS();
  TempDir dir;
  std::map<std::string, Tensor> tensors = {
      {"layer.0.weight", random_tensor(TensorType{DType::kF32, {3, 4}}, 1)},
      {"layer.0.bias", random_tensor(TensorType{DType::kF64, {4}}, 2, -1e5, 1e5)},
      {"half", random_tensor(TensorType{DType::kF16, {2, 3}}, 3, -60000, 60000)},
      {"brain", random_tensor(TensorType{DType::kBF16, {5}}, 4, -1e30, 1e30)},
      {"counts", random_tensor(TensorType{DType::kI32, {2, 2}}, 5, -2e9, 2e9)},
      {"step", Tensor(TensorType{DType::kI64, {3}})},
      {"mask", random_tensor(TensorType{DType::kBool, {6}}, 6)},
      {"pixels", random_tensor(TensorType{DType::kU8, {2, 1, 2}}, 7, 1, 255)},
      {"scalar", random_tensor(TensorType{DType::kF32, {}}, 8)},
      {"empty", Tensor(TensorType{DType::kF32, {0, 3}})}};
  // Beyond 2^53, where a trip through double would show: must stay exact as int64.
  int64_t* step = tensors["step"].data<int64_t>();
  step[0] = (int64_t(1) << 62) + 1;
  step[1] = -(int64_t(1) << 40) - 3;
  step[2] = 7;
  std::map<std::string, std::string> metadata = {{"format", "kiln"}, {"epoch", "3"}};
  std::string file = dir.file("kiln.safetensors");
  save_safetensors(file, tensors, metadata);

  std::ofstream expected(dir.file("expected.txt"));
  for (const auto& [key, value] : metadata) expected << "meta " << key << " " << value << "\n";
  for (const auto& [name, t] : tensors) {
    expected << "tensor " << name << " " << safetensors_dtype_name(t.dtype()) << " " << t.rank();
    for (int64_t d : t.shape()) expected << " " << d;
    for (int64_t i = 0; i < t.numel(); ++i) expected << " " << value_text(t, i);
    expected << "\n";
  }
  expected.close();

  std::string log;
  EXPECT_EQ(run_script("check", file, dir.file("expected.txt"), dir, &log), 0) << log;
  EXPECT_NE(log.find("checked 10 tensors: OK"), std::string::npos) << log;

  // The check is not vacuous: one wrong value (step[2] 7 -> 8) makes it fail.
  std::string text = read_bytes(dir.file("expected.txt"));
  size_t at = text.find(" -1099511627779 7\n");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 18, " -1099511627779 8\n");
  kiln::testing::write_bytes(dir.file("wrong.txt"), text);
  EXPECT_EQ(run_script("check", file, dir.file("wrong.txt"), dir, &log), 1) << log;
  EXPECT_NE(log.find("step: values"), std::string::npos) << log;
}

// Loads `file` with kiln and compares it with the side file the script wrote.
void expect_matches_side_file(const std::string& file, const std::string& expected_path) {
  SafetensorsFile loaded = load_safetensors(file);
  std::ifstream in(expected_path);
  ASSERT_TRUE(in.good()) << expected_path;
  std::map<std::string, std::string> metadata;
  size_t count = 0;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string kind, name;
    fields >> kind >> name;
    if (kind == "meta") {
      std::string value;
      fields >> value;
      metadata[name] = value;
      continue;
    }
    ++count;
    std::string dtype;
    int rank;
    fields >> dtype >> rank;
    Shape shape(rank);
    for (int64_t& d : shape) fields >> d;
    ASSERT_TRUE(loaded.tensors.count(name)) << name;
    const Tensor& t = loaded.tensors.at(name);
    EXPECT_EQ(safetensors_dtype_name(t.dtype()), dtype) << name;
    ASSERT_EQ(t.shape(), shape) << name;
    for (int64_t i = 0; i < t.numel(); ++i) {
      std::string text;
      fields >> text;
      if (is_float(t.dtype()))
        EXPECT_EQ(t.get(i), std::strtod(text.c_str(), nullptr)) << name << "[" << i << "]";
      else
        EXPECT_EQ(value_text(t, i), text) << name << "[" << i << "]";
    }
  }
  EXPECT_EQ(loaded.tensors.size(), count);
  if (!metadata.empty()) {
    EXPECT_EQ(loaded.metadata, metadata);
  }
}

TEST(TrainSafetensorsInterop, HuggingFaceFileLoadsInKiln) {
  SKIP_WITHOUT_PYTHON_SAFETENSORS();
  TempDir dir;
  std::string file = dir.file("hf.safetensors");
  std::string log;
  ASSERT_EQ(run_script("write", file, dir.file("expected.txt"), dir, &log), 0) << log;
  expect_matches_side_file(file, dir.file("expected.txt"));
  SafetensorsFile loaded = load_safetensors(file);
  EXPECT_EQ(loaded.metadata.at("producer"), "safetensors-python");
  EXPECT_EQ(loaded.tensors.at("i64").data<int64_t>()[0], (int64_t(1) << 62) + 1);
  EXPECT_EQ(loaded.tensors.at("empty").shape(), (Shape{0, 3}));
  // BF16 needs safetensors' TensorSpec API (0.6+); older versions write no .bf16 file.
  if (std::filesystem::exists(file + ".bf16"))
    expect_matches_side_file(file + ".bf16", dir.file("expected.txt.bf16"));
  else
    std::cout << "note: this safetensors has no TensorSpec; the BF16 direction was not checked\n";
}

}  // namespace
}  // namespace kiln::train

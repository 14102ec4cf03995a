// ONNX's node conformance tests (Debian's libonnx-testdata: one folder per case with model.onnx
// and test_data_set_0/{input,output}_N.pb), imported and run forward on the CPU through
// compile_step, outputs compared with the expected ones. ONE test over every case (CI runs it
// as one ctest): it fails when fewer than kPassFloor cases pass, and on every case that neither
// passes nor stops at a clear OnnxUnsupported (an op, attribute or dtype kiln does not have),
// unless tests/frontend/onnx_conformance_expected.txt lists it with why. So a wrong number or an
// unexpected error is a failure, never a silent skip. The outcome of each case is written to
// onnx_conformance.txt in the build folder (what docs/onnx.md's lists come from).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "compile/compile_step.h"
#include "frontend/onnx/onnx_import.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;

constexpr const char* kNodeTests = "/usr/share/libonnx-testdata/data/node";
constexpr int kPassFloor = 654;  // what passes now: a lower count is a regression

enum class Outcome { kPass, kUnsupported, kError, kMismatch };

struct CaseResult {
  Outcome outcome;
  std::string reason;  // one line
};

// input_N.pb / output_N.pb of a test data set, in N order.
std::vector<std::pair<std::string, Tensor>> load_tensors(const fs::path& dir, const std::string& prefix) {
  std::vector<std::pair<int, fs::path>> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix + "_", 0) == 0 && entry.path().extension() == ".pb")
      files.push_back({std::stoi(name.substr(prefix.size() + 1)), entry.path()});
  }
  std::sort(files.begin(), files.end());
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [index, path] : files) out.push_back(onnx::load_onnx_tensor(path.string()));
  return out;
}

bool close(double got, double want, double rtol, double atol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::abs(got - want) <= atol + rtol * std::abs(want);
}

std::string compare(const Tensor& got, const Tensor& want, size_t index) {
  if (got.dtype() != want.dtype())
    return fmt::format("output {} is {}, expected {}", index, to_string(got.type()), to_string(want.type()));
  if (got.shape() != want.shape())
    return fmt::format("output {} has shape {}, expected {}", index, to_string(got.shape()), to_string(want.shape()));
  const bool half = got.dtype() == DType::kF16 || got.dtype() == DType::kBF16;
  const double rtol = is_float(got.dtype()) ? (half ? 1e-2 : 1e-3) : 0, atol = is_float(got.dtype()) ? (half ? 1e-3 : 1e-5) : 0;
  for (int64_t i = 0; i < got.numel(); ++i)
    if (!close(got.get(i), want.get(i), rtol, atol))
      return fmt::format("output {} element {} is {}, expected {}", index, i, got.get(i), want.get(i));
  return "";
}

CaseResult run_case(const fs::path& dir) {
  try {
    const fs::path data = dir / "test_data_set_0";
    std::vector<std::pair<std::string, Tensor>> inputs, expected;
    std::string load_error;
    try {
      inputs = load_tensors(data, "input");
      expected = load_tensors(data, "output");
    } catch (const Error& e) {
      load_error = e.what();
    }
    onnx::ImportOptions options;
    for (const auto& [name, t] : inputs) options.shapes[name] = t.shape();
    onnx::ImportedModel model;
    try {
      model = onnx::import_onnx((dir / "model.onnx").string(), options);
    } catch (const onnx::OnnxUnsupported& e) {
      // A shape, axes or count given as an input: kiln needs it at import, as the given values
      // of the integer inputs.
      if (std::string(e.what()).find("known at import") == std::string::npos) throw;
      for (const auto& [name, t] : inputs)
        if (is_integer(t.dtype())) options.input_values[name] = t;
      model = onnx::import_onnx((dir / "model.onnx").string(), options);
    }
    if (!load_error.empty()) return {Outcome::kUnsupported, load_error};
    std::map<std::string, Tensor> by_name(inputs.begin(), inputs.end());
    std::vector<Tensor> bound;
    size_t next_data = 0;
    for (const GraphInput& in : model.graph.inputs) {
      const std::string& name = model.graph.value(in.value).name;
      if (in.role != Role::kData) {
        bound.push_back(model.initial_values.at(name));
        continue;
      }
      const auto renamed = model.onnx_names.find(name);
      const std::string onnx_name = renamed == model.onnx_names.end() ? name : renamed->second;
      auto it = by_name.find(onnx_name);
      const Tensor& t = it != by_name.end() ? it->second : inputs.at(next_data).second;
      ++next_data;
      if (t.type() != model.graph.type(in.value))
        return {Outcome::kError, fmt::format("input '{}' is {}, the graph wants {}", name, to_string(t.type()),
                                             to_string(model.graph.type(in.value)))};
      bound.push_back(t);
    }
    CompileOptions compile;
    compile.kind = StepKind::kForward;
    const CompiledStep step = compile_step(model.graph, compile);
    const std::vector<Tensor> outputs = step.executor->run(bound);
    if (outputs.size() != expected.size())
      return {Outcome::kMismatch, fmt::format("{} outputs, expected {}", outputs.size(), expected.size())};
    for (size_t i = 0; i < outputs.size(); ++i) {
      const std::string problem = compare(outputs[i], expected[i].second, i);
      if (!problem.empty()) return {Outcome::kMismatch, problem};
    }
    return {Outcome::kPass, ""};
  } catch (const onnx::OnnxUnsupported& e) {
    return {Outcome::kUnsupported, e.what()};
  } catch (const std::exception& e) {
    return {Outcome::kError, e.what()};
  }
}

// tests/frontend/onnx_conformance_expected.txt: "case: why" per line, # comments.
std::map<std::string, std::string> expected_failures() {
  std::ifstream in(std::string(KILN_SOURCE_DIR) + "/tests/frontend/onnx_conformance_expected.txt");
  std::map<std::string, std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t colon = line.find(':');
    out[line.substr(0, colon)] = colon == std::string::npos ? "" : line.substr(colon + 1);
  }
  return out;
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

TEST(OnnxConformance, NodeTestsPassOrSayWhy) {
  if (!onnx::onnx_available()) GTEST_SKIP() << "kiln is built without the ONNX front end (libonnx-dev)";
  if (!fs::is_directory(kNodeTests)) GTEST_SKIP() << kNodeTests << " is missing (Debian's libonnx-testdata)";
  std::vector<fs::path> cases;
  for (const auto& entry : fs::directory_iterator(kNodeTests))
    if (entry.is_directory()) cases.push_back(entry.path());
  std::sort(cases.begin(), cases.end());
  const std::map<std::string, std::string> allowed = expected_failures();
  std::ofstream report(std::string(KILN_BINARY_DIR) + "/onnx_conformance.txt");
  std::map<Outcome, int> counts;
  for (const fs::path& dir : cases) {
    const std::string name = dir.filename().string();
    const CaseResult r = run_case(dir);
    ++counts[r.outcome];
    const char* word = r.outcome == Outcome::kPass          ? "pass"
                       : r.outcome == Outcome::kUnsupported ? "unsupported"
                       : r.outcome == Outcome::kError       ? "error"
                                                            : "mismatch";
    report << name << " " << word << (r.reason.empty() ? "" : " " + one_line(r.reason)) << "\n";
    if (r.outcome == Outcome::kError || r.outcome == Outcome::kMismatch) {
      EXPECT_TRUE(allowed.count(name)) << name << ": " << word << ": " << one_line(r.reason);
    }
  }
  const int passed = counts[Outcome::kPass];
  std::printf("ONNX node tests: %d of %zu pass, %d unsupported, %d errors, %d mismatches (expected: %zu listed)\n",
              passed, cases.size(), counts[Outcome::kUnsupported], counts[Outcome::kError], counts[Outcome::kMismatch],
              allowed.size());
  EXPECT_GE(passed, kPassFloor);
}

}  // namespace
}  // namespace kiln::testing

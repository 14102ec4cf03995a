#include "frontend/onnx_node_tests.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "compile/compile_step.h"
#include "device/device_runtime.h"
#include "frontend/onnx/onnx_import.h"

namespace kiln::testing {

namespace fs = std::filesystem;

namespace {

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

// The input an "its scales (input 2 'scales') ... kiln needs it known at import" error names.
std::string input_needed_at_import(const std::string& message) {
  if (message.find("known at import") == std::string::npos) return "";
  const size_t input = message.find("(input ");
  const size_t open = input == std::string::npos ? input : message.find('\'', input);
  const size_t close = open == std::string::npos ? open : message.find('\'', open + 1);
  return close == std::string::npos ? "" : message.substr(open + 1, close - open - 1);
}

}  // namespace

std::vector<fs::path> onnx_node_test_cases(std::string* where) {
  const char* env = std::getenv("KILN_ONNX_NODE_TESTS");
  const fs::path root = env && *env ? env : "/usr/share/libonnx-testdata/data/node";
  if (where) *where = root.string();
  std::vector<fs::path> cases;
  if (!fs::is_directory(root)) return cases;
  for (const auto& entry : fs::directory_iterator(root))
    if (entry.is_directory()) cases.push_back(entry.path());
  std::sort(cases.begin(), cases.end());
  return cases;
}

NodeTestResult run_onnx_node_test(const fs::path& dir, Device device) {
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
      // of the integer inputs; then of each other input the error names (Resize's scales).
      if (std::string(e.what()).find("known at import") == std::string::npos) throw;
      for (const auto& [name, t] : inputs)
        if (is_integer(t.dtype())) options.input_values[name] = t;
      for (;;) {
        try {
          model = onnx::import_onnx((dir / "model.onnx").string(), options);
          break;
        } catch (const onnx::OnnxUnsupported& again) {
          const std::string name = input_needed_at_import(again.what());
          auto given = std::find_if(inputs.begin(), inputs.end(), [&](const auto& in) { return in.first == name; });
          if (given == inputs.end() || options.input_values.count(name)) throw;
          options.input_values[name] = given->second;
        }
      }
    }
    if (!load_error.empty()) return {NodeTestOutcome::kUnsupported, load_error};
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
        return {NodeTestOutcome::kError, fmt::format("input '{}' is {}, the graph wants {}", name, to_string(t.type()),
                                             to_string(model.graph.type(in.value)))};
      bound.push_back(t);
    }
    CompileOptions compile;
    compile.kind = StepKind::kForward;
    compile.executor.device = device;
    const CompiledStep step = compile_step(model.graph, compile);
    const DeviceRuntime& runtime = step.executor->runtime();
    if (device != Device::kCpu)
      for (Tensor& t : bound) t = runtime.to_device(t);
    std::vector<Tensor> outputs = step.executor->run(bound);
    if (device != Device::kCpu)
      for (Tensor& t : outputs) t = runtime.to_host(t);
    if (outputs.size() != expected.size())
      return {NodeTestOutcome::kMismatch, fmt::format("{} outputs, expected {}", outputs.size(), expected.size())};
    for (size_t i = 0; i < outputs.size(); ++i) {
      const std::string problem = compare(outputs[i], expected[i].second, i);
      if (!problem.empty()) return {NodeTestOutcome::kMismatch, problem};
    }
    return {NodeTestOutcome::kPass, ""};
  } catch (const onnx::OnnxUnsupported& e) {
    return {NodeTestOutcome::kUnsupported, e.what()};
  } catch (const std::exception& e) {
    return {NodeTestOutcome::kError, e.what()};
  }
}

const char* outcome_word(NodeTestOutcome outcome) {
  switch (outcome) {
    case NodeTestOutcome::kPass: return "pass";
    case NodeTestOutcome::kUnsupported: return "unsupported";
    case NodeTestOutcome::kError: return "error";
    case NodeTestOutcome::kMismatch: return "mismatch";
  }
  return "?";
}

// tests/frontend/onnx_conformance_expected.txt: "case: why" per line, # comments.
std::map<std::string, std::string> onnx_expected_failures() {
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

}  // namespace kiln::testing

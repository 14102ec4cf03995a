// ONNX's node conformance tests (Debian's libonnx-testdata: one folder per case with model.onnx
// and test_data_set_0/{input,output}_N.pb), imported and run forward through compile_step on a
// device, outputs compared with the expected ones. Shared by the CPU suite's
// OnnxConformance (tests/frontend/onnx_conformance_test.cc) and the GPU suite's
// (tests/cuda/onnx_conformance_test.cc).
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace kiln::testing {

enum class NodeTestOutcome { kPass, kUnsupported, kError, kMismatch };

struct NodeTestResult {
  NodeTestOutcome outcome;
  std::string reason;  // one line
};

// The case folders, sorted: under $KILN_ONNX_NODE_TESTS, else Debian's
// /usr/share/libonnx-testdata/data/node; empty when neither exists (`where` names the folder).
std::vector<std::filesystem::path> onnx_node_test_cases(std::string* where = nullptr);

// Imports the case, runs it forward on `device` (inputs uploaded, outputs read back) and
// compares with the expected outputs (relative 1e-3, f16/bf16 1e-2). Never throws: an
// OnnxUnsupported error is kUnsupported, any other error kError.
NodeTestResult run_onnx_node_test(const std::filesystem::path& dir, Device device);

// "pass", "unsupported", "error", "mismatch".
const char* outcome_word(NodeTestOutcome outcome);

// tests/frontend/onnx_conformance_expected.txt: case -> why, for the cases allowed to err or
// mismatch on the CPU.
std::map<std::string, std::string> onnx_expected_failures();

}  // namespace kiln::testing

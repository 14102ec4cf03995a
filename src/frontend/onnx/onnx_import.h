// The ONNX front end: an ONNX model file to a kiln forward Graph plus the initial values of its
// params and state. Built only where CMake finds Debian's libonnx-dev and libprotobuf-dev
// (onnx_available() says so; without them every function here throws kiln::Error saying the
// front end is not built).
//
//   ImportedModel m = import_onnx("model.onnx", {.shapes = {{"x", {8, 3, 32, 32}}}});
//   CompiledStep step = compile_step(m.graph, options);   // bind m.initial_values by name
//
// What the importer does (docs/onnx.md has the user's view):
// - Reads the ModelProto with the ONNX library's own protobuf classes (external data files
//   beside the model included) and converts each node with a per-op rule (frontend/onnx/ops_*.cc)
//   that knows the opset differences of opsets 1 to 21 it supports (attributes that became
//   inputs, changed defaults).
// - Shapes are static in kiln: graph inputs' dynamic dims come from `shapes`; every value whose
//   inputs are all known at import (Shape, ConstantOfShape, Range, their arithmetic, constant-only
//   subgraphs) is computed right away with the ops' reference kernels, so Reshape's shape or
//   Expand's shape are plain numbers by the time they are needed.
// - Initializers: float ones become params (trainable) unless frozen (`freeze`: glob patterns,
//   they become constants) or state (BatchNormalization's running mean and variance: state
//   inputs, whose new values in training mode are Graph::updates); integer ones become constants.
// - Anything kiln cannot express is one OnnxUnsupported error naming the node and the op or
//   attribute; a file that is not a valid model is one kiln::Error.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "support/error.h"
#include "tensor/tensor.h"

namespace kiln::onnx {

// An ONNX construct kiln does not support (an op, an attribute value, a dtype): the model is
// valid, kiln cannot run it. Its message is one line naming the node, its op and what is missing.
class OnnxUnsupported : public Error {
 public:
  using Error::Error;
};

struct ImportOptions {
  // Sizes of dynamic dims: a graph input's name with its full shape ("x" -> {8, 3, 32, 32}), or
  // a symbolic dim's name with its size ("batch" -> {8}).
  std::map<std::string, Shape> shapes;
  // Glob patterns (* and ?) of float initializers kept fixed: constants, not params.
  std::vector<std::string> freeze;
  // Graph inputs whose values are given at import (by ONNX name): constants of the graph, not
  // inputs. For a model that takes a shape, axes or a count as an input, which kiln's static
  // shapes need known.
  std::map<std::string, Tensor> input_values;
  // A model that returns logits rather than its loss: loss "cross_entropy" makes the first
  // output, logits (..., V), the mean cross-entropy against the graph input `labels` (..., ) of
  // i64 (the model's own input of that name, else a new data input), and the logits the second
  // output. "" keeps the outputs as they are (the model returns its loss first).
  std::string loss;
  std::string labels = "labels";
};

struct ImportedModel {
  Graph graph;  // the forward graph: inputs are data (the ONNX graph's inputs), params, state
  // Initial values of the params and state inputs, by their graph input's name.
  std::map<std::string, Tensor> initial_values;
  // The ONNX names of the graph's inputs and outputs where kiln had to change them (kiln names
  // are made of [A-Za-z0-9_.-]): kiln name -> ONNX name.
  std::map<std::string, std::string> onnx_names;
  int64_t opset = 0;  // of the default domain
};

// True when this kiln was built with the ONNX front end.
bool onnx_available();

// Throws OnnxUnsupported (what kiln cannot run) or kiln::Error (a missing, truncated or invalid
// file, a dynamic dim without a size).
ImportedModel import_onnx(const std::string& path, const ImportOptions& options = {});
// The same from the model's bytes; external data is looked for in `base_dir`.
ImportedModel import_onnx_bytes(const std::string& bytes, const std::string& base_dir,
                                const ImportOptions& options = {}, const std::string& source = "<bytes>");

// A serialized onnx.TensorProto file (the conformance tests' test_data_set_*/input_0.pb): its
// name and value.
std::pair<std::string, Tensor> load_onnx_tensor(const std::string& path);

// The kiln name for an ONNX name: characters outside [A-Za-z0-9_.-] become '_'.
std::string kiln_name(const std::string& onnx_name);

}  // namespace kiln::onnx

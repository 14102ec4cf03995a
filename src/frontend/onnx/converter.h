// Internal to the ONNX front end: what a per-op conversion rule sees (NodeContext) and the table
// of rules, filled by the ops_*.cc files. A rule reads the node's inputs (kiln Exprs, or their
// values where they are known at import) and attributes, appends kiln nodes with the builder,
// and returns one Expr per ONNX output (an empty Expr for an output it does not produce).
//
// A rule must read every attribute it honours: an attribute present on the node that the rule
// never read is reported as unsupported after the rule ran, so no attribute is ignored silently.
#pragma once

#include <onnx/onnx_pb.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "frontend/onnx/onnx_import.h"
#include "ir/builder.h"

namespace kiln::onnx {

class Importer;  // importer.cc

// A kiln dtype for an ONNX TensorProto.DataType; OnnxUnsupported (naming `what`) for the
// others (int8, uint16, strings, complex, ...).
DType dtype_of(int onnx_type, const std::string& what);
// An ONNX TensorProto as a host tensor; external data is read from `base_dir`.
Tensor tensor_of(const ::onnx::TensorProto& proto, const std::string& base_dir, const std::string& what);

class NodeContext {
 public:
  NodeContext(Importer& importer, const ::onnx::NodeProto& node, int64_t opset);

  Builder& b() const;
  int64_t opset() const { return opset_; }
  const ::onnx::NodeProto& node() const { return node_; }
  // "node 'Conv_3' (Conv)", for messages.
  std::string where() const;

  // ---- inputs: i-th of the node's inputs; an empty name is an omitted optional input.
  int num_inputs() const { return node_.input_size(); }
  bool has_input(int i) const { return i < node_.input_size() && !node_.input(i).empty(); }
  Expr in(int i) const;
  // The input's value where it is known at import (constants, shapes, folded subgraphs).
  std::optional<Tensor> known(int i) const;
  std::optional<Tensor> known(const Expr& e) const;
  // The known value, or OnnxUnsupported naming `what` ("shape") when it depends on the model's
  // inputs or params.
  Tensor constant(int i, const std::string& what) const;
  // Integer inputs read exactly (int64, never through double); ints refuses a float input.
  std::vector<int64_t> ints(int i, const std::string& what) const;
  int64_t int_scalar(int i, const std::string& what) const;
  double scalar(int i, const std::string& what) const;

  // ---- attributes (each read marks the attribute as honoured).
  bool has_attr(const std::string& name) const;
  int64_t attr_int(const std::string& name, int64_t fallback) const;
  double attr_float(const std::string& name, double fallback) const;
  std::string attr_string(const std::string& name, const std::string& fallback) const;
  std::vector<int64_t> attr_ints(const std::string& name, std::vector<int64_t> fallback = {}) const;
  std::vector<double> attr_floats(const std::string& name, std::vector<double> fallback = {}) const;
  Tensor attr_tensor(const std::string& name) const;
  // Marks the attribute as read without using it (it changes nothing kiln computes).
  void ignore_attr(const std::string& name) const;
  // Attribute names present on the node that no rule read.
  std::vector<std::string> unread_attributes() const;

  // ---- outputs
  int num_outputs() const { return node_.output_size(); }
  bool wants_output(int i) const { return i < node_.output_size() && !node_.output(i).empty(); }

  // One-line errors that name the node.
  template <typename... Args>
  [[noreturn]] void unsupported(fmt::format_string<Args...> format, Args&&... args) const {
    throw OnnxUnsupported(where() + ": " + fmt::format(format, std::forward<Args>(args)...));
  }
  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) const {
    throw Error(where() + ": " + fmt::format(format, std::forward<Args>(args)...));
  }

  // The importer's hook for state updates (BatchNormalization's running statistics): after a
  // step, graph input `target` takes `value` (only where `target` is a state input).
  void add_update(const Expr& target, const Expr& value) const;
  bool is_state_input(const Expr& e) const;
  // Whether the model comes from PyTorch's exporter (ModelProto.producer_name "pytorch"):
  // BatchNormalization then updates its running variance with the unbiased batch variance, as
  // torch does, where the ONNX reference uses the biased one.
  bool from_pytorch() const;

 private:
  const ::onnx::AttributeProto* attr(const std::string& name) const;

  Importer& importer_;
  const ::onnx::NodeProto& node_;
  int64_t opset_;
  mutable std::vector<std::string> read_;
};

using Rule = std::function<std::vector<Expr>(NodeContext&)>;
using RuleTable = std::map<std::string, Rule>;

// The rule families, one file each.
void add_elementwise_rules(RuleTable& rules);  // ops_elementwise.cc: math, comparisons, logic, casts
void add_tensor_rules(RuleTable& rules);       // ops_tensor.cc: shapes, indexing, constants, reductions
void add_nn_rules(RuleTable& rules);           // ops_nn.cc: matmul, conv, pooling, norms, losses

// Helpers the rule files share (importer.cc).
// A scalar of `like`'s dtype.
Expr scalar_like(const Expr& like, double value);
// x with every float-and-integer element type promoted the kiln way: casts `e` to `dtype` when
// they differ.
Expr cast_to(const Expr& e, DType dtype);
// x padded along `axis` by `before` and `after` elements (negative: cropped); mode "constant"
// (with `value`, a scalar of x's dtype), "edge" or "reflect" (ops_tensor.cc).
Expr pad_axis(Builder& b, Expr x, int64_t axis, int64_t before, int64_t after, const std::string& mode,
              const Expr& value);
// A constant tensor node holding `t`.
Expr constant_of(Builder& b, const Tensor& t);

}  // namespace kiln::onnx

#include "passes/mixed_precision.h"

#include <map>
#include <optional>
#include <set>
#include <utility>

#include "support/error.h"

namespace kiln {
namespace {

bool is_half(DType d) { return d == DType::kF16 || d == DType::kBF16; }

// Numpy/torch promotion between float dtypes: the wider one; f16 with bf16 gives f32 (neither
// holds the other's values).
DType promote(DType a, DType b) {
  if (a == b) return a;
  if (is_half(a) && is_half(b)) return DType::kF32;
  return dtype_size(a) >= dtype_size(b) ? a : b;
}

// Rebuilds a graph node by node into `out`, inserting casts.
class Rewriter {
 public:
  Rewriter(const Graph& in, const MixedPrecisionOptions& options) : in_(in), options_(options) {
    for (const Value& v : in.values)
      if (!v.name.empty()) original_names_.insert(v.name);
    out_.name = in.name;
    map_.assign(in.values.size(), -1);
  }

  // Returns true when some cast was inserted (otherwise `out` equals the input graph).
  bool rewrite() {
    for (const GraphInput& input : in_.inputs) {
      const Value& v = in_.value(input.value);
      map_[input.value] = out_.add_input(v.name, v.type, input.role);
      used_names_.insert(v.name);
    }
    for (const Node& node : in_.nodes) rewrite_node(node);
    // Outputs and updates keep their original types: callers see the same interface.
    for (ValueId id : in_.outputs) out_.outputs.push_back(restore_type(id));
    for (const Update& u : in_.updates)
      out_.updates.push_back(Update{map_[u.target], restore_type(u.value)});
    return changed_;
  }

  Graph take() { return std::move(out_); }

 private:
  Precision precision_of(Op op) const {
    auto it = options_.policy.find(op);
    return it == options_.policy.end() ? Precision::kFollow : it->second;
  }

  void rewrite_node(const Node& node) {
    std::vector<ValueId> inputs;
    for (ValueId id : node.inputs) inputs.push_back(map_[id]);
    // The dtype every float input is brought to; unset when the node has no float input.
    std::optional<DType> target;
    const Precision precision = precision_of(node.op);
    for (ValueId id : inputs) {
      DType d = out_.type(id).dtype;
      if (!is_float(d)) continue;
      if (precision == Precision::kLow)
        d = options_.low;
      else if (precision == Precision::kF32 && is_half(d))
        d = DType::kF32;
      target = target ? promote(*target, d) : d;
    }
    if (precision == Precision::kFollow && is_linear_bias(node, inputs)) target = options_.low;
    if (target) {
      for (ValueId& id : inputs)
        if (is_float(out_.type(id).dtype)) id = cast_to(id, *target);
    }
    std::vector<ValueId> outputs = out_.add_node(node.op, inputs, node.attrs);
    if (precision == Precision::kLow)
      for (ValueId id : outputs) low_results_[id] = node.op;
    for (size_t i = 0; i < outputs.size(); ++i) {
      map_[node.outputs[i]] = outputs[i];
      name_value(outputs[i], in_.value(node.outputs[i]).name);
    }
  }

  // add(matmul(x, w), b) with a 1-D float b: a linear layer's bias. It runs in the low dtype, as
  // under torch.autocast (where the bias rides in the GEMM), so what follows (attention's split,
  // gelu) stays 16-bit instead of making an f32 round trip, and the bias can ride in the GEMM's
  // epilogue (cuBLASLt BIAS / GELU_AUX_BIAS) here too. Likewise add(conv2d(x, w), b) with one
  // value per channel, b (C, 1, 1) or (1, C, 1, 1): a convolution's bias, which torch.autocast
  // adds inside the convolution, so a CNN's activations (relu, pooling) stay 16-bit between
  // its convolutions.
  bool is_linear_bias(const Node& node, const std::vector<ValueId>& inputs) const {
    if (node.op != Op::kAdd) return false;
    for (int i : {0, 1}) {
      const TensorType& bias = out_.type(inputs[1 - i]);
      const TensorType& product = out_.type(inputs[i]);
      const auto low = low_results_.find(inputs[i]);
      if (low == low_results_.end() || product.dtype != options_.low || !is_float(bias.dtype))
        continue;
      if (bias.rank() <= 1) return true;
      if (low->second == Op::kConv2d && is_channel_vector(bias.shape, product.shape)) return true;
    }
    return false;
  }

  // b (C, 1, 1) or (1, C, 1, 1) against y (N, C, H, W).
  static bool is_channel_vector(const Shape& b, const Shape& y) {
    const size_t r = b.size();
    return y.size() == 4 && (r == 3 || (r == 4 && b[0] == 1)) && b[r - 3] == y[1] &&
           b[r - 2] == 1 && b[r - 1] == 1;
  }

  // `id` (the new value of an input-graph value, never a cast this pass made, so no cast of a
  // cast appears) as `dtype`, casting once per (value, dtype).
  ValueId cast_to(ValueId id, DType dtype) {
    if (out_.type(id).dtype == dtype) return id;
    auto key = std::make_pair(id, dtype);
    auto cached = casts_.find(key);
    if (cached != casts_.end()) return cached->second;
    ValueId cast = out_.add(Op::kCast, {id}, {{"dtype", dtype}});
    changed_ = true;
    casts_[key] = cast;
    const std::string& name = out_.value(id).name;
    if (!name.empty()) name_cast(cast, name + "." + std::string(dtype_name(dtype)));
    return cast;
  }

  // Original names are unique in the input graph and casts never take one of them, so node
  // outputs keep theirs unconditionally; a cast gets "<name>.<dtype>" only when it is free.
  void name_value(ValueId id, const std::string& name) {
    if (name.empty()) return;
    out_.values[id].name = name;
    used_names_.insert(name);
  }
  void name_cast(ValueId id, const std::string& name) {
    if (original_names_.count(name) || used_names_.count(name)) return;
    name_value(id, name);
  }
  void unname(ValueId id) {
    used_names_.erase(out_.values[id].name);
    out_.values[id].name.clear();
  }

  // The new value of original value `id`, cast back to its original type when it changed; the
  // original name moves to the returned value, the internal one becomes "<name>.<dtype>".
  ValueId restore_type(ValueId id) {
    ValueId now = map_[id];
    const DType want = in_.type(id).dtype;
    if (out_.type(now).dtype == want) return now;
    ValueId cast = cast_to(now, want);
    const std::string name = in_.value(id).name;
    if (!name.empty() && out_.value(cast).name != name) {
      unname(now);
      unname(cast);
      name_value(cast, name);
      name_cast(now, name + "." + std::string(dtype_name(out_.type(now).dtype)));
    }
    return cast;
  }

  const Graph& in_;
  const MixedPrecisionOptions& options_;
  Graph out_;
  std::vector<ValueId> map_;  // original value id -> new value id
  std::map<std::pair<ValueId, DType>, ValueId> casts_;
  std::map<ValueId, Op> low_results_;  // outputs of nodes run in the low dtype (kLow ops): their op
  std::set<std::string> original_names_;
  std::set<std::string> used_names_;
  bool changed_ = false;
};

}  // namespace

PrecisionPolicy default_precision_policy() {
  PrecisionPolicy p;
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    const Precision precision = op_def(op).traits.precision;
    if (precision != Precision::kFollow) p[op] = precision;
  }
  return p;
}

MixedPrecisionPass::MixedPrecisionPass(MixedPrecisionOptions options)
    : options_(std::move(options)) {
  KILN_CHECK(is_half(options_.low), "mixed-precision: the low dtype must be bf16 or f16, got {}",
             dtype_name(options_.low));
}

bool MixedPrecisionPass::run(Graph& graph) {
  Rewriter rewriter(graph, options_);
  if (!rewriter.rewrite()) return false;
  graph = rewriter.take();
  return true;
}

}  // namespace kiln

// The ONNX importer's driver: reads the ModelProto, makes the graph's inputs (data, params,
// state) and constants, converts each node with its rule (converter.h), folds every value
// whose inputs are known with the ops' reference kernels, and drops what no output needs.
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <climits>
#include <limits>
#include <filesystem>
#include <fnmatch.h>
#include <fstream>
#include <set>
#include <sstream>
#include <unordered_map>

#include "frontend/onnx/converter.h"
#include "ir/op_def.h"
#include "ir/verifier.h"

namespace kiln::onnx {
namespace {

// Values folded at import are at most this many elements: larger ones stay nodes of the graph.
constexpr int64_t kMaxFoldedElements = int64_t{1} << 22;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "cannot open '{}'", path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

const RuleTable& rules() {
  static const RuleTable table = [] {
    RuleTable t;
    add_elementwise_rules(t);
    add_tensor_rules(t);
    add_nn_rules(t);
    return t;
  }();
  return table;
}

bool matches_any(const std::string& name, const std::vector<std::string>& patterns) {
  for (const std::string& p : patterns)
    if (fnmatch(p.c_str(), name.c_str(), 0) == 0) return true;
  return false;
}

}  // namespace


DType dtype_of(int onnx_type, const std::string& what) {
  using T = ::onnx::TensorProto;
  switch (onnx_type) {
    case T::FLOAT: return DType::kF32;
    case T::DOUBLE: return DType::kF64;
    case T::FLOAT16: return DType::kF16;
    case T::BFLOAT16: return DType::kBF16;
    case T::INT32: return DType::kI32;
    case T::INT64: return DType::kI64;
    case T::BOOL: return DType::kBool;
    case T::UINT8: return DType::kU8;
    default: break;
  }
  const std::string name = T::DataType_IsValid(onnx_type) ? T::DataType_Name(static_cast<T::DataType>(onnx_type))
                                                          : fmt::format("#{}", onnx_type);
  throw OnnxUnsupported(fmt::format("{}: dtype {} is not supported (kiln has float, double, float16, bfloat16, "
                                    "int32, int64, bool, uint8)",
                                    what, name));
}

Tensor tensor_of(const ::onnx::TensorProto& proto, const std::string& base_dir, const std::string& what) {
  using T = ::onnx::TensorProto;
  const DType dtype = dtype_of(proto.data_type(), what);
  Shape shape(proto.dims().begin(), proto.dims().end());
  // The data's size is checked against the dims before anything is allocated: a file that is
  // no TensorProto (a SequenceProto, say) can parse as one with absurd dims, and allocating
  // those first made a machine with enough memory page in tens of GiB instead of failing.
  int64_t n = 1;
  for (int64_t d : shape) {
    KILN_CHECK(d >= 0, "{}: negative dim {} in {}", what, d, to_string(shape));
    KILN_CHECK(d == 0 || n <= std::numeric_limits<int64_t>::max() / static_cast<int64_t>(dtype_size(dtype)) / d,
               "{}: dims {} are too large", what, to_string(shape));
    n *= d;
  }
  const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
  const TensorType type{dtype, shape};
  auto check_count = [&](int64_t count) {
    KILN_CHECK(count == n, "{}: {} values for {} ({} elements)", what, count, to_string(type), n);
  };
  auto check_bytes = [&](int64_t count) {
    KILN_CHECK(count == static_cast<int64_t>(bytes), "{}: {} bytes of data for {} ({} bytes)", what, count,
               to_string(type), bytes);
  };
  if (proto.data_location() == T::EXTERNAL) {
    std::string location;
    int64_t offset = 0, length = -1;
    for (const auto& kv : proto.external_data()) {
      if (kv.key() == "location") location = kv.value();
      else if (kv.key() == "offset") offset = std::stoll(kv.value());
      else if (kv.key() == "length") length = std::stoll(kv.value());
    }
    KILN_CHECK(!location.empty(), "{}: external data without a location", what);
    const std::filesystem::path path = std::filesystem::path(base_dir) / location;
    std::ifstream in(path, std::ios::binary);
    KILN_CHECK(in.good(), "{}: cannot open its external data file '{}'", what, path.string());
    if (length < 0) length = static_cast<int64_t>(bytes);
    KILN_CHECK(static_cast<size_t>(length) == bytes, "{}: external data of {} bytes for {} ({} bytes)", what, length,
               to_string(type), bytes);
    std::error_code ec;
    const auto file_size = std::filesystem::file_size(path, ec);
    KILN_CHECK(!ec && offset >= 0 && static_cast<uintmax_t>(offset) + bytes <= file_size,
               "{}: external data file '{}' ends before offset {} + {} bytes", what, path.string(), offset, length);
    Tensor t(type);
    in.seekg(offset);
    in.read(reinterpret_cast<char*>(t.raw()), length);
    KILN_CHECK(in.gcount() == length, "{}: external data file '{}' ends before offset {} + {} bytes", what,
               path.string(), offset, length);
    return t;
  }
  if (proto.has_raw_data()) {
    check_bytes(static_cast<int64_t>(proto.raw_data().size()));
    Tensor t(type);
    std::memcpy(t.raw(), proto.raw_data().data(), bytes);
    return t;
  }
  switch (dtype) {
    case DType::kF32: check_count(proto.float_data_size()); break;
    case DType::kF64: check_count(proto.double_data_size()); break;
    case DType::kI64: check_count(proto.int64_data_size()); break;
    default: check_count(proto.int32_data_size()); break;  // f16, bf16 (bits), i32, bool, u8
  }
  Tensor t(type);
  switch (dtype) {
    case DType::kF32:
      for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = proto.float_data(static_cast<int>(i));
      break;
    case DType::kF64:
      for (int64_t i = 0; i < n; ++i) t.data<double>()[i] = proto.double_data(static_cast<int>(i));
      break;
    case DType::kI64:
      for (int64_t i = 0; i < n; ++i) t.data<int64_t>()[i] = proto.int64_data(static_cast<int>(i));
      break;
    case DType::kF16:
    case DType::kBF16: {
      auto* bits = reinterpret_cast<uint16_t*>(t.raw());
      for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint16_t>(proto.int32_data(static_cast<int>(i)));
      break;
    }
    default:  // i32, bool, u8: int32_data
      for (int64_t i = 0; i < n; ++i) t.set_int(i, proto.int32_data(static_cast<int>(i)));
      break;
  }
  return t;
}

Expr scalar_like(const Expr& like, double value) { return like.builder().scalar(value, like.dtype()); }

Expr cast_to(const Expr& e, DType dtype) { return e.dtype() == dtype ? e : cast(e, dtype); }

Expr constant_of(Builder& b, const Tensor& t) {
  if (!is_float(t.dtype())) {  // integers stay exact: int64 values, never through double
    std::vector<int64_t> values = t.to_i64();
    bool uniform = !values.empty() && std::abs(static_cast<double>(values[0])) <= std::ldexp(1.0, 53);
    for (size_t i = 1; i < values.size() && uniform; ++i) uniform = values[i] == values[0];
    if (uniform) return b.full(t.shape(), static_cast<double>(values[0]), t.dtype());
    return b.constant_ints(t.shape(), std::move(values), t.dtype());
  }
  if (t.numel() > 0) {
    // A tensor whose elements are all equal is a `full` (short in the text, cheap to fold).
    const double first = t.get(0);
    bool uniform = !std::isnan(first);
    for (int64_t i = 1; i < t.numel() && uniform; ++i) uniform = t.get(i) == first;
    if (uniform) return b.full(t.shape(), first, t.dtype());
  }
  return b.constant(t.shape(), t.to_f64(), t.dtype());
}

// ---- the importer -------------------------------------------------------------------------------

class Importer {
 public:
  Importer(const ImportOptions& options, std::string base_dir, std::string source)
      : options_(options), base_dir_(std::move(base_dir)), source_(std::move(source)) {}

  ImportedModel run(const ::onnx::ModelProto& model);

  Builder& builder() { return b_; }
  std::optional<Tensor> known(ValueId id) {
    fold();
    auto it = known_.find(id);
    if (it == known_.end()) return std::nullopt;
    return it->second;
  }
  Expr value_of(const std::string& name, const std::string& where) {
    auto it = values_.find(name);
    KILN_CHECK(it != values_.end(), "{}: input '{}' is not produced by any earlier node, graph input or initializer",
               where, name);
    return it->second;
  }
  const std::string& base_dir() const { return base_dir_; }
  void add_update(ValueId target, ValueId value) {
    updates_.push_back(Update{target, value});
  }
  bool from_pytorch() const { return from_pytorch_; }
  bool is_state(ValueId id) const {
    const int i = b_.graph().input_index(id);
    return i >= 0 && b_.graph().inputs[i].role == Role::kState;
  }

 private:
  void fold();
  void add_inputs(const ::onnx::GraphProto& graph, ImportedModel& out);
  void convert(const ::onnx::NodeProto& node, int64_t opset);
  Shape input_shape(const ::onnx::ValueInfoProto& info);
  void prune();
  void add_loss();
  void note_empty_outputs(const ::onnx::NodeProto& node, const std::string& where);
  void check_empty_inputs(size_t first_node, const std::string& where);

  const ImportOptions& options_;
  std::string base_dir_, source_;
  Builder b_{"onnx"};
  std::unordered_map<std::string, Expr> values_;  // ONNX value name -> kiln value
  std::unordered_map<ValueId, Tensor> known_;     // values known at import
  size_t folded_nodes_ = 0;                       // nodes of the graph fold() has looked at
  std::vector<Update> updates_;
  bool from_pytorch_ = false;
  // Values the model made empty (a 0 dim) from inputs that all hold elements, with the node that
  // did it: a slice past the end, a split of size 0. They may flow to outputs and through ops
  // that keep them empty, but no op may compute a value that holds elements from one (a sum, a
  // product, a loss of nothing would train silently). Empty graph inputs and constants are the
  // user's and the model's own choice, and values known at import are shape arithmetic: neither
  // is tracked.
  std::unordered_map<ValueId, std::string> empty_causes_;
};

void Importer::note_empty_outputs(const ::onnx::NodeProto& node, const std::string& where) {
  std::vector<std::string> inputs;
  for (int i = 0; i < node.input_size(); ++i) {
    if (node.input(i).empty()) continue;
    const Expr e = value_of(node.input(i), where);
    if (e.type().numel() == 0) return;  // made empty by an empty input: tracked there, or not ours
    std::string text = to_string(e.type());
    if (std::optional<Tensor> t = known(e.id()); t && !is_float(t->dtype()) && t->numel() <= 16)
      text += fmt::format(" = [{}]", fmt::join(t->to_i64(), ", "));
    inputs.push_back(std::move(text));
  }
  if (inputs.empty()) return;  // a constant: empty by the model's own word
  for (int i = 0; i < node.output_size(); ++i) {
    auto it = values_.find(node.output(i));
    if (node.output(i).empty() || it == values_.end() || it->second.type().numel() > 0) continue;
    if (known(it->second.id())) continue;  // shape arithmetic, folded at import: nothing trains on it
    empty_causes_.emplace(it->second.id(), fmt::format("{} gives the empty {} from its inputs {}", where,
                                                       to_string(it->second.type()), fmt::join(inputs, ", ")));
  }
}

void Importer::check_empty_inputs(size_t first_node, const std::string& where) {
  const Graph& g = b_.graph();
  for (size_t n = first_node; n < g.nodes.size(); ++n) {
    const Node& node = g.nodes[n];
    auto cause = empty_causes_.end();
    for (ValueId in : node.inputs)
      if (cause == empty_causes_.end()) cause = empty_causes_.find(in);
    if (cause == empty_causes_.end()) continue;
    const std::string why = cause->second;
    for (ValueId out : node.outputs) {
      if (g.type(out).numel() == 0) {
        empty_causes_.emplace(out, why);
      } else if (node.op != Op::kConcat) {  // concat: the other pieces, as ONNX Concat allows
        fail("{}: {} computes {} from the empty {}, a value made of no elements (a loss or product of "
             "nothing would train silently); {}",
             where, op_name(node.op), to_string(g.type(out)), to_string(g.type(cause->first)), why);
      }
    }
  }
}

void Importer::fold() {
  Graph& g = b_.graph();
  for (; folded_nodes_ < g.nodes.size(); ++folded_nodes_) {
    const Node& node = g.nodes[folded_nodes_];
    if (has_flag(node.op, kRandom) || needs_process_group(node.op) || node.op == Op::kFused) continue;
    std::vector<Tensor> inputs;
    bool all_known = true;
    for (ValueId in : node.inputs) {
      auto it = known_.find(in);
      if (it == known_.end()) {
        all_known = false;
        break;
      }
      inputs.push_back(it->second);
    }
    if (!all_known) continue;
    std::vector<Tensor> outputs;
    bool small = true;
    for (ValueId out : node.outputs) {
      small = small && g.type(out).numel() <= kMaxFoldedElements;
      outputs.emplace_back(g.type(out));
    }
    if (!small) continue;
    op_def(node.op).reference(KernelArgs{node.attrs, inputs, outputs});
    for (size_t i = 0; i < node.outputs.size(); ++i) known_[node.outputs[i]] = outputs[i];
  }
}

Shape Importer::input_shape(const ::onnx::ValueInfoProto& info) {
  const std::string& name = info.name();
  if (auto it = options_.shapes.find(name); it != options_.shapes.end()) return it->second;
  if (auto it = options_.shapes.find(kiln_name(name)); it != options_.shapes.end()) return it->second;
  KILN_CHECK(info.type().has_tensor_type(), "graph input '{}' is not a tensor (sequences, maps and optionals are "
             "not supported)", name);
  const auto& tensor_type = info.type().tensor_type();
  KILN_CHECK(tensor_type.has_shape(), "graph input '{}' has no shape: give it with --shape {}=D0,D1,...", name,
             kiln_name(name));
  Shape shape;
  for (int d = 0; d < tensor_type.shape().dim_size(); ++d) {
    const auto& dim = tensor_type.shape().dim(d);
    if (dim.has_dim_value()) {
      shape.push_back(dim.dim_value());
      continue;
    }
    const std::string symbol = dim.has_dim_param() ? dim.dim_param() : "";
    auto it = symbol.empty() ? options_.shapes.end() : options_.shapes.find(symbol);
    KILN_CHECK(it != options_.shapes.end() && it->second.size() == 1,
               "graph input '{}' has a dynamic dim {}{}: give its size with --shape {}=D0,D1,...{}", name, d,
               symbol.empty() ? "" : " ('" + symbol + "')", kiln_name(name),
               symbol.empty() ? "" : " or --shape " + symbol + "=N");
    shape.push_back(it->second[0]);
  }
  return shape;
}

void Importer::add_inputs(const ::onnx::GraphProto& graph, ImportedModel& out) {
  // State: BatchNormalization's running mean and variance (inputs 3 and 4).
  std::set<std::string> state_names;
  for (const auto& node : graph.node())
    if (node.op_type() == "BatchNormalization" && (node.domain().empty() || node.domain() == "ai.onnx"))
      for (int i = 3; i < std::min(5, node.input_size()); ++i) state_names.insert(node.input(i));

  std::set<std::string> initializer_names;
  for (const auto& init : graph.initializer()) initializer_names.insert(init.name());
  KILN_CHECK(graph.sparse_initializer_size() == 0, "sparse initializers are not supported");
  std::set<std::string> used_names;
  auto unique_name = [&](const std::string& onnx_name) {
    std::string name = kiln_name(onnx_name);
    for (int k = 1; used_names.count(name); ++k) name = kiln_name(onnx_name) + "_" + std::to_string(k);
    used_names.insert(name);
    if (name != onnx_name) out.onnx_names[name] = onnx_name;
    return name;
  };

  for (const auto& info : graph.input()) {
    if (initializer_names.count(info.name())) continue;  // IR < 4 lists initializers as inputs too
    if (!info.type().has_tensor_type())
      throw OnnxUnsupported(fmt::format("graph input '{}' is not a tensor (sequences, maps and optionals are not "
                                        "supported)", info.name()));
    const DType dtype = dtype_of(info.type().tensor_type().elem_type(), "graph input '" + info.name() + "'");
    if (auto given = options_.input_values.find(info.name()); given != options_.input_values.end()) {
      KILN_CHECK(given->second.dtype() == dtype, "the value given for graph input '{}' is {}, the model wants {}",
                 info.name(), to_string(given->second.type()), dtype_name(dtype));
      Expr c = constant_of(b_, given->second);
      known_[c.id()] = given->second;
      values_[info.name()] = c;
      continue;
    }
    values_[info.name()] = b_.data(unique_name(info.name()), input_shape(info), dtype);
  }
  for (const auto& init : graph.initializer()) {
    const std::string what = "initializer '" + init.name() + "'";
    Tensor value = tensor_of(init, base_dir_, what);
    const bool trainable = is_float(value.dtype()) && !matches_any(init.name(), options_.freeze) &&
                           !matches_any(kiln_name(init.name()), options_.freeze);
    if (trainable) {
      const std::string name = unique_name(init.name());
      const bool state = state_names.count(init.name()) != 0;
      values_[init.name()] = state ? b_.state(name, value.shape(), value.dtype())
                                   : b_.param(name, value.shape(), value.dtype());
      out.initial_values[name] = value;
    } else {
      Expr c = constant_of(b_, value);
      known_[c.id()] = value;
      values_[init.name()] = c;
    }
  }
  folded_nodes_ = b_.graph().nodes.size();  // the constants above are known already
}

NodeContext::NodeContext(Importer& importer, const ::onnx::NodeProto& node, int64_t opset)
    : importer_(importer), node_(node), opset_(opset) {}

Builder& NodeContext::b() const { return importer_.builder(); }

std::string NodeContext::where() const {
  return node_.name().empty() ? fmt::format("node ({})", node_.op_type())
                              : fmt::format("node '{}' ({})", node_.name(), node_.op_type());
}

Expr NodeContext::in(int i) const {
  if (!has_input(i)) fail("input {} is missing", i);
  return importer_.value_of(node_.input(i), where());
}

std::optional<Tensor> NodeContext::known(int i) const {
  if (!has_input(i)) return std::nullopt;
  return known(in(i));
}

std::optional<Tensor> NodeContext::known(const Expr& e) const { return importer_.known(e.id()); }

Tensor NodeContext::constant(int i, const std::string& what) const {
  std::optional<Tensor> t = known(i);
  if (!t) unsupported("its {} (input {} '{}') depends on the model's inputs or params; kiln needs it known at import",
                      what, i, has_input(i) ? node_.input(i) : "");
  return *t;
}

std::vector<int64_t> NodeContext::ints(int i, const std::string& what) const {
  Tensor t = constant(i, what);
  // Exact: PyTorch writes x[:, k:] with an end of INT64_MAX, which a double rounds to 2^63.
  if (is_float(t.dtype())) fail("its {} (input {}) must be integers, got {}", what, i, to_string(t.type()));
  return t.to_i64();
}

int64_t NodeContext::int_scalar(int i, const std::string& what) const {
  Tensor t = constant(i, what);
  if (t.numel() != 1) fail("its {} (input {}) must be one value, got {}", what, i, to_string(t.type()));
  if (!is_float(t.dtype())) return t.get_int(0);
  const double v = t.get(0);  // a float count (OneHot's depth may be one): truncated, as ONNX casts
  if (!(std::abs(v) < std::ldexp(1.0, 63))) fail("its {} (input {}) is {}, not an integer", what, i, v);
  return static_cast<int64_t>(v);
}

double NodeContext::scalar(int i, const std::string& what) const {
  Tensor t = constant(i, what);
  if (t.numel() != 1) fail("its {} (input {}) must be one value, got {}", what, i, to_string(t.type()));
  return t.get(0);
}

const ::onnx::AttributeProto* NodeContext::attr(const std::string& name) const {
  for (const auto& a : node_.attribute())
    if (a.name() == name) {
      read_.push_back(name);
      return &a;
    }
  return nullptr;
}

bool NodeContext::has_attr(const std::string& name) const {
  for (const auto& a : node_.attribute())
    if (a.name() == name) return true;
  return false;
}

void NodeContext::ignore_attr(const std::string& name) const { attr(name); }

int64_t NodeContext::attr_int(const std::string& name, int64_t fallback) const {
  const auto* a = attr(name);
  return a ? a->i() : fallback;
}
double NodeContext::attr_float(const std::string& name, double fallback) const {
  const auto* a = attr(name);
  return a ? a->f() : fallback;
}
std::string NodeContext::attr_string(const std::string& name, const std::string& fallback) const {
  const auto* a = attr(name);
  return a ? a->s() : fallback;
}
std::vector<int64_t> NodeContext::attr_ints(const std::string& name, std::vector<int64_t> fallback) const {
  const auto* a = attr(name);
  return a ? std::vector<int64_t>(a->ints().begin(), a->ints().end()) : fallback;
}
std::vector<double> NodeContext::attr_floats(const std::string& name, std::vector<double> fallback) const {
  const auto* a = attr(name);
  return a ? std::vector<double>(a->floats().begin(), a->floats().end()) : fallback;
}
Tensor NodeContext::attr_tensor(const std::string& name) const {
  const auto* a = attr(name);
  if (!a) fail("attribute '{}' is missing", name);
  if (a->type() == ::onnx::AttributeProto::SPARSE_TENSOR) unsupported("sparse tensor attribute '{}'", name);
  return tensor_of(a->t(), importer_.base_dir(), where() + " attribute '" + name + "'");
}

std::vector<std::string> NodeContext::unread_attributes() const {
  std::vector<std::string> out;
  for (const auto& a : node_.attribute())
    if (std::find(read_.begin(), read_.end(), a.name()) == read_.end()) out.push_back(a.name());
  return out;
}

void NodeContext::add_update(const Expr& target, const Expr& value) const {
  if (importer_.is_state(target.id())) importer_.add_update(target.id(), value.id());
}
bool NodeContext::is_state_input(const Expr& e) const { return importer_.is_state(e.id()); }
bool NodeContext::from_pytorch() const { return importer_.from_pytorch(); }

void Importer::convert(const ::onnx::NodeProto& node, int64_t opset) {
  NodeContext context(*this, node, opset);
  if (!node.domain().empty() && node.domain() != "ai.onnx")
    context.unsupported("domain '{}' is not supported (only the default ONNX domain)", node.domain());
  auto it = rules().find(node.op_type());
  if (it == rules().end()) context.unsupported("op {} is not supported", node.op_type());
  for (const auto& a : node.attribute())
    if (a.type() == ::onnx::AttributeProto::GRAPH || a.type() == ::onnx::AttributeProto::GRAPHS)
      context.unsupported("subgraph attribute '{}' (control flow) is not supported", a.name());
  std::vector<Expr> outputs;
  const size_t first_node = b_.graph().nodes.size();
  try {
    outputs = it->second(context);
  } catch (const OnnxUnsupported&) {
    throw;
  } catch (const Error& e) {
    const std::string message = e.what();
    if (message.rfind(context.where(), 0) == 0) throw;
    throw Error(context.where() + ": " + message);
  }
  const std::vector<std::string> unread = context.unread_attributes();
  if (!unread.empty())
    context.unsupported("attribute{} {} {} not supported", unread.size() == 1 ? "" : "s", fmt::join(unread, ", "),
                        unread.size() == 1 ? "is" : "are");
  for (int i = 0; i < node.output_size(); ++i) {
    if (node.output(i).empty()) continue;
    if (i >= static_cast<int>(outputs.size()) || outputs[i].id() < 0)
      context.unsupported("output {} ('{}') is not supported", i, node.output(i));
    values_[node.output(i)] = outputs[i];
  }
  check_empty_inputs(first_node, context.where());
  note_empty_outputs(node, context.where());
}

// --loss cross_entropy: the loss of the first output (logits) against the labels.
void Importer::add_loss() {
  KILN_CHECK(options_.loss == "cross_entropy", "unknown loss '{}' (expected cross_entropy)", options_.loss);
  Graph& g = b_.graph();
  Expr logits = b_.wrap(g.outputs.at(0));
  KILN_CHECK(is_float(logits.dtype()) && logits.rank() >= 1, "--loss cross_entropy needs float logits (..., V) as "
             "the first output, got {}", to_string(logits.type()));
  Shape label_shape = logits.shape();
  label_shape.pop_back();
  Expr labels;
  for (const GraphInput& in : g.inputs)
    if (g.value(in.value).name == kiln_name(options_.labels)) labels = b_.wrap(in.value);
  if (labels.id() < 0) {
    if (auto it = options_.shapes.find(options_.labels); it != options_.shapes.end()) label_shape = it->second;
    labels = b_.data(kiln_name(options_.labels), label_shape, DType::kI64);
  }
  KILN_CHECK(labels.shape() == label_shape && is_integer(labels.dtype()),
             "--labels {} is {}, expected integers of shape {} for logits {}", options_.labels,
             to_string(labels.type()), to_string(label_shape), to_string(logits.type()));
  const size_t first_node = g.nodes.size();
  Expr loss = cross_entropy(logits, cast_to(labels, DType::kI64));
  check_empty_inputs(first_node, "--loss cross_entropy");
  g.outputs.insert(g.outputs.begin(), loss.id());
}

// Drops the nodes no output or update needs (shape subgraphs once folded, unused constants).
void Importer::prune() {
  Graph& g = b_.graph();
  std::vector<bool> needed(g.values.size(), false);
  for (ValueId out : g.outputs) needed[out] = true;
  for (const Update& u : g.updates) needed[u.value] = true;
  std::vector<Node> kept;
  for (size_t n = g.nodes.size(); n-- > 0;) {
    const Node& node = g.nodes[n];
    bool live = false;
    for (ValueId out : node.outputs) live = live || needed[out];
    if (!live) continue;
    for (ValueId in : node.inputs) needed[in] = true;
    kept.push_back(node);
  }
  std::reverse(kept.begin(), kept.end());
  g.nodes = std::move(kept);
}

ImportedModel Importer::run(const ::onnx::ModelProto& model) {
  ImportedModel out;
  for (const auto& opset : model.opset_import())
    if (opset.domain().empty() || opset.domain() == "ai.onnx") out.opset = opset.version();
  KILN_CHECK(model.has_graph(), "{}: the model has no graph", source_);
  if (out.opset == 0) out.opset = 1;  // IR 1 models name no opset
  KILN_CHECK(out.opset <= 21, "{}: opset {} of the default domain is newer than kiln knows (<= 21)", source_,
             out.opset);
  from_pytorch_ = model.producer_name() == "pytorch";
  const ::onnx::GraphProto& graph = model.graph();
  if (!graph.name().empty()) b_.graph().name = kiln_name(graph.name());
  add_inputs(graph, out);
  for (const auto& node : graph.node()) convert(node, out.opset);
  KILN_CHECK(graph.output_size() > 0, "{}: the graph has no outputs", source_);
  for (const auto& output : graph.output()) b_.graph().outputs.push_back(value_of(output.name(), "graph output").id());
  b_.graph().updates = updates_;
  if (!options_.loss.empty()) add_loss();
  prune();
  out.graph = b_.take();
  verify(out.graph);
  return out;
}

// ---- the public functions -------------------------------------------------------------------------

bool onnx_available() { return true; }

ImportedModel import_onnx_bytes(const std::string& bytes, const std::string& base_dir, const ImportOptions& options,
                                const std::string& source) {
  ::onnx::ModelProto model;
  KILN_CHECK(bytes.size() < static_cast<size_t>(INT_MAX),
             "{}: {} bytes is over protobuf's 2 GiB limit: save the model with its weights as external data "
             "(onnx.save_model(..., save_as_external_data=True))",
             source, bytes.size());
  google::protobuf::io::ArrayInputStream stream(bytes.data(), static_cast<int>(bytes.size()));
  google::protobuf::io::CodedInputStream coded(&stream);
  coded.SetTotalBytesLimit(INT_MAX);
  KILN_CHECK(model.ParseFromCodedStream(&coded) && coded.ConsumedEntireMessage(),
             "{}: not a valid ONNX model (the protobuf does not parse: truncated or not an .onnx file)", source);
  Importer importer(options, base_dir, source);
  try {
    return importer.run(model);
  } catch (const OnnxUnsupported& e) {
    throw OnnxUnsupported(source + ": " + e.what());
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
}

ImportedModel import_onnx(const std::string& path, const ImportOptions& options) {
  const std::string bytes = read_file(path);
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  return import_onnx_bytes(bytes, dir.empty() ? "." : dir.string(), options, path);
}

std::pair<std::string, Tensor> load_onnx_tensor(const std::string& path) {
  const std::string bytes = read_file(path);
  ::onnx::TensorProto proto;
  KILN_CHECK(proto.ParseFromString(bytes), "{}: not a serialized onnx.TensorProto", path);
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  return {proto.name(), tensor_of(proto, dir.string(), path)};
}

}  // namespace kiln::onnx

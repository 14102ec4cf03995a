// CUDA C++ generation for fused nodes: lowering of the body to micro values through one emitter
// table, then the elementwise or rows kernel text. See codegen.h for the kernel shapes.
#include "backends/cuda/nvrtc/codegen.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>

#include "ir/op_def.h"
#include "ops/elementwise.h"
#include "support/error.h"

namespace kiln::cuda {

// The lines of the elementwise math table and the device policy: the text of
// ops/elementwise_math.h and backends/cuda/common/device_math.cuh, embedded at build time
// (CMakeLists.txt writes it into a generated .cc), so that NVRTC compiles the very lines that
// nvcc and g++ compile.
extern const char* const kEmbeddedMathSource;

namespace {

// ---- micro values ----------------------------------------------------------------------------

// Where a micro value lives: one value per row of the iteration space (computed once by every
// thread of the row's block), one per element, or one per column (a column reduction: a sum over
// every row, complete only after the whole kernel; never read inside the body).
enum class Space : uint8_t { kRow, kFull, kColumn };
enum class MKind : uint8_t { kLoad, kExpr, kReduce, kColumn };
enum class ReduceOp : uint8_t { kSum, kMax };

struct MVal {
  MKind kind = MKind::kExpr;
  Space space = Space::kRow;
  std::string ctype;  // the C type it is computed in
  // kLoad: body input `input`, at index expression `text` (over `i`/`e` or `row`), whether
  // consecutive elements along the row are consecutive in memory (vector loads).
  int input = -1;
  bool contiguous = false;
  int64_t target_last = 1;  // kLoad: the last dim of the shape its index runs over
  // kExpr: CUDA text with $0.. for args and $t for ctype.
  std::string text;
  std::vector<int> args;
  ReduceOp reduce = ReduceOp::kSum;  // kReduce: over args[0] (a full value) along the row
  int64_t divisor = 1;               // kColumn: the sum of args[0] over the rows, divided by this
  int level = 0;  // reductions on the longest path to it
};

struct Unsupported {
  std::string why;
};

// A body output stored with `width` more columns of `value` after each row of the iteration
// space: concat(x, full) along the last axis (emit_concat). width 0: none.
struct RowPad {
  int64_t width = 0;
  double value = 0;
};

[[noreturn]] void unsupported(std::string why) { throw Unsupported{std::move(why)}; }

std::string ctype_of(DType d) {
  switch (d) {
    case DType::kF32: case DType::kF16: case DType::kBF16: return "float";
    case DType::kF64: return "double";
    case DType::kI32: return "int";
    case DType::kI64: return "long long";
    case DType::kBool: return "bool";
    case DType::kU8: return "unsigned char";
  }
  return "float";
}

// The C type a tensor of `d` is stored as.
std::string storage_of(DType d) {
  switch (d) {
    case DType::kF16: return "__half";
    case DType::kBF16: return "__nv_bfloat16";
    default: return ctype_of(d);
  }
}

// Converts the stored element `x` (text) to its compute type, and back.
std::string load_conversion(DType d, const std::string& x) {
  if (d == DType::kF16) return "__half2float(" + x + ")";
  if (d == DType::kBF16) return "__bfloat162float(" + x + ")";
  return x;
}
std::string store_conversion(DType d, const std::string& x) {
  if (d == DType::kF16) return "__float2half_rn(" + x + ")";
  if (d == DType::kBF16) return "__float2bfloat16_rn(" + x + ")";
  return x;
}

// A literal of C type `ctype`.
std::string lit(const std::string& ctype, double v) {
  std::string text;
  if (std::isnan(v)) {
    text = "kiln_nan()";
  } else if (std::isinf(v)) {
    text = v > 0 ? "kiln_inf()" : "(-kiln_inf())";
  } else {
    text = fmt::format("{:.17g}", v);
    if (text.find_first_of(".e") == std::string::npos) text += ".0";
  }
  return "static_cast<" + ctype + ">(" + text + ")";
}
std::string lit_int(int64_t v) { return fmt::format("{}LL", v); }

// The offset into a tensor of shape `v` of element `var` (a flat index over `target`), with
// numpy broadcasting (right-aligned); consecutive target dims that are all present or all
// broadcast in `v` are merged, so (N,) in (R, N) reads `var % N` and (R, 1) reads `var / N`.
std::string broadcast_index(const Shape& v, const Shape& target, const std::string& var) {
  const int r = static_cast<int>(target.size()), rv = static_cast<int>(v.size());
  struct Group {
    bool present;
    int64_t size, inner, stride;
  };
  std::vector<Group> groups;
  int64_t inner = 1, vstride = 1;
  for (int d = r - 1; d >= 0; --d) {
    const int64_t t = target[d];
    const int64_t vd = d >= r - rv ? v[d - (r - rv)] : 1;
    if (t == 1) continue;
    const bool present = vd == t;
    if (!groups.empty() && groups.back().present == present) {
      groups.back().size *= t;
    } else {
      groups.push_back({present, t, inner, vstride});
    }
    inner *= t;
    if (present) vstride *= t;
  }
  std::string out;
  for (const Group& g : groups) {
    if (!g.present) continue;
    std::string coord = var;
    if (g.inner != 1) coord = fmt::format("({} / {})", coord, lit_int(g.inner));
    if (g.inner * g.size != inner) coord = fmt::format("({} % {})", coord, lit_int(g.size));
    if (g.stride != 1) coord = fmt::format("{} * {}", coord, lit_int(g.stride));
    out += (out.empty() ? "" : " + ") + coord;
  }
  return out.empty() ? "0" : out;
}

bool broadcasts_to(const Shape& from, const Shape& to) {
  if (from.size() > to.size()) return false;
  for (size_t k = 0; k < from.size(); ++k) {
    const int64_t f = from[from.size() - 1 - k], t = to[to.size() - 1 - k];
    if (f != t && f != 1) return false;
  }
  return true;
}

// ---- lowering --------------------------------------------------------------------------------

class Lowering {
 public:
  Lowering(const Graph& body, bool rows, Shape s) : body_(body), rows_(rows), s_(std::move(s)) {
    n_ = s_.empty() ? 1 : s_.back();
    srow_ = s_.empty() ? Shape{} : Shape(s_.begin(), s_.end() - 1);
    r_ = numel(srow_);
  }

  const Graph& body() const { return body_; }
  bool rows() const { return rows_; }
  const Shape& s() const { return s_; }
  int64_t n() const { return n_; }
  int64_t r() const { return r_; }
  std::vector<MVal>& vals() { return vals_; }
  std::map<ValueId, int>& computed() { return computed_; }
  std::map<ValueId, RowPad>& pads() { return pads_; }

  int add(MVal m) {
    vals_.push_back(std::move(m));
    return static_cast<int>(vals_.size()) - 1;
  }

  // Body input `input` read in `space`. For an elementwise consumer, `out` is its output shape
  // (the input broadcasts against it); row ops pass nullptr (the input spans the space).
  int load(int input, Space space, const Shape* out) {
    const ValueId id = body_.inputs[input].value;
    const Shape& shape = body_.type(id).shape;
    const Shape& space_shape = space == Space::kFull ? s_ : srow_;
    const int64_t space_numel = space == Space::kFull ? r_ * n_ : r_;
    // Broadcast against the consumer's shape when it covers the space element for element
    // (possibly reshaped), else against the space's own shape.
    const Shape& target = out != nullptr && numel(*out) == space_numel ? *out : space_shape;
    if (!broadcasts_to(shape, target))
      unsupported(fmt::format("input {} {} does not broadcast to the iteration space {}", input,
                              to_string(shape), to_string(space_shape)));
    if (out != nullptr && numel(*out) != space_numel && !broadcasts_to(*out, space_shape))
      unsupported(fmt::format("a value of shape {} does not broadcast to the iteration space {}",
                              to_string(*out), to_string(space_shape)));
    const std::string var = space == Space::kFull ? (rows_ ? "e" : "i") : "row";
    MVal m;
    m.kind = MKind::kLoad;
    m.space = space;
    m.ctype = ctype_of(body_.type(id).dtype);
    m.input = input;
    m.text = broadcast_index(shape, target, var);
    // A rows kernel's e is base + j with base = row * kN: a per-column input's e % kN is j,
    // without a 64-bit modulo per element (which bounded GPT-2's LayerNorm rows by issue).
    if (rows_ && space == Space::kFull && m.text == fmt::format("(e % {}LL)", n_)) m.text = "j";
    m.contiguous = !shape.empty() && !target.empty() && shape.back() == target.back() &&
                   target.back() > 1;
    m.target_last = target.empty() ? 1 : target.back();
    auto key = std::make_tuple(input, space, m.text);
    if (auto it = loads_.find(key); it != loads_.end()) return it->second;
    const int id_m = add(std::move(m));
    loads_[key] = id_m;
    return id_m;
  }

  int expr(std::string ctype, std::string text, std::vector<int> args) {
    MVal m;
    m.ctype = std::move(ctype);
    m.text = std::move(text);
    m.space = Space::kRow;
    for (int a : args) {
      if (vals_[a].space == Space::kFull) m.space = Space::kFull;
      m.level = std::max(m.level, vals_[a].level);
    }
    m.args = std::move(args);
    return add(std::move(m));
  }

  int reduce(ReduceOp op, int arg) {
    if (!rows_) unsupported("a reduction along the row needs a \"rows\" fused node");
    if (vals_[arg].space != Space::kFull)
      unsupported("a row reduction of a value that is already one per row");
    MVal m;
    m.kind = MKind::kReduce;
    m.space = Space::kRow;
    m.ctype = vals_[arg].ctype;
    m.reduce = op;
    m.args = {arg};
    m.level = vals_[arg].level + 1;
    return add(std::move(m));
  }

  // The sum of the full value `arg` over every row (divided by `divisor`: a mean).
  int column(int arg, int64_t divisor) {
    if (vals_[arg].space != Space::kFull)
      unsupported("a column reduction of a value that is one per row, not one per element");
    MVal m;
    m.kind = MKind::kColumn;
    m.space = Space::kColumn;
    m.ctype = vals_[arg].ctype;
    m.args = {arg};
    m.divisor = divisor;
    m.level = vals_[arg].level;
    return add(std::move(m));
  }

 private:
  const Graph& body_;
  bool rows_;
  Shape s_, srow_;
  int64_t n_ = 1, r_ = 1;
  std::vector<MVal> vals_;
  std::map<ValueId, int> computed_;
  std::map<ValueId, RowPad> pads_;  // padded body outputs (emit_concat)
  std::map<std::tuple<int, Space, std::string>, int> loads_;
};

// What an emitter sees: the node, and access to its inputs as micro values.
class Ctx {
 public:
  Ctx(Lowering& lowering, const Node& node) : l(lowering), node(node) {}
  Lowering& l;
  const Node& node;

  const Graph& body() const { return l.body(); }
  const Attributes& attrs() const { return node.attrs; }
  const TensorType& in_type(int k) const { return body().type(node.inputs[k]); }
  const TensorType& out_type(int k = 0) const { return body().type(node.outputs[k]); }
  std::string ct(int k = 0) const { return ctype_of(out_type(k).dtype); }
  int64_t n() const { return l.n(); }

  void require(bool ok, const std::string& why) const {
    if (!ok) unsupported(fmt::format("{}: {}", op_info(node.op).name, why));
  }
  void require_float() const {
    for (size_t k = 0; k < node.inputs.size(); ++k)
      require(is_float(in_type(static_cast<int>(k)).dtype),
              fmt::format("input {} is {}, only float dtypes are generated", k,
                          to_string(in_type(static_cast<int>(k)))));
  }

  // Input k as a micro value, read in `space` when it is a body input (indexed as `as` when
  // given: a value that spans the space in its own shape).
  int x(int k, Space space, const Shape* as = nullptr) {
    const ValueId id = node.inputs[k];
    if (auto it = l.computed().find(id); it != l.computed().end()) {
      const MVal& m = l.vals()[it->second];
      require(m.kind != MKind::kColumn,
              fmt::format("input {} is a column reduction's result, which is complete only after "
                          "the whole kernel; it cannot be read inside the body",
                          k));
      if (m.space == Space::kRow && space == Space::kFull && l.rows()) {
        const Shape& shape = body().type(id).shape;
        require(numel(shape) == 1 ||
                    (numel(shape) == l.r() && broadcasts_to(shape, l.s()) &&
                     (shape.empty() || shape.back() == 1)),
                fmt::format("a per-row value of shape {} is broadcast against {}",
                            to_string(shape), to_string(l.s())));
      }
      return it->second;
    }
    const int input = body().input_index(id);
    require(input >= 0, fmt::format("input {} (%{}) is neither a body input nor computed", k,
                                    body().value(id).name));
    const bool elementwise = has_flag(node.op, kElementwise) || node.op == Op::kReshape;
    return l.load(input, space, as != nullptr ? as : elementwise ? &out_type().shape : nullptr);
  }

  // The space of an elementwise op's operands and output.
  Space elementwise_space() {
    if (!l.rows()) return Space::kFull;
    const Shape& out = out_type().shape;
    if (numel(out) == l.r() * l.n() && numel(out) != l.r()) return Space::kFull;
    bool any_row = false;
    for (ValueId id : node.inputs) {
      auto it = l.computed().find(id);
      if (it == l.computed().end()) continue;
      if (l.vals()[it->second].space == Space::kFull) return Space::kFull;
      if (body().type(id).shape.size() > 0 && numel(body().type(id).shape) > 1) any_row = true;
    }
    if (any_row) return Space::kRow;
    return broadcasts_to(out, l.s()) && numel(out) != l.r() ? Space::kFull : Space::kRow;
  }
  std::vector<int> operands() {
    const Space space = elementwise_space();
    std::vector<int> ids;
    for (size_t k = 0; k < node.inputs.size(); ++k) ids.push_back(x(static_cast<int>(k), space));
    return ids;
  }

  int e(const std::string& ctype, std::string text, std::vector<int> args) {
    return l.expr(ctype, std::move(text), std::move(args));
  }
  int sum(int a) { return l.reduce(ReduceOp::kSum, a); }
  int max(int a) { return l.reduce(ReduceOp::kMax, a); }
  // The column index j of the element (rows kernels only).
  int column() {
    require(l.rows(), "needs the column index, which only \"rows\" kernels have");
    MVal m;
    m.space = Space::kFull;
    m.ctype = "long long";
    m.text = "static_cast<long long>(j)";
    return l.add(std::move(m));
  }
  // The row op's input x must span the whole iteration space, rows of length N.
  int row_input(int k) {
    require(l.rows(), "is a row op: needs a \"rows\" fused node");
    const Shape& shape = in_type(k).shape;
    require(!shape.empty() && shape.back() == l.n() && numel(shape) == l.r() * l.n(),
            fmt::format("input {} has shape {}, not the iteration space {}", k, to_string(shape),
                        to_string(l.s())));
    const int id = x(k, Space::kFull);
    require(l.vals()[id].space == Space::kFull, "its input is per row, not per element");
    return id;
  }
  void require_last_axis(int64_t axis, int rank) {
    require(rank >= 1 && normalize_axis(axis, rank) == rank - 1,
            fmt::format("axis {} is not the last axis (rank {})", axis, rank));
  }
};

using Emitter = std::function<std::vector<int>(Ctx&)>;

// An op that is a line of ops/elementwise_math.h: a call of the line's functor with the device
// policy (the prelude holds both). Integer operands only where nothing can wrap or divide by
// zero: comparisons, and maximum and minimum, which select an operand (u8 not at all).
std::vector<int> emit_line(Ctx& c) {
  const math::Fn fn = *ops::elementwise_fn(c.node.op, c.attrs());
  std::string name;
  math::Domain domain = math::Domain::kFloat;
  math::visit(fn, [&](auto line) {
    name = decltype(line)::name();
    domain = decltype(line)::domain();
  });
  if (domain == math::Domain::kCompare || fn == math::Fn::kMaximum || fn == math::Fn::kMinimum) {
    for (size_t k = 0; k < c.node.inputs.size(); ++k)
      c.require(c.in_type(static_cast<int>(k)).dtype != DType::kU8,
                "u8 operands are not generated");
  } else {
    c.require_float();
  }
  const std::vector<int> args = c.operands();
  std::string call = "kiln::math::" + name + "::apply<KilnMath>($0";
  for (size_t k = 1; k < args.size(); ++k) call += fmt::format(", ${}", k);
  return {c.e(c.ct(), call + ")", args)};
}

std::vector<int> emit_cast(Ctx& c) {
  const DType from = c.in_type(0).dtype, to = c.out_type().dtype;
  const std::string ct = c.ct();
  std::string text;
  if (to == DType::kBool) {
    text = "($0 != 0)";
  } else if (to == DType::kF16) {
    text = "__half2float(__float2half_rn(static_cast<float>($0)))";
  } else if (to == DType::kBF16) {
    text = "__bfloat162float(__float2bfloat16_rn(static_cast<float>($0)))";
  } else if (is_float(to) || !is_float(from)) {
    text = "static_cast<$t>($0)";  // to a float, or integer/bool to integer (wraps)
  } else {
    // Float to integer: truncate toward zero, saturate, NaN -> 0 (cvt.rzi does all three).
    const bool dbl = from == DType::kF64;
    if (to == DType::kI32) text = dbl ? "__double2int_rz($0)" : "__float2int_rz($0)";
    else if (to == DType::kI64) text = dbl ? "__double2ll_rz($0)" : "__float2ll_rz($0)";
    else text = dbl ? "static_cast<unsigned char>(min(__double2uint_rz($0), 255u))"
                    : "static_cast<unsigned char>(min(__float2uint_rz($0), 255u))";
  }
  return {c.e(ct, text, c.operands())};
}

std::vector<int> emit_full(Ctx& c) {
  return {c.e(c.ct(), lit(c.ct(), c.attrs().f("value")), {})};
}

// concat(x, full(c)) along the last axis, as a body output only: x's rows stored with the full's
// columns of c after each (the padded activation of passes/ones_column.h, whose ones column a
// weight-gradient GEMM turns into the bias gradient). The row stays in registers; the store
// goes to a row stride of N + width. Rows kernels only, and no body node may read it.
std::vector<int> emit_concat(Ctx& c) {
  c.require(c.l.rows(), "a padded row needs a \"rows\" fused node");
  c.require(c.node.inputs.size() == 2, "only concat(x, full), a padded row, is generated");
  c.require_last_axis(c.attrs().i("axis"), c.out_type().rank());
  const Node* pad = nullptr;
  for (const Node& n : c.body().nodes) {
    if (!n.outputs.empty() && n.outputs[0] == c.node.inputs[1]) pad = &n;
    for (ValueId in : n.inputs)
      c.require(in != c.node.outputs[0], "a padded row is read inside the body");
  }
  c.require(pad != nullptr && pad->op == Op::kFull, "the second operand is not a full");
  const Shape& xs = c.in_type(0).shape;
  c.require(!xs.empty() && xs.back() == c.n() && numel(xs) == c.l.r() * c.n(),
            fmt::format("x has shape {}, not the iteration space {}", to_string(xs),
                        to_string(c.l.s())));
  const int64_t width = c.in_type(1).shape.back();
  // A lane (or thread) per pad column.
  c.require(width >= 1 && width <= 32, fmt::format("a pad of {} columns (1 to 32)", width));
  const int x = c.x(0, Space::kFull);
  c.require(c.l.vals()[x].space == Space::kFull, "x is per row, not per element");
  c.l.pads()[c.node.outputs[0]] = RowPad{width, pad->attrs.f("value")};
  return {x};
}

std::vector<int> emit_reshape(Ctx& c) {
  // Flat order is unchanged; only whole-space values may be reshaped (see Lowering::load).
  c.require(numel(c.in_type(0).shape) == c.l.r() * c.n() || numel(c.in_type(0).shape) == 1,
            "only reshapes of whole-iteration-space values are generated");
  return {c.x(0, Space::kFull)};
}

// Whether `axes` are every axis but the last of a rank-`rank` value (a column reduction: bias
// gradients, LayerNorm's dgamma / dbeta).
bool column_axes(const std::vector<int64_t>& axes, int rank) {
  if (rank < 2 || static_cast<int>(axes.size()) != rank - 1) return false;
  std::vector<bool> hit(rank, false);
  for (int64_t a : axes) {
    if (a < -rank || a >= rank) return false;
    hit[normalize_axis(a, rank)] = true;
  }
  for (int d = 0; d + 1 < rank; ++d)
    if (!hit[d]) return false;
  return true;
}

// sum / mean over every axis but the last, of a value spanning the iteration space (R, N): one
// value per column, written as a group output (elementwise and rows kernels).
std::vector<int> emit_column_reduction(Ctx& c) {
  const Shape& shape = c.in_type(0).shape;
  c.require(!shape.empty() && shape.back() == c.n() && numel(shape) == c.l.r() * c.n(),
            fmt::format("a column reduction of {}, which is not the iteration space {}",
                        to_string(shape), to_string(c.l.s())));
  const int x = c.x(0, Space::kFull, &shape);
  return {c.l.column(x, c.node.op == Op::kMean ? c.l.r() : 1)};
}

// sum / mean / max over the last axis (rows kernels), or sum / mean over the leading axes.
std::vector<int> emit_row_reduction(Ctx& c) {
  c.require_float();
  const std::vector<int64_t>& axes = c.attrs().ints("axes");
  const int rank = c.in_type(0).rank();
  if (c.node.op != Op::kMax && column_axes(axes, rank)) return emit_column_reduction(c);
  c.require(axes.size() == 1 || (axes.empty() && rank == 1),
            "only reductions over the last axis are generated");
  if (!axes.empty()) c.require_last_axis(axes[0], rank);
  const int x = c.row_input(0);
  if (c.node.op == Op::kMax) return {c.max(x)};
  const int s = c.sum(x);
  if (c.node.op == Op::kSum) return {s};
  return {c.e(c.ct(), "($0 / " + lit(c.ct(), static_cast<double>(c.n())) + ")", {s})};
}

std::vector<int> emit_softmax(Ctx& c, bool log) {
  c.require_float();
  c.require_last_axis(c.attrs().i("axis"), c.in_type(0).rank());
  const std::string t = c.ct();
  const int x = c.row_input(0);
  const int m = c.max(x);
  const int ex = c.e(t, "KilnMath::exp($0 - $1)", {x, m});
  const int s = c.sum(ex);
  if (log) return {c.e(t, "($0 - $1 - KilnMath::log($2))", {x, m, s})};
  return {c.e(t, "($0 / $1)", {ex, s})};
}

std::vector<int> emit_softmax_grad(Ctx& c, bool log) {
  c.require_float();
  c.require_last_axis(c.attrs().i("axis"), c.in_type(0).rank());
  const std::string t = c.ct();
  const int y = c.row_input(0), dy = c.row_input(1);
  if (log) return {c.e(t, "($0 - KilnMath::exp($1) * $2)", {dy, y, c.sum(dy)})};
  return {c.e(t, "($0 * ($1 - $2))", {y, dy, c.sum(c.e(t, "($0 * $1)", {dy, y}))})};
}

std::vector<int> emit_layer_norm(Ctx& c) {
  c.require_float();
  const std::string t = c.ct(), n = lit(t, static_cast<double>(c.n()));
  const int x = c.row_input(0);
  const int gamma = c.x(1, Space::kFull), beta = c.x(2, Space::kFull);
  const int mean = c.e(t, "($0 / " + n + ")", {c.sum(x)});
  const int d = c.e(t, "($0 - $1)", {x, mean});
  const int var = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $0)", {d}))});
  const int rstd =
      c.e(t, "KilnMath::rsqrt($0 + " + lit(t, c.attrs().f("epsilon")) + ")", {var});
  return {c.e(t, "($0 * $1 * $2 + $3)", {d, rstd, gamma, beta})};
}

std::vector<int> emit_rms_norm(Ctx& c) {
  c.require_float();
  const std::string t = c.ct(), n = lit(t, static_cast<double>(c.n()));
  const int x = c.row_input(0);
  const int gamma = c.x(1, Space::kFull);
  const int ms = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $0)", {x}))});
  const int rstd = c.e(t, "KilnMath::rsqrt($0 + " + lit(t, c.attrs().f("epsilon")) + ")", {ms});
  return {c.e(t, "($0 * $1 * $2)", {x, rstd, gamma})};
}

// (x, gamma, dy) -> dx per element, and dgamma, dbeta summed over the rows (column values).
// With x_hat = (x - mean) * rstd and g = dy * gamma: dx = rstd * (g - mean(g) - x_hat *
// mean(g * x_hat)), as the op's reference kernel.
std::vector<int> emit_layer_norm_grad(Ctx& c) {
  c.require_float();
  const std::string t = c.ct(), n = lit(t, static_cast<double>(c.n()));
  const int x = c.row_input(0), dy = c.row_input(2);
  const int gamma = c.x(1, Space::kFull);
  const int mean = c.e(t, "($0 / " + n + ")", {c.sum(x)});
  const int d = c.e(t, "($0 - $1)", {x, mean});
  const int var = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $0)", {d}))});
  const int rstd = c.e(t, "KilnMath::rsqrt($0 + " + lit(t, c.attrs().f("epsilon")) + ")", {var});
  const int x_hat = c.e(t, "($0 * $1)", {d, rstd});
  const int g = c.e(t, "($0 * $1)", {dy, gamma});
  const int mean_g = c.e(t, "($0 / " + n + ")", {c.sum(g)});
  const int mean_gx = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $1)", {g, x_hat}))});
  const int dx = c.e(t, "($0 * ($1 - $2 - $3 * $4))", {rstd, g, mean_g, x_hat, mean_gx});
  return {dx, c.l.column(c.e(t, "($0 * $1)", {dy, x_hat}), 1), c.l.column(dy, 1)};
}

// (x, gamma, dy) -> dx per element and dgamma over the rows: with rstd = rsqrt(mean(x^2) + eps)
// and g = dy * gamma, dx = rstd * g - rstd^3 * x * mean(g * x), as the op's reference kernel.
std::vector<int> emit_rms_norm_grad(Ctx& c) {
  c.require_float();
  const std::string t = c.ct(), n = lit(t, static_cast<double>(c.n()));
  const int x = c.row_input(0), dy = c.row_input(2);
  const int gamma = c.x(1, Space::kFull);
  const int ms = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $0)", {x}))});
  const int rstd = c.e(t, "KilnMath::rsqrt($0 + " + lit(t, c.attrs().f("epsilon")) + ")", {ms});
  const int g = c.e(t, "($0 * $1)", {dy, gamma});
  const int mean_gx = c.e(t, "($0 / " + n + ")", {c.sum(c.e(t, "($0 * $1)", {g, x}))});
  const int dx = c.e(t, "($0 * $1 - $0 * $0 * $0 * $2 * $3)", {rstd, g, x, mean_gx});
  return {dx, c.l.column(c.e(t, "($0 * $1 * $2)", {dy, x, rstd}), 1)};
}

// logits (R, V) and labels (R,): max, sum of exp, and the label's logit, per row. An
// out-of-range label (the reference throws) gives NaN: a kernel cannot throw.
struct CrossEntropyRow {
  int x, label, m, s, hit, bad;
};
CrossEntropyRow cross_entropy_row(Ctx& c) {
  c.require(is_float(c.in_type(0).dtype), "logits must be float");
  const std::string t = c.ct();
  CrossEntropyRow r;
  r.x = c.row_input(0);
  r.label = c.x(1, Space::kRow);
  c.require(c.l.vals()[r.label].space == Space::kRow, "labels must be one per row");
  r.m = c.max(r.x);
  r.s = c.sum(c.e(t, "KilnMath::exp($0 - $1)", {r.x, r.m}));
  const int j = c.column();
  r.hit = c.e("bool", "($0 == static_cast<long long>($1))", {j, r.label});
  const std::string ignore = lit_int(c.attrs().i("ignore_index"));
  r.bad = c.e("bool",
              fmt::format("(static_cast<long long>($0) != {} && (static_cast<long long>($0) < 0 "
                          "|| static_cast<long long>($0) >= {}))",
                          ignore, lit_int(c.n())),
              {r.label});
  return r;
}

std::vector<int> emit_cross_entropy(Ctx& c) {
  c.require(c.attrs().s("reduction") == "none",
            "reduction \"" + c.attrs().s("reduction") +
                "\" sums over rows (a column reduction); only \"none\" is generated");
  const std::string t = c.ct(), ignore = lit_int(c.attrs().i("ignore_index"));
  CrossEntropyRow r = cross_entropy_row(c);
  const int picked = c.sum(c.e(t, "($0 ? $1 : static_cast<$t>(0))", {r.hit, r.x}));
  return {c.e(t,
              "($4 ? kiln_nan() : static_cast<long long>($0) == " + ignore +
                  " ? static_cast<$t>(0) : $1 + KilnMath::log($2) - $3)",
              {r.label, r.m, r.s, picked, r.bad})};
}

std::vector<int> emit_cross_entropy_grad(Ctx& c) {
  const std::string& reduction = c.attrs().s("reduction");
  c.require(reduction == "none" || reduction == "sum",
            "reduction \"" + reduction +
                "\" divides by the count of labelled rows (a column reduction); only \"none\" "
                "and \"sum\" are generated");
  const std::string t = c.ct(), ignore = lit_int(c.attrs().i("ignore_index"));
  CrossEntropyRow r = cross_entropy_row(c);
  const int dloss = c.x(2, Space::kRow);
  const int p = c.e(t, "(KilnMath::exp($0 - $1) / $2)", {r.x, r.m, r.s});
  return {c.e(t,
              "($4 ? kiln_nan() : static_cast<long long>($0) == " + ignore +
                  " ? static_cast<$t>(0) : ($1 - ($2 ? static_cast<$t>(1) : static_cast<$t>(0)))"
                  " * $3)",
              {r.label, p, r.hit, dloss, r.bad})};
}

// THE emitter table: one entry per op the nvrtc dialect generates; the op of every math line
// is emit_line.
const std::map<Op, Emitter>& emitters() {
  static const std::map<Op, Emitter> table = [] {
    std::map<Op, Emitter> t = {
        {Op::kWhere, [](Ctx& c) { return std::vector<int>{c.e(c.ct(), "($0 ? $1 : $2)", c.operands())}; }},
        {Op::kCast, emit_cast},
        {Op::kConcat, emit_concat},
        {Op::kFull, emit_full},
        {Op::kReshape, emit_reshape},
        {Op::kSum, emit_row_reduction},
        {Op::kMean, emit_row_reduction},
        {Op::kMax, emit_row_reduction},
        {Op::kSoftmax, [](Ctx& c) { return emit_softmax(c, false); }},
        {Op::kLogSoftmax, [](Ctx& c) { return emit_softmax(c, true); }},
        {Op::kSoftmaxGrad, [](Ctx& c) { return emit_softmax_grad(c, false); }},
        {Op::kLogSoftmaxGrad, [](Ctx& c) { return emit_softmax_grad(c, true); }},
        {Op::kLayerNorm, emit_layer_norm},
        {Op::kRmsNorm, emit_rms_norm},
        {Op::kLayerNormGrad, emit_layer_norm_grad},
        {Op::kRmsNormGrad, emit_rms_norm_grad},
        {Op::kCrossEntropy, emit_cross_entropy},
        {Op::kCrossEntropyGrad, emit_cross_entropy_grad},
    };
    for (int i = 0; i < kNumOps; ++i)
      if (ops::is_math_op(static_cast<Op>(i))) t[static_cast<Op>(i)] = emit_line;
    return t;
  }();
  return table;
}

bool is_row_op(Op op) {
  switch (op) {
    case Op::kSum: case Op::kMean: case Op::kMax: case Op::kSoftmax: case Op::kLogSoftmax:
    case Op::kSoftmaxGrad: case Op::kLogSoftmaxGrad: case Op::kLayerNorm: case Op::kRmsNorm:
    case Op::kLayerNormGrad: case Op::kRmsNormGrad:
    case Op::kCrossEntropy: case Op::kCrossEntropyGrad:
      return true;
    default:
      return false;
  }
}

bool is_column_reduction(const Graph& body, const Node& node) {
  return (node.op == Op::kSum || node.op == Op::kMean) && !node.inputs.empty() &&
         column_axes(node.attrs.ints("axes"), body.type(node.inputs[0]).rank());
}

// The iteration space: rows kernels, the first row op's (first) input; elementwise, the largest
// output or column reduction input.
Shape iteration_space(const Graph& body, bool rows) {
  if (rows) {
    for (const Node& node : body.nodes)
      if (is_row_op(node.op) && !is_column_reduction(body, node))
        return body.type(node.inputs[0]).shape;
  }
  Shape best;
  int64_t best_numel = -1;
  auto consider = [&](const Shape& s) {
    if (numel(s) > best_numel) {
      best = s;
      best_numel = numel(s);
    }
  };
  for (ValueId id : body.outputs) consider(body.type(id).shape);
  for (const Node& node : body.nodes)
    if (is_column_reduction(body, node)) consider(body.type(node.inputs[0]).shape);
  return best;
}

// ---- kernel text -----------------------------------------------------------------------------

// Everything a generated kernel starts with: fp16/bf16, the math lines, small helpers.
std::string prelude() {
  return std::string("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n\n") + kEmbeddedMathSource +
         R"(
// ---- helpers (identical in every generated kernel) ----
using KilnMath = kiln::cuda::DeviceMath;
__device__ __forceinline__ float kiln_nan() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ float kiln_inf() { return __int_as_float(0x7f800000); }
// V elements of T as one aligned access.
template <int V, typename T> struct alignas(sizeof(T) * V) KilnPack { T v[V]; };
)";
}

constexpr const char* kBlockReduce = R"(
// Sum (OP 0) or max (OP 1) of v over the block's THREADS threads, returned to every thread:
// warp shuffles, then one round through shared memory.
template <int OP, typename T> __device__ __forceinline__ T kiln_combine(T a, T b) {
  return OP == 0 ? a + b : (a > b || a != a ? a : b);
}
template <int THREADS, int OP, typename T> __device__ __forceinline__ T kiln_block_reduce(T v) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = kiln_combine<OP>(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (THREADS == 32) return v;
  __shared__ T partial[32];
  __syncthreads();  // the previous reduction's readers are done with `partial`
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  v = lane < THREADS / 32 ? partial[lane] : (OP == 0 ? T(0) : partial[0]);
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = kiln_combine<OP>(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
)";

std::string substitute(const MVal& m, const std::vector<std::string>& names) {
  std::string out;
  for (size_t p = 0; p < m.text.size(); ++p) {
    const char ch = m.text[p];
    if (ch == '$' && p + 1 < m.text.size()) {
      const char next = m.text[p + 1];
      if (next == 't') {
        out += m.ctype;
        ++p;
        continue;
      }
      if (next >= '0' && next <= '9') {
        out += names[m.args[next - '0']];
        ++p;
        continue;
      }
    }
    out += ch;
  }
  return out;
}

constexpr size_t kMaxColumnSharedBytes = 32768;

struct Lowered {
  std::vector<MVal> vals;
  std::vector<int> outputs;  // per body output: its micro value
  std::vector<int> columns;  // the body outputs that are column reductions
  std::vector<RowPad> pads;  // per body output: the columns stored after each row
  std::string column_ctype;  // what they are summed in ("float" or "double")
  Shape s;
  int64_t rows = 0, n = 1;
  std::vector<std::string> ops;
};

Lowered lower(const Graph& body, FusedKind kind) {
  const bool rows = kind == FusedKind::kRows;
  if (!rows && kind != FusedKind::kElementwise)
    unsupported(fmt::format("kind \"{}\" is not generated (only \"elementwise\" and \"rows\")",
                            fused_kind_name(kind)));
  if (body.outputs.empty()) unsupported("the body has no outputs");
  Lowering l(body, rows, iteration_space(body, rows));
  Lowered out;
  for (const Node& node : body.nodes) {
    out.ops.emplace_back(op_info(node.op).name);
    auto it = emitters().find(node.op);
    if (it == emitters().end())
      unsupported(fmt::format("op {} has no emitter", op_info(node.op).name));
    Ctx c(l, node);
    std::vector<int> ids = it->second(c);
    if (ids.size() != node.outputs.size())
      unsupported(fmt::format("op {}: {} outputs, the emitter gives {}", op_info(node.op).name,
                              node.outputs.size(), ids.size()));
    for (size_t k = 0; k < ids.size(); ++k) {
      // Emitters compute in the output's C type; make the stored dtype's rounding explicit
      // only where it changes the C type (bool from comparisons is already exact).
      l.computed()[node.outputs[k]] = ids[k];
    }
  }
  for (ValueId id : body.outputs) {
    const Shape& shape = body.type(id).shape;
    int m = -1;
    if (auto it = l.computed().find(id); it != l.computed().end()) {
      m = it->second;
    } else {
      const int input = body.input_index(id);
      if (input < 0) unsupported("a body output is neither computed nor an input");
      m = l.load(input, numel(shape) == l.r() && rows ? Space::kRow : Space::kFull, &shape);
    }
    const MVal& v = l.vals()[m];
    const auto pad = l.pads().find(id);
    out.pads.push_back(pad == l.pads().end() ? RowPad{} : pad->second);
    if (v.kind == MKind::kColumn) {
      if (numel(shape) != l.n())
        unsupported(fmt::format("column reduction output {} has shape {}, not one value per "
                                "column of {}",
                                body.value(id).name, to_string(shape), to_string(l.s())));
      if (v.ctype != "float" && v.ctype != "double")
        unsupported("a column reduction computed in " + v.ctype);
      if (!out.column_ctype.empty() && out.column_ctype != v.ctype)
        unsupported("column reductions computed in both float and double");
      out.column_ctype = v.ctype;
      out.columns.push_back(static_cast<int>(out.outputs.size()));
      out.outputs.push_back(m);
      continue;
    }
    const bool full = v.space == Space::kFull;
    if (full && numel(shape) != l.r() * (l.n() + out.pads.back().width))
      unsupported(fmt::format("output {} has shape {}, not the iteration space {}",
                              body.value(id).name, to_string(shape), to_string(l.s())));
    if (!full && numel(shape) != (rows ? l.r() : l.r() * l.n()))
      unsupported(fmt::format("output {} of shape {} is neither per element nor per row of {}",
                              body.value(id).name, to_string(shape), to_string(l.s())));
    out.outputs.push_back(m);
  }
  out.vals = std::move(l.vals());
  out.s = l.s();
  out.rows = l.r();
  out.n = l.n();
  // Rows kernels keep the block's column sums in shared memory (one slot per column).
  if (rows && !out.columns.empty() &&
      out.columns.size() * static_cast<size_t>(out.n) * (out.column_ctype == "double" ? 8 : 4) >
          kMaxColumnSharedBytes)
    unsupported(fmt::format("{} column reductions of {} columns exceed the {} bytes of shared "
                            "memory a rows kernel keeps them in",
                            out.columns.size(), out.n, kMaxColumnSharedBytes));
  return out;
}

std::string header(FusedKind kind, const Lowered& low, const Graph& body) {
  std::string text = fmt::format(
      "// kiln fused kernel ({}), generated by the nvrtc dialect (backends/cuda/nvrtc/codegen.cc).\n"
      "// ops: {}\n// iteration space {} = {} rows of {}\n",
      fused_kind_name(kind), fmt::join(low.ops, ", "), to_string(low.s), low.rows, low.n);
  // Types only, never value names: the source is the compile caches' key, and the same body
  // in every layer (names h0.ln1.weight, h1.ln1.weight, ...) must be one compile, not one each.
  for (size_t k = 0; k < body.inputs.size(); ++k)
    text += fmt::format("//   in{}: {}\n", k, to_string(body.type(body.inputs[k].value)));
  for (size_t k = 0; k < body.outputs.size(); ++k)
    text += fmt::format("//   out{}: {}\n", k, to_string(body.type(body.outputs[k])));
  return text;
}

std::string params(const Graph& body) {
  std::vector<std::string> p;
  for (size_t k = 0; k < body.inputs.size(); ++k)
    p.push_back(fmt::format("const {}* __restrict__ in{}",
                            storage_of(body.type(body.inputs[k].value).dtype), k));
  for (size_t k = 0; k < body.outputs.size(); ++k)
    p.push_back(
        fmt::format("{}* __restrict__ out{}", storage_of(body.type(body.outputs[k]).dtype), k));
  return fmt::format("{}", fmt::join(p, ", "));
}
std::string param_names(const Graph& body) {
  std::vector<std::string> p;
  for (size_t k = 0; k < body.inputs.size(); ++k) p.push_back(fmt::format("in{}", k));
  for (size_t k = 0; k < body.outputs.size(); ++k) p.push_back(fmt::format("out{}", k));
  return fmt::format("{}", fmt::join(p, ", "));
}

std::string var(int id) { return fmt::format("v{}", id); }

// Emits, in order, the statements for `targets` and what they need that is not yet in `done`
// (a value's args first), as `const T vK = ...;`. `load_text` gives a load's expression.
void emit_closure(const std::vector<MVal>& vals, const std::vector<int>& targets,
                  std::set<int>& done, const std::function<bool(int)>& include,
                  const std::function<std::string(int)>& load_text, const std::string& indent,
                  std::string& out) {
  std::vector<std::string> names(vals.size());
  for (size_t k = 0; k < vals.size(); ++k) names[k] = var(static_cast<int>(k));
  std::function<void(int)> visit = [&](int id) {
    if (done.count(id) || !include(id)) return;
    done.insert(id);
    const MVal& m = vals[id];
    for (int a : m.args) visit(a);
    std::string rhs = m.kind == MKind::kLoad ? load_text(id) : substitute(m, names);
    out += fmt::format("{}const {} {} = {};\n", indent, m.ctype, var(id), rhs);
  };
  for (int t : targets) visit(t);
}

// ---- column reductions (shared by the elementwise and rows kernels) ----

// Kernel parameters when the body has column reductions: the body's tensors, then the scratch
// buffer of per-tile partial sums.
std::string column_params(const Graph& body, const Lowered& low) {
  return params(body) + fmt::format(", {}* __restrict__ kiln_partials", low.column_ctype);
}
std::string column_param_names(const Graph& body) { return param_names(body) + ", kiln_partials"; }

// The second kernel: column c of column output o is the sum of the `tiles` partials
// partials[(o' * tiles + t) * N + c] (o' numbering the column outputs), divided by the count for
// a mean. Blocks of 32 columns x 8 threads per column: thread y adds tiles y, y + 8, ... in
// order, then the 8 sums are added in order. A fixed order: the result does not depend on
// scheduling (no atomics).
std::string column_finish(const Graph& body, const Lowered& low, int64_t tiles,
                          GeneratedKernel& k) {
  k.finish_entry = "kiln_fused_columns_finish";
  k.finish_threads = 256;
  k.finish_blocks = std::max<int64_t>(1, (low.n + 31) / 32);
  const std::string& t = low.column_ctype;
  std::string text = fmt::format(
      "\n// Adds each column's {} partial(s) in a fixed order (deterministic) into the column "
      "outputs.\n"
      "extern \"C\" __global__ void __launch_bounds__(256) {}({}) {{\n"
      "  __shared__ {} kiln_sh[8][32];\n"
      "  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;\n"
      "  const long long c = static_cast<long long>(blockIdx.x) * 32 + tx;\n",
      tiles, k.finish_entry, column_params(body, low), t);
  for (size_t q = 0; q < low.columns.size(); ++q) {
    const int o = low.columns[q];
    const MVal& m = low.vals[low.outputs[o]];
    std::string value = "s";
    if (m.divisor != 1) value = fmt::format("(s / {})", lit(t, static_cast<double>(m.divisor)));
    text += fmt::format(
        "  {{\n"
        "    {} s = {};\n"
        "    if (c < {}) for (long long t = ty; t < {}; t += 8) s += kiln_partials[({} + t) * {} "
        "+ c];\n"
        "    kiln_sh[ty][tx] = s;\n"
        "    __syncthreads();\n"
        "    if (ty == 0 && c < {}) {{\n"
        "      s = {};\n"
        "      for (int g = 0; g < 8; ++g) s += kiln_sh[g][tx];\n"
        "      out{}[c] = {};\n"
        "    }}\n"
        "    __syncthreads();\n"
        "  }}\n",
        t, lit(t, 0.0), lit_int(low.n), lit_int(tiles), lit_int(static_cast<int64_t>(q) * tiles),
        lit_int(low.n), lit_int(low.n), lit(t, 0.0), o,
        store_conversion(body.type(body.outputs[o]).dtype, value));
  }
  text += "}\n";
  return text;
}

void set_param_bytes(const Graph& body, GeneratedKernel& k) {
  for (const GraphInput& in : body.inputs)
    k.param_element_bytes.push_back(static_cast<int>(dtype_size(body.type(in.value).dtype)));
  for (ValueId id : body.outputs)
    k.param_element_bytes.push_back(static_cast<int>(dtype_size(body.type(id).dtype)));
}

// Elementwise bodies with column reductions: a 2-D grid, block (x, y) handles the strip x of
// kStrip columns over the tile y of kRowTile rows. Its kTX x kTY threads: kTX along the strip,
// kV consecutive columns each (vector accesses), kTY rows apart. Each thread computes the body
// on its rows, writes the per-element outputs, and sums its columns' terms in registers; the
// block then adds its kTY rows of sums in a fixed order through shared memory and writes one
// partial per column for its tile; column_finish adds the tiles.
GeneratedKernel generate_columns(const Graph& body, const Lowered& low) {
  GeneratedKernel k;
  k.kind = FusedKind::kElementwise;
  k.rows = low.rows;
  k.row_length = low.n;
  k.ops = low.ops;
  k.column_outputs = low.columns;
  const std::set<int> is_column(low.columns.begin(), low.columns.end());
  const int64_t rows = low.rows, n = low.n;
  // Vector width: 16-byte accesses of the widest stored per-element type, dividing every row
  // length the loads run along (the column outputs are written by the second kernel).
  size_t widest = 1;
  for (const GraphInput& in : body.inputs)
    widest = std::max(widest, dtype_size(body.type(in.value).dtype));
  for (size_t o = 0; o < body.outputs.size(); ++o)
    if (!is_column.count(static_cast<int>(o)))
      widest = std::max(widest, dtype_size(body.type(body.outputs[o]).dtype));
  int v = static_cast<int>(std::min<size_t>(8, 16 / widest));
  auto divides_all = [&](int w) {
    if (n % w != 0) return false;
    for (const MVal& m : low.vals)
      if (m.kind == MKind::kLoad && m.text != "0" && m.target_last % w != 0) return false;
    return true;
  };
  while (v > 1 && !divides_all(v)) v /= 2;
  k.vector_width = v;
  // Geometry: a warp across the strip where the row is that long; about 1024 blocks in all
  // (several per SM), tiles a multiple of kTY rows.
  const int64_t groups = std::max<int64_t>(1, n / v);
  int tx = 1;
  while (tx < 32 && tx < groups) tx *= 2;
  const int ty = 256 / tx;
  const int64_t strip = static_cast<int64_t>(tx) * v;
  const int64_t strips = std::max<int64_t>(1, (n + strip - 1) / strip);
  const int64_t want_tiles = std::max<int64_t>(1, 1024 / strips);
  int64_t row_tile = (rows + want_tiles - 1) / want_tiles;
  row_tile = std::max<int64_t>(ty, (row_tile + ty - 1) / ty * ty);
  const int64_t tiles = (rows + row_tile - 1) / row_tile;
  k.threads = 256;
  k.blocks = strips;
  k.blocks_y = tiles;
  k.scalar_blocks = strips;
  k.partial_tiles = tiles;
  k.partials_bytes = low.columns.size() * static_cast<size_t>(tiles) * static_cast<size_t>(n) *
                     (low.column_ctype == "double" ? 8 : 4);
  set_param_bytes(body, k);

  const std::string acc_t = low.column_ctype;
  std::string text = header(FusedKind::kElementwise, low, body);
  text += fmt::format(
      "// {} column reduction(s) over {} rows: blocks of {} rows x {} columns ({} x {} threads, "
      "{} columns each), {} x {} blocks; then a second kernel adds the {} tile partials per "
      "column\n",
      low.columns.size(), rows, row_tile, strip, tx, ty, v, strips, tiles, tiles);
  text += prelude();
  text += fmt::format(
      "\nconstexpr long long kRows = {}, kN = {}, kRowTile = {};\n"
      "constexpr int kTX = {}, kTY = {}, kV = {}, kStrip = {};\n\n",
      lit_int(rows), lit_int(n), lit_int(row_tile), tx, ty, v, strip);
  text += "// VEC: 16-byte vector accesses (every pointer aligned); else element by element, "
          "same geometry.\ntemplate <bool VEC>\n__device__ __forceinline__ void kiln_tile(" +
          column_params(body, low) + ") {\n";
  text += fmt::format("  __shared__ {} kiln_sh[kTY * kStrip];\n", acc_t);
  text +=
      "  const int tx = threadIdx.x % kTX, ty = threadIdx.x / kTX;\n"
      "  const long long col = static_cast<long long>(blockIdx.x) * kStrip + tx * kV;\n"
      "  const long long row0 = static_cast<long long>(blockIdx.y) * kRowTile;\n"
      "  const long long row1 = row0 + kRowTile < kRows ? row0 + kRowTile : kRows;\n";
  for (size_t q = 0; q < low.columns.size(); ++q)
    text += fmt::format("  {} c{}[kV];\n  #pragma unroll\n  for (int v = 0; v < kV; ++v) c{}[v] "
                        "= {};\n",
                        acc_t, q, q, lit(acc_t, 0.0));
  text += "  if (col < kN) {\n    for (long long r = row0 + ty; r < row1; r += kTY) {\n"
          "      const long long i = r * kN + col;\n";
  for (size_t id = 0; id < low.vals.size(); ++id) {
    const MVal& m = low.vals[id];
    if (m.kind != MKind::kLoad) continue;
    const DType d = body.type(body.inputs[m.input].value).dtype;
    const std::string st = storage_of(d);
    text += fmt::format("      {} a{}[kV];\n", m.ctype, id);
    if (m.contiguous) {
      text += fmt::format(
          "      if (VEC) {{\n"
          "        const KilnPack<kV, {}> p = *reinterpret_cast<const KilnPack<kV, {}>*>(in{} + "
          "({}));\n"
          "        #pragma unroll\n        for (int v = 0; v < kV; ++v) a{}[v] = {};\n"
          "      }} else {{\n"
          "        #pragma unroll\n        for (int v = 0; v < kV; ++v) a{}[v] = {};\n"
          "      }}\n",
          st, st, m.input, m.text, id, load_conversion(d, "p.v[v]"), id,
          load_conversion(d, fmt::format("in{}[({}) + v]", m.input, m.text)));
    } else {
      text += fmt::format(
          "      {{\n        const {} s = {};\n        #pragma unroll\n        for (int v = 0; v < "
          "kV; ++v) a{}[v] = s;\n      }}\n",
          m.ctype, load_conversion(d, fmt::format("in{}[{}]", m.input, m.text)), id);
    }
  }
  std::vector<int> targets;
  for (size_t o = 0; o < body.outputs.size(); ++o) {
    const MVal& m = low.vals[low.outputs[o]];
    targets.push_back(m.kind == MKind::kColumn ? m.args[0] : low.outputs[o]);
    if (!is_column.count(static_cast<int>(o)))
      text += fmt::format("      KilnPack<kV, {}> r{};\n",
                          storage_of(body.type(body.outputs[o]).dtype), o);
  }
  text += "      #pragma unroll\n      for (int v = 0; v < kV; ++v) {\n";
  std::set<int> done;
  emit_closure(low.vals, targets, done, [](int) { return true; },
               [](int id) { return fmt::format("a{}[v]", id); }, "        ", text);
  for (size_t o = 0; o < body.outputs.size(); ++o)
    if (!is_column.count(static_cast<int>(o)))
      text += fmt::format("        r{}.v[v] = {};\n", o,
                          store_conversion(body.type(body.outputs[o]).dtype,
                                           var(low.outputs[o])));
  for (size_t q = 0; q < low.columns.size(); ++q)
    text += fmt::format("        c{}[v] += {};\n", q,
                        var(low.vals[low.outputs[low.columns[q]]].args[0]));
  text += "      }\n";
  for (size_t o = 0; o < body.outputs.size(); ++o) {
    if (is_column.count(static_cast<int>(o))) continue;
    const std::string st = storage_of(body.type(body.outputs[o]).dtype);
    text += fmt::format(
        "      if (VEC) {{\n        *reinterpret_cast<KilnPack<kV, {}>*>(out{} + i) = r{};\n"
        "      }} else {{\n        #pragma unroll\n        for (int v = 0; v < kV; ++v) out{}[i + "
        "v] = r{}.v[v];\n      }}\n",
        st, o, o, o, o);
  }
  text += "    }\n  }\n";
  text += "  // The block's kTY row sums of each column, added in a fixed order.\n";
  for (size_t q = 0; q < low.columns.size(); ++q) {
    text += fmt::format(
        "  #pragma unroll\n  for (int v = 0; v < kV; ++v) kiln_sh[ty * kStrip + tx * kV + v] = "
        "c{}[v];\n"
        "  __syncthreads();\n"
        "  if (threadIdx.x < kStrip && static_cast<long long>(blockIdx.x) * kStrip + threadIdx.x "
        "< kN) {{\n"
        "    {} s = {};\n"
        "    for (int t = 0; t < kTY; ++t) s += kiln_sh[t * kStrip + threadIdx.x];\n"
        "    kiln_partials[({} + blockIdx.y) * kN + static_cast<long long>(blockIdx.x) * kStrip + "
        "threadIdx.x] = s;\n"
        "  }}\n"
        "  __syncthreads();\n",
        q, acc_t, lit(acc_t, 0.0), lit_int(static_cast<int64_t>(q) * tiles));
  }
  text += "}\n\n";
  const std::string args = column_param_names(body);
  auto entry = [&](const std::string& name, bool vec) {
    return fmt::format(
        "extern \"C\" __global__ void __launch_bounds__(256) {}({}) {{\n  kiln_tile<{}>({});\n}}\n",
        name, column_params(body, low), vec ? "true" : "false", args);
  };
  k.entry = v > 1 ? "kiln_fused_columns_vec" : "kiln_fused_columns";
  text += entry(k.entry, v > 1);
  if (v > 1) {
    text += "\n// For pointers not aligned to kV elements.\n";
    k.scalar_entry = "kiln_fused_columns";
    text += entry(k.scalar_entry, false);
  }
  text += column_finish(body, low, tiles, k);
  k.source = std::move(text);
  return k;
}

// ---- elementwise kernels ----

GeneratedKernel generate_elementwise(const Graph& body, const Lowered& low) {
  if (!low.columns.empty()) return generate_columns(body, low);
  GeneratedKernel k;
  k.kind = FusedKind::kElementwise;
  k.rows = low.rows;
  k.row_length = low.n;
  k.ops = low.ops;
  const int64_t total = low.rows * low.n;
  // Vector width: 16-byte accesses of the widest stored type, dividing every row length the
  // loads run along.
  size_t widest = 1;
  for (const GraphInput& in : body.inputs)
    widest = std::max(widest, dtype_size(body.type(in.value).dtype));
  for (ValueId id : body.outputs) widest = std::max(widest, dtype_size(body.type(id).dtype));
  int v = static_cast<int>(std::min<size_t>(8, 16 / widest));
  auto divides_all = [&](int w) {
    if (low.n % w != 0) return false;
    for (const MVal& m : low.vals)
      if (m.kind == MKind::kLoad && m.text != "0" && m.target_last % w != 0) return false;
    return true;
  };
  while (v > 1 && !divides_all(v)) v /= 2;
  k.vector_width = v;
  for (const GraphInput& in : body.inputs)
    k.param_element_bytes.push_back(static_cast<int>(dtype_size(body.type(in.value).dtype)));
  for (ValueId id : body.outputs)
    k.param_element_bytes.push_back(static_cast<int>(dtype_size(body.type(id).dtype)));

  std::string text = header(FusedKind::kElementwise, low, body);
  text += fmt::format("// {} elements, {} per thread ({}-byte accesses of the widest type)\n",
                      total, v, v * widest);
  text += prelude();
  text += fmt::format("\nconstexpr long long kElements = {}LL;\n\n", total);
  text += "// Elements i .. i + V - 1 (one row segment: V divides every row length).\n";
  text += "template <int V>\n__device__ __forceinline__ void kiln_elements(long long i, " +
          params(body) + ") {\n";
  // Loads: whole vectors where contiguous along the row, one broadcast element otherwise.
  for (size_t id = 0; id < low.vals.size(); ++id) {
    const MVal& m = low.vals[id];
    if (m.kind != MKind::kLoad) continue;
    const DType d = body.type(body.inputs[m.input].value).dtype;
    const std::string st = storage_of(d);
    text += fmt::format("  {} a{}[V];\n", m.ctype, id);
    if (m.contiguous) {
      text += fmt::format(
          "  {{\n    const KilnPack<V, {}> p = *reinterpret_cast<const KilnPack<V, {}>*>(in{} + "
          "({}));\n    #pragma unroll\n    for (int v = 0; v < V; ++v) a{}[v] = {};\n  }}\n",
          st, st, m.input, m.text, id, load_conversion(d, "p.v[v]"));
    } else {
      text += fmt::format(
          "  {{\n    const {} s = {};\n    #pragma unroll\n    for (int v = 0; v < V; ++v) "
          "a{}[v] = s;\n  }}\n",
          m.ctype, load_conversion(d, fmt::format("in{}[{}]", m.input, m.text)), id);
    }
  }
  for (size_t o = 0; o < body.outputs.size(); ++o)
    text += fmt::format("  KilnPack<V, {}> r{};\n", storage_of(body.type(body.outputs[o]).dtype),
                        o);
  text += "  #pragma unroll\n  for (int v = 0; v < V; ++v) {\n";
  std::set<int> done;
  emit_closure(low.vals, low.outputs, done, [](int) { return true; },
               [](int id) { return fmt::format("a{}[v]", id); }, "    ", text);
  for (size_t o = 0; o < body.outputs.size(); ++o)
    text += fmt::format("    r{}.v[v] = {};\n", o,
                        store_conversion(body.type(body.outputs[o]).dtype, var(low.outputs[o])));
  text += "  }\n";
  for (size_t o = 0; o < body.outputs.size(); ++o) {
    const std::string st = storage_of(body.type(body.outputs[o]).dtype);
    text += fmt::format("  *reinterpret_cast<KilnPack<V, {}>*>(out{} + i) = r{};\n", st, o, o);
  }
  text += "}\n\n";
  const std::string args = param_names(body);
  k.threads = 256;
  auto entry = [&](const std::string& name, int width) {
    return fmt::format(
        "extern \"C\" __global__ void __launch_bounds__(256) {}({}) {{\n"
        "  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x * {};\n"
        "  for (long long i = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * "
        "{};\n       i < kElements; i += stride)\n"
        "    kiln_elements<{}>(i, {});\n}}\n",
        name, params(body), width, width, width, args);
  };
  auto blocks_for = [&](int width) {
    const int64_t groups = (total + width - 1) / width;
    return std::clamp<int64_t>((groups + 255) / 256, 1, int64_t{1} << 20);
  };
  k.entry = v > 1 ? "kiln_fused_vec" : "kiln_fused";
  text += entry(k.entry, v);
  k.blocks = blocks_for(v);
  if (v > 1) {
    text += "\n// For pointers not aligned to V elements.\n";
    k.scalar_entry = "kiln_fused";
    text += entry(k.scalar_entry, 1);
    k.scalar_blocks = blocks_for(1);
  }
  k.source = std::move(text);
  return k;
}

// ---- rows kernels ----

GeneratedKernel generate_rows(const Graph& body, const Lowered& low) {
  GeneratedKernel k;
  k.kind = FusedKind::kRows;
  k.rows = low.rows;
  k.row_length = low.n;
  k.ops = low.ops;
  // Threads per row: about 4 elements each, a whole warp at least, 1024 at most. Rows of up to
  // kWarpRowMax elements go one warp each, 8 rows to a block (4 with column sums): the row's reductions are warp shuffles only (no __syncthreads, no shared memory),
  // and each thread has a few dozen loads in flight instead of 3 (GPT-2's LayerNorm rows of 768
  // ran at a third of the bandwidth with a 256-thread block per row).
  constexpr int64_t kWarpRowMax = 1024;
  const bool columns = !low.columns.empty();
  const bool warp_rows = low.n <= kWarpRowMax;
  const std::string acc_t = low.column_ctype;
  const int64_t acc_bytes = acc_t == "double" ? 8 : 4;
  const int64_t column_values = static_cast<int64_t>(low.columns.size()) * low.n;
  // Warp mode with V columns per lane and step (see entry_text): a lane's elements, and a
  // warp's shared-memory column sums, [q][m][lane] (lanes adjacent: no bank conflicts).
  constexpr int kRowsVector = 4;
  bool rows_divide = low.n % kRowsVector == 0;  // every stored row starts V-aligned
  for (const RowPad& pad : low.pads) rows_divide = rows_divide && pad.width % kRowsVector == 0;
  const int vector = warp_rows && rows_divide ? kRowsVector : 1;
  auto lane_elements = [&](int v) -> int64_t { return (low.n + 32 * v - 1) / (32 * v) * v; };
  const int64_t warp_sums = static_cast<int64_t>(low.columns.size()) * 32 *
                            std::max(lane_elements(1), lane_elements(vector));
  // Warps (rows) per block in warp mode: 8; with column sums 4, or fewer where their shared
  // memory would pass the 48 KiB of static shared memory.
  int warps = 8;
  if (columns && warp_rows) {
    warps = 4;
    while (warps > 1 && warps * warp_sums * acc_bytes > 48 * 1024) warps /= 2;
  }
  int threads = 32;
  while (!warp_rows && threads < 1024 && threads * 4 < low.n) threads *= 2;
  k.threads = warp_rows ? 32 * warps : threads;
  k.blocks = warp_rows ? (low.rows + warps - 1) / warps : low.rows;
  set_param_bytes(body, k);
  // Column reductions: a fixed grid of blocks, each taking rows blockIdx.x, + kGrid, ...; a
  // thread adds its columns' terms (j = threadIdx.x + m kThreads, the same columns in every
  // row) into the block's shared-memory sums, written out at the end as the block's partials.
  // A warp per row: warp w of block b takes rows W b + w, + W kGrid, ...; each lane adds its
  // columns' terms into its warp's own shared-memory sums (a lane owns its slots: no atomics,
  // no barrier), and the block's warps' sums are added in warp order at the end
  // (deterministic). Shared memory rather than registers: a LayerNorm gradient's three column
  // sums of a 768 row took 72 registers a lane, and at ~210 a kernel ran 8 warps per SM.
  const int64_t grid = warp_rows ? std::min<int64_t>(k.blocks, 512)
                                 : std::min<int64_t>(low.rows, 1024);
  if (columns) {
    k.blocks = grid;
    k.column_outputs = low.columns;
    k.partial_tiles = grid;
    k.partials_bytes = low.columns.size() * static_cast<size_t>(grid) *
                       static_cast<size_t>(low.n) * (acc_t == "double" ? 8 : 4);
  }

  const std::vector<MVal>& vals = low.vals;
  int max_level = 0;
  for (const MVal& m : vals)
    if (m.kind == MKind::kReduce) max_level = std::max(max_level, m.level);

  std::string text = header(FusedKind::kRows, low, body);
  if (columns && warp_rows)
    text += fmt::format(
        "// {} blocks of {} warps, a warp per row (rows 8 blockIdx.x + warp + m * {}); {} "
        "pass(es) over a row; {} column reduction(s) summed per lane in registers, then per "
        "block, then a second kernel adds the {} block partials per column\n",
        grid, warps, grid * warps, max_level + 1, low.columns.size(),
        grid);
  else if (columns)
    text += fmt::format(
        "// {} blocks of {} threads, each over rows blockIdx.x + m * {}; {} pass(es) over a row; "
        "{} column reduction(s) summed per block in shared memory, then a second kernel adds "
        "the {} block partials per column\n",
        grid, threads, grid, max_level + 1, low.columns.size(), grid);
  else if (warp_rows)
    text += fmt::format("// one warp per row, {} rows per block; {} pass(es) over the row\n",
                        warps, max_level + 1);
  else
    text += fmt::format("// one block of {} threads per row; {} pass(es) over the row\n", threads,
                        max_level + 1);
  text += prelude();
  text += kBlockReduce;
  text += fmt::format("\nconstexpr int kThreads = {};\nconstexpr long long kN = {}LL;\n\n",
                      threads, low.n);
  // Warp mode takes V adjacent columns per lane and step (V = kRowsVector where the row length
  // allows): lane t's elements m = g V + u are columns (t + 32 g) V + u, loaded and stored as
  // one V-wide access per input and output, so a warp moves 512 bytes of f32 per instruction
  // instead of 128 (GPT-2's LayerNorm rows: vector accesses keep more bytes in flight). A second
  // entry with V = 1 serves pointers not aligned to V elements (launch_generated checks).
  k.vector_width = vector;
  // Where output o's row starts: base = row * kN, or row * (kN + width) when it is padded.
  auto row_start = [&](size_t o) {
    const int64_t width = low.pads[o].width;
    return width == 0 ? std::string("base") : fmt::format("row * {}", lit_int(low.n + width));
  };
  auto entry_text = [&](const std::string& name, int v) {
    std::string text;
    const int64_t lane_columns = lane_elements(v);  // warp mode: elements per lane
    const int64_t groups = lane_columns / v;          // warp mode: V-wide steps per lane
    text += fmt::format("extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{\n",
                        k.threads, name, columns ? column_params(body, low) : params(body));
    if (columns && warp_rows) {
      // kiln_cw[(q * L + m) * 32 + lane]: this warp's sum of column output q over the lane's
      // element m (L per lane); each lane zeroes and adds its own slots only.
      text += fmt::format(
          "  __shared__ {0} kiln_col[{1}];\n"
          "  {0} * const kiln_cw = kiln_col + (threadIdx.x >> 5) * {2} + (threadIdx.x & 31);\n"
          "  for (int s = 0; s < {2}; s += 32) kiln_cw[s] = {3};\n",
          acc_t, lit_int(warps * warp_sums), lit_int(warp_sums), lit(acc_t, 0.0));
      text += fmt::format(
          "  for (long long row = static_cast<long long>(blockIdx.x) * {} + (threadIdx.x >> 5); "
          "row < {}; row += {}) {{\n"
          "  const long long base = row * kN;\n",
          warps, lit_int(low.rows), lit_int(grid * warps));
    } else if (columns) {
      text += fmt::format(
          "  __shared__ {} kiln_col[{}];\n"
          "  for (int j = threadIdx.x; j < {}; j += kThreads) kiln_col[j] = {};\n"
          "  __syncthreads();\n"
          "  for (long long row = blockIdx.x; row < {}; row += {}) {{\n"
          "  const long long base = row * kN;\n",
          acc_t, lit_int(static_cast<int64_t>(low.columns.size()) * low.n),
          lit_int(static_cast<int64_t>(low.columns.size()) * low.n), lit(acc_t, 0.0),
          lit_int(low.rows), lit_int(grid));
    } else if (warp_rows) {
      // A warp past the last row leaves at once: its reductions are warp-only, nobody waits.
      text += fmt::format(
          "  const long long row = static_cast<long long>(blockIdx.x) * {} + (threadIdx.x >> 5);\n"
          "  if (row >= {}) return;\n  const long long base = row * kN;\n",
          warps, lit_int(low.rows));
    } else {
      text += "  const long long row = blockIdx.x;\n  const long long base = row * kN;\n";
    }
    // The thread's place in its row's group of kThreads.
    text += warp_rows ? "  const int kiln_t = threadIdx.x & 31;\n"
                      : "  const int kiln_t = threadIdx.x;\n";

    // Warp mode: every input read along the whole row (index e) is loaded once per row into
    // registers, kiln_r<input>[m] holding the lane's element m, and every pass reads it from
    // there (a pass's column loop is unrolled over the lane's columns). Without that a LayerNorm
    // gradient read x four times and dy three times a row through L1/L2.
    // Only inputs a reduction pass reads: one the final pass alone reads is loaded there, in
    // its V-wide step, and holds no registers through the passes before (a LayerNorm
    // gradient's residual gradient: 24 registers a lane).
    std::set<int> cached_inputs;
    if (warp_rows) {
      std::vector<bool> seen(vals.size(), false);
      std::vector<int> stack;
      for (const MVal& m : vals)
        if (m.kind == MKind::kReduce) stack.push_back(m.args[0]);
      while (!stack.empty()) {
        const int id = stack.back();
        stack.pop_back();
        if (seen[static_cast<size_t>(id)] || vals[id].space != Space::kFull) continue;
        seen[static_cast<size_t>(id)] = true;
        const MVal& m = vals[id];
        if (m.kind == MKind::kLoad && m.text == "e") cached_inputs.insert(m.input);
        for (int a : m.args) stack.push_back(a);
      }
    }
    // The other inputs read along the row: loaded V wide in the final pass (kiln_q<input>).
    std::set<int> step_inputs;
    if (warp_rows)
      for (const MVal& m : vals)
        if (m.kind == MKind::kLoad && m.space == Space::kFull && m.text == "e" &&
            !cached_inputs.count(m.input))
          step_inputs.insert(m.input);
    auto load_text = [&](int id) {
      const MVal& m = vals[id];
      if (m.space == Space::kFull && m.text == "e" && cached_inputs.count(m.input))
        return fmt::format("kiln_r{}[m]", m.input);
      if (m.space == Space::kFull && m.text == "e" && step_inputs.count(m.input))
        return load_conversion(body.type(body.inputs[m.input].value).dtype,
                               fmt::format("kiln_q{}.v[u]", m.input));
      const DType d = body.type(body.inputs[m.input].value).dtype;
      return load_conversion(d, fmt::format("in{}[{}]", m.input, m.text));
    };
    std::set<int> done;
    auto is_row = [&](int id) { return vals[id].space == Space::kRow; };
    auto is_full = [&](int id) { return vals[id].space == Space::kFull; };
    // Row values of level <= `level` that something needs, in order.
    auto emit_row_values = [&](int level) {
      std::vector<int> ready;
      for (size_t id = 0; id < vals.size(); ++id)
        if (is_row(static_cast<int>(id)) && vals[id].kind != MKind::kReduce &&
            vals[id].level <= level)
          ready.push_back(static_cast<int>(id));
      emit_closure(vals, ready, done,
                   [&](int id) { return is_row(id) && vals[id].kind != MKind::kReduce; },
                   load_text, "  ", text);
    };
    // Warp mode: an outer loop over the lane's V-wide steps (j0: the step's first column), an
    // inner one over its V elements (m, j, e); between them, a step's vector loads and stores.
    const std::string outer_head =
        fmt::format("#pragma unroll\n  for (int g = 0; g < {}; ++g) {{\n"
                    "    const int j0 = (kiln_t + 32 * g) * {};\n"
                    "    if (j0 >= kN) break;\n",
                    groups, v);
    const std::string inner_head = fmt::format(
        "#pragma unroll\n    for (int u = 0; u < {}; ++u) {{\n    const int m = g * {} + u;\n"
        "    const int j = j0 + u;\n    const long long e = base + j;\n",
        v, v);
    const std::string loop_head =
        warp_rows ? outer_head + inner_head
                  : std::string("  for (int j = kiln_t; j < kN; j += kThreads) {\n"
                                "    const long long e = base + j;\n");
    const std::string loop_tail = warp_rows ? "    }\n  }\n" : "  }\n";
    auto pack = [&](DType d) { return fmt::format("KilnPack<{}, {}>", v, storage_of(d)); };
    for (int input : cached_inputs) {
      const DType d = body.type(body.inputs[input].value).dtype;
      text += fmt::format("  {} kiln_r{}[{}];\n", ctype_of(d), input, lane_columns);
      text += outer_head;
      text += fmt::format(
          "    const {0} kiln_p = *reinterpret_cast<const {0}*>(in{1} + base + j0);\n"
          "#pragma unroll\n    for (int u = 0; u < {2}; ++u) kiln_r{1}[g * {2} + u] = {3};\n  }}\n",
          pack(d), input, v, load_conversion(d, "kiln_p.v[u]"));
    }
    for (int level = 1; level <= max_level; ++level) {
      emit_row_values(level - 1);
      std::vector<int> reductions;
      for (size_t id = 0; id < vals.size(); ++id)
        if (vals[id].kind == MKind::kReduce && vals[id].level == level)
          reductions.push_back(static_cast<int>(id));
      text += fmt::format("  // pass {}: {} reduction(s)\n", level, reductions.size());
      for (int id : reductions)
        text += fmt::format("  {} acc{} = {};\n", vals[id].ctype, id,
                            vals[id].reduce == ReduceOp::kSum ? lit(vals[id].ctype, 0.0)
                                                              : "-" + lit(vals[id].ctype, INFINITY));
      text += loop_head;
      std::set<int> pass_done = done;  // full values are recomputed in every pass
      std::vector<int> args;
      for (int id : reductions) args.push_back(vals[id].args[0]);
      emit_closure(vals, args, pass_done, is_full, load_text, "    ", text);
      for (int id : reductions) {
        if (vals[id].reduce == ReduceOp::kSum)
          text += fmt::format("    acc{} += {};\n", id, var(vals[id].args[0]));
        else
          text += fmt::format("    acc{} = kiln_combine<1>(acc{}, {});\n", id, id,
                              var(vals[id].args[0]));
      }
      text += loop_tail;
      for (int id : reductions) {
        text += fmt::format("  const {} {} = kiln_block_reduce<kThreads, {}>(acc{});\n",
                            vals[id].ctype, var(id), vals[id].reduce == ReduceOp::kSum ? 0 : 1,
                            id);
        done.insert(id);
      }
    }
    emit_row_values(max_level);
    // Final pass: the per-element outputs (and the column reductions' terms).
    std::vector<int> full_outputs;
    for (int m : low.outputs)
      if (is_full(m)) full_outputs.push_back(m);
    for (int o : low.columns) full_outputs.push_back(vals[low.outputs[o]].args[0]);
    if (!full_outputs.empty()) {
      text += columns ? "  // final pass: per-element outputs and column sums\n"
                      : "  // final pass: per-element outputs\n";
      // Warp mode stores each output's V elements of a step as one access after the inner loop.
      std::string packs, stores;
      for (int input : step_inputs)
        packs += fmt::format(
            "    const {0} kiln_q{1} = *reinterpret_cast<const {0}*>(in{1} + base + j0);\n",
            pack(body.type(body.inputs[input].value).dtype), input);
      for (size_t o = 0; o < body.outputs.size(); ++o) {
        if (!is_full(low.outputs[o])) continue;
        const DType d = body.type(body.outputs[o]).dtype;
        packs += fmt::format("    {} kiln_o{};\n", pack(d), o);
        stores += fmt::format("    *reinterpret_cast<{}*>(out{} + {} + j0) = kiln_o{};\n",
                              pack(d), o, row_start(o), o);
      }
      text += warp_rows ? outer_head + packs + inner_head : loop_head;
      std::set<int> pass_done = done;
      emit_closure(vals, full_outputs, pass_done, is_full, load_text, "    ", text);
      for (size_t o = 0; o < body.outputs.size(); ++o)
        if (is_full(low.outputs[o]))
          text += fmt::format(fmt::runtime(warp_rows ? "    kiln_o{0}.v[u] = {2};\n"
                                                     : "    out{0}[{1} + j] = {2};\n"),
                              o, row_start(o), store_conversion(body.type(body.outputs[o]).dtype,
                                                                var(low.outputs[o])));
      for (size_t q = 0; q < low.columns.size(); ++q) {
        const std::string term = var(vals[low.outputs[low.columns[q]]].args[0]);
        text += warp_rows ? fmt::format("    kiln_cw[({} + m) * 32] += {};\n",
                                        lit_int(static_cast<int64_t>(q) * lane_columns), term)
                          : fmt::format("    kiln_col[{} + j] += {};\n",
                                        lit_int(static_cast<int64_t>(q) * low.n), term);
      }
      if (warp_rows) {
        text += "    }\n";
        text += stores;
        text += "  }\n";
      } else {
        text += loop_tail;
      }
    }
    // Padded outputs: a lane (thread) per pad column writes it after the row.
    for (size_t o = 0; o < body.outputs.size(); ++o) {
      const RowPad& pad = low.pads[o];
      if (pad.width == 0) continue;
      const DType d = body.type(body.outputs[o]).dtype;
      text += fmt::format("  if (kiln_t < {}) out{}[{} + kN + kiln_t] = {};\n", pad.width, o,
                          row_start(o), store_conversion(d, lit(ctype_of(d), pad.value)));
    }
    bool any_row_output = false;
    for (size_t o = 0; o < body.outputs.size(); ++o) {
      if (is_full(low.outputs[o]) || vals[low.outputs[o]].kind == MKind::kColumn) continue;
      if (!any_row_output) text += "  if (kiln_t == 0) {\n";
      any_row_output = true;
      text += fmt::format("    out{}[row] = {};\n", o,
                          store_conversion(body.type(body.outputs[o]).dtype, var(low.outputs[o])));
    }
    if (any_row_output) text += "  }\n";
    if (columns && warp_rows) {
      // The block's sums: its warps' sums added in warp order.
      // Slot (q, m, lane) holds column (lane + 32 (m / V)) V + m % V of output q.
      text += fmt::format(
          "  }}\n  // this block's partial column sums, its warps' added in warp order\n"
          "  __syncthreads();\n"
          "  for (int s = threadIdx.x; s < {0}; s += {1}) {{\n"
          "    const int q = s / {2}, m = s / 32 % {3}, lane = s % 32;\n"
          "    const int j = (lane + 32 * (m / {4})) * {4} + m % {4};\n"
          "    if (j >= kN) continue;\n"
          "    {5} sum = kiln_col[s];\n"
          "    for (int w = 1; w < {6}; ++w) sum += kiln_col[w * {7} + s];\n"
          "    kiln_partials[(q * {8} + blockIdx.x) * kN + j] = sum;\n"
          "  }}\n",
          lit_int(static_cast<int64_t>(low.columns.size()) * 32 * lane_columns), k.threads,
          32 * lane_columns, lane_columns, v, acc_t, warps, lit_int(warp_sums), lit_int(grid));
    } else if (columns) {
      text += fmt::format(
          "  }}\n  // this block's partial column sums\n  __syncthreads();\n"
          "  for (int j = threadIdx.x; j < {}; j += kThreads)\n"
          "    kiln_partials[(j / kN * {} + blockIdx.x) * kN + j % kN] = kiln_col[j];\n",
          lit_int(static_cast<int64_t>(low.columns.size()) * low.n), lit_int(grid));
    }
    text += "}\n";
    return text;
  };
  k.entry = "kiln_fused_rows";
  const std::string finish = columns ? column_finish(body, low, grid, k) : std::string();
  if (vector > 1) {
    // A source of its own, compiled only when a pointer is unaligned (never for the arena's
    // 64-byte-aligned values): a second copy of a long unrolled kernel in the main source
    // doubled NVRTC's time on a cold start.
    k.scalar_entry = "kiln_fused_rows_scalar";
    k.scalar_blocks = k.blocks;
    k.scalar_source =
        text + "\n// For pointers not aligned to V elements.\n" + entry_text(k.scalar_entry, 1) + finish;
  }
  k.source = text + entry_text(k.entry, vector) + finish;
  return k;
}

}  // namespace

bool can_generate(const Graph& body, FusedKind kind, std::string* why) {
  try {
    (void)lower(body, kind);
    return true;
  } catch (const Unsupported& u) {
    if (why) *why = u.why;
  } catch (const Error& e) {
    if (why) *why = e.what();
  }
  return false;
}

GeneratedKernel generate_kernel(const Graph& body, FusedKind kind) {
  Lowered low;
  try {
    low = lower(body, kind);
  } catch (const Unsupported& u) {
    fail("nvrtc codegen: cannot generate the {} body @{}: {}", fused_kind_name(kind), body.name,
         u.why);
  }
  return kind == FusedKind::kRows ? generate_rows(body, low) : generate_elementwise(body, low);
}

std::vector<Op> ops_with_emitters() {
  std::vector<Op> ops;
  for (const auto& [op, emitter] : emitters()) ops.push_back(op);
  std::sort(ops.begin(), ops.end(),
            [](Op a, Op b) { return op_info(a).name < op_info(b).name; });
  return ops;
}

}  // namespace kiln::cuda

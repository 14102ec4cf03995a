// Lowering a fused body to micro values (lowering.h): the iteration space, loads of body
// inputs with their broadcast index, the emitter's view of a node (Ctx), and lower(), which runs
// the emitter table over the body and checks what the kernel shapes can store.
#include "backends/cuda/nvrtc/lowering.h"

#include <algorithm>
#include <cmath>

#include "ir/op_def.h"
#include "ops/elementwise.h"

namespace kiln::cuda::codegen {

void unsupported(std::string why) { throw Unsupported{std::move(why)}; }

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

std::string storage_of(DType d) {
  switch (d) {
    case DType::kF16: return "__half";
    case DType::kBF16: return "__nv_bfloat16";
    default: return ctype_of(d);
  }
}

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

// ---- lowering ----

int Lowering::load(int input, Space space, const Shape* out) {
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

int Lowering::expr(std::string ctype, std::string text, std::vector<int> args) {
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

int Lowering::reduce(ReduceOp op, int arg) {
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

int Lowering::column(int arg, int64_t divisor) {
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

// ---- what an emitter sees ----

void Ctx::require_float() const {
  for (size_t k = 0; k < node.inputs.size(); ++k)
    require(is_float(in_type(static_cast<int>(k)).dtype),
            fmt::format("input {} is {}, only float dtypes are generated", k,
                        to_string(in_type(static_cast<int>(k)))));
}

int Ctx::x(int k, Space space, const Shape* as) {
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

Space Ctx::elementwise_space() {
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

std::vector<int> Ctx::operands() {
  const Space space = elementwise_space();
  std::vector<int> ids;
  for (size_t k = 0; k < node.inputs.size(); ++k) ids.push_back(x(static_cast<int>(k), space));
  return ids;
}

int Ctx::column() {
  require(l.rows(), "needs the column index, which only \"rows\" kernels have");
  MVal m;
  m.space = Space::kFull;
  m.ctype = "long long";
  m.text = "static_cast<long long>(j)";
  return l.add(std::move(m));
}

int Ctx::row_input(int k) {
  require(l.rows(), "is a row op: needs a \"rows\" fused node");
  const Shape& shape = in_type(k).shape;
  require(!shape.empty() && shape.back() == l.n() && numel(shape) == l.r() * l.n(),
          fmt::format("input {} has shape {}, not the iteration space {}", k, to_string(shape),
                      to_string(l.s())));
  const int id = x(k, Space::kFull);
  require(l.vals()[id].space == Space::kFull, "its input is per row, not per element");
  return id;
}

void Ctx::require_last_axis(int64_t axis, int rank) {
  require(rank >= 1 && normalize_axis(axis, rank) == rank - 1,
          fmt::format("axis {} is not the last axis (rank {})", axis, rank));
}

namespace {

bool is_column_reduction(const Graph& body, const Node& node) {
  return (node.op == Op::kSum || node.op == Op::kMean) && !node.inputs.empty() &&
         column_axes(node.attrs.ints("axes"), body.type(node.inputs[0]).rank());
}

// The iteration space: rows kernels, the first row op's (first) input; elementwise, the largest
// output or column reduction input.
Shape iteration_space(const Graph& body, bool rows) {
  if (rows) {
    for (const Node& node : body.nodes)
      if (op_def(node.op).traits.row_op && !is_column_reduction(body, node))
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

}  // namespace

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

}  // namespace kiln::cuda::codegen

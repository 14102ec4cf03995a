// The nvrtc codegen's front half, shared by every kernel shape: a fused body lowered op by op,
// through ONE table of per-op emitters (emitters.cc), into micro values (loads of body inputs,
// scalar CUDA expressions over other micro values, reductions along the row, column sums), and
// the C text of dtypes and constants that emitters and kernel writers both write. codegen.h
// says what the kernels look like; kernel_text.h holds what their writers share.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "ir/graph.h"
#include "ir/op_def.h"
#include "ops/fused/kind.h"
#include "support/error.h"

namespace kiln::cuda::codegen {

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

// Thrown while lowering a body the codegen cannot generate; `why` is can_generate's reason.
struct Unsupported {
  std::string why;
};

// A body output stored with `width` more columns of `value` after each row of the iteration
// space: concat(x, full) along the last axis (emit_concat). width 0: none.
struct RowPad {
  int64_t width = 0;
  double value = 0;
};

[[noreturn]] void unsupported(std::string why);

// ---- C text of dtypes and constants ----

// The C type a value of `d` is computed in (f32 for the 16-bit floats).
std::string ctype_of(DType d);
// The C type a tensor of `d` is stored as.
std::string storage_of(DType d);
// Converts the stored element `x` (text) to its compute type, and back.
std::string load_conversion(DType d, const std::string& x);
std::string store_conversion(DType d, const std::string& x);
// A literal of C type `ctype`.
std::string lit(const std::string& ctype, double v);
std::string lit_int(int64_t v);

// ---- shapes ----

// The offset into a tensor of shape `v` of element `var` (a flat index over `target`), with
// numpy broadcasting (right-aligned); consecutive target dims that are all present or all
// broadcast in `v` are merged, so (N,) in (R, N) reads `var % N` and (R, 1) reads `var / N`.
std::string broadcast_index(const Shape& v, const Shape& target, const std::string& var);
bool broadcasts_to(const Shape& from, const Shape& to);
// Whether `axes` are every axis but the last of a rank-`rank` value (a column reduction: bias
// gradients, LayerNorm's dgamma / dbeta).
bool column_axes(const std::vector<int64_t>& axes, int rank);

// ---- lowering ----

// The micro values of one body over its iteration space S = (R, N) (rows: R rows of N).
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
  int load(int input, Space space, const Shape* out);
  int expr(std::string ctype, std::string text, std::vector<int> args);
  int reduce(ReduceOp op, int arg);
  // The sum of the full value `arg` over every row (divided by `divisor`: a mean).
  int column(int arg, int64_t divisor);

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
  void require_float() const;

  // Input k as a micro value, read in `space` when it is a body input (indexed as `as` when
  // given: a value that spans the space in its own shape).
  int x(int k, Space space, const Shape* as = nullptr);
  // The space of an elementwise op's operands and output.
  Space elementwise_space();
  std::vector<int> operands();

  int e(const std::string& ctype, std::string text, std::vector<int> args) {
    return l.expr(ctype, std::move(text), std::move(args));
  }
  int sum(int a) { return l.reduce(ReduceOp::kSum, a); }
  int max(int a) { return l.reduce(ReduceOp::kMax, a); }
  // The column index j of the element (rows kernels only).
  int column();
  // The row op's input x must span the whole iteration space, rows of length N.
  int row_input(int k);
  void require_last_axis(int64_t axis, int rank);
};

// An op's emitter: the micro values of the node's outputs, in order. Throws Unsupported.
using Emitter = std::function<std::vector<int>(Ctx&)>;

// THE emitter table (emitters.cc): one entry per op the nvrtc dialect generates.
const std::map<Op, Emitter>& emitters();

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

// The body lowered for `kind` (elementwise or rows). Throws Unsupported.
Lowered lower(const Graph& body, FusedKind kind);

}  // namespace kiln::cuda::codegen

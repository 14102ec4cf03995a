// Dialect "cpu" for `fused` nodes: a fusion group runs as ONE pass over tiles of whole rows.
//
// The group's iteration space is flattened to R rows of N elements (R = product of all dims but
// the last of its full-size shape S, N = the last dim; a GEMM group's S is the matmul output).
// Every body value then has one of these layouts:
//   rows     R rows of L elements, row-major, so the rows of a tile are one contiguous range:
//            full-size values (L = N), per-row columns S[:-1] + [1] and S[:-1] (L = 1), a
//            GEMM's left operand (L = K). On a tile of r rows such a value has the shape
//            (1, ..., 1, r, L) (or (1, ..., 1, r)), so it keeps its rank and every axis attribute
//            and numpy broadcast of the body still means what it meant.
//   whole    the same for every tile: broadcast inputs (scalars, row vectors [1..., N]) and
//            values computed only from them (recomputed per tile: they are small).
//   column   the result of a column reduction (sum/mean over every axis but the last), or a
//            column output of a row op (OpDef::column_outputs_from: layer_norm_grad's dgamma,
//            whose kernel on a tile gives the tile's share): each chunk of tiles accumulates its
//            rows (or tile shares) into f64 partials; after the last tile the partials are summed
//            in chunk order (chunk 0 first) and rounded to f32 once.
// Per tile, the body's nodes run one by one on tile-sized tensors through the registry's best
// CPU kernel for the tile shapes (the fast "cpu" kernels where they apply; add/sub/mul/div of a
// tile and a per-row column, and where, which the fast kernels refuse, by loops here; the
// reference kernel otherwise), chosen for a full tile and for the last (shorter) tile when the
// body is planned: once, at kernel selection (supports() caches the plan per body).
// Intermediate values live in a per-thread scratch arena reused across tiles; a full-size body
// output is written by its producing node straight into the output's tile rows (no copy).
//
// GEMM nucleus (kind "gemm-epilogue"): per tile, cblas_sgemm computes the tile's rows of the
// product (op(A)'s rows r0..r1 times op(B), transposes as BLAS arguments, no copies) into the
// scratch (or the output), then the epilogue runs on that tile while it is in cache.
//
// Tile policy: r = (target bytes, 256 KiB ~ one L2) / (bytes of one row summed over every
// rows-layout value the tile touches), at least 1 row (a row op needs whole rows), at most R.
// Without a GEMM, r is also capped at ceil(R / threads) so every thread gets a tile, and the
// tiles are split into one contiguous chunk per thread (support/parallel.h). With a GEMM, r is
// at least 512 rows (each BLAS call packs B again and splits its rows over the threads: small
// calls lose; 512 rows of the product, 1.5 MiB at N = 768, stay in L3 for the epilogue) and
// the tiles run in order on the calling thread, each GEMM threaded by OpenBLAS and each
// epilogue kernel by OpenMP (OpenBLAS is the pthreads build: calling it from several OpenMP
// threads at once would oversubscribe the cores).
//
// Supported bodies: every float value f32 (integer labels and bool conditions allowed); at most
// one matmul, of 2-D f32 operands that are body inputs; column reductions only as body outputs;
// every node's outputs either rows-layout (checked: the op's inference on tile shapes gives
// exactly the tile shapes) or computed from whole values only. bf16/f16 bodies are not taken
// (there are no fast bf16/f16 CPU kernels to reuse): the fused reference kernel runs them.
#include "backends/cpu/fused.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "backends/cpu/cpu_kernels.h"
#include "ir/graph.h"
#include "ir/op_def.h"
#include "ops/fp8.h"
#include "support/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kDefaultTileBytes = 256 * 1024;
std::atomic<int64_t> g_tile_bytes{kDefaultTileBytes};

enum class Layout : uint8_t { kUnused, kRows, kWhole, kColumn };

struct ValueInfo {
  Layout layout = Layout::kUnused;
  int64_t row_elems = 0;   // kRows: L
  bool keeps_rank = true;  // kRows: shape S[:-1] + [L] (true) or S[:-1] (false)
};

enum class Step : uint8_t { kKernel, kGemm, kColumnReduction };

struct NodePlan {
  Step step = Step::kKernel;
  // kKernel: the kernel and the output types for a full tile [0] and for the last tile [1].
  KernelFn kernel[2];
  std::vector<TensorType> out_types[2];
  // kGemm: body input indices of the operands.
  int gemm_a = -1, gemm_b = -1;
  // kColumnReduction: index of the partial sums, and the factor applied at the end.
  int column_slot = -1;
  double scale = 1.0;
  // kKernel of an op with column outputs (OpDef::column_outputs_from, e.g. layer_norm_grad's
  // dgamma): per output, the partial sums its tile results are added to, or -1.
  std::vector<int> out_column_slot;
};

struct Plan {
  Shape space;
  int64_t rows = 0, row_length = 0, tile_rows = 0, tiles = 0, last_rows = 0;
  bool gemm = false;
  int64_t tile_bytes = 0, threads = 0;  // the policy inputs it was made with
  std::vector<std::string> reference_ops;  // body nodes that run the reference kernel per tile
  std::vector<ValueInfo> values;
  std::vector<NodePlan> nodes;
  std::vector<int> direct_output;     // per value: the body output its producer writes, or -1
  std::vector<size_t> scratch_offset; // per value: its offset in the scratch arena, or npos
  size_t scratch_bytes = 0;
  int column_slots = 0;
};

constexpr size_t kNoSlot = static_cast<size_t>(-1);

size_t align64(size_t n) { return (n + 63) / 64 * 64; }

// The rows layout of a value of shape v in space s, if it has one.
std::optional<ValueInfo> rows_layout(const Shape& s, const Shape& v) {
  if (v.size() == s.size() && !v.empty() && std::equal(v.begin(), v.end() - 1, s.begin()))
    return ValueInfo{Layout::kRows, v.back(), true};
  if (v.size() + 1 == s.size() && std::equal(v.begin(), v.end(), s.begin()))
    return ValueInfo{Layout::kRows, 1, false};
  return std::nullopt;
}

// A scalar or a row vector [1..., N]: read whole by every tile.
bool is_broadcast(const Shape& s, const Shape& v) {
  if (numel(v) == 1) return true;
  if (v.size() > s.size() || v.empty()) return false;
  for (size_t i = 0; i + 1 < v.size(); ++i)
    if (v[i] != 1) return false;
  return v.back() == s.back();
}

// The shape of a value on a tile of r rows.
Shape tile_shape(const Plan& p, const ValueInfo& info, const Shape& full, int64_t r) {
  if (info.layout != Layout::kRows || p.space.size() < 2) return full;
  Shape t(p.space.size() - 2, 1);
  t.push_back(r);
  if (info.keeps_rank) t.push_back(full.back());
  return t;
}

TensorType tile_type(const Plan& p, const Graph& body, ValueId id, int64_t r) {
  const TensorType& full = body.type(id);
  return TensorType{full.dtype, tile_shape(p, p.values[id], full.shape, r)};
}

bool is_column_reduction(const Node& node, const Graph& body, const Shape& space) {
  if ((node.op != Op::kSum && node.op != Op::kMean) || node.inputs.size() != 1) return false;
  const Shape& in = body.type(node.inputs[0]).shape;
  if (in.size() < 2 || in.size() != space.size()) return false;
  std::vector<int64_t> axes = node.attrs.ints("axes");
  if (axes.empty()) return false;  // all axes: a full reduction
  for (int64_t& a : axes) {
    if (a < -static_cast<int64_t>(in.size()) || a >= static_cast<int64_t>(in.size()))
      return false;
    a = normalize_axis(a, static_cast<int>(in.size()));
  }
  std::sort(axes.begin(), axes.end());
  for (size_t i = 0; i < axes.size(); ++i)
    if (axes[i] != static_cast<int64_t>(i)) return false;
  return axes.size() + 1 == in.size();
}

// Binary f32 ops of a full tile (..., r, L) and a per-row column (..., r, 1), either side: the
// fast binary kernels refuse that layout (their reference fallback goes through f64 get/set),
// and it is common in fused groups (x - mean, dx * rstd after training-rewrites). One plain
// loop: the tile is already one thread's work.
struct AddF { static float apply(float a, float b) { return a + b; } };
struct SubF { static float apply(float a, float b) { return a - b; } };
struct MulF { static float apply(float a, float b) { return a * b; } };
struct DivF { static float apply(float a, float b) { return a / b; } };

template <typename F>
void column_binary(const KernelArgs& k) {
  const Tensor& out = k.outputs[0];
  const int64_t n = out.shape().back();
  const int64_t rows = out.numel() / n;
  const bool a_is_column = k.inputs[0].numel() == rows;
  const float* __restrict__ full = k.inputs[a_is_column ? 1 : 0].data<float>();
  const float* __restrict__ column = k.inputs[a_is_column ? 0 : 1].data<float>();
  float* __restrict__ y = out.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float c = column[r];
    const float* x = full + r * n;
    float* yr = y + r * n;
    if (a_is_column)
      for (int64_t j = 0; j < n; ++j) yr[j] = F::apply(c, x[j]);
    else
      for (int64_t j = 0; j < n; ++j) yr[j] = F::apply(x[j], c);
  }
}

// How an operand of a (rows, n) tile is indexed: element (r, j) is at r * row + j * col.
struct Strides {
  int64_t row = 0, col = 0;
};
// The operand's strides when it is the full tile, one element, a per-row column or a row
// vector of the output `y`; nullopt for anything else.
std::optional<Strides> tile_strides(const Shape& x, const Shape& y) {
  const int64_t n = y.back();
  if (x == y) return Strides{n, 1};
  if (numel(x) == 1) return Strides{0, 0};
  Shape column = y;
  column.back() = 1;
  if (x == column) return Strides{1, 0};
  if (!x.empty() && x.back() == n && numel(x) == n) return Strides{0, 1};
  return std::nullopt;
}

// where(cond, a, b) in f32 with a bool condition, each operand full, scalar, column or row (the
// ignore-index mask of the decomposed cross-entropy gradient is a (B, T, 1) column).
void where_tile(const KernelArgs& k) {
  const Tensor& out = k.outputs[0];
  const Shape& y = out.shape();
  const int64_t n = y.back(), rows = out.numel() / n;
  const Strides sc = *tile_strides(k.inputs[0].shape(), y);
  const Strides sa = *tile_strides(k.inputs[1].shape(), y);
  const Strides sb = *tile_strides(k.inputs[2].shape(), y);
  const bool* cond = k.inputs[0].data<bool>();
  const float* a = k.inputs[1].data<float>();
  const float* b = k.inputs[2].data<float>();
  float* o = out.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j)
      o[r * n + j] = cond[r * sc.row + j * sc.col] ? a[r * sa.row + j * sa.col]
                                                   : b[r * sb.row + j * sb.col];
}

// A loop of this file for this node on these tile types (column_binary, where_tile), or
// nullptr.
KernelFn own_kernel(const Node& node, const std::vector<TensorType>& in,
                    const std::vector<TensorType>& out) {
  if (node.op == Op::kWhere && in.size() == 3 && out.size() == 1 && !out[0].shape.empty() &&
      in[0].dtype == DType::kBool && in[1].dtype == DType::kF32 &&
      in[2].dtype == DType::kF32 && out[0].dtype == DType::kF32) {
    for (const TensorType& t : in)
      if (!tile_strides(t.shape, out[0].shape)) return nullptr;
    return where_tile;
  }
  if (in.size() != 2 || out.size() != 1) return nullptr;
  for (const TensorType& t : {in[0], in[1], out[0]})
    if (t.dtype != DType::kF32) return nullptr;
  const Shape& y = out[0].shape;
  if (y.empty() || y.back() <= 1) return nullptr;
  Shape column = y;
  column.back() = 1;
  const bool layout = (in[0].shape == y && in[1].shape == column) ||
                      (in[0].shape == column && in[1].shape == y);
  if (!layout) return nullptr;
  switch (node.op) {
    case Op::kAdd: return column_binary<AddF>;
    case Op::kSub: return column_binary<SubF>;
    case Op::kMul: return column_binary<MulF>;
    case Op::kDiv: return column_binary<DivF>;
    default: return nullptr;
  }
}

std::optional<Plan> make_plan(const Graph& body, std::string& why) {
  auto refuse = [&](std::string message) {
    why = std::move(message);
    return std::optional<Plan>();
  };
  Plan p;
  const size_t nv = body.values.size();
  p.values.resize(nv);
  p.nodes.resize(body.nodes.size());
  p.direct_output.assign(nv, -1);
  p.scratch_offset.assign(nv, kNoSlot);

  for (const Value& v : body.values)
    if (is_float(v.type.dtype) && v.type.dtype != DType::kF32)
      return refuse(fmt::format("value %{} is {}: only f32 bodies are taken", v.name,
                                to_string(v.type)));

  // The GEMM nucleus, and which values each node reads.
  int gemm_node = -1;
  std::vector<bool> is_input(nv, false), read_tilewise(nv, false), is_output(nv, false);
  for (const GraphInput& in : body.inputs) is_input[in.value] = true;
  for (ValueId id : body.outputs) is_output[id] = true;
  for (size_t n = 0; n < body.nodes.size(); ++n) {
    const Node& node = body.nodes[n];
    if (node.op == Op::kFused) return refuse("a nested fused node");
    if (node.op == Op::kMatmul) {
      if (gemm_node >= 0) return refuse("more than one matmul");
      if (matmul_fp8(node.attrs).on()) return refuse("an fp8 matmul (the matmul kernels quantize)");
      gemm_node = static_cast<int>(n);
      continue;
    }
    for (ValueId id : node.inputs) read_tilewise[id] = true;
  }

  // The space: the GEMM's output, else the largest value.
  if (gemm_node >= 0) {
    p.space = body.type(body.nodes[gemm_node].outputs[0]).shape;
  } else {
    int64_t best = -1;
    for (size_t id = 0; id < nv; ++id)
      if (body.values[id].type.numel() > best) {
        best = body.values[id].type.numel();
        p.space = body.values[id].type.shape;
      }
  }
  if (p.space.empty() || numel(p.space) == 0)
    return refuse(fmt::format("space {} is a scalar or empty", to_string(p.space)));
  p.row_length = p.space.back();
  p.rows = numel(p.space) / p.row_length;

  // Inputs: broadcast first (a float (N,) beside (N, N) is a bias under numpy's rules), rows
  // first for integers (cross-entropy labels are per row) and when there is one row (both
  // read the same bytes; rows lets a column reduction or row op take it).
  for (size_t i = 0; i < body.inputs.size(); ++i) {
    const ValueId id = body.inputs[i].value;
    if (!read_tilewise[id] && !is_output[id]) continue;  // only the GEMM reads it
    const TensorType& t = body.type(id);
    const std::optional<ValueInfo> rows = rows_layout(p.space, t.shape);
    const bool broadcast = is_broadcast(p.space, t.shape);
    if (rows && (is_integer(t.dtype) || !broadcast || p.rows == 1))
      p.values[id] = *rows;
    else if (broadcast)
      p.values[id].layout = Layout::kWhole;
    else
      return refuse(fmt::format("input {} (%{}) is {}: neither rows of space {} nor broadcast",
                                i, body.value(id).name, to_string(t), to_string(p.space)));
  }

  // Layouts of node outputs.
  for (size_t n = 0; n < body.nodes.size(); ++n) {
    const Node& node = body.nodes[n];
    NodePlan& np = p.nodes[n];
    if (static_cast<int>(n) == gemm_node) {
      np.step = Step::kGemm;
      if (node.inputs.size() != 2 || node.outputs.size() != 1) return refuse("odd matmul");
      np.gemm_a = body.input_index(node.inputs[0]);
      np.gemm_b = body.input_index(node.inputs[1]);
      if (np.gemm_a < 0 || np.gemm_b < 0)
        return refuse("the matmul reads a value computed inside the body");
      const Shape& a = body.type(node.inputs[0]).shape;
      const Shape& b = body.type(node.inputs[1]).shape;
      // (..., M, K) @ (K, N) without transpose_a is the 2-D product of the flattened rows.
      const bool ta = node.attrs.b("transpose_a");
      if (a.size() < 2 || b.size() != 2 || (ta && a.size() != 2) || p.space.size() != a.size())
        return refuse("the matmul is not 2-D (or rows of a sequence times a matrix)");
      for (int64_t d : {numel(a) / std::max<int64_t>(a.back(), 1), a.back(), b[0], b[1]})
        if (d > INT_MAX) return refuse("the matmul is too large for BLAS");
      for (ValueId id : {node.inputs[0], node.inputs[1], node.outputs[0]})
        if (body.type(id).dtype != DType::kF32) return refuse("the matmul is not f32");
      p.values[node.outputs[0]] = ValueInfo{Layout::kRows, p.row_length, true};
      p.gemm = true;
      continue;
    }
    for (ValueId id : node.inputs) {
      const Layout l = p.values[id].layout;
      if (l == Layout::kColumn)
        return refuse(fmt::format("node {} ({}) reads a column reduction", n, op_name(node.op)));
      KILN_CHECK(l != Layout::kUnused, "cpu fused: node {} reads %{} before it is computed", n,
                 body.value(id).name);
    }
    if (is_column_reduction(node, body, p.space)) {
      const ValueInfo& in = p.values[node.inputs[0]];
      const TensorType& out = body.type(node.outputs[0]);
      if (in.layout != Layout::kRows || !in.keeps_rank || in.row_elems != p.row_length ||
          out.numel() != p.row_length || out.dtype != DType::kF32)
        return refuse(fmt::format("column reduction node {} does not reduce full rows", n));
      np.step = Step::kColumnReduction;
      np.column_slot = p.column_slots++;
      np.scale = node.op == Op::kMean ? 1.0 / static_cast<double>(p.rows) : 1.0;
      p.values[node.outputs[0]].layout = Layout::kColumn;
      continue;
    }
    bool all_whole = true;
    for (ValueId id : node.inputs) all_whole = all_whole && p.values[id].layout == Layout::kWhole;
    const int column_from = all_whole ? -1 : op_def(node.op).column_outputs_from;
    if (column_from >= 0) {
      // Sums over every row of input 0: a tile's kernel gives the tile's share (f32, as every
      // other partial here), added up across tiles.
      const ValueInfo& in = p.values[node.inputs[0]];
      if (in.layout != Layout::kRows || !in.keeps_rank || in.row_elems != p.row_length)
        return refuse(fmt::format("node {} ({}) sums rows that are not the space's", n,
                                  op_name(node.op)));
      np.out_column_slot.assign(node.outputs.size(), -1);
    }
    for (size_t j = 0; j < node.outputs.size(); ++j) {
      const ValueId id = node.outputs[j];
      if (all_whole) {
        p.values[id].layout = Layout::kWhole;
        continue;
      }
      if (column_from >= 0 && static_cast<int>(j) >= column_from) {
        const TensorType& out = body.type(id);
        if (out.numel() != p.row_length || out.dtype != DType::kF32)
          return refuse(fmt::format("node {} ({}) output {} is {}, not one f32 per column", n,
                                    op_name(node.op), j, to_string(out)));
        np.out_column_slot[j] = p.column_slots++;
        p.values[id].layout = Layout::kColumn;
        continue;
      }
      const std::optional<ValueInfo> rows = rows_layout(p.space, body.type(id).shape);
      if (!rows)
        return refuse(fmt::format("node {} ({}) gives {}: not rows of space {}", n,
                                  op_name(node.op), to_string(body.type(id)),
                                  to_string(p.space)));
      p.values[id] = *rows;
    }
  }
  for (ValueId id : body.outputs)
    if (p.values[id].layout == Layout::kUnused) return refuse("an output the kernel never has");

  // Tile rows.
  int64_t row_bytes = 0;
  for (size_t id = 0; id < nv; ++id)
    if (p.values[id].layout == Layout::kRows)
      row_bytes += p.values[id].row_elems *
                   static_cast<int64_t>(dtype_size(body.values[id].type.dtype));
  if (p.gemm) {
    const Node& g = body.nodes[gemm_node];
    const Shape& a = body.type(g.inputs[0]).shape;
    const int64_t k = g.attrs.b("transpose_a") ? a[0] : a.back();
    row_bytes += k * 4;
  }
  const int64_t target = g_tile_bytes.load();
  p.tile_bytes = target;
  p.threads = max_threads();
  int64_t r = std::clamp<int64_t>(target / std::max<int64_t>(row_bytes, 1), 1, p.rows);
  if (p.gemm) {
    r = std::max(r, std::min<int64_t>(p.rows, std::max<int64_t>(1, target / 512)));
  } else {
    r = std::min(r, std::max<int64_t>(1, (p.rows + p.threads - 1) / p.threads));
  }
  p.tile_rows = r;
  p.tiles = (p.rows + r - 1) / r;
  p.last_rows = p.rows - (p.tiles - 1) * r;

  // Kernels for the tile shapes, checked against the layouts.
  const KernelRegistry& registry = kernel_registry();
  for (size_t n = 0; n < body.nodes.size(); ++n) {
    const Node& node = body.nodes[n];
    NodePlan& np = p.nodes[n];
    if (np.step != Step::kKernel) continue;
    for (int variant = 0; variant < 2; ++variant) {
      const int64_t tr = variant == 0 ? p.tile_rows : p.last_rows;
      std::vector<TensorType> in_types;
      for (ValueId id : node.inputs) in_types.push_back(tile_type(p, body, id, tr));
      std::vector<TensorType> expected;
      for (ValueId id : node.outputs) expected.push_back(tile_type(p, body, id, tr));
      std::vector<TensorType> inferred;
      try {
        inferred = infer_types(node.op, in_types, node.attrs);
      } catch (const Error& e) {
        return refuse(fmt::format("node {} ({}) on a tile: {}", n, op_name(node.op), e.what()));
      }
      if (inferred != expected)
        return refuse(fmt::format("node {} ({}) on a tile of {} rows gives {}, expected {}", n,
                                  op_name(node.op), tr, to_string(inferred[0]),
                                  to_string(expected[0])));
      np.out_types[variant] = expected;
      const KernelImpl& impl =
          registry.select(NodeView{node, in_types, expected}, Device::kCpu, {});
      np.kernel[variant] = impl.dialect == "reference" ? own_kernel(node, in_types, expected)
                                                       : nullptr;
      if (!np.kernel[variant]) {
        np.kernel[variant] = impl.kernel;
        if (variant == 0 && impl.dialect == "reference")
          p.reference_ops.emplace_back(op_name(node.op));
      }
    }
  }

  // Where values live: producers of full-size outputs write into them; other computed values
  // get a scratch slot.
  for (size_t i = 0; i < body.outputs.size(); ++i) {
    const ValueId id = body.outputs[i];
    if (p.values[id].layout == Layout::kRows && !is_input[id] && p.direct_output[id] < 0)
      p.direct_output[id] = static_cast<int>(i);
  }
  for (size_t n = 0; n < body.nodes.size(); ++n)
    for (ValueId id : body.nodes[n].outputs) {
      // A column reduction adds straight into the partials; a kernel's column output is
      // written to scratch first.
      const Layout l = p.values[id].layout;
      if ((l == Layout::kColumn && p.nodes[n].step == Step::kColumnReduction) ||
          p.direct_output[id] >= 0)
        continue;
      p.scratch_offset[id] = p.scratch_bytes;
      const TensorType t = tile_type(p, body, id, p.tile_rows);
      p.scratch_bytes += align64(t.bytes());
    }
  return p;
}

// Storage that points into memory owned elsewhere (an input, an output, the scratch arena):
// an aliasing shared_ptr with no owner, so making a view allocates nothing.
std::shared_ptr<std::byte[]> unowned(std::byte* p) {
  return std::shared_ptr<std::byte[]>(std::shared_ptr<std::byte[]>(), p);
}

// This thread's scratch arena, grown as needed and kept for later calls.
std::byte* thread_scratch(size_t bytes) {
  struct Arena {
    std::byte* data = nullptr;
    size_t capacity = 0;
    ~Arena() { std::free(data); }
  };
  thread_local Arena arena;
  if (arena.capacity < bytes) {
    std::free(arena.data);
    arena.capacity = 0;
    arena.data = static_cast<std::byte*>(std::aligned_alloc(64, align64(bytes)));
    if (arena.data == nullptr) fail("cpu fused: out of memory for a {}-byte scratch arena", bytes);
    arena.capacity = align64(bytes);
  }
  return arena.data;
}

// Rows [r0, r0 + r) of a rows-layout tensor, as a tensor of type `type`.
Tensor row_view(const Tensor& t, const ValueInfo& info, int64_t r0, TensorType type) {
  const size_t offset = static_cast<size_t>(r0 * info.row_elems) * dtype_size(t.dtype());
  return Tensor(std::move(type), unowned(t.raw() + offset), 0);
}

// Plans made by supports(), by body, so that a kernel call does not re-plan (tens of
// microseconds a call for a ten-node body: a few percent of a small model's step). Keyed by the
// body's address and checked through a weak_ptr: a body freed and another allocated at the same
// address is a miss, never a stale plan. A plan made under another tile target or thread count
// is a miss too.
struct CachedPlan {
  std::weak_ptr<const Graph> body;
  std::shared_ptr<const Plan> plan;
};
std::mutex g_plans_mutex;
std::unordered_map<const Graph*, CachedPlan> g_plans;

void remember_plan(const std::shared_ptr<const Graph>& body, std::shared_ptr<const Plan> plan) {
  std::lock_guard<std::mutex> lock(g_plans_mutex);
  if (g_plans.size() >= 1024)
    std::erase_if(g_plans, [](const auto& entry) { return entry.second.body.expired(); });
  g_plans[body.get()] = CachedPlan{body, std::move(plan)};
}

std::shared_ptr<const Plan> find_plan(const Graph* body) {
  std::lock_guard<std::mutex> lock(g_plans_mutex);
  const auto it = g_plans.find(body);
  if (it == g_plans.end() || it->second.body.lock().get() != body) return nullptr;
  const Plan& p = *it->second.plan;
  if (p.tile_bytes != g_tile_bytes.load() || p.threads != max_threads()) return nullptr;
  return it->second.plan;
}

void run_fused_cpu(const KernelArgs& k) {
  KILN_CHECK(k.body != nullptr, "cpu fused: the kernel was called without the node's body");
  const Graph& body = *k.body;
  std::shared_ptr<const Plan> plan = find_plan(k.body);
  if (!plan) {
    std::string why;
    std::optional<Plan> made = make_plan(body, why);
    KILN_CHECK(made.has_value(), "cpu fused: body @{} is not supported ({}); supports() should "
               "have refused it", body.name, why);
    plan = std::make_shared<const Plan>(std::move(*made));
  }
  const Plan& p = *plan;
  const size_t nv = body.values.size();

  const int64_t chunks = p.gemm || p.rows * p.row_length < 2 * kGrainCheap
                             ? 1
                             : std::min<int64_t>(max_threads(), p.tiles);
  const size_t n_cols = static_cast<size_t>(p.row_length);
  // partials[chunk * slots + slot]: f64 column sums of the chunk's rows.
  std::vector<std::vector<double>> partials(static_cast<size_t>(chunks * p.column_slots),
                                            std::vector<double>(n_cols, 0.0));

  parallel_chunks(0, p.tiles, chunks, [&](int64_t chunk, int64_t t0, int64_t t1) {
    std::byte* scratch = thread_scratch(p.scratch_bytes);
    std::vector<Tensor> vals(nv);
    std::vector<Tensor> ins, outs;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * p.tile_rows;
      const int64_t r = std::min(p.tile_rows, p.rows - r0);
      const int variant = r == p.tile_rows ? 0 : 1;
      for (size_t i = 0; i < body.inputs.size(); ++i) {
        const ValueId id = body.inputs[i].value;
        const ValueInfo& info = p.values[id];
        if (info.layout == Layout::kRows)
          vals[id] = row_view(k.inputs[i], info, r0, tile_type(p, body, id, r));
        else if (info.layout == Layout::kWhole)
          vals[id] = k.inputs[i];
      }
      // The tensor a node output is written to.
      auto destination = [&](ValueId id, const TensorType& type) {
        const int out = p.direct_output[id];
        if (out >= 0) return row_view(k.outputs[out], p.values[id], r0, type);
        return Tensor(type, unowned(scratch + p.scratch_offset[id]), 0);
      };
      for (size_t n = 0; n < body.nodes.size(); ++n) {
        const Node& node = body.nodes[n];
        const NodePlan& np = p.nodes[n];
        switch (np.step) {
          case Step::kGemm: {
            const Tensor& a = k.inputs[np.gemm_a];
            const Tensor& b = k.inputs[np.gemm_b];
            const bool ta = node.attrs.b("transpose_a"), tb = node.attrs.b("transpose_b");
            const int64_t lda = a.shape().back(), ldb = b.shape()[1];  // a: rows flattened
            const int64_t kk = ta ? a.shape()[0] : a.shape().back();
            const int64_t n_out = p.row_length;
            Tensor c = destination(node.outputs[0], TensorType{DType::kF32, {r, n_out}});
            float* c_data = c.data<float>();
            if (kk == 0) {
              std::memset(c_data, 0, c.bytes());
            } else {
              const float* a_data = a.data<float>() + (ta ? r0 : r0 * lda);
              cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                          tb ? CblasTrans : CblasNoTrans, static_cast<blasint>(r),
                          static_cast<blasint>(n_out), static_cast<blasint>(kk), 1.0f, a_data,
                          static_cast<blasint>(std::max<int64_t>(lda, 1)), b.data<float>(),
                          static_cast<blasint>(std::max<int64_t>(ldb, 1)), 0.0f, c_data,
                          static_cast<blasint>(std::max<int64_t>(n_out, 1)));
            }
            vals[node.outputs[0]] = c;
            break;
          }
          case Step::kColumnReduction: {
            const float* x = vals[node.inputs[0]].data<float>();
            double* sum = partials[static_cast<size_t>(chunk * p.column_slots + np.column_slot)]
                              .data();
            for (int64_t row = 0; row < r; ++row) {
              const float* xr = x + row * p.row_length;
              for (size_t j = 0; j < n_cols; ++j) sum[j] += static_cast<double>(xr[j]);
            }
            break;
          }
          case Step::kKernel: {
            ins.clear();
            outs.clear();
            for (ValueId id : node.inputs) ins.push_back(vals[id]);
            for (size_t j = 0; j < node.outputs.size(); ++j)
              outs.push_back(destination(node.outputs[j], np.out_types[variant][j]));
            np.kernel[variant](KernelArgs{node.attrs, ins, outs, nullptr, nullptr});
            for (size_t j = 0; j < node.outputs.size(); ++j) vals[node.outputs[j]] = outs[j];
            for (size_t j = 0; j < np.out_column_slot.size(); ++j) {
              if (np.out_column_slot[j] < 0) continue;
              const float* x = outs[j].data<float>();
              double* sum = partials[static_cast<size_t>(chunk * p.column_slots +
                                                         np.out_column_slot[j])]
                                .data();
              for (size_t c = 0; c < n_cols; ++c) sum[c] += static_cast<double>(x[c]);
            }
            break;
          }
        }
      }
      // Outputs not written in place: inputs passed through, values output twice, whole values.
      for (size_t i = 0; i < body.outputs.size(); ++i) {
        const ValueId id = body.outputs[i];
        const ValueInfo& info = p.values[id];
        if (info.layout == Layout::kRows && p.direct_output[id] != static_cast<int>(i)) {
          const size_t size = dtype_size(k.outputs[i].dtype());
          const size_t bytes = static_cast<size_t>(r * info.row_elems) * size;
          const size_t offset = static_cast<size_t>(r0 * info.row_elems) * size;
          std::memcpy(k.outputs[i].raw() + offset, vals[id].raw(), bytes);
        } else if (info.layout == Layout::kWhole && r0 == 0) {
          std::memcpy(k.outputs[i].raw(), vals[id].raw(), k.outputs[i].bytes());
        }
      }
    }
  });

  // Column values: chunk partials summed in chunk order, then scaled and rounded once.
  auto finish = [&](ValueId id, int slot, double scale) {
    std::vector<double> total(n_cols, 0.0);
    for (int64_t c = 0; c < chunks; ++c) {
      const std::vector<double>& part = partials[static_cast<size_t>(c * p.column_slots + slot)];
      for (size_t j = 0; j < n_cols; ++j) total[j] += part[j];
    }
    for (size_t i = 0; i < body.outputs.size(); ++i) {
      if (body.outputs[i] != id) continue;
      float* out = k.outputs[i].data<float>();
      for (size_t j = 0; j < n_cols; ++j) out[j] = static_cast<float>(total[j] * scale);
    }
  };
  for (size_t n = 0; n < body.nodes.size(); ++n) {
    const NodePlan& np = p.nodes[n];
    if (np.step == Step::kColumnReduction)
      finish(body.nodes[n].outputs[0], np.column_slot, np.scale);
    for (size_t j = 0; j < np.out_column_slot.size(); ++j)
      if (np.out_column_slot[j] >= 0) finish(body.nodes[n].outputs[j], np.out_column_slot[j], 1.0);
  }
}

}  // namespace

FusedPlanInfo fused_plan_info(const Graph& body) {
  FusedPlanInfo info;
  const std::optional<Plan> plan = make_plan(body, info.why_not);
  if (!plan) return info;
  info.supported = true;
  info.rows = plan->rows;
  info.row_length = plan->row_length;
  info.tile_rows = plan->tile_rows;
  info.tiles = plan->tiles;
  info.gemm = plan->gemm;
  info.column_reductions = plan->column_slots;
  info.reference_ops = plan->reference_ops;
  return info;
}

void set_fused_tile_bytes(int64_t bytes) {
  g_tile_bytes.store(bytes > 0 ? bytes : kDefaultTileBytes);
}

void register_fused_kernels(KernelRegistry& registry) {
  registry.add(Op::kFused,
               KernelImpl{"cpu", Device::kCpu, kFastPriority,
                          [](const NodeView& node) {
                            if (node.node.body == nullptr) return false;
                            std::string why;
                            std::optional<Plan> plan = make_plan(*node.node.body, why);
                            if (!plan) return false;
                            remember_plan(node.node.body,
                                          std::make_shared<const Plan>(std::move(*plan)));
                            return true;
                          },
                          run_fused_cpu});
}

}  // namespace kiln::cpu

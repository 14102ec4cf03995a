// The elementwise kernel shape of the nvrtc codegen (FusedKind::kElementwise; codegen.h): one
// thread per V consecutive elements with vector loads and stores, or, where the body has column
// reductions, a 2-D grid of column strips over tiles of rows and a second kernel that adds the
// tiles' partial sums.
#include <algorithm>

#include "backends/cuda/nvrtc/kernel_text.h"

namespace kiln::cuda::codegen {
namespace {

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

}  // namespace

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
  set_param_bytes(body, k);

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

}  // namespace kiln::cuda::codegen

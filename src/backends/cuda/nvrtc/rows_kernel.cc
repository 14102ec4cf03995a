// The rows kernel shape of the nvrtc codegen (FusedKind::kRows; codegen.h): a warp per row of
// up to 1024 elements (a thread block per row past that), reductions along the row by warp
// shuffles, one pass over the row per level of reductions, column sums in shared memory and a
// second kernel that adds the blocks' partials. generate_rows chooses the geometry
// (rows_geometry) and writes each entry point with a RowsEntryWriter, one step per part of it.
#include <algorithm>
#include <cmath>

#include "backends/cuda/nvrtc/kernel_text.h"

namespace kiln::cuda::codegen {
namespace {

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

// Threads per row: about 4 elements each, a whole warp at least, 1024 at most. Rows of up to
// kWarpRowMax elements go one warp each, 8 rows to a block (4 with column sums): the row's
// reductions are warp shuffles only (no __syncthreads, no shared memory), and each thread has a
// few dozen loads in flight instead of 3 (GPT-2's LayerNorm rows of 768 ran at a third of the
// bandwidth with a 256-thread block per row).
constexpr int64_t kWarpRowMax = 1024;
// Warp mode with V columns per lane and step (see RowsEntryWriter): a lane's elements, and a
// warp's shared-memory column sums, [q][m][lane] (lanes adjacent: no bank conflicts).
constexpr int kRowsVector = 4;

// How a rows kernel spreads over the GPU, for both of its entry points.
struct RowsGeometry {
  bool columns = false;    // the body has column reductions
  bool warp_rows = false;  // a warp per row; else a block of `threads` per row
  std::string acc_t;       // the C type column sums are added in
  int vector = 1;          // V of the main entry: adjacent columns per lane and step
  int64_t n = 1;           // the row length
  // Warp mode: shared-memory column sums per warp, and warps (rows) per block.
  int64_t warp_sums = 0;
  int warps = 8;
  int threads = 32;       // threads per row (32 in warp mode): kThreads
  int block_threads = 0;  // threads per block
  int64_t blocks = 0;
  // With column reductions, the fixed grid of blocks that take the rows in turn.
  int64_t grid = 0;
  int max_level = 0;  // passes over a row that end in reductions

  // Warp mode: the elements of a row each lane holds, at V = v.
  int64_t lane_elements(int v) const { return (n + 32 * v - 1) / (32 * v) * v; }
};

RowsGeometry rows_geometry(const Lowered& low) {
  RowsGeometry g;
  g.columns = !low.columns.empty();
  g.warp_rows = low.n <= kWarpRowMax;
  g.acc_t = low.column_ctype;
  g.n = low.n;
  const int64_t acc_bytes = g.acc_t == "double" ? 8 : 4;
  bool rows_divide = low.n % kRowsVector == 0;  // every stored row starts V-aligned
  for (const RowPad& pad : low.pads) rows_divide = rows_divide && pad.width % kRowsVector == 0;
  g.vector = g.warp_rows && rows_divide ? kRowsVector : 1;
  g.warp_sums = static_cast<int64_t>(low.columns.size()) * 32 *
                std::max(g.lane_elements(1), g.lane_elements(g.vector));
  // Warps (rows) per block in warp mode: 8; with column sums 4, or fewer where their shared
  // memory would pass the 48 KiB of static shared memory.
  if (g.columns && g.warp_rows) {
    g.warps = 4;
    while (g.warps > 1 && g.warps * g.warp_sums * acc_bytes > 48 * 1024) g.warps /= 2;
  }
  while (!g.warp_rows && g.threads < 1024 && g.threads * 4 < low.n) g.threads *= 2;
  g.block_threads = g.warp_rows ? 32 * g.warps : g.threads;
  g.blocks = g.warp_rows ? (low.rows + g.warps - 1) / g.warps : low.rows;
  // Column reductions: a fixed grid of blocks, each taking rows blockIdx.x, + kGrid, ...; a
  // thread adds its columns' terms (j = threadIdx.x + m kThreads, the same columns in every
  // row) into the block's shared-memory sums, written out at the end as the block's partials.
  // A warp per row: warp w of block b takes rows W b + w, + W kGrid, ...; each lane adds its
  // columns' terms into its warp's own shared-memory sums (a lane owns its slots: no atomics,
  // no barrier), and the block's warps' sums are added in warp order at the end
  // (deterministic). Shared memory rather than registers: a LayerNorm gradient's three column
  // sums of a 768 row took 72 registers a lane, and at ~210 a kernel ran 8 warps per SM.
  g.grid = g.warp_rows ? std::min<int64_t>(g.blocks, 512) : std::min<int64_t>(low.rows, 1024);
  for (const MVal& m : low.vals)
    if (m.kind == MKind::kReduce) g.max_level = std::max(g.max_level, m.level);
  return g;
}

// The source's comment on how the kernel covers the rows.
std::string geometry_comment(const Lowered& low, const RowsGeometry& g) {
  if (g.columns && g.warp_rows)
    return fmt::format(
        "// {} blocks of {} warps, a warp per row (rows 8 blockIdx.x + warp + m * {}); {} "
        "pass(es) over a row; {} column reduction(s) summed per lane in registers, then per "
        "block, then a second kernel adds the {} block partials per column\n",
        g.grid, g.warps, g.grid * g.warps, g.max_level + 1, low.columns.size(), g.grid);
  if (g.columns)
    return fmt::format(
        "// {} blocks of {} threads, each over rows blockIdx.x + m * {}; {} pass(es) over a row; "
        "{} column reduction(s) summed per block in shared memory, then a second kernel adds "
        "the {} block partials per column\n",
        g.grid, g.threads, g.grid, g.max_level + 1, low.columns.size(), g.grid);
  if (g.warp_rows)
    return fmt::format("// one warp per row, {} rows per block; {} pass(es) over the row\n",
                       g.warps, g.max_level + 1);
  return fmt::format("// one block of {} threads per row; {} pass(es) over the row\n", g.threads,
                     g.max_level + 1);
}

// Which inputs read along the whole row (index e) a warp-mode kernel holds in registers, and
// which it loads V wide in its final pass; none in block mode.
struct RowInputs {
  // Every input a reduction pass reads is loaded once per row into registers, kiln_r<input>[m]
  // holding the lane's element m, and every pass reads it there (a pass's column loop is
  // unrolled over the lane's columns). Without that a LayerNorm gradient read x four times and
  // dy three times a row through L1/L2.
  std::set<int> cached;
  // The other inputs read along the row: one the final pass alone reads is loaded there, in its
  // V-wide step (kiln_q<input>), and holds no registers through the passes before (a LayerNorm
  // gradient's residual gradient: 24 registers a lane).
  std::set<int> step;
};

RowInputs row_inputs(const Lowered& low, const RowsGeometry& g) {
  RowInputs inputs;
  if (!g.warp_rows) return inputs;
  const std::vector<MVal>& vals = low.vals;
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
    if (m.kind == MKind::kLoad && m.text == "e") inputs.cached.insert(m.input);
    for (int a : m.args) stack.push_back(a);
  }
  for (const MVal& m : vals)
    if (m.kind == MKind::kLoad && m.space == Space::kFull && m.text == "e" &&
        !inputs.cached.count(m.input))
      inputs.step.insert(m.input);
  return inputs;
}

// Writes one entry point of a rows kernel, V = v columns per lane and step in warp mode (V = 1:
// the entry for pointers not aligned to kRowsVector elements). Warp mode takes V adjacent
// columns per lane and step: lane t's elements m = g V + u are columns (t + 32 g) V + u, loaded
// and stored as one V-wide access per input and output, so a warp moves 512 bytes of f32 per
// instruction instead of 128 (GPT-2's LayerNorm rows: vector accesses keep more bytes in
// flight). The steps, in the order the kernel runs them: the row (or rows) a thread works on,
// the register loads, one pass per level of reductions, the final pass over the per-element
// outputs and column terms, padding, per-row outputs, and the block's column partials.
class RowsEntryWriter {
 public:
  RowsEntryWriter(const Graph& body, const Lowered& low, const RowsGeometry& g,
                  const RowInputs& inputs, int v)
      : body_(body), low_(low), vals_(low.vals), g_(g), inputs_(inputs), v_(v),
        lane_columns_(g.lane_elements(v)), groups_(lane_columns_ / v) {
    // Warp mode: an outer loop over the lane's V-wide steps (j0: the step's first column), an
    // inner one over its V elements (m, j, e); between them, a step's vector loads and stores.
    outer_head_ = fmt::format("#pragma unroll\n  for (int g = 0; g < {}; ++g) {{\n"
                              "    const int j0 = (kiln_t + 32 * g) * {};\n"
                              "    if (j0 >= kN) break;\n",
                              groups_, v_);
    inner_head_ = fmt::format(
        "#pragma unroll\n    for (int u = 0; u < {}; ++u) {{\n    const int m = g * {} + u;\n"
        "    const int j = j0 + u;\n    const long long e = base + j;\n",
        v_, v_);
    loop_head_ = g_.warp_rows ? outer_head_ + inner_head_
                              : std::string("  for (int j = kiln_t; j < kN; j += kThreads) {\n"
                                            "    const long long e = base + j;\n");
    loop_tail_ = g_.warp_rows ? "    }\n  }\n" : "  }\n";
  }

  std::string write(const std::string& name) {
    text_ += fmt::format("extern \"C\" __global__ void __launch_bounds__({}) {}({}) {{\n",
                         g_.block_threads, name,
                         g_.columns ? column_params(body_, low_) : params(body_));
    row_loop();
    load_cached_inputs();
    for (int level = 1; level <= g_.max_level; ++level) reduction_pass(level);
    emit_row_values(g_.max_level);
    final_pass();
    padded_outputs();
    row_outputs();
    block_partials();
    text_ += "}\n";
    return std::move(text_);
  }

 private:
  bool is_row(int id) const { return vals_[id].space == Space::kRow; }
  bool is_full(int id) const { return vals_[id].space == Space::kFull; }
  std::string pack(DType d) const { return fmt::format("KilnPack<{}, {}>", v_, storage_of(d)); }
  DType input_dtype(int input) const { return body_.type(body_.inputs[input].value).dtype; }
  DType output_dtype(size_t o) const { return body_.type(body_.outputs[o]).dtype; }

  // Where output o's row starts: base = row * kN, or row * (kN + width) when it is padded.
  std::string row_start(size_t o) const {
    const int64_t width = low_.pads[o].width;
    return width == 0 ? std::string("base") : fmt::format("row * {}", lit_int(low_.n + width));
  }

  std::string load_text(int id) const {
    const MVal& m = vals_[id];
    if (m.space == Space::kFull && m.text == "e" && inputs_.cached.count(m.input))
      return fmt::format("kiln_r{}[m]", m.input);
    if (m.space == Space::kFull && m.text == "e" && inputs_.step.count(m.input))
      return load_conversion(input_dtype(m.input), fmt::format("kiln_q{}.v[u]", m.input));
    const DType d = input_dtype(m.input);
    return load_conversion(d, fmt::format("in{}[{}]", m.input, m.text));
  }

  // Statements for `targets` and what they need, of the values `include` admits, into `done`.
  void emit(const std::vector<int>& targets, std::set<int>& done,
            const std::function<bool(int)>& include, const std::string& indent) {
    emit_closure(vals_, targets, done, include, [this](int id) { return load_text(id); }, indent,
                 text_);
  }

  // The row this thread works on (base: its first element), or the loop over the rows its warp
  // or block takes with column sums (closed by block_partials), after zeroing those sums.
  void row_loop() {
    const std::string& acc_t = g_.acc_t;
    if (g_.columns && g_.warp_rows) {
      // kiln_cw[(q * L + m) * 32 + lane]: this warp's sum of column output q over the lane's
      // element m (L per lane); each lane zeroes and adds its own slots only.
      text_ += fmt::format(
          "  __shared__ {0} kiln_col[{1}];\n"
          "  {0} * const kiln_cw = kiln_col + (threadIdx.x >> 5) * {2} + (threadIdx.x & 31);\n"
          "  for (int s = 0; s < {2}; s += 32) kiln_cw[s] = {3};\n",
          acc_t, lit_int(g_.warps * g_.warp_sums), lit_int(g_.warp_sums), lit(acc_t, 0.0));
      text_ += fmt::format(
          "  for (long long row = static_cast<long long>(blockIdx.x) * {} + (threadIdx.x >> 5); "
          "row < {}; row += {}) {{\n"
          "  const long long base = row * kN;\n",
          g_.warps, lit_int(low_.rows), lit_int(g_.grid * g_.warps));
    } else if (g_.columns) {
      text_ += fmt::format(
          "  __shared__ {} kiln_col[{}];\n"
          "  for (int j = threadIdx.x; j < {}; j += kThreads) kiln_col[j] = {};\n"
          "  __syncthreads();\n"
          "  for (long long row = blockIdx.x; row < {}; row += {}) {{\n"
          "  const long long base = row * kN;\n",
          acc_t, lit_int(static_cast<int64_t>(low_.columns.size()) * low_.n),
          lit_int(static_cast<int64_t>(low_.columns.size()) * low_.n), lit(acc_t, 0.0),
          lit_int(low_.rows), lit_int(g_.grid));
    } else if (g_.warp_rows) {
      // A warp past the last row leaves at once: its reductions are warp-only, nobody waits.
      text_ += fmt::format(
          "  const long long row = static_cast<long long>(blockIdx.x) * {} + (threadIdx.x >> 5);\n"
          "  if (row >= {}) return;\n  const long long base = row * kN;\n",
          g_.warps, lit_int(low_.rows));
    } else {
      text_ += "  const long long row = blockIdx.x;\n  const long long base = row * kN;\n";
    }
    // The thread's place in its row's group of kThreads.
    text_ += g_.warp_rows ? "  const int kiln_t = threadIdx.x & 31;\n"
                          : "  const int kiln_t = threadIdx.x;\n";
  }

  // Warp mode: the inputs the reduction passes read, into the lanes' registers (RowInputs).
  void load_cached_inputs() {
    for (int input : inputs_.cached) {
      const DType d = input_dtype(input);
      text_ += fmt::format("  {} kiln_r{}[{}];\n", ctype_of(d), input, lane_columns_);
      text_ += outer_head_;
      text_ += fmt::format(
          "    const {0} kiln_p = *reinterpret_cast<const {0}*>(in{1} + base + j0);\n"
          "#pragma unroll\n    for (int u = 0; u < {2}; ++u) kiln_r{1}[g * {2} + u] = {3};\n  }}\n",
          pack(d), input, v_, load_conversion(d, "kiln_p.v[u]"));
    }
  }

  // Row values of level <= `level` that something needs, in order.
  void emit_row_values(int level) {
    std::vector<int> ready;
    for (size_t id = 0; id < vals_.size(); ++id)
      if (is_row(static_cast<int>(id)) && vals_[id].kind != MKind::kReduce &&
          vals_[id].level <= level)
        ready.push_back(static_cast<int>(id));
    emit(ready, done_, [this](int id) { return is_row(id) && vals_[id].kind != MKind::kReduce; },
         "  ");
  }

  // One pass over the row that computes the reductions of `level` (warp shuffles, then the
  // block), after the row values they need.
  void reduction_pass(int level) {
    emit_row_values(level - 1);
    std::vector<int> reductions;
    for (size_t id = 0; id < vals_.size(); ++id)
      if (vals_[id].kind == MKind::kReduce && vals_[id].level == level)
        reductions.push_back(static_cast<int>(id));
    text_ += fmt::format("  // pass {}: {} reduction(s)\n", level, reductions.size());
    for (int id : reductions)
      text_ += fmt::format("  {} acc{} = {};\n", vals_[id].ctype, id,
                           vals_[id].reduce == ReduceOp::kSum ? lit(vals_[id].ctype, 0.0)
                                                              : "-" + lit(vals_[id].ctype, INFINITY));
    text_ += loop_head_;
    std::set<int> pass_done = done_;  // full values are recomputed in every pass
    std::vector<int> args;
    for (int id : reductions) args.push_back(vals_[id].args[0]);
    emit(args, pass_done, [this](int id) { return is_full(id); }, "    ");
    for (int id : reductions) {
      if (vals_[id].reduce == ReduceOp::kSum)
        text_ += fmt::format("    acc{} += {};\n", id, var(vals_[id].args[0]));
      else
        text_ += fmt::format("    acc{} = kiln_combine<1>(acc{}, {});\n", id, id,
                             var(vals_[id].args[0]));
    }
    text_ += loop_tail_;
    for (int id : reductions) {
      text_ += fmt::format("  const {} {} = kiln_block_reduce<kThreads, {}>(acc{});\n",
                           vals_[id].ctype, var(id), vals_[id].reduce == ReduceOp::kSum ? 0 : 1,
                           id);
      done_.insert(id);
    }
  }

  // The final pass: the per-element outputs (and the column reductions' terms). Warp mode
  // stores each output's V elements of a step as one access after the inner loop.
  void final_pass() {
    std::vector<int> full_outputs;
    for (int m : low_.outputs)
      if (is_full(m)) full_outputs.push_back(m);
    for (int o : low_.columns) full_outputs.push_back(vals_[low_.outputs[o]].args[0]);
    if (full_outputs.empty()) return;
    text_ += g_.columns ? "  // final pass: per-element outputs and column sums\n"
                        : "  // final pass: per-element outputs\n";
    std::string packs, stores;
    for (int input : inputs_.step)
      packs += fmt::format(
          "    const {0} kiln_q{1} = *reinterpret_cast<const {0}*>(in{1} + base + j0);\n",
          pack(input_dtype(input)), input);
    for (size_t o = 0; o < body_.outputs.size(); ++o) {
      if (!is_full(low_.outputs[o])) continue;
      const DType d = output_dtype(o);
      packs += fmt::format("    {} kiln_o{};\n", pack(d), o);
      stores += fmt::format("    *reinterpret_cast<{}*>(out{} + {} + j0) = kiln_o{};\n", pack(d),
                            o, row_start(o), o);
    }
    text_ += g_.warp_rows ? outer_head_ + packs + inner_head_ : loop_head_;
    std::set<int> pass_done = done_;
    emit(full_outputs, pass_done, [this](int id) { return is_full(id); }, "    ");
    for (size_t o = 0; o < body_.outputs.size(); ++o)
      if (is_full(low_.outputs[o]))
        text_ += fmt::format(fmt::runtime(g_.warp_rows ? "    kiln_o{0}.v[u] = {2};\n"
                                                       : "    out{0}[{1} + j] = {2};\n"),
                             o, row_start(o),
                             store_conversion(output_dtype(o), var(low_.outputs[o])));
    for (size_t q = 0; q < low_.columns.size(); ++q) {
      const std::string term = var(vals_[low_.outputs[low_.columns[q]]].args[0]);
      text_ += g_.warp_rows ? fmt::format("    kiln_cw[({} + m) * 32] += {};\n",
                                          lit_int(static_cast<int64_t>(q) * lane_columns_), term)
                            : fmt::format("    kiln_col[{} + j] += {};\n",
                                          lit_int(static_cast<int64_t>(q) * low_.n), term);
    }
    if (g_.warp_rows) {
      text_ += "    }\n";
      text_ += stores;
      text_ += "  }\n";
    } else {
      text_ += loop_tail_;
    }
  }

  // Padded outputs: a lane (thread) per pad column writes it after the row.
  void padded_outputs() {
    for (size_t o = 0; o < body_.outputs.size(); ++o) {
      const RowPad& pad = low_.pads[o];
      if (pad.width == 0) continue;
      const DType d = output_dtype(o);
      text_ += fmt::format("  if (kiln_t < {}) out{}[{} + kN + kiln_t] = {};\n", pad.width, o,
                           row_start(o), store_conversion(d, lit(ctype_of(d), pad.value)));
    }
  }

  // Outputs of one value per row, written by the row's first thread.
  void row_outputs() {
    bool any_row_output = false;
    for (size_t o = 0; o < body_.outputs.size(); ++o) {
      if (is_full(low_.outputs[o]) || vals_[low_.outputs[o]].kind == MKind::kColumn) continue;
      if (!any_row_output) text_ += "  if (kiln_t == 0) {\n";
      any_row_output = true;
      text_ += fmt::format("    out{}[row] = {};\n", o,
                           store_conversion(output_dtype(o), var(low_.outputs[o])));
    }
    if (any_row_output) text_ += "  }\n";
  }

  // With column sums: closes the loop over rows and writes the block's partial sums.
  void block_partials() {
    if (g_.columns && g_.warp_rows) {
      // The block's sums: its warps' sums added in warp order.
      // Slot (q, m, lane) holds column (lane + 32 (m / V)) V + m % V of output q.
      text_ += fmt::format(
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
          lit_int(static_cast<int64_t>(low_.columns.size()) * 32 * lane_columns_),
          g_.block_threads, 32 * lane_columns_, lane_columns_, v_, g_.acc_t, g_.warps,
          lit_int(g_.warp_sums), lit_int(g_.grid));
    } else if (g_.columns) {
      text_ += fmt::format(
          "  }}\n  // this block's partial column sums\n  __syncthreads();\n"
          "  for (int j = threadIdx.x; j < {}; j += kThreads)\n"
          "    kiln_partials[(j / kN * {} + blockIdx.x) * kN + j % kN] = kiln_col[j];\n",
          lit_int(static_cast<int64_t>(low_.columns.size()) * low_.n), lit_int(g_.grid));
    }
  }

  const Graph& body_;
  const Lowered& low_;
  const std::vector<MVal>& vals_;
  const RowsGeometry& g_;
  const RowInputs& inputs_;
  const int v_;
  const int64_t lane_columns_;  // warp mode: elements per lane
  const int64_t groups_;        // warp mode: V-wide steps per lane
  std::string outer_head_, inner_head_, loop_head_, loop_tail_;
  std::set<int> done_;  // the row values written so far
  std::string text_;
};

}  // namespace

GeneratedKernel generate_rows(const Graph& body, const Lowered& low) {
  const RowsGeometry g = rows_geometry(low);
  GeneratedKernel k;
  k.kind = FusedKind::kRows;
  k.rows = low.rows;
  k.row_length = low.n;
  k.ops = low.ops;
  k.threads = g.block_threads;
  k.blocks = g.blocks;
  set_param_bytes(body, k);
  if (g.columns) {
    k.blocks = g.grid;
    k.column_outputs = low.columns;
    k.partial_tiles = g.grid;
    k.partials_bytes = low.columns.size() * static_cast<size_t>(g.grid) *
                       static_cast<size_t>(low.n) * (g.acc_t == "double" ? 8 : 4);
  }
  // A second entry with V = 1 serves pointers not aligned to V elements (launch_generated
  // checks).
  k.vector_width = g.vector;

  std::string text = header(FusedKind::kRows, low, body);
  text += geometry_comment(low, g);
  text += prelude();
  text += kBlockReduce;
  text += fmt::format("\nconstexpr int kThreads = {};\nconstexpr long long kN = {}LL;\n\n",
                      g.threads, low.n);
  const RowInputs inputs = row_inputs(low, g);
  auto entry_text = [&](const std::string& name, int v) {
    return RowsEntryWriter(body, low, g, inputs, v).write(name);
  };
  k.entry = "kiln_fused_rows";
  const std::string finish = g.columns ? column_finish(body, low, g.grid, k) : std::string();
  if (g.vector > 1) {
    // A source of its own, compiled only when a pointer is unaligned (never for the arena's
    // 64-byte-aligned values): a second copy of a long unrolled kernel in the main source
    // doubled NVRTC's time on a cold start.
    k.scalar_entry = "kiln_fused_rows_scalar";
    k.scalar_blocks = k.blocks;
    k.scalar_source =
        text + "\n// For pointers not aligned to V elements.\n" + entry_text(k.scalar_entry, 1) + finish;
  }
  k.source = text + entry_text(k.entry, g.vector) + finish;
  return k;
}

}  // namespace kiln::cuda::codegen

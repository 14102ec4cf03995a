// CUDA C++ source generation for fused nodes (the "nvrtc" dialect's front half; nvrtc.h compiles
// and launches what this produces). Pure C++20 with no CUDA headers: the CLI's
// `kiln compile --dump-kernels` and the CPU tests use it on machines without a GPU.
//
// A fused node's body (Node::body) is lowered op by op, through ONE table of per-op emitters
// (emitters.cc, `emitters()`), into "micro values": loads of body inputs, scalar CUDA expressions
// over other micro values, and (rows kind only) sum/max reductions along the row. Two kernel
// shapes come out of that:
//   "elementwise": the body's values all broadcast (numpy rules) to one iteration shape S; one
//     thread computes V consecutive elements (V in 1/2/4/8: 16-byte accesses of the widest
//     stored type, V dividing the row length N) with vector loads and stores; inputs of other
//     shapes are indexed by compile-time index arithmetic (i % N for (N,), i / N for (R, 1), 0
//     for scalars, the general product otherwise). A second, scalar entry point serves pointers
//     that are not aligned for V.
//   "rows": one warp per row of S = (R, N) (the row op's input), 8 rows to a block, for rows of
//     up to 1024 elements; otherwise a thread block per row. Reductions
//     along the row (max, sum) by warp shuffles (and one shared-memory step for a block); the
//     row's elementwise work is recomputed in each pass over the row. A warp per row loads each
//     input read along the row once into registers (the lane's columns, the passes' loops
//     unrolled); a block per row re-reads them from L1/L2.
// Column reductions: sum / mean over every axis but the last of a value spanning (R, N) (bias
// gradients, LayerNorm's dgamma / dbeta), as group outputs never read inside the body, in both
// kernel shapes. The main kernel writes per-element outputs as above and one f32 (f64 in f64)
// partial sum per column per tile of rows into a stream-ordered scratch buffer; a second small
// kernel ("finish") adds each column's partials in tile order. No atomics: the result is the
// same bit for bit on every run.
//   elementwise: a 2-D grid; block (x, y) covers a strip of columns (a warp of threads across
//     it, V columns each, vector accesses) over a tile of rows; each thread sums its columns in
//     registers, the block adds its threads' row sums through shared memory in a fixed order.
//   rows: a fixed grid of blocks. A warp per row (rows up to 1024): at most 512 blocks of 8
//     warps, each warp taking every (8 grid)-th row; a lane sums its columns' terms in registers
//     across its rows, and the block's warps add theirs into shared memory in warp order. A block
//     per row: at most 1024 blocks, block b taking rows b, b + grid, ...; each thread adds the
//     terms of its columns into the block's sums in shared memory.
// Computation is in f32 for f32/f16/bf16 storage (f64 in f64; integers and bools as themselves),
// rounding once per stored output, so results differ from the per-op reference (which rounds
// every intermediate to its storage type) by a few ulps of the storage type.
//
// The source is a deterministic function of the body (op sequence, attributes, shapes, dtypes):
// equal bodies give byte-equal sources, which is the NVRTC cache's key (nvrtc.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ops/fused/kind.h"

namespace kiln::cuda {

// One generated kernel and how to launch it. Kernel parameters: one pointer per body input, then
// one per body output, in order, and with column reductions the partials buffer last (nothing
// else: every size is a compile-time constant).
struct GeneratedKernel {
  FusedKind kind = FusedKind::kElementwise;  // kElementwise | kRows
  std::string source;  // CUDA C++ for NVRTC (includes only cuda_fp16.h and cuda_bf16.h)
  std::string entry;   // extern "C" kernel name
  // Elementwise only: the entry point for any pointer alignment (vector_width 1); empty when
  // `entry` is already scalar.
  std::string scalar_entry;
  // Rows kernels with a vector entry: the scalar entry (and the finish kernel) in a source of
  // their own, compiled at the first unaligned launch; empty: scalar_entry is in `source`.
  std::string scalar_source;
  int vector_width = 1;  // elements per thread in `entry`
  // Launch geometry: `blocks` blocks of `threads` threads (the scalar entry: scalar_blocks).
  int64_t blocks = 0, scalar_blocks = 0;
  int threads = 0;
  // Byte sizes of the parameters' element types (for the alignment check before `entry`).
  std::vector<int> param_element_bytes;
  int64_t rows = 0, row_length = 0;  // the iteration space (R, N)
  std::vector<std::string> ops;      // the body's ops, in order (for the header and reports)
  // Column reductions (empty: none). The body outputs `entry` leaves to `finish_entry`; the grid
  // of `entry` is blocks x blocks_y (both entries); the scratch buffer of partials
  // (partial_tiles per column per column output) is the last parameter of both kernels, which
  // run one after the other on the stream.
  std::vector<int> column_outputs;
  int64_t blocks_y = 1;
  int64_t partial_tiles = 0;
  size_t partials_bytes = 0;
  std::string finish_entry;
  int64_t finish_blocks = 0;
  int finish_threads = 0;
};

// Whether `body` can be generated as a kernel of `kind` (elementwise or rows: the two kernel
// shapes above); if not, `why` says what is missing (e.g. "op conv2d has no emitter"). Never
// throws.
bool can_generate(const Graph& body, FusedKind kind, std::string* why = nullptr);
// The kernel for `body`. Throws kiln::Error (with can_generate's reason) when it cannot.
GeneratedKernel generate_kernel(const Graph& body, FusedKind kind);
// Ops that have an emitter (any kind), sorted by name: for tests and reports.
std::vector<Op> ops_with_emitters();

}  // namespace kiln::cuda

// The CPU kernel of `fused` nodes (dialect "cpu"): runs a fusion group as ONE pass over tiles of
// whole rows, so the values that never leave the group live only in a small per-thread scratch
// arena instead of full-size buffers. See fused.cc for the tile policy and what bodies it takes;
// everything else runs through the fused op's reference kernel (ops/fused.cc).
//
// This header exposes the kernel's planning for tests and benchmarks: whether a body is taken
// (and why not), and how it would be tiled.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/backend.h"

namespace kiln::cpu {

void register_fused_kernels(KernelRegistry& registry);

struct FusedPlanInfo {
  bool supported = false;
  std::string why_not;     // when !supported: the first thing the kernel does not handle
  int64_t rows = 0;        // R: product of all dims but the last of the group's full shape
  int64_t row_length = 0;  // N: its last dim
  int64_t tile_rows = 0;   // rows per tile (the last tile may have fewer)
  int64_t tiles = 0;
  bool gemm = false;       // holds a GEMM nucleus (tiles then run in order, BLAS threads each)
  int64_t column_reductions = 0;
  // Body ops that run their reference kernel on each tile (no fast kernel takes the tile
  // shapes): correct, but slow.
  std::vector<std::string> reference_ops;
};
// How the fused CPU kernel would run `body` (a fused node's body; inputs typed as the node's).
FusedPlanInfo fused_plan_info(const Graph& body);

// Bytes of live tile values the tile policy aims for (default 256 KiB, about one L2); tests set
// it small to get many tiles and a partial last tile. 0 restores the default. Not thread-safe
// against running kernels: set it between runs.
void set_fused_tile_bytes(int64_t bytes);

}  // namespace kiln::cpu

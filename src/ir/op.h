// The Op enum and its static facts, generated from the one op table in ir/ops.def.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace kiln {

enum OpFlag : uint32_t {
  kNone = 0,
  kElementwise = 1u << 0,  // output element i depends only on input elements i (after broadcast)
  kReduction = 1u << 1,    // reduces over one or more axes
  kShape = 1u << 2,        // moves data without arithmetic (reshape, transpose, slice, ...)
  kSource = 1u << 3,       // no inputs; output determined by attributes
  kRandom = 1u << 4,       // uses the counter-based RNG (deterministic given seed and offset)
  kOptimizer = 1u << 5,    // a parameter/state update (outputs replace inputs via Graph::updates)
  // Starts a collective over the process group (all_reduce, all_gather, reduce_scatter): runs
  // on the communication stream, and its output is read only through a collective_wait (the
  // join). Every rank must run the same collectives in the same order, so passes never fold,
  // merge (CSE), fuse or recompute one (ops/collective.h).
  kCollective = 1u << 6,
};

enum class Op : uint16_t {
#define KILN_OP(name, text, min_in, max_in, flags) k##name,
#include "ir/ops.def"
#undef KILN_OP
};

inline constexpr int kNumOps = 0
#define KILN_OP(name, text, min_in, max_in, flags) +1
#include "ir/ops.def"
#undef KILN_OP
    ;

struct OpInfo {
  Op op;
  std::string_view name;
  int min_inputs;
  int max_inputs;  // -1: any number >= min_inputs
  uint32_t flags;
};

const OpInfo& op_info(Op op);
inline std::string_view op_name(Op op) { return op_info(op).name; }
std::optional<Op> parse_op(std::string_view name);
inline bool has_flag(Op op, OpFlag flag) { return (op_info(op).flags & flag) != 0; }
// Whether a kernel of `op` needs the process group (KernelArgs::communicator): the collectives
// and local_shard (this rank's slice). Such nodes are never constant-folded.
inline bool needs_process_group(Op op) { return has_flag(op, kCollective) || op == Op::kLocalShard; }

}  // namespace kiln

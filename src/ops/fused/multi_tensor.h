// The body contracts of the multi-tensor kinds (the multi-tensor pass makes them,
// passes/multi_tensor.h), read into what the kernels of every backend need
// (backends/cpu/multi_tensor.cc, backends/cuda/multi_tensor/multi_tensor.cc):
//   "multi-tensor-update": only optimizer_update nodes, all with equal attributes (one optimizer,
//     the same hyperparameters) and the same scalar operands (lr, step); every operand a body
//     input; every result a distinct body output, and every body output one result.
//   "global-norm": terms t_i = sum(square(x_i)) or sum(square(cast(x_i, f32))) (each x_i a
//     body input read by that term alone; f32 square and sum, a rank-0 sum), combined by a tree
//     of f32 scalar adds whose root is the only body output.
//   "multi-tensor-cast": only cast nodes, each of an f32 body input to bf16 or f16 (members may
//     mix the two, and two members may read the same input); every result a distinct body
//     output, and every body output one result.
// The order in which members may run when the memory plan overlaps them is the backends' own
// business (backends/multi_tensor.h).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "ir/graph.h"

namespace kiln::multi_tensor {

// One update node of a multi-tensor body, as indices into the FUSED node's inputs and outputs.
struct Member {
  std::vector<int> inputs;   // per operand of the update op
  std::vector<int> outputs;  // per result
};
struct UpdateBody {
  Attributes attrs;             // the members' (equal) attributes: attrs.s("optimizer") names the rule
  std::vector<Member> members;  // in body order
};
// The members of a multi-tensor update body; nullopt, with the first reason in `why`, when the
// body is not of that form.
std::optional<UpdateBody> update_body(const Graph& body, std::string* why = nullptr);

struct NormBody {
  std::vector<int> term_input;  // per term (in body order): the body input it reads
  // The add tree, in body order: each operand a term (>= 0) or an earlier add (-1 - its index).
  std::vector<std::array<int, 2>> adds;
  int result = 0;  // the body output, in the same code
};
std::optional<NormBody> norm_body(const Graph& body, std::string* why = nullptr);

struct CastMember {
  int input = 0;   // index into the fused node's inputs (f32)
  int output = 0;  // index into the fused node's outputs
  DType to = DType::kBF16;  // kBF16 or kF16
};
std::optional<std::vector<CastMember>> cast_body(const Graph& body, std::string* why = nullptr);

}  // namespace kiln::multi_tensor

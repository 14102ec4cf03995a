// What the multi-tensor kernels of every backend share (backends/cpu/multi_tensor.cc,
// backends/cuda/multi_tensor.cc): reading the body of a fused node that the multi-tensor pass
// (passes/multi_tensor.h) made, and the order in which its members may run when the memory plan
// put an output of one member over an input of another.
//
// Bodies:
//   "multi-tensor-adamw" / "multi-tensor-sgd": only adamw_update (sgd_update) nodes, all with
//     equal attributes and the same scalar operands (lr, and adamw's step); every operand a body
//     input; every result a distinct body output, and every body output one result.
//   "global-norm": terms t_i = sum(square(x_i)) or sum(square(cast(x_i, f32))) (each x_i a
//     body input read by that term alone; f32 square and sum, a rank-0 sum), combined by a tree
//     of f32 scalar adds whose root is the only body output.
//   "multi-tensor-cast": only cast nodes, each of an f32 body input to bf16 or f16 (members may
//     mix the two, and two members may read the same input); every result a distinct body
//     output, and every body output one result. No aliasing question: an f32 input and a 16-bit
//     result never share a buffer (the kernels are not in_place_ok).
//
// Aliasing. A member is elementwise: it reads element i of its operands before writing element
// i of its results, so a result written over its own operand (the executor's in-place updates)
// is safe. A result written over ANOTHER member's operand is not, when the two run at once (one
// GPU launch) or in the wrong order. The executor's memory plan may do that where an update is
// not written straight into its target (KernelImpl::in_place_ok lets a node's output take the
// buffer of any same-typed input that dies at the node: f16 loss scaling wraps every update in
// a `where`, so every result is an arena value there, and a dying gradient of one member is a
// natural home for a result of another). plan_run_order() finds those overlaps from the actual
// pointers and orders the members into waves (a member whose operand another member overwrites
// runs in an earlier wave); members caught in a cycle read copies of the overwritten operands.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "tensor/tensor.h"

namespace kiln::multi_tensor {

// One update node of a multi-tensor body, as indices into the FUSED node's inputs and outputs.
struct Member {
  std::vector<int> inputs;   // per operand of the update op
  std::vector<int> outputs;  // per result
};
struct UpdateBody {
  Op op = Op::kAdamwUpdate;
  Attributes attrs;             // the members' (equal) attributes
  std::vector<Member> members;  // in body order
};
// The members of a multi-tensor update body whose nodes are all `op` (kAdamwUpdate or
// kSgdUpdate); nullopt, with the first reason in `why`, when the body is not of that form.
std::optional<UpdateBody> update_body(const Graph& body, Op op, std::string* why = nullptr);

struct NormBody {
  std::vector<int> term_input;  // per term (in body order): the body input it reads
  // The add tree, in body order: each operand a term (>= 0) or an earlier add (-1 - its index).
  std::vector<std::array<int, 2>> adds;
  int result = 0;  // the body output, in the same code
};
std::optional<NormBody> norm_body(const Graph& body, std::string* why = nullptr);
// The output the add tree computes from per-term values rounded to f32, each add in f32: the
// body's own arithmetic (an f32 add is an f64 add rounded to f32, as the reference kernel does).
float combine_terms(const NormBody& norm, const std::vector<float>& terms);

struct CastMember {
  int input = 0;   // index into the fused node's inputs (f32)
  int output = 0;  // index into the fused node's outputs
  DType to = DType::kBF16;  // kBF16 or kF16
};
std::optional<std::vector<CastMember>> cast_body(const Graph& body, std::string* why = nullptr);

// Byte ranges each member reads (its operands) and writes (its results).
struct Region {
  const std::byte* begin = nullptr;
  size_t bytes = 0;
};
struct MemberRegions {
  std::vector<Region> reads, writes;
};
struct RunOrder {
  std::vector<std::vector<int>> waves;  // members; waves run in order, a wave's members at once
  // (member, operand index within the member) pairs to read from a copy taken before any wave.
  std::vector<std::pair<int, int>> copies;
};
// One wave of every member when nothing overlaps (the usual case: the executor writes each
// update into its own target).
RunOrder plan_run_order(const std::vector<MemberRegions>& members);
// The regions of `members` over the kernel's tensors.
std::vector<MemberRegions> member_regions(const std::vector<Member>& members,
                                          std::span<const Tensor> inputs,
                                          std::span<const Tensor> outputs);

}  // namespace kiln::multi_tensor

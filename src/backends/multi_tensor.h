// What the multi-tensor kernels of every backend share (backends/cpu/multi_tensor.cc,
// backends/cuda/multi_tensor/multi_tensor.cc) beyond the body contracts (ops/fused/multi_tensor.h, which
// read a body into its members): the norm's add tree over the terms, and the order in which
// members may run when the memory plan put an output of one member over an input of another.
// (multi-tensor-cast has no aliasing question: an f32 input and a 16-bit result never share a
// buffer, and its kernels are not in_place_ok.)
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

#include <cstddef>
#include <span>
#include <vector>

#include "ops/fused/multi_tensor.h"
#include "tensor/tensor.h"

namespace kiln::multi_tensor {

// The output the add tree computes from per-term values rounded to f32, each add in f32: the
// body's own arithmetic (an f32 add is an f64 add rounded to f32, as the reference kernel does).
float combine_terms(const NormBody& norm, const std::vector<float>& terms);

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

// What each op is, beyond its op-table line: its attribute schema, its shape/dtype inference
// (which is also its verifier: it throws kiln::Error on anything it cannot accept), its CPU
// reference kernel, and its traits: the facts passes and analyses read about it (OpTraits).
// Definitions live in src/ops/, one file per family of ops, and are collected by
// ops/registry.cc. The IR uses the schema and inference; backends use the reference kernel.
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ir/attribute.h"
#include "ir/op.h"
#include "ir/shape.h"

namespace kiln {

class Tensor;
class Communicator;  // device/communicator.h
class Expr;
class Graph;
struct Node;
struct GradContext;  // ops/gradient.h

struct AttrSpec {
  std::string name;
  AttrKind kind;
  // Value used when the attribute is absent. No default and not optional: required.
  std::optional<AttrValue> default_value = std::nullopt;
  bool optional = false;  // may be absent, with no default (e.g. attention's scale)
  // A number list (kind kFloats) that holds ints where the node's `dtype` attribute is an
  // integer or bool dtype, so that int64 values stay exact (constant's values): normalization
  // converts an integral float list to ints there, and ints to floats for float dtypes.
  bool ints_for_integer_dtype = false;
};

// Arguments of a kernel call: the node's attributes, its input tensors, and its output tensors,
// already allocated with the inferred types.
struct KernelArgs {
  const Attributes& attrs;
  std::span<const Tensor> inputs;
  std::span<Tensor> outputs;
  // The cudaStream_t a CUDA kernel enqueues on (nullptr for CPU kernels). Kept as void* so
  // this header needs no CUDA headers.
  void* stream = nullptr;
  // The node's body: set for `fused` nodes (Node::body), nullptr otherwise.
  const Graph* body = nullptr;
  // The process group's collective engine, for the ops that need one (needs_process_group);
  // nullptr in a single-process step. A collective's `stream` is the communication stream.
  const Communicator* communicator = nullptr;
};

using InferFn = std::function<std::vector<TensorType>(std::span<const TensorType> inputs,
                                                      const Attributes& attrs)>;
using KernelFn = std::function<void(const KernelArgs& args)>;
// Inference of an op whose types come from a body graph (only `fused`).
using BodyInferFn = std::function<std::vector<TensorType>(
    std::span<const TensorType> inputs, const Attributes& attrs, const Graph& body)>;
// Builds the gradient of a node: one Expr per input (an empty Expr where that input gets no
// gradient). Rules are written with the builder API; see ops/gradient.h.
using GradFn = std::function<std::vector<Expr>(const GradContext& context)>;

// How the mixed-precision pass runs an op (passes/mixed_precision.h): float inputs cast to the
// 16-bit dtype (kLow), 16-bit inputs cast up to f32 (kF32), or in its inputs' dtype (kFollow).
enum class Precision { kLow, kF32, kFollow };

// The part a node plays in a fusion group; ops/fused/group.h states each kind's contract.
enum class GroupRole : uint8_t { kElementwise, kRowOp, kColumnReduction, kGemm, kOther };

// What rematerialization (passes/remat.h) may do with a node: compute it again freely, only as
// a last resort (a GEMM, attention or convolution costs real time to run twice), or never (a
// collective is a round every rank makes in the same order; an update changes state).
enum class Recompute : uint8_t { kCheap, kHeavy, kNever };

// The facts about an op that passes and analyses read, stated once with the op instead of in a
// switch per pass. tests/op_table_test.cc checks them against the op table's flags.
struct OpTraits {
  // Works along the last axis with rows independent (softmax, the norms, cross_entropy, sum,
  // mean, max and their gradients) for the attributes fusion_role says: a generated rows
  // kernel computes it one row at a time.
  bool row_op = false;
  // Mixed precision's default (passes/mixed_precision.h); a user's policy may say otherwise.
  // kLow: the ops tensor cores serve; kF32: statistics over many elements and the loss.
  Precision precision = Precision::kFollow;
  // The node's role in a fusion group, for its attributes and input types (nullptr: an
  // elementwise op is kElementwise unless it is random (dropout's counter-based mask is indexed
  // by an element's global position: left to its own kernel), a row op kRowOp, others kOther).
  std::function<GroupRole(const Graph& graph, const Node& node)> fusion_role = nullptr;
  Recompute recompute = Recompute::kCheap;
  // The node's FLOPs for the cost model (analysis/cost_model.h); nullptr: one per output
  // element for elementwise, shape and source ops, five per input element otherwise. Its bytes
  // are its inputs' and outputs' for every op.
  std::function<double(const Graph& graph, const Node& node)> flops = nullptr;
  // One of kiln's composite kernels (attention, the norms, gelu, silu, rotary embedding): what
  // an export decomposes and the front ends or the recognize pass keep whole; the compile
  // report counts them.
  bool composite = false;
};

struct OpDef {
  std::vector<AttrSpec> attrs;
  InferFn infer;
  KernelFn reference;  // simple, correct, computes in f64: the oracle for every fast kernel
  // The gradient rule. An op without one must say so with differentiable = false (integer
  // outputs, comparisons, argmax, ...); autodiff then refuses to differentiate through it.
  GradFn gradient = nullptr;
  bool differentiable = true;
  // Set only for ops that carry a body (`fused`): infer_types calls it with the node's body,
  // and `infer` then just refuses a call without one.
  BodyInferFn infer_with_body = nullptr;
  // Outputs from this index on are sums over every row of input 0 (rows: all dims but the
  // last), e.g. LayerNorm's dgamma and dbeta; -1: none. A kernel run on a subset of the rows
  // computes that subset's share, and the shares add up: fusion puts such an op in a group of
  // whole-row tiles, the column outputs summed across tiles like a bias gradient.
  int column_outputs_from = -1;
  // Completes attributes whose defaults depend on another attribute, after the schema's own
  // defaults (optimizer_update: the hyperparameters of the optimizer it names).
  std::function<void(Attributes&)> normalize = nullptr;
  OpTraits traits = {};
};

// The definition of `op`. Throws kiln::Error if the op has none (a half-added op).
const OpDef& op_def(Op op);
// True when every op of the table has a definition with inference and a reference kernel.
bool has_op_def(Op op);

// Checks `attrs` against the op's schema: unknown names, wrong kinds and missing required
// attributes throw kiln::Error; absent defaults are filled in; an int given for a float (and
// an empty list for either list kind) is converted; a list marked ints_for_integer_dtype takes
// the kind its dtype asks for (a float that is not an integer there throws).
Attributes normalize_attributes(Op op, Attributes attrs);
// Checks the input count, then runs the op's inference. Error messages name the op.
// `body`: the node's body (Node::body); required for `fused`, refused for every other op.
std::vector<TensorType> infer_types(Op op, std::span<const TensorType> inputs,
                                    const Attributes& attrs, const Graph* body = nullptr);

}  // namespace kiln

// What each op is, beyond its op-table line: its attribute schema, its shape/dtype inference
// (which is also its verifier: it throws kiln::Error on anything it cannot accept) and its CPU
// reference kernel. Definitions live in src/ops/, one file per family of ops, and are collected
// by ops/registry.cc. The IR uses the schema and inference; backends use the reference kernel.
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

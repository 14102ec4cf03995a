// The fused op: a node that holds a subgraph (Node::body) and computes exactly what the body
// computes. The fusion pass (passes/fusion/fusion.h) outlines each fusion group into one.
//   fused(x0, x1, ...) {kind} : the body's output types.
//     kind: what the body is, one of the fused kinds (ops/fused/kind.h: "elementwise", "rows",
//     "gemm-epilogue", "classifier", ...), each with a body contract.
//     stream (optional): "update": the node runs on the executor's update stream, beside the
//     compute (ops/update_stream.h); only a multi-tensor-update may.
//   Body: a graph whose inputs (all role data) match the node's inputs 1:1 in type, with no
//   updates, at least one output, no fused node inside (fusion never nests), and meeting its
//   kind's contract (check_fused_body).
// Inference checks all of that (verifying the body) and returns the body's output types: so
// verify() rejects a body that is not what its kind says, right after the pass that built it. The
// reference kernel runs the body node by node with every op's reference kernel on whole tensors:
// no tiling, so it is the oracle for the fast tiled kernels. Not differentiable: fusion runs
// after autodiff.
#include <cstring>

#include "ir/graph.h"
#include "ir/verifier.h"
#include "ops/common.h"
#include "ops/fused/kind.h"
#include "ops/update_stream.h"

namespace kiln::ops {
namespace {

std::vector<TensorType> infer_fused(std::span<const TensorType> inputs, const Attributes& a,
                                    const Graph& body) {
  KILN_CHECK(!a.s("kind").empty(), "attribute 'kind' is empty, expected one of: {}",
             known_fused_kinds());
  const FusedKind kind = fused_kind(a);
  if (a.has("stream"))
    KILN_CHECK(a.s("stream") == kUpdateStream && kind == FusedKind::kMultiTensorUpdate,
               "attribute 'stream' is \"{}\" on a {} node: only a multi-tensor-update may run on the \"{}\" stream",
               a.s("stream"), fused_kind_name(kind), kUpdateStream);
  KILN_CHECK(body.inputs.size() == inputs.size(), "the body @{} has {} inputs, the node has {}",
             body.name, body.inputs.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const GraphInput& in = body.inputs[i];
    KILN_CHECK(body.is_valid(in.value), "body input {} has an out-of-range value id {}", i,
               in.value);
    KILN_CHECK(in.role == Role::kData, "body input {} (%{}) has role {}, expected data", i,
               body.value(in.value).name, role_name(in.role));
    KILN_CHECK(body.type(in.value) == inputs[i],
               "body input {} (%{}) is {}, but the node's input {} is {}", i,
               body.value(in.value).name, to_string(body.type(in.value)), i,
               to_string(inputs[i]));
  }
  KILN_CHECK(body.updates.empty(), "the body @{} has {} updates, expected none", body.name,
             body.updates.size());
  KILN_CHECK(!body.outputs.empty(), "the body @{} has no outputs", body.name);
  for (size_t n = 0; n < body.nodes.size(); ++n)
    KILN_CHECK(body.nodes[n].op != Op::kFused,
               "the body @{} holds a fused node (node {}): fused nodes do not nest", body.name, n);
  try {
    verify(body);
  } catch (const Error& e) {
    fail("body @{}: {}", body.name, e.what());
  }
  check_fused_body(kind, body);
  std::vector<TensorType> out;
  for (ValueId id : body.outputs) out.push_back(body.type(id));
  return out;
}

void run_fused_reference(const KernelArgs& k) {
  KILN_CHECK(k.body != nullptr, "fused: the kernel was called without the node's body");
  const Graph& body = *k.body;
  KILN_CHECK(k.inputs.size() == body.inputs.size() && k.outputs.size() == body.outputs.size(),
             "fused: {} inputs and {} outputs given, the body takes {} and gives {}",
             k.inputs.size(), k.outputs.size(), body.inputs.size(), body.outputs.size());
  std::vector<Tensor> values(body.values.size());
  for (size_t i = 0; i < body.inputs.size(); ++i) values[body.inputs[i].value] = k.inputs[i];
  std::vector<Tensor> ins, outs;
  for (const Node& node : body.nodes) {
    ins.clear();
    outs.clear();
    for (ValueId id : node.inputs) ins.push_back(values[id]);
    for (ValueId id : node.outputs) outs.emplace_back(body.type(id));
    op_def(node.op).reference(KernelArgs{node.attrs, ins, outs, k.stream, node.body.get()});
    for (size_t i = 0; i < node.outputs.size(); ++i) values[node.outputs[i]] = outs[i];
  }
  for (size_t i = 0; i < body.outputs.size(); ++i) {
    const Tensor& result = values[body.outputs[i]];
    Tensor& out = k.outputs[i];
    KILN_CHECK(result.type() == out.type(), "fused: body output {} is {}, the node's output is {}",
               i, to_string(result.type()), to_string(out.type()));
    if (out.bytes() > 0) std::memcpy(out.raw(), result.raw(), out.bytes());
  }
}

}  // namespace

void define_fused_ops(OpRegistry& registry) {
  OpDef def{
      {required("kind", AttrKind::kString), optional("stream", AttrKind::kString)},
      [](std::span<const TensorType>, const Attributes&) -> std::vector<TensorType> {
        fail("a fused node needs a body (its subgraph), none was given");
      },
      run_fused_reference,
      /*gradient=*/nullptr, /*differentiable=*/false};
  def.infer_with_body = infer_fused;
  registry.define(Op::kFused, std::move(def));
}

}  // namespace kiln::ops

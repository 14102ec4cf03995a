// The conformance sweep (ggml's test-backend-ops): ONE table of cases (op, dtypes, shapes,
// attributes, tolerance) covering every op of the op table, and one sweep that runs every case
// through EVERY registered kernel of a device whose supports() takes the node, on seeded random
// inputs (never zeros; positive where the math needs it, valid indices), into outputs poisoned
// with 0xFF bytes (NaN in every float dtype) so that an element a kernel forgets to write shows,
// and compares each output element-wise with the op's reference kernel (OpDef::reference, the
// oracle). kiln_tests sweeps the CPU kernels (tests/backends/conformance_test.cc), kiln_gpu_tests
// the CUDA kernels (tests/cuda/conformance_test.cc); both print the coverage: per op, how many
// (case, dtype) nodes each dialect ran, and which kernels no case reached.
//
// Adding an op: its cases go in conformance.cc's table (the sweep fails naming an op without
// one). Adding a kernel: the coverage lists it as unreached until a case reaches it.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "ir/graph.h"
#include "test_util.h"

namespace kiln::testing::conformance {

// A random input of an op case: the case's dtype and a seed give a host tensor.
using Gen = std::function<Tensor(DType dtype, uint64_t seed)>;

struct Case {
  std::string name;
  Op op;
  std::vector<DType> dtypes;  // the case runs once per dtype
  std::vector<Gen> inputs = {};
  Attributes attrs = {};
  // Factor on the output dtype's tolerance (tolerance_of), for ops that sum many rounded terms.
  double tolerance = 1.0;
  bool dtype_attr = false;  // set attrs["dtype"] to the case's dtype (sources, one_hot)
  // A case ported from a dialect's own test: those dialects must take the node (on the device
  // that has them), e.g. {"openblas"}, and are held to the (atol, rtol) they always held, for
  // every output; every other kernel gets the looser of that and its output dtype's tolerance.
  std::optional<Tolerance> taken_by_tolerance = std::nullopt;
  std::vector<std::string> taken_by = {};
  // Rewrites inputs from the others once they are drawn (e.g. attention_grad's out and lse from
  // the forward pass on its q, k, v), with the node's normalized attributes.
  std::function<void(std::vector<Tensor>& inputs, const Attributes& attrs)> derive = nullptr;
  // Nodes a pass makes (fused nodes): the graph for a dtype, holding exactly one node of `op`
  // that reads only graph inputs; `inputs` and `attrs` are then unused, and each graph input
  // is drawn by `graph_input` (name, type, seed), or uniform in [-1, 1) when that is empty.
  std::function<Graph(DType dtype)> graph = nullptr;
  std::function<Tensor(const std::string& name, const TensorType& type, uint64_t seed)>
      graph_input = nullptr;
};

// Every case, in table order.
const std::vector<Case>& cases();

// The node of one case at one dtype, with its random inputs.
struct Instance {
  std::string name;  // "<case>/<dtype>"
  std::shared_ptr<const Graph> graph;  // holds the node (and a fused node's body)
  size_t node_index = 0;
  std::vector<TensorType> input_types, output_types;
  std::vector<Tensor> inputs;
  const Node& node() const { return graph->nodes[node_index]; }
  NodeView view() const { return NodeView{node(), input_types, output_types}; }
};
Instance instantiate(const Case& c, DType dtype, uint64_t seed);
// The node of `op` on these inputs with these attributes (normalized), as an op case makes it.
Instance instance_of(Op op, std::vector<Tensor> inputs, const Attributes& attrs);

// (atol, rtol) of an output dtype: f32 1e-5, f64 1e-12, f16 2e-3, bf16 1e-2, integers and bool
// exact; |actual - expected| <= atol + rtol |expected| element-wise.
Tolerance tolerance_of(DType dtype);

// Runs `kernel` on `device` for the instance: inputs copied there, outputs poisoned with 0xFF
// bytes, the kernel's prepare hook first (as the executor does), then the kernel on a stream
// of its own (CUDA), synchronized and the device's data errors checked; host outputs back.
// Throws kiln::Error (as the kernel does) when the kernel wrote one of its inputs.
std::vector<Tensor> run_kernel(Device device, const KernelImpl& kernel, const Instance& instance);

// The sweep's body for one op: every case of `op` at every dtype, through every kernel of
// `device` whose supports() takes the node, each compared with the reference kernel. Failures
// name the case, the dtype, the kernel and the output.
void expect_kernels_match_reference(Op op, Device device);

// Ops of the op table that have at least one case, in table order (the sweep's parameters).
std::vector<Op> ops_with_cases();
// The ops of the op table that have no case (the sweep fails naming each), but the collectives
// (needs_process_group, and collective_wait), which tests/distributed/ and tests/cuda/ check.
std::vector<Op> ops_without_cases();

// The coverage of the table on `devices`: a markdown table of op x (device, dialect) giving
// the number of (case, dtype) nodes each dialect's kernels take (so run in the sweep), the
// totals, and the kernels no case reached (their supports() refused every node).
struct Coverage {
  std::string table;
  std::vector<std::string> unreached;  // "fused: cuda-nn kernel 3 of 4 (priority 25)"
};
Coverage coverage(const std::vector<Device>& devices);

}  // namespace kiln::testing::conformance

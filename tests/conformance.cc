// The conformance sweep: how a case becomes a node with inputs, how a kernel runs on each
// device, the comparison with the reference kernel, and the coverage report. The table of
// cases is in conformance_cases.cc.
#include "conformance.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "backends/cuda/runtime/device_errors.h"
#include "backends/cuda/runtime/memory.h"
#include "ir/text.h"

namespace kiln::testing::conformance {

Tolerance tolerance_of(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return {1e-5, 1e-5};
    case DType::kF64:
      return {1e-12, 1e-12};
    case DType::kF16:
      return {2e-3, 2e-3};
    case DType::kBF16:
      return {1e-2, 1e-2};
    default:
      return {0.0, 0.0};  // integers and bool: exact
  }
}

namespace {

// Case c's seed: the same at every dtype, distinct per case.
uint64_t seed_of(size_t case_index) { return 1000 * case_index + 1; }

Instance instantiate_graph(const Case& c, DType dtype, uint64_t seed, Instance inst) {
  auto graph = std::make_shared<Graph>(c.graph(dtype));
  std::vector<size_t> found;
  for (size_t n = 0; n < graph->nodes.size(); ++n)
    if (graph->nodes[n].op == c.op) found.push_back(n);
  KILN_CHECK(found.size() == 1, "case {}: the graph holds {} {} nodes, expected one:\n{}",
             inst.name, found.size(), op_name(c.op), print(*graph));
  inst.node_index = found[0];
  std::map<ValueId, Tensor> drawn;
  for (size_t k = 0; k < graph->inputs.size(); ++k) {
    const Value& value = graph->value(graph->inputs[k].value);
    const uint64_t s = seed + 17 * k;
    drawn[graph->inputs[k].value] = c.graph_input ? c.graph_input(value.name, value.type, s)
                                                  : random_tensor(value.type, s, -1.0, 1.0);
  }
  const Node& node = graph->nodes[inst.node_index];
  for (ValueId id : node.inputs) {
    KILN_CHECK(drawn.count(id) != 0, "case {}: the {} node reads %{}, which is no graph input:\n{}",
               inst.name, op_name(c.op), graph->value(id).name, print(*graph));
    inst.inputs.push_back(drawn[id]);
    inst.input_types.push_back(graph->type(id));
  }
  for (ValueId id : node.outputs) inst.output_types.push_back(graph->type(id));
  inst.graph = std::move(graph);
  return inst;
}

}  // namespace

Instance instance_of(Op op, std::vector<Tensor> inputs, const Attributes& attrs) {
  Instance inst;
  auto graph = std::make_shared<Graph>();
  std::vector<ValueId> ids;
  for (size_t k = 0; k < inputs.size(); ++k) {
    ids.push_back(graph->add_input(fmt::format("x{}", k), inputs[k].type(), Role::kData));
    inst.input_types.push_back(inputs[k].type());
  }
  graph->outputs = graph->add_node(op, ids, attrs);
  for (ValueId id : graph->outputs) inst.output_types.push_back(graph->type(id));
  inst.graph = std::move(graph);
  inst.inputs = std::move(inputs);
  return inst;
}

Instance instantiate(const Case& c, DType dtype, uint64_t seed) {
  const std::string name = fmt::format("{}/{}", c.name, dtype_name(dtype));
  if (c.graph) {
    Instance inst;
    inst.name = name;
    return instantiate_graph(c, dtype, seed, std::move(inst));
  }
  Attributes attrs = c.attrs;
  if (c.dtype_attr) attrs.set("dtype", dtype);
  std::vector<Tensor> inputs;
  for (size_t k = 0; k < c.inputs.size(); ++k) inputs.push_back(c.inputs[k](dtype, seed + 17 * k));
  if (c.derive) c.derive(inputs, normalize_attributes(c.op, attrs));
  Instance inst = instance_of(c.op, std::move(inputs), attrs);
  inst.name = name;
  return inst;
}

namespace {

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.bytes() == b.bytes() &&
         (a.bytes() == 0 || std::memcmp(a.raw(), b.raw(), a.bytes()) == 0);
}

// A kernel reads its inputs only: the executor hands the same buffer to later readers.
void check_inputs_unchanged(const KernelImpl& kernel, const Instance& instance,
                            const std::vector<Tensor>& after) {
  for (size_t k = 0; k < after.size(); ++k)
    KILN_CHECK(same_bytes(after[k], instance.inputs[k]), "the {} kernel wrote its input {} ({})",
               kernel.dialect, k, to_string(after[k].type()));
}

}  // namespace

std::vector<Tensor> run_kernel(Device device, const KernelImpl& kernel, const Instance& instance) {
  const Node& node = instance.node();
  if (kernel.prepare) kernel.prepare(instance.view());
  std::vector<Tensor> inputs, outputs;
  if (device == Device::kCpu) {
    for (const Tensor& t : instance.inputs) inputs.push_back(t.clone());
    for (const TensorType& t : instance.output_types) {
      outputs.emplace_back(t);
      if (t.bytes() > 0) std::memset(outputs.back().raw(), 0xFF, t.bytes());
    }
    kernel.kernel(KernelArgs{node.attrs, inputs, outputs, nullptr, node.body.get()});
    check_inputs_unchanged(kernel, instance, inputs);
    return outputs;
  }
  for (const Tensor& t : instance.inputs) inputs.push_back(cuda::to_device(t));
  cuda::Stream stream;
  for (const TensorType& t : instance.output_types) {
    outputs.push_back(cuda::device_tensor(t, /*zero=*/false));
    if (t.bytes() > 0) cuda::fill_bytes_async(outputs.back(), 0xFF, stream.handle());
  }
  kernel.kernel(KernelArgs{node.attrs, inputs, outputs, stream.handle(), node.body.get()});
  stream.synchronize();
  cuda::check_device_errors();
  std::vector<Tensor> host, inputs_after;
  for (const Tensor& t : outputs) host.push_back(cuda::to_host(t));
  for (const Tensor& t : inputs) inputs_after.push_back(cuda::to_host(t));
  check_inputs_unchanged(kernel, instance, inputs_after);
  return host;
}

namespace {

// "cuda-nn" when the dialect has one kernel for the op on the device, else "cuda-nn #2 of 4".
std::string kernel_label(Op op, Device device, const KernelImpl* impl) {
  int index = 0, count = 0;
  for (const KernelImpl* other : kernel_registry().candidates(op, device)) {
    if (other->dialect != impl->dialect) continue;
    ++count;
    if (other == impl) index = count;
  }
  return count == 1 ? impl->dialect : fmt::format("{} #{} of {}", impl->dialect, index, count);
}

bool takes(const KernelImpl* impl, const Instance& inst) {
  return !impl->supports || impl->supports(inst.view());
}

std::vector<Tensor> run_reference(const Instance& inst) {
  const Node& node = inst.node();
  std::vector<Tensor> outputs;
  for (const TensorType& t : inst.output_types) outputs.emplace_back(t);
  op_def(node.op).reference(KernelArgs{node.attrs, inst.inputs, outputs, nullptr, node.body.get()});
  return outputs;
}

// The output dtype's tolerance (times the case's factor for floats), or the case's own for the
// dialects it was ported from (the looser of the two for every other kernel).
Tolerance tolerance_for(const Case& c, const KernelImpl& kernel, DType dtype) {
  Tolerance tol = tolerance_of(dtype);
  if (is_float(dtype)) {
    tol.atol *= c.tolerance;
    tol.rtol *= c.tolerance;
  }
  if (!c.taken_by_tolerance) return tol;
  const Tolerance& own = *c.taken_by_tolerance;
  if (std::find(c.taken_by.begin(), c.taken_by.end(), kernel.dialect) != c.taken_by.end())
    return own;
  return {std::max(tol.atol, own.atol), std::max(tol.rtol, own.rtol)};
}

void check_kernel(const Case& c, const Instance& inst, Device device, const KernelImpl* impl,
                  const std::vector<Tensor>& expected) {
  SCOPED_TRACE(
      fmt::format("kernel {} on {}", kernel_label(c.op, device, impl), device_name(device)));
  std::vector<Tensor> actual;
  try {
    actual = run_kernel(device, *impl, inst);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the kernel threw: " << e.what();
    return;
  }
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t o = 0; o < expected.size(); ++o) {
    ASSERT_EQ(actual[o].type(), expected[o].type()) << "output " << o;
    Tolerance tol = tolerance_for(c, *impl, expected[o].dtype());
    // A fused body may keep its f32 intermediates where the reference rounds each op to the
    // body's 16 bits (generated kernels compute in f32): a wide output carries the narrowest
    // float input's rounding.
    if (c.op == Op::kFused && is_float(expected[o].dtype()))
      for (const TensorType& in : inst.input_types)
        if (is_float(in.dtype)) {
          const Tolerance narrow = tolerance_for(c, *impl, in.dtype);
          tol = {std::max(tol.atol, narrow.atol), std::max(tol.rtol, narrow.rtol)};
        }
    const double error = max_scaled_error(actual[o], expected[o], tol.atol, tol.rtol);
    EXPECT_LE(error, 1.0) << "output " << o << " (atol " << tol.atol << ", rtol " << tol.rtol
                          << ")\n  kernel:    " << summarize(actual[o])
                          << "\n  reference: " << summarize(expected[o]);
  }
}

bool has_nan(const Tensor& t) {
  if (!is_float(t.dtype())) return false;
  for (int64_t i = 0; i < t.numel(); ++i)
    if (std::isnan(t.get(i))) return true;
  return false;
}

}  // namespace

void expect_kernels_match_reference(Op op, Device device) {
  int runs = 0;
  for (size_t ci = 0; ci < cases().size(); ++ci) {
    const Case& c = cases()[ci];
    if (c.op != op) continue;
    for (DType dtype : c.dtypes) {
      SCOPED_TRACE(fmt::format("case {}/{}", c.name, dtype_name(dtype)));
      Instance inst;
      std::vector<Tensor> expected;
      try {
        inst = instantiate(c, dtype, seed_of(ci));
        expected = run_reference(inst);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "the case is broken: " << e.what();
        continue;
      }
      // An element left unwritten reads as the poison, NaN: a reference NaN would hide it.
      for (size_t o = 0; o < expected.size(); ++o)
        EXPECT_FALSE(has_nan(expected[o])) << "the reference's output " << o << " has a NaN";
      std::set<std::string> took;
      for (const KernelImpl* impl : kernel_registry().candidates(op, device)) {
        if (!takes(impl, inst)) continue;
        check_kernel(c, inst, device, impl, expected);
        took.insert(impl->dialect);
        ++runs;
      }
      for (const std::string& dialect : c.taken_by) {
        const auto mine = kernel_registry().candidates(op, device);
        const bool here = std::any_of(mine.begin(), mine.end(), [&](const KernelImpl* impl) {
          return impl->dialect == dialect;
        });
        EXPECT_TRUE(!here || took.count(dialect)) << "no " << dialect << " kernel took the node";
      }
    }
  }
  // An op without kernels on the device reports nothing to check.
  if (runs == 0 && !kernel_registry().candidates(op, device).empty())
    ADD_FAILURE() << op_name(op) << " has " << device_name(device)
                  << " kernels but no case reached any of them";
}

std::vector<Op> ops_with_cases() {
  std::set<Op> seen;
  std::vector<Op> out;
  for (const Case& c : cases())
    if (seen.insert(c.op).second) out.push_back(c.op);
  return out;
}

std::vector<Op> ops_without_cases() {
  const std::vector<Op> with = ops_with_cases();
  std::vector<Op> out;
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    // The collectives' kernels are the engine's (a node alone has no process group to run in):
    // tests/distributed/ checks Gloo's and the sharded steps they make, tests/cuda/ NCCL's.
    if (needs_process_group(op) || op == Op::kCollectiveWait) continue;
    if (std::find(with.begin(), with.end(), op) == with.end()) out.push_back(op);
  }
  return out;
}

Coverage coverage(const std::vector<Device>& devices) {
  // Columns: (device, dialect), each device's dialects by their highest priority, lowest first.
  struct Column {
    Device device;
    std::string dialect;
    int priority;
  };
  std::vector<Column> columns;
  for (Device device : devices)
    for (int i = 0; i < kNumOps; ++i)
      for (const KernelImpl* impl : kernel_registry().candidates(static_cast<Op>(i), device)) {
        auto it = std::find_if(columns.begin(), columns.end(), [&](const Column& col) {
          return col.device == device && col.dialect == impl->dialect;
        });
        if (it == columns.end())
          columns.push_back({device, impl->dialect, impl->priority});
        else
          it->priority = std::max(it->priority, impl->priority);
      }
  std::stable_sort(columns.begin(), columns.end(), [&](const Column& a, const Column& b) {
    if (a.device != b.device) return a.device < b.device;
    return a.priority < b.priority;
  });

  // Per op: its instances (cases x dtypes), and per column the nodes its kernels take.
  std::map<Op, std::vector<Instance>> instances;
  for (size_t ci = 0; ci < cases().size(); ++ci)
    for (DType dtype : cases()[ci].dtypes) {
      try {
        instances[cases()[ci].op].push_back(instantiate(cases()[ci], dtype, seed_of(ci)));
      } catch (const std::exception&) {
        // A broken case fails in the sweep, which names it; here it reaches nothing.
      }
    }

  Coverage out;
  std::string& t = out.table;
  t += "| op | cases |";
  for (const Column& col : columns)
    t += fmt::format(" {}: {} |", device_name(col.device), col.dialect);
  t += "\n|---|---|";
  for (size_t i = 0; i < columns.size(); ++i) t += "---|";
  t += "\n";
  std::vector<int64_t> totals(columns.size(), 0);
  int64_t total_instances = 0, kernels = 0;
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = static_cast<Op>(i);
    const std::vector<Instance>& mine = instances[op];
    total_instances += static_cast<int64_t>(mine.size());
    t += fmt::format("| {} | {} |", op_name(op), mine.size());
    for (size_t k = 0; k < columns.size(); ++k) {
      int64_t taken = 0;
      bool any = false;
      for (const KernelImpl* impl : kernel_registry().candidates(op, columns[k].device)) {
        if (impl->dialect != columns[k].dialect) continue;
        any = true;
        int64_t mine_taken = 0;
        for (const Instance& inst : mine) mine_taken += takes(impl, inst);
        taken += mine_taken;
        if (mine_taken == 0)
          out.unreached.push_back(fmt::format(
              "{}: {} kernel {} (priority {})", op_name(op), device_name(columns[k].device),
              kernel_label(op, columns[k].device, impl), impl->priority));
      }
      totals[k] += taken;
      t += any ? fmt::format(" {} |", taken) : std::string(" - |");
    }
    t += "\n";
  }
  t += fmt::format("| **total** | {} |", total_instances);
  for (int64_t n : totals) t += fmt::format(" {} |", n);
  t += "\n";
  for (Device device : devices)
    for (int i = 0; i < kNumOps; ++i)
      kernels +=
          static_cast<int64_t>(kernel_registry().candidates(static_cast<Op>(i), device).size());
  int64_t runs = 0;
  for (int64_t n : totals) runs += n;
  t += fmt::format(
      "\n{} ops, {} cases, {} (case, dtype) nodes; {} kernel runs over {} registered kernels, {} "
      "of them reached by no case.\n(A cell counts the nodes the dialect's kernels take: "
      "supports() says yes, so the sweep runs it; - : no kernel of that dialect.)\n",
      kNumOps, cases().size(), total_instances, runs, kernels, out.unreached.size());
  return out;
}

}  // namespace kiln::testing::conformance

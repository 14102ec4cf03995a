// Grouped optimizer updates and the global gradient norm on the CPU (dialect "cpu"), for the
// fused nodes the multi-tensor pass makes (passes/multi_tensor.h; bodies described in
// ops/fused/multi_tensor.h):
//   "multi-tensor-update"  each member through the fast per-tensor update
//       kernel (train_kernels.cc, found in the registry, so the arithmetic is exactly that of
//       the ungrouped step), in waves that respect overlaps between members
//       (multi_tensor::plan_run_order). in_place_ok: each member reads element i of its
//       operands before writing element i of its results.
//   "global-norm"  each term's cast, square and sum through the best CPU kernel of each (the
//       f32 "cpu" reductions: blocked f32/f64 sums), on whole tensors, then the body's add tree
//       in f32: the bits of the ungrouped step on the CPU (the pass matrix test asks for them),
//       with one term's temporaries alive at a time.
//   "multi-tensor-cast"  each member through the best CPU kernel of its cast (the one the
//       ungrouped node would run, found in the registry): the same bits.
// Priority above the generic fused CPU kernel (fused.cc, kFastPriority), which would run these
// bodies' update ops tile by tile through their reference kernels.
#include "backends/cpu/cpu_kernels.h"
#include "backends/multi_tensor.h"
#include "ops/fused/kind.h"

namespace kiln::cpu {
namespace {

constexpr int kMultiTensorPriority = kOpenBlasPriority + 10;

std::vector<TensorType> types_of(const Graph& g, const std::vector<ValueId>& ids) {
  std::vector<TensorType> out;
  for (ValueId id : ids) out.push_back(g.type(id));
  return out;
}

// The kernel each member runs: the best CPU kernel of its op that may write in place, else the
// op's reference kernel (elementwise: reads element i of every operand before writing it).
KernelFn member_kernel(const Graph& body, const Node& member) {
  const std::vector<TensorType> in = types_of(body, member.inputs);
  const std::vector<TensorType> out = types_of(body, member.outputs);
  const NodeView view{member, in, out};
  for (const KernelImpl* impl : kernel_registry().candidates(member.op, Device::kCpu))
    if (impl->in_place_ok && (!impl->supports || impl->supports(view))) return impl->kernel;
  return op_def(member.op).reference;
}

void run_updates(const KernelArgs& args) {
  KILN_CHECK(args.body != nullptr, "multi-tensor update: the kernel was called without the node's body");
  std::string why;
  const std::optional<multi_tensor::UpdateBody> parsed = multi_tensor::update_body(*args.body, &why);
  KILN_CHECK(parsed.has_value(), "multi-tensor update: body @{} is not one: {}", args.body->name, why);
  const std::vector<multi_tensor::Member>& members = parsed->members;
  const multi_tensor::RunOrder order =
      multi_tensor::plan_run_order(multi_tensor::member_regions(members, args.inputs, args.outputs));
  // Operands another member overwrites, where no order helps: read from copies taken first.
  std::vector<std::vector<Tensor>> operands(members.size());
  for (size_t k = 0; k < members.size(); ++k)
    for (int i : members[k].inputs) operands[k].push_back(args.inputs[static_cast<size_t>(i)]);
  for (auto [member, operand] : order.copies) {
    Tensor& t = operands[static_cast<size_t>(member)][static_cast<size_t>(operand)];
    t = t.clone();
  }
  // One kernel choice per distinct operand dtypes (the pass groups equal dtypes: one choice).
  std::vector<std::pair<std::vector<DType>, KernelFn>> kernels;
  auto kernel_of = [&](size_t k) -> const KernelFn& {
    std::vector<DType> dtypes;
    for (const Tensor& t : operands[k]) dtypes.push_back(t.dtype());
    for (const auto& [key, fn] : kernels)
      if (key == dtypes) return fn;
    kernels.emplace_back(std::move(dtypes), member_kernel(*args.body, args.body->nodes[k]));
    return kernels.back().second;
  };
  std::vector<Tensor> results;
  for (const std::vector<int>& wave : order.waves) {
    for (int k : wave) {
      const multi_tensor::Member& m = members[static_cast<size_t>(k)];
      results.clear();
      for (int o : m.outputs) results.push_back(args.outputs[static_cast<size_t>(o)]);
      const Node& node = args.body->nodes[static_cast<size_t>(k)];
      kernel_of(static_cast<size_t>(k))(
          KernelArgs{node.attrs, operands[static_cast<size_t>(k)], results, args.stream, nullptr});
    }
  }
}

bool updates_supported(const NodeView& view) {
  return is_fused(view.node, FusedKind::kMultiTensorUpdate) && multi_tensor::update_body(*view.node.body).has_value();
}

// ---- global norm ----------------------------------------------------------------------------

bool norm_supported(const NodeView& view) {
  return is_fused(view.node, FusedKind::kGlobalNorm) && multi_tensor::norm_body(*view.node.body).has_value();
}

// Each term's nodes (cast, square, sum) through the best CPU kernel of each, on whole tensors,
// as the ungrouped step runs them; then the add tree in f32.
void run_norm(const KernelArgs& args) {
  KILN_CHECK(args.body != nullptr, "global-norm: the kernel was called without the node's body");
  const Graph& body = *args.body;
  std::string why;
  const std::optional<multi_tensor::NormBody> norm = multi_tensor::norm_body(body, &why);
  KILN_CHECK(norm.has_value(), "global-norm: body @{} is not one: {}", body.name, why);
  std::vector<Tensor> values(body.values.size());
  for (size_t i = 0; i < body.inputs.size(); ++i) values[body.inputs[i].value] = args.inputs[i];
  std::vector<float> terms;
  std::vector<Tensor> ins, outs;
  for (const Node& node : body.nodes) {
    if (node.op == Op::kAdd) continue;
    const std::vector<TensorType> in = types_of(body, node.inputs), out = types_of(body, node.outputs);
    const NodeView view{node, in, out};
    const KernelImpl* impl = nullptr;
    for (const KernelImpl* candidate : kernel_registry().candidates(node.op, Device::kCpu))
      if (!candidate->supports || candidate->supports(view)) {
        impl = candidate;
        break;
      }
    KILN_CHECK(impl != nullptr, "global-norm: body op {} has no CPU kernel", op_name(node.op));
    ins.clear();
    outs.clear();
    for (ValueId id : node.inputs) ins.push_back(values[id]);
    for (const TensorType& t : out) outs.emplace_back(t);
    impl->kernel(KernelArgs{node.attrs, ins, outs, args.stream, nullptr});
    values[node.outputs[0]] = outs[0];
    // A term's input is read once: drop it (and the square) as soon as the sum has it.
    if (node.op == Op::kSum) {
      terms.push_back(*outs[0].data<float>());
      values[node.inputs[0]] = Tensor();
    }
  }
  *args.outputs[0].data<float>() = multi_tensor::combine_terms(*norm, terms);
}

// ---- casts of the params ---------------------------------------------------------------------

bool cast_supported(const NodeView& view) {
  return is_fused(view.node, FusedKind::kMultiTensorCast) && multi_tensor::cast_body(*view.node.body).has_value();
}

void run_casts(const KernelArgs& args) {
  KILN_CHECK(args.body != nullptr, "multi-tensor cast: the kernel was called without the node's body");
  const Graph& body = *args.body;
  std::string why;
  const std::optional<std::vector<multi_tensor::CastMember>> members = multi_tensor::cast_body(body, &why);
  KILN_CHECK(members.has_value(), "multi-tensor cast: body @{} is not one: {}", body.name, why);
  for (size_t k = 0; k < members->size(); ++k) {
    const multi_tensor::CastMember& m = (*members)[k];
    const Node& node = body.nodes[k];
    const std::vector<TensorType> in = types_of(body, node.inputs), out = types_of(body, node.outputs);
    const NodeView view{node, in, out};
    KernelFn kernel = op_def(Op::kCast).reference;
    for (const KernelImpl* impl : kernel_registry().candidates(Op::kCast, Device::kCpu))
      if (!impl->supports || impl->supports(view)) {
        kernel = impl->kernel;
        break;
      }
    // Handles on the same storage: the member writes straight into the node's output.
    const Tensor x = args.inputs[static_cast<size_t>(m.input)];
    Tensor y = args.outputs[static_cast<size_t>(m.output)];
    kernel(KernelArgs{node.attrs, {&x, 1}, {&y, 1}, args.stream, nullptr});
  }
}

}  // namespace

void register_multi_tensor_kernels(KernelRegistry& registry) {
  registry.add(Op::kFused, KernelImpl{"cpu", Device::kCpu, kMultiTensorPriority, updates_supported, run_updates,
                                      /*in_place_ok=*/true});
  registry.add(Op::kFused,
               KernelImpl{"cpu", Device::kCpu, kMultiTensorPriority, norm_supported, run_norm});
  registry.add(Op::kFused,
               KernelImpl{"cpu", Device::kCpu, kMultiTensorPriority, cast_supported, run_casts});
}

}  // namespace kiln::cpu

#include "ops/collective.h"

#include "ops/common.h"
#include "ops/gradient.h"

namespace kiln {

namespace {

Attributes collective_attrs(int world_size, std::optional<ReduceOp> reduce = std::nullopt) {
  Attributes attrs;
  attrs.set("world_size", int64_t{world_size});
  if (reduce) attrs.set("reduce", std::string(reduce_op_name(*reduce)));
  return attrs;
}

Expr started(Op op, const Expr& x, Attributes attrs) {
  Builder& b = x.builder();
  return b.apply1(Op::kCollectiveWait, {b.apply1(op, {x}, std::move(attrs))});
}

}  // namespace

Expr all_reduce(const Expr& x, int world_size, ReduceOp reduce) {
  return started(Op::kAllReduce, x, collective_attrs(world_size, reduce));
}
Expr all_gather(const Expr& shard, int world_size) {
  return started(Op::kAllGather, shard, collective_attrs(world_size));
}
Expr reduce_scatter(const Expr& x, int world_size, ReduceOp reduce) {
  return started(Op::kReduceScatter, x, collective_attrs(world_size, reduce));
}
Expr local_shard(const Expr& x, int world_size) {
  return x.builder().apply1(Op::kLocalShard, {x}, collective_attrs(world_size));
}

namespace ops {
namespace {

int world_of(const Attributes& a) {
  const int64_t w = a.i("world_size");
  KILN_CHECK(w >= 1, "world_size must be >= 1, got {}", w);
  return static_cast<int>(w);
}

ReduceOp reduce_of(const Attributes& a) { return parse_reduce_op(a.s("reduce")); }

// A kernel's process group, checked against the node's world size.
const Communicator& communicator_of(const KernelArgs& k, std::string_view op) {
  KILN_CHECK(k.communicator != nullptr,
             "{} needs a process group: run the step with one (kiln launch -n N, or torchrun's variables)", op);
  KILN_CHECK(k.communicator->world_size() == world_of(k.attrs),
             "{} was compiled for world size {} but runs in a group of {}", op, world_of(k.attrs),
             k.communicator->world_size());
  return *k.communicator;
}

// Flat [world_size * k] -> [k]: the shape rule of reduce_scatter and local_shard.
TensorType scattered(const TensorType& x, const Attributes& a, std::string_view op) {
  const int world = world_of(a);
  KILN_CHECK(x.rank() == 1, "{} takes a 1-D tensor, got {}", op, to_string(x));
  KILN_CHECK(x.shape[0] % world == 0, "{}: {} elements do not split into {} equal shards", op, x.shape[0], world);
  return TensorType{x.dtype, {x.shape[0] / world}};
}

}  // namespace

void define_collective_ops(OpRegistry& registry) {
  registry.define(Op::kAllReduce, OpDef{
      {required("world_size", AttrKind::kInt), with_default("reduce", std::string("sum"))},
      [](std::span<const TensorType> in, const Attributes& a) {
        world_of(a);
        reduce_of(a);
        return std::vector<TensorType>{in[0]};
      },
      [](const KernelArgs& k) {
        communicator_of(k, "all_reduce").all_reduce(k.inputs[0], k.outputs[0], reduce_of(k.attrs), k.stream);
      },
      [](const GradContext& c) {
        const ReduceOp reduce = reduce_of(c.attrs());
        KILN_CHECK(reduce != ReduceOp::kMax, "all_reduce(max) has no gradient");
        // d(sum_r x_r)/dx_q = 1 on every rank: each rank's x gets the sum of every rank's dy.
        return std::vector<Expr>{all_reduce(c.dy(), world_of(c.attrs()), reduce)};
      }})
      .traits = {.recompute = Recompute::kNever};

  registry.define(Op::kAllGather, OpDef{
      {required("world_size", AttrKind::kInt)},
      [](std::span<const TensorType> in, const Attributes& a) {
        KILN_CHECK(in[0].rank() == 1, "all_gather takes a 1-D shard, got {}", to_string(in[0]));
        return std::vector<TensorType>{{in[0].dtype, {in[0].shape[0] * world_of(a)}}};
      },
      [](const KernelArgs& k) { communicator_of(k, "all_gather").all_gather(k.inputs[0], k.outputs[0], k.stream); },
      [](const GradContext& c) {
        // Every rank's output holds this rank's shard: its gradient is the sum over ranks of
        // their dy's slice at this rank's place.
        return std::vector<Expr>{reduce_scatter(c.dy(), world_of(c.attrs()), ReduceOp::kSum)};
      }})
      .traits = {.recompute = Recompute::kNever};

  registry.define(Op::kReduceScatter, OpDef{
      {required("world_size", AttrKind::kInt), with_default("reduce", std::string("sum"))},
      [](std::span<const TensorType> in, const Attributes& a) {
        reduce_of(a);
        return std::vector<TensorType>{scattered(in[0], a, "reduce_scatter")};
      },
      [](const KernelArgs& k) {
        communicator_of(k, "reduce_scatter")
            .reduce_scatter(k.inputs[0], k.outputs[0], reduce_of(k.attrs), k.stream);
      },
      [](const GradContext& c) {
        const ReduceOp reduce = reduce_of(c.attrs());
        KILN_CHECK(reduce != ReduceOp::kMax, "reduce_scatter(max) has no gradient");
        const int world = world_of(c.attrs());
        Expr dx = all_gather(c.dy(), world);
        if (reduce == ReduceOp::kAvg) dx = dx * (1.0 / world);
        return std::vector<Expr>{dx};
      }})
      .traits = {.recompute = Recompute::kNever};

  registry.define(Op::kCollectiveWait, OpDef{
      {},
      [](std::span<const TensorType> in, const Attributes&) { return std::vector<TensorType>{in[0]}; },
      [](const KernelArgs& k) {
        // The memory plan makes the wait a view of the collective's output; where it cannot
        // (the wait's value is a graph output), a copy.
        if (k.inputs[0].raw() == k.outputs[0].raw()) return;
        for (int64_t i = 0; i < k.outputs[0].numel(); ++i) k.outputs[0].copy_element(i, k.inputs[0], i);
      },
      [](const GradContext& c) { return std::vector<Expr>{c.dy()}; }})
      .traits = {.recompute = Recompute::kNever};

  registry.define(Op::kLocalShard, OpDef{
      {required("world_size", AttrKind::kInt)},
      [](std::span<const TensorType> in, const Attributes& a) {
        return std::vector<TensorType>{scattered(in[0], a, "local_shard")};
      },
      [](const KernelArgs& k) {
        const int64_t n = k.outputs[0].numel();
        const int64_t start = n * communicator_of(k, "local_shard").rank();
        for (int64_t i = 0; i < n; ++i) k.outputs[0].copy_element(i, k.inputs[0], start + i);
      },
      nullptr, false});
}

}  // namespace ops
}  // namespace kiln

// The sharding pass's graphs (passes/sharding.h), before any process group runs them: per mode,
// the collectives a training step holds and where; zero3's params are shards and no gathered
// param is read by both the forward and the backward; the pipeline keeps every collective (CSE
// merges none, fusion takes none) and verifies; the memory plan keeps a collective's input
// until its wait. The numbers each mode computes are checked against a single process by the
// distributed tests (tests/distributed/).
#include "passes/sharding.h"

#include <map>
#include <set>

#include "analysis/memory_plan.h"
#include "compile/training_graph.h"
#include "ir/verifier.h"
#include "models/models.h"
#include "ops/collective.h"
#include "passes/pipeline.h"
#include "passes/uses.h"
#include "test_util.h"

namespace kiln {
namespace {

#define EXPECT_THROW_MSG(statement, text) \
  EXPECT_NE(testing::error_of([&] { statement; }).find(text), std::string::npos) << testing::error_of([&] { statement; })

size_t count_op(const Graph& g, Op op) {
  size_t n = 0;
  for (const Node& node : g.nodes) n += node.op == op ? 1 : 0;
  return n;
}

StepProgram step_of(const Graph& forward, ShardMode mode, int world, const std::string& amp = "off",
                    double clip = 0) {
  OptimizerConfig config;
  config.amp = amp;
  config.grad_clip = clip;
  return build_training_graph(forward, config, ShardingOptions{mode, world});
}

Graph tiny_gpt(int64_t batch = 2) { return models::by_name("gpt2-tiny", batch); }

TEST(Sharding, ModesParse) {
  for (ShardMode m : {ShardMode::kNone, ShardMode::kDp, ShardMode::kZero1, ShardMode::kZero2, ShardMode::kZero3})
    EXPECT_EQ(parse_shard_mode(shard_mode_name(m)), m);
  EXPECT_THROW_MSG(parse_shard_mode("fsdp"), "expected none, dp, zero1, zero2 or zero3");
  EXPECT_THROW_MSG(validate(ShardingOptions{ShardMode::kDp, 0}), "world size must be >= 1");
}

TEST(Sharding, ShardGeometryPadsToEqualShards) {
  const ParamShard s = param_shard(TensorType{DType::kF32, {5, 3}}, 4);  // 15 elements over 4 ranks
  EXPECT_EQ(s.shard_numel, 4);
  EXPECT_EQ(s.padded_numel(), 16);
  EXPECT_EQ(param_shard(TensorType{DType::kF32, {8}}, 4).shard_numel, 2);  // no padding
}

TEST(Sharding, DataParallelAveragesEveryGradientAndTheLoss) {
  const Graph forward = tiny_gpt();
  const StepProgram p = step_of(forward, ShardMode::kDp, 2);
  verify(p.graph);
  const size_t params = p.param_inputs.size();
  // One all_reduce per gradient, one for the loss; no other collective; params and state whole.
  EXPECT_EQ(count_op(p.graph, Op::kAllReduce), params + 1);
  EXPECT_EQ(count_op(p.graph, Op::kReduceScatter) + count_op(p.graph, Op::kAllGather), 0u);
  for (int i : p.param_inputs)
    EXPECT_EQ(p.graph.type(p.graph.inputs[i].value), forward.type(forward.inputs[i].value));
  // The loss output is the ranks' mean.
  const Uses uses(p.graph);
  const int wait = uses.producer[p.graph.outputs[0]];
  ASSERT_GE(wait, 0);
  EXPECT_EQ(p.graph.nodes[wait].op, Op::kCollectiveWait);
  const Node& reduce = p.graph.nodes[uses.producer[p.graph.nodes[wait].inputs[0]]];
  EXPECT_EQ(reduce.op, Op::kAllReduce);
  EXPECT_EQ(reduce.attrs.s("reduce"), "avg");
}

TEST(Sharding, ZeroOneAndTwoKeepOptimizerStateAsShards) {
  const Graph forward = tiny_gpt();
  for (ShardMode mode : {ShardMode::kZero1, ShardMode::kZero2}) {
    SCOPED_TRACE(std::string(shard_mode_name(mode)));
    const int world = 3;
    const StepProgram p = step_of(forward, mode, world, "off", /*clip=*/1.0);
    verify(p.graph);
    const size_t params = p.param_inputs.size();
    // Params whole; m and v are the flat padded shards.
    std::map<std::string, TensorType> full;
    for (int i : p.param_inputs) full[p.graph.value(p.graph.inputs[i].value).name] = p.graph.type(p.graph.inputs[i].value);
    size_t moments = 0;
    for (int i : p.state_inputs) {
      const Value& v = p.graph.value(p.graph.inputs[i].value);
      for (const char* prefix : {"opt.m.", "opt.v."}) {
        if (v.name.rfind(prefix, 0) != 0) continue;
        const TensorType& f = full.at(v.name.substr(6));
        EXPECT_EQ(v.type, (TensorType{DType::kF32, {param_shard(f, world).shard_numel}})) << v.name;
        ++moments;
      }
    }
    EXPECT_EQ(moments, 2 * params);
    // zero1 all-reduces whole gradients and takes its shard; zero2 reduce-scatters them. Both
    // gather every updated param; clipping adds one all_reduce of the squares, the loss one.
    EXPECT_EQ(count_op(p.graph, Op::kAllGather), params);
    if (mode == ShardMode::kZero1) {
      EXPECT_EQ(count_op(p.graph, Op::kAllReduce), params + 2);
      EXPECT_EQ(count_op(p.graph, Op::kLocalShard), 2 * params);  // the gradient's and the param's
      EXPECT_EQ(count_op(p.graph, Op::kReduceScatter), 0u);
    } else {
      EXPECT_EQ(count_op(p.graph, Op::kReduceScatter), params);
      EXPECT_EQ(count_op(p.graph, Op::kAllReduce), 2u);
      EXPECT_EQ(count_op(p.graph, Op::kLocalShard), params);  // the param's
    }
  }
}

// Nodes reading each gathered param value: no value is read on both sides of the loss.
void expect_no_gather_read_by_forward_and_backward(const Graph& g) {
  const Uses uses(g);
  size_t loss_node = 0;
  for (size_t n = 0; n < g.nodes.size(); ++n)
    if (g.nodes[n].op == Op::kCrossEntropy) loss_node = n;
  ASSERT_GT(loss_node, 0u);
  size_t checked = 0;
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes[n].op != Op::kCollectiveWait) continue;
    const Node& start = g.nodes[uses.producer[g.nodes[n].inputs[0]]];
    if (start.op != Op::kAllGather) continue;
    // Follow the wait through its slice and reshape views to the value the model reads.
    ValueId v = g.nodes[n].outputs[0];
    while (uses.readers[v].size() == 1 &&
           (g.nodes[uses.readers[v][0]].op == Op::kSlice || g.nodes[uses.readers[v][0]].op == Op::kReshape))
      v = g.nodes[uses.readers[v][0]].outputs[0];
    bool before = false, after = false;
    for (int r : uses.readers[v]) (static_cast<size_t>(r) < loss_node ? before : after) = true;
    EXPECT_FALSE(before && after) << "gathered " << g.value(v).name << " is read by the forward and the backward";
    ++checked;
  }
  EXPECT_GT(checked, 0u);
}

TEST(Sharding, ZeroThreeShardsParamsAndGathersThemAgainForTheBackward) {
  const Graph forward = tiny_gpt();
  for (const std::string amp : {"off", "bf16"}) {
    SCOPED_TRACE(amp);
    const int world = 2;
    const StepProgram p = step_of(forward, ShardMode::kZero3, world, amp);
    verify(p.graph);
    const size_t params = p.param_inputs.size();
    for (int i : p.param_inputs) {
      const TensorType full = forward.type(forward.inputs[i].value);
      EXPECT_EQ(p.graph.type(p.graph.inputs[i].value), (TensorType{DType::kF32, {param_shard(full, world).shard_numel}}));
    }
    // Each param is gathered at least once for the forward, and the weights again for the
    // backward; each gradient is reduce-scattered; no param is gathered after the update.
    EXPECT_GT(count_op(p.graph, Op::kAllGather), params);
    EXPECT_EQ(count_op(p.graph, Op::kReduceScatter), params);
    EXPECT_EQ(count_op(p.graph, Op::kLocalShard), 0u);
    if (amp == "bf16") {
      // Matmul weights are gathered from their 16-bit cast (half the bytes).
      size_t low = 0;
      for (const Node& n : p.graph.nodes)
        if (n.op == Op::kAllGather && p.graph.type(n.inputs[0]).dtype == DType::kBF16) ++low;
      EXPECT_GT(low, 0u);
    }
    expect_no_gather_read_by_forward_and_backward(p.graph);
  }
}

// zero2/3 reduce each gradient right after the backward makes it (zero3 without clipping also
// updates the param there), so no layer's full gradient waits for the end of the backward; dp,
// zero1 and a clipped zero3 (the norm reads every gradient first) keep theirs after it. The
// results are the modes' equality tests' (tests/passes/distributed_test.cc).
TEST(Sharding, ZeroTwoAndThreeReduceEachGradientAsSoonAsItIsMade) {
  const Graph forward = tiny_gpt();
  struct Case {
    ShardMode mode;
    double clip;
    bool early_reductions, early_updates;
  };
  for (const Case c : {Case{ShardMode::kDp, 0, false, false}, Case{ShardMode::kZero1, 0, false, false},
                       Case{ShardMode::kZero2, 0, true, false}, Case{ShardMode::kZero3, 0, true, true},
                       Case{ShardMode::kZero3, 1.0, true, false}}) {
    SCOPED_TRACE(std::string(shard_mode_name(c.mode)) + (c.clip > 0 ? " clipped" : ""));
    const StepProgram p = step_of(forward, c.mode, 2, "bf16", c.clip);
    verify(p.graph);
    int last_matmul = -1, first_reduction = -1, first_update = -1;
    for (size_t n = 0; n < p.graph.nodes.size(); ++n) {
      const Op op = p.graph.nodes[n].op;
      if (op == Op::kMatmul) last_matmul = static_cast<int>(n);
      if ((op == Op::kReduceScatter || op == Op::kAllReduce) && first_reduction < 0) first_reduction = static_cast<int>(n);
      if (op == Op::kOptimizerUpdate && first_update < 0) first_update = static_cast<int>(n);
    }
    ASSERT_GE(first_reduction, 0);
    EXPECT_EQ(first_reduction < last_matmul, c.early_reductions);
    EXPECT_EQ(first_update < last_matmul, c.early_updates);
  }
}

TEST(Sharding, PipelineKeepsEveryCollective) {
  const Graph forward = tiny_gpt();
  for (ShardMode mode : {ShardMode::kDp, ShardMode::kZero2, ShardMode::kZero3}) {
    SCOPED_TRACE(std::string(shard_mode_name(mode)));
    StepProgram p = step_of(forward, mode, 2, "bf16");
    std::map<Op, size_t> before;
    for (Op op : {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter}) before[op] = count_op(p.graph, op);
    // (bucket-collectives merges collectives on purpose: tests/passes/distributed_test.cc.)
    PassOptions options;
    options.disabled.insert("bucket-collectives");
    default_pipeline(options).run(p.graph);
    verify(p.graph);
    for (auto [op, n] : before) EXPECT_EQ(count_op(p.graph, op), n) << op_name(op);
    // A collective never lands inside a fused body.
    for (const Node& n : p.graph.nodes) {
      if (!n.body) continue;
      for (const Node& inner : n.body->nodes) EXPECT_FALSE(has_flag(inner.op, kCollective) || inner.op == Op::kCollectiveWait);
    }
  }
}

TEST(Sharding, CseMergesNoCollectives) {
  Builder b("two_gathers");
  Expr shard = b.param("w", {4});
  Expr a = all_gather(shard, 2), c = all_gather(shard, 2);
  b.graph().outputs.push_back((a + c).id());
  Graph g = b.take();
  PassOptions options;
  options.disabled.insert("bucket-collectives");
  default_pipeline(options).run(g);
  EXPECT_EQ(count_op(g, Op::kAllGather), 2u);
}

TEST(Sharding, PlanKeepsACollectiveInputUntilItsWait) {
  Builder b("overlap");
  Expr x = b.param("x", {64});
  Expr g = exp(x) * 2.0;              // the collective's input, an arena value
  Expr started = b.apply1(Op::kAllReduce, {g}, {{"world_size", int64_t{2}}});
  Expr other = tanh(x) + 1.0;         // runs while the all_reduce is in flight
  Expr more = sigmoid(other) * 3.0;
  Expr done = b.apply1(Op::kCollectiveWait, {started});
  b.graph().outputs.push_back((done + more).id());
  const Graph graph = b.take();
  verify(graph);
  const MemoryPlan plan = plan_memory(graph);
  const Uses uses(graph);
  const int wait_node = uses.producer[done.id()];
  EXPECT_GE(plan.liveness.last[g.id()], wait_node);
  // The wait is a view of the collective's output: no bytes of its own.
  EXPECT_TRUE(plan.is_view(done.id()));
  // Nothing computed between the start and the wait shares bytes with the input.
  auto overlaps = [&](ValueId a, ValueId c) {
    const int64_t a0 = plan.offsets[a], c0 = plan.offsets[c];
    return a0 < c0 + static_cast<int64_t>(graph.type(c).bytes()) && c0 < a0 + static_cast<int64_t>(graph.type(a).bytes());
  };
  for (ValueId v : {other.id(), more.id()}) {
    if (!plan.in_arena(v)) continue;
    EXPECT_FALSE(overlaps(g.id(), v)) << graph.value(v).name;
  }
}

TEST(Sharding, VerifierWantsEveryCollectiveReadThroughItsWait) {
  Builder b("unwaited");
  Expr x = b.param("x", {8});
  Expr started = b.apply1(Op::kAllReduce, {x}, {{"world_size", int64_t{2}}});
  b.graph().outputs.push_back((started * 2.0).id());
  EXPECT_THROW_MSG(verify(b.graph()), "without its collective_wait");
  Builder c("wait_of_nothing");
  Expr y = c.param("y", {8});
  c.graph().outputs.push_back((c.apply1(Op::kCollectiveWait, {exp(y)})).id());
  EXPECT_THROW_MSG(verify(c.graph()), "is not the output of a collective");
}

TEST(Sharding, ShapeRulesRejectUnevenShards) {
  Builder b("uneven");
  Expr x = b.param("x", {10});
  EXPECT_THROW_MSG(b.apply1(Op::kReduceScatter, {x}, {{"world_size", int64_t{4}}}), "do not split into 4 equal shards");
  EXPECT_THROW_MSG(b.apply1(Op::kAllGather, {reshape(x, {2, 5})}, {{"world_size", int64_t{2}}}), "1-D shard");
  EXPECT_THROW_MSG(b.apply1(Op::kAllReduce, {x}, {{"world_size", int64_t{2}}, {"reduce", std::string("mean")}}),
                   "expected sum, avg or max");
}

TEST(Sharding, ForwardStepOfZeroThreeGathersAndAveragesTheLoss) {
  Graph forward = tiny_gpt();
  shard_forward_step(forward, ShardingOptions{ShardMode::kZero3, 2});
  verify(forward);
  EXPECT_GT(count_op(forward, Op::kAllGather), 0u);
  EXPECT_EQ(count_op(forward, Op::kAllReduce), 1u);
  EXPECT_EQ(count_op(forward, Op::kReduceScatter), 0u);
}

}  // namespace
}  // namespace kiln

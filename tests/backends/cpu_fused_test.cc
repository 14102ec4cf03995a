// The tiled CPU kernel of `fused` nodes (backends/cpu/fused.cc) against the fused op's reference
// kernel (the whole body with reference kernels, untiled): elementwise chains with broadcasts,
// row ops, column reductions, a GEMM nucleus with its epilogue, partial last tiles, single
// rows; bodies it must refuse; a fused node through the executor; gpt2-tiny training steps with
// the fusion pass against the same steps without it.
#include <memory>
#include <set>

#include "backends/cpu/fused.h"
#include "ir/graph.h"
#include "models/models.h"
#include "passes/fusion/fusion.h"
#include "runtime/executor.h"
#include "test_util.h"
#include "train/trainer.h"

namespace kiln {
namespace {

using testing::rand;

TensorType f32(Shape shape) { return TensorType{DType::kF32, std::move(shape)}; }

// A fused node over `body`, as the executor would see it.
Node fused_node(std::shared_ptr<const Graph> body, const std::string& kind) {
  Node node{Op::kFused, {}, {}, Attributes{{"kind", kind}}, std::move(body)};
  return node;
}

std::vector<Tensor> allocate_outputs(const Graph& body) {
  std::vector<Tensor> outs;
  for (ValueId id : body.outputs) outs.emplace_back(body.type(id));
  return outs;
}

// Runs the fused node through the "cpu" kernel (which must support it) and the reference.
void expect_cpu_matches_reference(const Graph& body_graph, const std::vector<Tensor>& inputs,
                                  double atol = 1e-5, double rtol = 1e-4) {
  auto body = std::make_shared<const Graph>(body_graph);
  const Node node = fused_node(body, "rows");
  std::vector<TensorType> in_types, out_types;
  for (const GraphInput& in : body->inputs) in_types.push_back(body->type(in.value));
  for (ValueId id : body->outputs) out_types.push_back(body->type(id));
  const KernelImpl& impl =
      kernel_registry().select(NodeView{node, in_types, out_types}, Device::kCpu, {});
  const cpu::FusedPlanInfo info = cpu::fused_plan_info(*body);
  ASSERT_EQ(impl.dialect, "cpu") << "refused: " << info.why_not;
  ASSERT_TRUE(info.supported);

  std::vector<Tensor> expected = allocate_outputs(*body);
  op_def(Op::kFused).reference(KernelArgs{node.attrs, inputs, expected, nullptr, body.get()});
  std::vector<Tensor> actual = allocate_outputs(*body);
  impl.kernel(KernelArgs{node.attrs, inputs, actual, nullptr, body.get()});
  for (size_t i = 0; i < actual.size(); ++i) {
    const double error = max_scaled_error(actual[i], expected[i], atol, rtol);
    EXPECT_LE(error, 1.0) << "output " << i << " (" << to_string(actual[i].type())
                          << "), tiles of " << info.tile_rows << " rows x " << info.tiles;
  }
}

std::vector<Tensor> random_inputs(const Graph& body, uint64_t seed) {
  std::vector<Tensor> out;
  for (const GraphInput& in : body.inputs) {
    const TensorType& t = body.type(in.value);
    out.push_back(rand(t.dtype, t.shape, seed++, 0.1, 1.0));
  }
  return out;
}

// Every test runs with the default tile policy and with tiny tiles (many tiles, a partial last
// one), since the small test shapes fit in one or two default tiles.
class CpuFused : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override { cpu::set_fused_tile_bytes(GetParam()); }
  void TearDown() override { cpu::set_fused_tile_bytes(0); }
};

INSTANTIATE_TEST_SUITE_P(TileBytes, CpuFused, ::testing::Values(0, 4096),
                         [](const auto& info) {
                           return info.param == 0 ? std::string("DefaultTiles")
                                                  : std::string("TinyTiles");
                         });

// tanh(gelu(x + bias) * s): a row-vector bias and a scalar broadcast into (B, T, C).
Graph elementwise_chain(Shape shape) {
  Graph g;
  const int64_t c = shape.back();
  ValueId x = g.add_input("x", f32(shape), Role::kData);
  ValueId bias = g.add_input("bias", f32({c}), Role::kData);
  ValueId s = g.add_input("s", f32({}), Role::kData);
  ValueId h = g.add(Op::kAdd, {x, bias});
  h = g.add(Op::kGelu, {h});
  h = g.add(Op::kMul, {h, s});
  g.outputs = {g.add(Op::kTanh, {h})};
  return g;
}

TEST_P(CpuFused, ElementwiseChainWithBroadcastBias) {
  for (Shape shape : {Shape{3, 37, 96}, Shape{100, 64}, Shape{5, 1, 33}}) {
    SCOPED_TRACE(to_string(shape));
    Graph body = elementwise_chain(shape);
    expect_cpu_matches_reference(body, random_inputs(body, 1));
  }
}

// The row of the bias written as (1, 1, C) and a per-row column (B, T, 1) scale.
TEST_P(CpuFused, RowVectorAndPerRowColumnBroadcasts) {
  Graph g;
  ValueId x = g.add_input("x", f32({4, 29, 48}), Role::kData);
  ValueId bias = g.add_input("bias", f32({1, 1, 48}), Role::kData);
  ValueId scale = g.add_input("scale", f32({4, 29, 1}), Role::kData);
  ValueId h = g.add(Op::kSub, {x, bias});
  g.outputs = {g.add(Op::kMul, {scale, h})};
  expect_cpu_matches_reference(g, random_inputs(g, 7));
}

// h = x + residual; y = layer_norm(h): both outputs (h is also read inside).
TEST_P(CpuFused, ResidualAddAndLayerNorm) {
  for (Shape shape : {Shape{2, 53, 128}, Shape{131, 40}}) {
    SCOPED_TRACE(to_string(shape));
    Graph g;
    const int64_t c = shape.back();
    ValueId x = g.add_input("x", f32(shape), Role::kData);
    ValueId res = g.add_input("res", f32(shape), Role::kData);
    ValueId gamma = g.add_input("gamma", f32({c}), Role::kData);
    ValueId beta = g.add_input("beta", f32({c}), Role::kData);
    ValueId h = g.add(Op::kAdd, {x, res});
    ValueId y = g.add(Op::kLayerNorm, {h, gamma, beta});
    g.outputs = {h, y};
    expect_cpu_matches_reference(g, random_inputs(g, 11));
  }
}

// softmax(x) * m + x, and a hand-decomposed softmax: exp(x - max) / sum, with per-row columns
// computed inside the body.
TEST_P(CpuFused, SoftmaxRowOpFollowedByElementwise) {
  Graph g;
  ValueId x = g.add_input("x", f32({6, 23, 70}), Role::kData);
  ValueId m = g.add_input("m", f32({6, 23, 70}), Role::kData);
  ValueId p = g.add(Op::kSoftmax, {x}, {{"axis", int64_t{-1}}});
  ValueId y = g.add(Op::kAdd, {g.add(Op::kMul, {p, m}), x});
  ValueId row_max = g.add(Op::kMax, {x}, {{"axes", std::vector<int64_t>{-1}}, {"keepdims", true}});
  ValueId e = g.add(Op::kExp, {g.add(Op::kSub, {x, row_max})});
  ValueId row_sum = g.add(Op::kSum, {e}, {{"axes", std::vector<int64_t>{2}}, {"keepdims", true}});
  ValueId q = g.add(Op::kDiv, {e, row_sum});
  // A per-row output without keepdims: (6, 23).
  ValueId row_mean = g.add(Op::kMean, {x}, {{"axes", std::vector<int64_t>{-1}}});
  // where with a per-row bool column and a scalar (the cross-entropy gradient's mask).
  ValueId keep = g.add_input("keep", TensorType{DType::kBool, {6, 23, 1}}, Role::kData);
  ValueId other = g.add_input("other", f32({}), Role::kData);
  ValueId masked = g.add(Op::kWhere, {keep, q, other});
  g.outputs = {y, q, row_mean, masked};
  // Every node on a fast kernel or a loop of the fused kernel, none on the reference per tile.
  EXPECT_EQ(cpu::fused_plan_info(g).reference_ops, std::vector<std::string>{});
  expect_cpu_matches_reference(g, random_inputs(g, 21));
}

// A bias gradient (column sum over every axis but the last) next to the full-size gradient,
// and a mean over the columns with keepdims.
TEST_P(CpuFused, ColumnReductionBesideFullOutput) {
  Graph g;
  ValueId dy = g.add_input("dy", f32({5, 41, 72}), Role::kData);
  ValueId x = g.add_input("x", f32({5, 41, 72}), Role::kData);
  ValueId dx = g.add(Op::kGeluGrad, {x, dy});
  ValueId db = g.add(Op::kSum, {dx}, {{"axes", std::vector<int64_t>{0, 1}}});
  ValueId dm = g.add(Op::kMean, {g.add(Op::kMul, {dx, x})},
                     {{"axes", std::vector<int64_t>{1, 0}}, {"keepdims", true}});
  g.outputs = {dx, db, dm};
  const cpu::FusedPlanInfo info = cpu::fused_plan_info(g);
  EXPECT_EQ(info.column_reductions, 2);
  // Sums of 205 terms of size ~1: absolute tolerance for the cancellation.
  expect_cpu_matches_reference(g, random_inputs(g, 31), 1e-4, 1e-4);
}

// GPT-2's backward at a LayerNorm: the norm's gradient (dx per row, dgamma and dbeta summed over
// every row: tile shares added up), the residual gradient added, and that sum's bias gradient;
// once on a given dy and once with dy the product of a GEMM nucleus. RMSNorm's gradient too.
TEST_P(CpuFused, NormGradientColumnOutputsWithResidualAndBiasGradient) {
  const int64_t rows = 93, c = 40, k = 24;
  for (bool gemm : {false, true})
    for (Op op : {Op::kLayerNormGrad, Op::kRmsNormGrad}) {
      SCOPED_TRACE(fmt::format("gemm={} op={}", gemm, op_name(op)));
      Graph g;
      ValueId x = g.add_input("x", f32({3, rows / 3, c}), Role::kData);
      ValueId gamma = g.add_input("gamma", f32({c}), Role::kData);
      ValueId resid = g.add_input("resid", f32({3, rows / 3, c}), Role::kData);
      ValueId dy;
      if (gemm) {
        ValueId a = g.add_input("a", f32({3, rows / 3, k}), Role::kData);
        ValueId w = g.add_input("w", f32({c, k}), Role::kData);
        dy = g.add(Op::kMatmul, {a, w}, {{"transpose_b", true}});
      } else {
        dy = g.add_input("dy", f32({3, rows / 3, c}), Role::kData);
      }
      const std::vector<ValueId> grads = g.add_node(op, {x, gamma, dy});
      ValueId sum = g.add(Op::kAdd, {grads[0], resid});
      ValueId bias_grad = g.add(Op::kSum, {sum}, {{"axes", std::vector<int64_t>{0, 1}}});
      g.outputs = {sum, bias_grad};
      for (size_t j = 1; j < grads.size(); ++j) g.outputs.push_back(grads[j]);
      const cpu::FusedPlanInfo info = cpu::fused_plan_info(g);
      EXPECT_EQ(info.column_reductions, static_cast<int64_t>(grads.size()));
      EXPECT_EQ(info.gemm, gemm);
      // Column sums of 93 terms of size ~1.
      expect_cpu_matches_reference(g, random_inputs(g, 45), 1e-4, 1e-4);
    }
}

// gelu(a @ w + bias), in each transpose combination.
TEST_P(CpuFused, GemmNucleusWithBiasAndGeluEpilogue) {
  const int64_t m = 150, k = 96, n = 80;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(fmt::format("transpose_a={} transpose_b={}", ta, tb));
      Graph g;
      ValueId a = g.add_input("a", f32(ta ? Shape{k, m} : Shape{m, k}), Role::kData);
      ValueId w = g.add_input("w", f32(tb ? Shape{n, k} : Shape{k, n}), Role::kData);
      ValueId bias = g.add_input("bias", f32({n}), Role::kData);
      ValueId c = g.add(Op::kMatmul, {a, w}, {{"transpose_a", ta}, {"transpose_b", tb}});
      ValueId y = g.add(Op::kGelu, {g.add(Op::kAdd, {c, bias})});
      g.outputs = {y};
      const cpu::FusedPlanInfo info = cpu::fused_plan_info(g);
      EXPECT_TRUE(info.gemm);
      EXPECT_EQ(info.rows, m);
      EXPECT_EQ(info.row_length, n);
      expect_cpu_matches_reference(g, random_inputs(g, 41), 1e-4, 1e-4);
    }
}

// The GEMM's product is also an output, next to the epilogue; the left operand is read again by
// the epilogue (a residual).
TEST_P(CpuFused, GemmProductAndResidualEpilogue) {
  Graph g;
  ValueId a = g.add_input("a", f32({77, 64}), Role::kData);
  ValueId w = g.add_input("w", f32({64, 64}), Role::kData);
  ValueId c = g.add(Op::kMatmul, {a, w});
  ValueId y = g.add(Op::kAdd, {g.add(Op::kRelu, {c}), a});
  g.outputs = {y, c};
  expect_cpu_matches_reference(g, random_inputs(g, 51), 1e-4, 1e-4);
}

TEST_P(CpuFused, SingleRow) {
  Graph chain = elementwise_chain({1, 1, 300});
  expect_cpu_matches_reference(chain, random_inputs(chain, 61));
  Graph g;
  ValueId x = g.add_input("x", f32({1, 257}), Role::kData);
  ValueId gamma = g.add_input("gamma", f32({257}), Role::kData);
  ValueId beta = g.add_input("beta", f32({257}), Role::kData);
  ValueId y = g.add(Op::kLayerNorm, {x, gamma, beta});
  ValueId db = g.add(Op::kSum, {y}, {{"axes", std::vector<int64_t>{0}}});
  g.outputs = {g.add(Op::kExp, {y}), db};
  expect_cpu_matches_reference(g, random_inputs(g, 62));
  // A rank-1 space: one row.
  Graph v;
  ValueId xv = v.add_input("x", f32({100}), Role::kData);
  v.outputs = {v.add(Op::kSoftmax, {v.add(Op::kNeg, {xv})}, {{"axis", int64_t{0}}})};
  expect_cpu_matches_reference(v, random_inputs(v, 63));
}

// The reference serves the row ops and broadcasts the fast kernels refuse (a (B, T, 1) column
// in a binary op) tile by tile: still equal.
TEST_P(CpuFused, CrossEntropyRowsWithIntegerLabels) {
  Graph g;
  ValueId logits = g.add_input("logits", f32({3, 17, 50}), Role::kData);
  ValueId labels = g.add_input("labels", TensorType{DType::kI64, {3, 17}}, Role::kData);
  ValueId scaled = g.add(Op::kMul, {logits, logits});
  g.outputs = {g.add(Op::kCrossEntropy, {scaled, labels}, {{"reduction", std::string("none")}})};
  std::vector<Tensor> inputs = {rand(DType::kF32, {3, 17, 50}, 71),
                                rand(DType::kI64, {3, 17}, 72, 0, 50)};
  expect_cpu_matches_reference(g, inputs);
}

TEST(CpuFusedTiles, PartialLastTileAndTileCounts) {
  Graph g = elementwise_chain({1000, 64});
  cpu::set_fused_tile_bytes(64 * 4 * 5 * 7);  // 5 row-sized values of 64 f32: 7 rows a tile
  const cpu::FusedPlanInfo info = cpu::fused_plan_info(g);
  cpu::set_fused_tile_bytes(0);
  ASSERT_TRUE(info.supported) << info.why_not;
  EXPECT_EQ(info.rows, 1000);
  EXPECT_EQ(info.row_length, 64);
  EXPECT_EQ(info.tile_rows, 7);
  EXPECT_EQ(info.tiles, 143);  // 142 tiles of 7 and one of 6

  // Default policy at 8192 x 768 (5 values a row: 15 KiB): about 17 rows a tile.
  Graph big = elementwise_chain({8192, 768});
  const cpu::FusedPlanInfo d = cpu::fused_plan_info(big);
  EXPECT_EQ(d.tile_rows, 256 * 1024 / (5 * 768 * 4));
}

TEST(CpuFusedTiles, RefusedBodiesFallBackToTheReference) {
  // bf16: no fast kernels to reuse.
  Graph g;
  ValueId x = g.add_input("x", TensorType{DType::kBF16, {8, 16}}, Role::kData);
  g.outputs = {g.add(Op::kExp, {g.add(Op::kNeg, {x})})};
  cpu::FusedPlanInfo info = cpu::fused_plan_info(g);
  EXPECT_FALSE(info.supported);
  EXPECT_NE(info.why_not.find("bf16"), std::string::npos) << info.why_not;

  // A (T, C) broadcast into (B, T, C): not a row vector, so not tiled by rows.
  Graph p;
  ValueId h = p.add_input("h", f32({2, 8, 16}), Role::kData);
  ValueId pos = p.add_input("pos", f32({8, 16}), Role::kData);
  p.outputs = {p.add(Op::kRelu, {p.add(Op::kAdd, {h, pos})})};
  info = cpu::fused_plan_info(p);
  EXPECT_FALSE(info.supported);
  EXPECT_NE(info.why_not.find("f32[8,16]"), std::string::npos) << info.why_not;

  // A column reduction read inside the body.
  Graph c;
  ValueId y = c.add_input("y", f32({10, 6}), Role::kData);
  ValueId s = c.add(Op::kSum, {y}, {{"axes", std::vector<int64_t>{0}}});
  c.outputs = {c.add(Op::kMul, {y, s})};
  info = cpu::fused_plan_info(c);
  EXPECT_FALSE(info.supported);
  EXPECT_NE(info.why_not.find("column reduction"), std::string::npos) << info.why_not;

  // The executor then runs them with the fused reference kernel.
  Graph main;
  ValueId mx = main.add_input("x", TensorType{DType::kBF16, {8, 16}}, Role::kData);
  main.outputs = main.add_node(Op::kFused, {mx}, {{"kind", std::string("elementwise")}},
                               std::make_shared<const Graph>(g));
  Executor exec(main);
  EXPECT_EQ(exec.node_dialects(), std::vector<std::string>{"reference"});
}

// A main graph holding a fused node: the executor picks the "cpu" kernel, and its outputs equal
// the same nodes run unfused.
TEST(CpuFusedTiles, ExecutorPicksTheTiledKernel) {
  Graph body;
  {
    ValueId x = body.add_input("x", f32({64, 33, 96}), Role::kData);
    ValueId r = body.add_input("r", f32({64, 33, 96}), Role::kData);
    ValueId gamma = body.add_input("gamma", f32({96}), Role::kData);
    ValueId beta = body.add_input("beta", f32({96}), Role::kData);
    ValueId h = body.add(Op::kAdd, {x, r});
    body.outputs = {h, body.add(Op::kLayerNorm, {h, gamma, beta})};
  }
  Graph fused;
  std::vector<ValueId> ins;
  for (const GraphInput& in : body.inputs)
    ins.push_back(fused.add_input(body.value(in.value).name, body.type(in.value), Role::kData));
  fused.outputs =
      fused.add_node(Op::kFused, ins, {{"kind", std::string("rows")}},
                     std::make_shared<const Graph>(body));
  Executor fused_exec(fused);
  EXPECT_EQ(fused_exec.node_dialects(), std::vector<std::string>{"cpu"});
  Executor unfused_exec(body);

  const std::vector<Tensor> inputs = random_inputs(body, 81);
  const std::vector<Tensor> got = fused_exec.run(inputs);
  const std::vector<Tensor> want = unfused_exec.run(inputs);
  ASSERT_EQ(got.size(), 2u);
  // Same fast kernels on tiles as on whole tensors: equal.
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(testing::all_close(got[i], want[i], 0, 0));
}

// gpt2-tiny training steps (SGD without momentum, so that an update is lr times the gradient)
// with the default pipeline, fusion included, equal the same steps with the fusion pass
// disabled: the losses within 1e-5 relative, and every param's change within 1e-5 of that
// change's largest magnitude. Every fused node must run on the tiled "cpu" kernel.
TEST(CpuFusedTraining, Gpt2TinyStepsWithFusionEqualUnfused) {
  const models::GptConfig config = models::gpt_config("gpt2-tiny");
  const Graph forward = models::gpt(config);
  OptimizerConfig optimizer;
  optimizer.name = "sgd";
  optimizer.hyper["momentum"] = 0.0;
  optimizer.lr = 0.1;
  const std::vector<Tensor> init = models::init_params(forward, 5, config.layers);
  auto copies = [&] {
    std::vector<Tensor> out;
    for (const Tensor& t : init) out.push_back(t.clone());
    return out;
  };
  PassOptions no_fusion;  // nor the passes that outline fused nodes of their own kinds
  no_fusion.disabled = {"fusion", "classifier", "multi-tensor"};
  train::Trainer fused(forward, optimizer, copies());
  train::Trainer unfused(forward, optimizer, copies(), {}, no_fusion);

  const Graph& step = fused.program().graph;
  const std::vector<std::string> dialects = fused.step_executor().node_dialects();
  int fused_nodes = 0;
  for (size_t n = 0; n < step.nodes.size(); ++n) {
    if (step.nodes[n].op != Op::kFused) continue;
    const std::string& kind = step.nodes[n].attrs.s("kind");
    if (kind == "classifier" || kind.starts_with("multi-tensor") || kind == "global-norm") continue;
    ++fused_nodes;
    EXPECT_EQ(dialects[n], "cpu") << "fused node " << n << " (" << step.nodes[n].attrs.s("kind")
                                  << "): " << cpu::fused_plan_info(*step.nodes[n].body).why_not;
  }
  EXPECT_GT(fused_nodes, 0);
  for (const Node& node : unfused.program().graph.nodes) EXPECT_NE(node.op, Op::kFused);
  // What the CPU kernel must take here: GEMM nuclei with epilogues that hold row ops (a
  // LayerNorm after a projection, its decomposed gradient after a matmul) and column sums.
  std::set<std::string> kinds;
  for (const fusion::FusedNodeReport& r : fusion::report(step)) kinds.insert(r.kind);
  EXPECT_TRUE(kinds.count("gemm-epilogue")) << fmt::format("{}", fmt::join(kinds, ","));
  bool row_ops = false, column_sums = false;
  for (const Node& node : step.nodes) {
    if (node.op != Op::kFused || node.attrs.s("kind") != "gemm-epilogue") continue;
    for (const Node& inner : node.body->nodes) {
      row_ops = row_ops || inner.op == Op::kLayerNorm || inner.op == Op::kMean;
      column_sums = column_sums || (inner.op == Op::kSum && inner.attrs.ints("axes").size() > 1);
    }
  }
  EXPECT_TRUE(row_ops);
  EXPECT_TRUE(column_sums);

  for (int s = 0; s < 2; ++s) {
    const double vocab = static_cast<double>(config.vocab);
    const Shape tokens{config.batch, config.seq};
    const std::vector<Tensor> batch = {rand(DType::kI64, tokens, 90 + s, 0, vocab),
                                       rand(DType::kI64, tokens, 95 + s, 0, vocab)};
    const Tensor a = fused.step(batch)[0], b = unfused.step(batch)[0];
    EXPECT_LE(max_scaled_error(a, b, 0, 1e-5), 1.0)
        << "step " << s << ": loss " << a.get(0) << " vs " << b.get(0);
  }
  int compared = 0;
  const std::vector<Tensor> pa = fused.params(), pb = unfused.params();
  ASSERT_EQ(pa.size(), init.size());
  for (size_t i = 0; i < init.size(); ++i) {
    const std::vector<double> before = init[i].to_f64(), x = pa[i].to_f64(), y = pb[i].to_f64();
    double scale = 0, error = 0;
    for (size_t j = 0; j < before.size(); ++j) {
      scale = std::max(scale, std::abs(y[j] - before[j]));
      error = std::max(error, std::abs(x[j] - y[j]));
    }
    EXPECT_LE(error, 1e-5 * scale + 1e-8) << "param " << i << ": change up to " << scale;
    ++compared;
  }
  EXPECT_GT(compared, 10);
}

}  // namespace
}  // namespace kiln

// The classifier-chunks pass (passes/classifier_chunks.h): a language-model head computed a
// chunk of rows at a time. On gpt2-tiny's training graphs (f32, bf16, f16 with loss scaling;
// CPU reference kernels) the chunked step computes what the unchunked one does up to float
// reassociation: the loss, and every param after an SGD step without momentum (whose new
// momentum buffer is the gradient itself). Labels with ignored rows (and all rows ignored) keep
// the "mean" semantics; "sum" and an untied head (W stored (C, V)) chunk too. The chunks'
// shapes and count follow the cap (rows a multiple of 64, the last chunk shorter), the planned
// arena shrinks with them, and heads the pass cannot rewrite are left alone.
#include "passes/classifier_chunks.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "analysis/memory_plan.h"
#include "ir/text.h"
#include "models/models.h"
#include "ops/fused/classifier.h"
#include "passes/classifier.h"
#include "passes/pipeline.h"
#include "passes/schedule.h"
#include "passes/simplify/dead_code.h"
#include "simplify/simplify_test_util.h"
#include "compile/training_graph.h"

namespace kiln {
namespace {

using testing::random_inputs;
using testing::relatively_close;
using testing::run_step;

// Rows of each fused classifier node, largest first (the schedule pass may run them in any
// order).
std::vector<int64_t> classifier_rows(const Graph& g) {
  std::vector<int64_t> rows;
  for (const Node& node : g.nodes)
    if (node.op == Op::kFused && node.attrs.s("kind") == "classifier")
      rows.push_back(match_classifier_body(*node.body)->rows);
  std::sort(rows.rbegin(), rows.rend());
  return rows;
}

// scatter_adds into zeros (the embeddings' gradients; the tied one's scatters into the head's
// weight-gradient sum once chunked).
int scatters_into_zeros(const Graph& g) {
  std::vector<int> producer(g.values.size(), -1);
  for (size_t n = 0; n < g.nodes.size(); ++n)
    for (ValueId out : g.nodes[n].outputs) producer[static_cast<size_t>(out)] = static_cast<int>(n);
  int count = 0;
  for (const Node& node : g.nodes) {
    if (node.op != Op::kScatterAdd) continue;
    const int p = producer[static_cast<size_t>(node.inputs[0])];
    count += p >= 0 && g.nodes[static_cast<size_t>(p)].op == Op::kFull;
  }
  return count;
}

StepProgram training(const std::string& amp, int64_t batch) {
  OptimizerConfig config;
  config.name = "sgd";
  config.hyper["momentum"] = 0.0;  // the new momentum buffer is the gradient itself
  config.amp = amp;
  return build_training_graph(models::by_name("gpt2-tiny", batch, 0), config);
}

Graph prepared(const Graph& graph, size_t chunk_bytes, Device target = Device::kCpu) {
  PassOptions options;
  options.target = target;
  options.logits_chunk_bytes = chunk_bytes;
  Graph g = graph;
  default_pipeline(options).run(g);
  return g;
}

// Loss and every result of the step, chunked against unchunked.
void expect_same_step(const Graph& without, const Graph& with, const std::vector<Tensor>& inputs,
                      double rtol) {
  const std::vector<Tensor> want = run_step(without, inputs), got = run_step(with, inputs);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_NEAR(got[0].get(0), want[0].get(0), rtol * std::abs(want[0].get(0)) + 1e-12);
  for (size_t i = 1; i < got.size(); ++i) {
    SCOPED_TRACE("result " + std::to_string(i));
    EXPECT_TRUE(relatively_close({got[i]}, {want[i]}, rtol));
  }
}

TEST(ClassifierChunksPass, Gpt2TinyStepMatchesTheUnchunkedStep) {
  // Batch 3 x 64 positions = 192 rows; vocabulary 256.
  for (const std::string amp : {"off", "bf16", "f16"}) {
    for (Device target : {Device::kCpu, Device::kCuda}) {
      SCOPED_TRACE("amp " + amp + (target == Device::kCuda ? ", prepared for cuda" : ""));
      const StepProgram program = training(amp, 3);
      const size_t row_bytes = 256 * (amp == "off" ? 4 : 2);
      // A cap of 128 rows: two chunks, 128 and 64 rows.
      const Graph without = prepared(program.graph, 0, target);
      const Graph with = prepared(program.graph, 128 * row_bytes, target);
      EXPECT_EQ(classifier_rows(without), std::vector<int64_t>{192});
      EXPECT_EQ(classifier_rows(with), (std::vector<int64_t>{128, 64}));
      EXPECT_EQ(scatters_into_zeros(without), 2);  // wte (tied to the head) and wpe
      EXPECT_EQ(scatters_into_zeros(with), 1);
      // 16-bit weight-gradient products are rounded per chunk before the f32 sum.
      const std::vector<Tensor> inputs = random_inputs(program.graph, 41, 0, 256);
      expect_same_step(without, with, inputs, amp == "off" ? 1e-5 : 2e-2);
    }
  }
}

TEST(ClassifierChunksPass, ChunkRowsFollowTheCap) {
  const StepProgram program = training("off", 4);  // 256 rows of 1 KiB logits
  EXPECT_EQ(classifier_rows(prepared(program.graph, 256 * 1024)), std::vector<int64_t>{256});
  EXPECT_EQ(classifier_rows(prepared(program.graph, 256 * 1024 - 1)), (std::vector<int64_t>{128, 128}));
  EXPECT_EQ(classifier_rows(prepared(program.graph, 100 * 1024)), (std::vector<int64_t>{64, 64, 64, 64}));
  // Below one quantum of rows: chunks of one quantum (the cap cannot be met exactly).
  EXPECT_EQ(classifier_rows(prepared(program.graph, 1024)), (std::vector<int64_t>{64, 64, 64, 64}));
  EXPECT_EQ(classifier_rows(prepared(program.graph, 0)), std::vector<int64_t>{256});
}

// A head written out: x (rows, C) times the tied W (V, C) transposed, the loss with ignored
// labels, the input gradient and the weight gradient.
constexpr const char* kTiedHead =
    "graph @g(%x: f32[3,64,8] data, %w: f32[40,8] param, %t: i64[3,64] data) {\n"
    "  %l = matmul(%x, %w) {transpose_b=true} : f32[3,64,40]\n"
    "  %loss = cross_entropy(%l, %t) {reduction=\"REDUCTION\"} : f32[]\n"
    "  %d = full() {dtype=f32, shape=[], value=1.5} : f32[]\n"
    "  %g = cross_entropy_grad(%l, %t, %d) {reduction=\"REDUCTION\"} : f32[3,64,40]\n"
    "  %dx = matmul(%g, %w) : f32[3,64,8]\n"
    "  %gf = reshape(%g) {shape=[-1, 40]} : f32[192,40]\n"
    "  %xf = reshape(%x) {shape=[-1, 8]} : f32[192,8]\n"
    "  %dw = matmul(%gf, %xf) {transpose_a=true} : f32[40,8]\n"
    "  return %loss, %dx, %dw\n"
    "}\n";

Graph head(const std::string& reduction) {
  std::string text = kTiedHead;
  for (size_t at; (at = text.find("REDUCTION")) != std::string::npos;) text.replace(at, 9, reduction);
  Graph g = parse(text);
  ClassifierPass().run(g);
  return g;
}

// Chunked (64 rows: 3 chunks) against unchunked, with `ignored` labels set to ignore_index.
void check_head(const std::string& reduction, int ignored) {
  SCOPED_TRACE(reduction + ", " + std::to_string(ignored) + " rows ignored");
  const Graph without = head(reduction);
  Graph with = without;
  ASSERT_TRUE(ClassifierChunksPass(64 * 40 * 4).run(with));
  DeadCodeElimination().run(with);
  verify(with);
  EXPECT_EQ(classifier_rows(with), (std::vector<int64_t>{64, 64, 64}));
  std::vector<Tensor> inputs = random_inputs(without, 5, 0, 40);
  Tensor& labels = inputs[2];
  for (int i = 0; i < ignored; ++i) labels.set((i * 37) % 192, -100.0);
  const std::vector<Tensor> want = run_step(without, inputs), got = run_step(with, inputs);
  EXPECT_NEAR(got[0].get(0), want[0].get(0), 1e-5 * std::abs(want[0].get(0)) + 1e-12);
  EXPECT_TRUE(relatively_close({got[1], got[2]}, {want[1], want[2]}, 1e-5));
  if (ignored == 192) {  // no counted row: loss and gradients all 0, as unchunked
    EXPECT_EQ(got[0].get(0), 0.0);
    EXPECT_EQ(got[2].get(7), 0.0);
  }
}

TEST(ClassifierChunksPass, MeanCountsOnlyLabelsThatAreNotIgnored) {
  check_head("mean", 0);
  check_head("mean", 50);
  check_head("mean", 192);
  check_head("sum", 50);
}

TEST(ClassifierChunksPass, UntiedHeadChunksToo) {
  // W stored (C, V): dX = G W^T, dW = X^T G; i32 labels, dloss an input.
  Graph untied = parse(
      "graph @g(%x: f32[192,8] data, %w: f32[8,40] param, %t: i32[192] data, %d: f32[] data) {\n"
      "  %l = matmul(%x, %w) : f32[192,40]\n"
      "  %loss = cross_entropy(%l, %t) : f32[]\n"
      "  %g = cross_entropy_grad(%l, %t, %d) : f32[192,40]\n"
      "  %dx = matmul(%g, %w) {transpose_b=true} : f32[192,8]\n"
      "  %dw = matmul(%x, %g) {transpose_a=true} : f32[8,40]\n"
      "  return %loss, %dx, %dw\n"
      "}\n");
  ClassifierPass().run(untied);
  Graph with = untied;
  ASSERT_TRUE(ClassifierChunksPass(64 * 40 * 4).run(with));
  verify(with);
  EXPECT_EQ(classifier_rows(with), (std::vector<int64_t>{64, 64, 64}));
  const std::vector<Tensor> inputs = random_inputs(untied, 9, 0, 40);
  const std::vector<Tensor> want = run_step(untied, inputs), got = run_step(with, inputs);
  EXPECT_NEAR(got[0].get(0), want[0].get(0), 1e-5 * std::abs(want[0].get(0)));
  EXPECT_TRUE(relatively_close({got[1], got[2]}, {want[1], want[2]}, 1e-5));
}

TEST(ClassifierChunksPass, HeadsItCannotRewriteAreLeftAlone) {
  auto unchanged = [](const std::string& text) {
    Graph g = parse(text);
    ClassifierPass().run(g);
    const std::string before = print(g);
    EXPECT_FALSE(ClassifierChunksPass(64 * 40 * 4).run(g)) << text;
    EXPECT_EQ(print(g), before);
  };
  const std::string header =
      "graph @g(%x: f32[192,8] data, %w: f32[40,8] param, %t: i64[192] data, %d: f32[] data) {\n"
      "  %l = matmul(%x, %w) {transpose_b=true} : f32[192,40]\n";
  // Per-row losses ("none").
  unchanged(header +
            "  %loss = cross_entropy(%l, %t) {reduction=\"none\"} : f32[192]\n"
            "  %d2 = full() {dtype=f32, shape=[192], value=1.0} : f32[192]\n"
            "  %g = cross_entropy_grad(%l, %t, %d2) {reduction=\"none\"} : f32[192,40]\n"
            "  %dx = matmul(%g, %w) : f32[192,8]\n"
            "  return %loss, %dx\n"
            "}\n");
  // The logits are also a graph output.
  unchanged(header +
            "  %loss = cross_entropy(%l, %t) : f32[]\n"
            "  %g = cross_entropy_grad(%l, %t, %d) : f32[192,40]\n"
            "  %dx = matmul(%g, %w) : f32[192,8]\n"
            "  return %loss, %dx, %l\n"
            "}\n");
  // The gradient has a reader that is not a product (an elementwise op needs all of it).
  unchanged(header +
            "  %loss = cross_entropy(%l, %t) : f32[]\n"
            "  %g = cross_entropy_grad(%l, %t, %d) : f32[192,40]\n"
            "  %dx = matmul(%g, %w) : f32[192,8]\n"
            "  %s = sum(%g) {axes=[0]} : f32[40]\n"
            "  return %loss, %dx, %s\n"
            "}\n");
  // A contraction with something that is not the head's input.
  unchanged(header +
            "  %loss = cross_entropy(%l, %t) : f32[]\n"
            "  %g = cross_entropy_grad(%l, %t, %d) : f32[192,40]\n"
            "  %dw = matmul(%g, %l) {transpose_a=true} : f32[40,40]\n"
            "  return %loss, %dw\n"
            "}\n");
  // Logits that fit the cap.
  Graph g = head("mean");
  EXPECT_FALSE(ClassifierChunksPass(192 * 40 * 4).run(g));
}

// The point of the pass: the planned arena of a step whose logits dominate it.
TEST(ClassifierChunksPass, ThePlannedArenaShrinks) {
  Graph g = parse(
      "graph @g(%x: f32[1024,8] data, %w: f32[4096,8] param, %t: i64[1024] data) {\n"
      "  %l = matmul(%x, %w) {transpose_b=true} : f32[1024,4096]\n"
      "  %loss = cross_entropy(%l, %t) : f32[]\n"
      "  %d = full() {dtype=f32, shape=[], value=1.0} : f32[]\n"
      "  %g = cross_entropy_grad(%l, %t, %d) : f32[1024,4096]\n"
      "  %dx = matmul(%g, %w) : f32[1024,8]\n"
      "  %dw = matmul(%g, %x) {transpose_a=true} : f32[4096,8]\n"
      "  return %loss, %dx, %dw\n"
      "}\n");
  ClassifierPass().run(g);
  Graph chunked = g;
  ASSERT_TRUE(ClassifierChunksPass(4 << 20).run(chunked));  // 16 MiB of logits in 4 chunks
  DeadCodeElimination().run(chunked);
  EXPECT_EQ(classifier_rows(chunked).size(), 4u);
  SchedulePass().run(g);
  SchedulePass().run(chunked);
  const size_t whole = plan_memory(g).arena_bytes, chunks = plan_memory(chunked).arena_bytes;
  // Logits (and their gradient, written over them by the kernel but planned apart here): 16 MiB
  // each whole, 4 MiB each chunked; the weight gradient's f32 partial sums add 128 KiB.
  EXPECT_GE(whole, size_t{16} << 20);
  EXPECT_LT(chunks, whole / 2);
}

}  // namespace
}  // namespace kiln

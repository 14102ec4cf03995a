// Rematerialization under a memory budget: no budget (or a budget already met) changes nothing;
// on MLP and GPT-2 training steps a budget between the smallest plan and the unremat'd peak is
// met and the steps are bit-identical to the ones without remat (dropout included); a budget
// below the smallest plan is a clear error naming it, and that budget then works; a GEMM is
// recomputed only when nothing cheaper is left; byte sizes parse.
#include "passes/remat.h"

#include <cstring>
#include <regex>

#include "analysis/cost_model.h"
#include "analysis/memory_plan.h"
#include "ir/text.h"
#include "models/models.h"
#include "passes/pipeline.h"
#include "runtime/executor.h"
#include "test_util.h"
#include "train/trainer.h"

namespace kiln {
namespace {

// A zoo model's training graph through the default pipeline up to (not including) schedule:
// what remat sees there.
Graph before_schedule(const Graph& forward) {
  OptimizerConfig config;
  config.grad_clip = 1.0;
  Graph g = build_training_graph(forward, config).graph;
  PassOptions options;
  options.disabled = {"schedule"};
  default_pipeline(options).run(g);
  return g;
}

Graph mlp_graph() { return before_schedule(models::mlp({256, 64, {128, 128}, 10})); }

size_t count_op(const Graph& g, Op op) {
  size_t n = 0;
  for (const Node& node : g.nodes) n += node.op == op ? 1 : 0;
  return n;
}

// The smallest budget the error names, in bytes; fails the test when it does not throw.
size_t smallest_budget(const Graph& graph) {
  Graph g = graph;
  try {
    Rematerialize(size_t{1}).run(g);
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("memory budget 1 B is too small for this step"), std::string::npos) << what;
    EXPECT_NE(what.find("without remat: "), std::string::npos) << what;
    std::smatch m;
    EXPECT_TRUE(std::regex_search(what, m, std::regex(R"(needs [0-9.]+ [KMG]?i?B \((\d+) bytes\))"))) << what;
    return m.size() > 1 ? std::stoull(m[1].str()) : 0;
  }
  ADD_FAILURE() << "a 1-byte budget did not throw";
  return 0;
}

TEST(Remat, WithoutBudgetOrWithinItTheGraphIsUnchanged) {
  Graph g = mlp_graph();
  const std::string before = print(g);
  Rematerialize none(std::nullopt);
  EXPECT_FALSE(none.run(g));
  EXPECT_EQ(print(g), before);
  const size_t peak = planned_peak_bytes(g);
  Rematerialize roomy(peak);
  EXPECT_FALSE(roomy.run(g));
  EXPECT_EQ(print(g), before);
  EXPECT_EQ(roomy.stats().peak_before, peak);
  // Not in the pipeline without a budget; in it, before schedule, with one.
  std::vector<std::string> names = default_pipeline().names();
  EXPECT_EQ(std::count(names.begin(), names.end(), "remat"), 0);
  PassOptions options;
  options.memory_budget = size_t{1} << 20;
  names = default_pipeline(options).names();
  const auto remat = std::find(names.begin(), names.end(), "remat");
  ASSERT_NE(remat, names.end());
  ASSERT_NE(remat + 1, names.end());
  EXPECT_EQ(*(remat + 1), "schedule");
}

// Losses of two steps, then every param and state tensor, from a Trainer with these options.
std::vector<Tensor> train_two_steps(const Graph& forward, const std::vector<Tensor>& init,
                                    const std::vector<std::vector<Tensor>>& batches,
                                    PassOptions passes, Graph* program = nullptr) {
  OptimizerConfig config;
  config.grad_clip = 1.0;
  train::Trainer trainer(forward, config, init, {}, std::move(passes));
  std::vector<Tensor> out;
  for (const auto& batch : batches)
    for (const Tensor& t : trainer.step(batch)) out.push_back(t.clone());
  for (const auto& [name, t] : trainer.named_tensors()) out.push_back(t.clone());
  if (program) *program = trainer.program().graph;
  return out;
}

void expect_bit_identical(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].type(), b[i].type()) << "result " << i;
    EXPECT_EQ(std::memcmp(a[i].raw(), b[i].raw(), a[i].bytes()), 0) << "result " << i << " differs";
  }
}

// The training graph after the default pipeline without remat, its peak, and the smallest
// budget remat finds; then a budget halfway between runs: met, and bit-identical steps.
void check_model(const Graph& forward, const std::vector<Tensor>& init,
                 const std::vector<std::vector<Tensor>>& batches, const char* what) {
  SCOPED_TRACE(what);
  Graph plain;
  std::vector<Tensor> expected = train_two_steps(forward, init, batches, {}, &plain);
  const size_t peak = plan_memory(plain).arena_bytes;
  // The graph as remat sees it: the pipeline up to schedule (remat's own measure agrees).
  const Graph unscheduled = before_schedule(forward);
  EXPECT_EQ(planned_peak_bytes(unscheduled), peak);

  const size_t smallest = smallest_budget(unscheduled);
  ASSERT_GT(smallest, 0u);
  ASSERT_LT(smallest, peak) << "remat should find something to recompute";
  fmt::print("{}: peak without remat {} ({} bytes), smallest plan {} ({} bytes)\n", what,
             format_bytes(peak), peak, format_bytes(smallest), smallest);

  for (size_t budget : {(peak + smallest) / 2, smallest}) {
    PassOptions options;
    options.memory_budget = budget;
    Graph remat;
    std::vector<Tensor> got = train_two_steps(forward, init, batches, options, &remat);
    EXPECT_LE(plan_memory(remat).arena_bytes, budget) << "budget " << budget;
    EXPECT_GT(remat.nodes.size(), plain.nodes.size()) << "budget " << budget;
    expect_bit_identical(got, expected);
    Graph g = unscheduled;
    Rematerialize pass(budget);
    EXPECT_TRUE(pass.run(g));
    fmt::print("  budget {}: planned {}, {} values recomputed, {} nodes cloned ({} heavy), "
               "{:.3g} FLOPs added\n",
               format_bytes(budget), format_bytes(pass.stats().peak_after),
               pass.stats().values_recomputed, pass.stats().nodes_cloned,
               pass.stats().heavy_nodes_cloned, pass.stats().flops_added);
  }
}

TEST(Remat, MlpMeetsBudgetsWithBitIdenticalSteps) {
  Graph g = models::mlp({256, 64, {128, 128}, 10});
  std::vector<std::vector<Tensor>> batches;
  for (int s = 0; s < 2; ++s)
    batches.push_back({testing::rand(DType::kF32, {256, 64}, 10 + s),
                       testing::rand(DType::kI64, {256}, 20 + s, 0, 10)});
  check_model(g, models::init_params_fan_in(g, 1), batches, "mlp 64-128-128-10, batch 256");
}

TEST(Remat, Gpt2TinyWithDropoutMeetsBudgetsWithBitIdenticalSteps) {
  models::GptConfig config = models::gpt_config("gpt2-tiny");
  config.dropout = 0.1;  // the dropout masks are recomputed too: they must match bit for bit
  Graph g = models::gpt(config);
  std::vector<std::vector<Tensor>> batches;
  for (int s = 0; s < 2; ++s)
    batches.push_back({testing::rand(DType::kI64, {config.batch, config.seq}, 30 + s, 0, config.vocab),
                       testing::rand(DType::kI64, {config.batch, config.seq}, 40 + s, 0, config.vocab)});
  check_model(g, models::init_params(g, 2, config.layers), batches, "gpt2-tiny + dropout 0.1");
}

TEST(Remat, TooSmallBudgetNamesTheSmallestThatWorks) {
  Graph g = mlp_graph();
  const size_t peak = planned_peak_bytes(g);
  const size_t smallest = smallest_budget(g);
  ASSERT_LT(smallest, peak);
  Graph tight = g;
  try {
    Rematerialize(smallest - 64).run(tight);
    ADD_FAILURE() << "no error below the smallest plan";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(fmt::format("memory budget {} is too small", format_bytes(smallest - 64))),
              std::string::npos) << what;
    EXPECT_NE(what.find(fmt::format("needs {} ({} bytes)", format_bytes(smallest), smallest)),
              std::string::npos) << what;
    EXPECT_NE(what.find(fmt::format("(without remat: {})", format_bytes(peak))), std::string::npos)
        << what;
  }
  Graph exact = g;
  Rematerialize pass(smallest);
  EXPECT_TRUE(pass.run(exact));
  EXPECT_EQ(pass.stats().peak_after, smallest);
  EXPECT_EQ(planned_peak_bytes(exact), smallest);
}

// %m (a GEMM) and %e (an exp of the input) are read early (by %s) and late (by %late, %late2,
// which wait for the chain's %r), so both are live across the chain of 2 KiB values %s..%t3.
// 16x16 f32 values are 1 KiB; %r and %q are graph outputs, outside the arena.
const char* kTwoCandidates = R"(graph @two(%x: f32[16,16] data, %w: f32[16,16] param) {
  %m = matmul(%x, %w) : f32[16,16]
  %e = exp(%x) : f32[16,16]
  %s = concat(%m, %e) {axis=0} : f32[32,16]
  %t1 = tanh(%s) : f32[32,16]
  %t2 = neg(%t1) : f32[32,16]
  %t3 = sigmoid(%t2) : f32[32,16]
  %r = sum(%t3) {axes=[0], keepdims=true} : f32[1,16]
  %late = mul(%m, %r) : f32[16,16]
  %late2 = mul(%late, %e) : f32[16,16]
  %q = sum(%late2) : f32[]
  return %r, %q
}
)";

TEST(Remat, GemmIsRecomputedOnlyWhenNothingCheaperIsLeft) {
  Graph g = parse(kTwoCandidates);
  // By hand (the schedule pass keeps this order): at %t1, %m %e (1 KiB each) %s %t1 (2 KiB each)
  // are live: 6 KiB, the peak (likewise at %t2, %t3). Placement: s 0, t1 2048, t2 0, t3 2048,
  // m 4096, e 5120, late 0, late2 1024: 6 KiB.
  EXPECT_EQ(planned_peak_bytes(g), 6144u);
  // 5 KiB: recomputing %e (256 exps, from the input) before %late2 suffices; the GEMM stays.
  // Then at %t1: m s t1 = 5 KiB; placement s 0, t1 2048, t2 0, t3 2048, m 4096, e 2048 (dies at
  // %s), late 0, e' 1024, late2 2048.
  Graph one = g;
  Rematerialize light(5120);
  EXPECT_TRUE(light.run(one));
  EXPECT_EQ(count_op(one, Op::kExp), 2u);
  EXPECT_EQ(count_op(one, Op::kMatmul), 1u);
  EXPECT_EQ(light.stats().heavy_nodes_cloned, 0);
  EXPECT_EQ(light.stats().flops_added, 256.0);
  EXPECT_EQ(planned_peak_bytes(one), 5120u);
  // 4 KiB needs both: the GEMM is recomputed too (2*16^3 FLOPs), as the last resort. At %s,
  // m e s = 4 KiB remain, which nothing can lower: the smallest plan.
  Graph two = g;
  Rematerialize heavy(4096);
  EXPECT_TRUE(heavy.run(two));
  EXPECT_EQ(count_op(two, Op::kExp), 2u);
  EXPECT_EQ(count_op(two, Op::kMatmul), 2u);
  EXPECT_EQ(heavy.stats().heavy_nodes_cloned, 1);
  EXPECT_EQ(heavy.stats().flops_added, 256.0 + 8192.0);
  EXPECT_EQ(planned_peak_bytes(two), 4096u);
  EXPECT_EQ(smallest_budget(g), 4096u);
  // Same results, bit for bit.
  std::vector<Tensor> inputs = {testing::rand(DType::kF32, {16, 16}, 1),
                                testing::rand(DType::kF32, {16, 16}, 2)};
  std::vector<Tensor> base = Executor(g).run(inputs);
  for (const Graph* r : {&one, &two}) {
    std::vector<Tensor> got = Executor(*r).run(inputs);
    expect_bit_identical(got, base);
  }
}

TEST(Remat, FlopEstimates) {
  Graph g = parse(kTwoCandidates);
  EXPECT_EQ(node_flops(g, g.nodes[0]), 2.0 * 16 * 16 * 16);  // matmul: 2MNK
  EXPECT_EQ(node_flops(g, g.nodes[1]), 256.0);               // exp: one per element
  EXPECT_EQ(node_flops(g, g.nodes[2]), 512.0);               // concat: one per element
  EXPECT_EQ(node_flops(g, g.nodes[6]), 5.0 * 512);           // sum: a few per input element
  EXPECT_TRUE(is_heavy_op(Op::kMatmul));
  EXPECT_TRUE(is_heavy_op(Op::kAttention));
  EXPECT_FALSE(is_heavy_op(Op::kGelu));
}

TEST(Remat, ParsesByteSizes) {
  EXPECT_EQ(parse_byte_size("4096"), 4096u);
  EXPECT_EQ(parse_byte_size("512MiB"), 512u << 20);
  EXPECT_EQ(parse_byte_size("2GiB"), size_t{2} << 30);
  EXPECT_EQ(parse_byte_size("2gib"), size_t{2} << 30);
  EXPECT_EQ(parse_byte_size(" 100 KiB "), 102400u);
  EXPECT_EQ(parse_byte_size("1.5GB"), 1500000000u);
  EXPECT_EQ(parse_byte_size("0.5MiB"), 524288u);
  EXPECT_EQ(parse_byte_size("64B"), 64u);
  for (const char* bad : {"", "MiB", "abc", "12XB", "1.5", "0", "-5", "1.2.3MiB", "5 M iB"}) {
    try {
      parse_byte_size(bad);
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("memory size '{}'", bad)), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace kiln

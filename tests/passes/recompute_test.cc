// The recompute pass (passes/recompute.h): on training steps it lowers the planned peak where
// SwiGLU's activations can be recomputed, never raises it elsewhere, and leaves graphs without a
// backward alone. (That the steps compute the same bits with it on and off is the pass matrix's
// check, tests/train/pass_matrix_test.cc.)
#include <gtest/gtest.h>

#include "analysis/memory_plan.h"
#include "compile/compile_step.h"
#include "models/models.h"
#include "passes/recompute.h"

namespace kiln {
namespace {

struct Compiled {
  size_t peak = 0;  // the live peak of the plan `kiln compile --report` shows (plan_step_memory)
  std::vector<std::string> notes;
};

Compiled compile(const Graph& forward, bool recompute, const std::string& amp = "bf16") {
  CompileOptions options;
  options.optimizer.amp = amp;
  options.bind_kernels = false;
  options.executor.device = Device::kCuda;  // the pipeline a GPU run gets; no GPU needed
  if (!recompute) options.passes.disabled.insert("recompute");
  CompiledStep step = compile_step(forward, options);
  Compiled out{plan_step_memory(step.program.graph).live_peak_bytes, {}};
  for (const PassRecord& r : step.pass_records)
    if (r.name == "recompute") out.notes = r.notes;
  return out;
}

TEST(Recompute, SwigluActivationsLeaveTheForwardPeak) {
  // Two blocks, SwiGLU hidden 96 over d 32, 8 x 16 tokens: each block keeps silu(x w1) and its
  // product with x w3 (bf16 [8,16,96], 24 KiB each) from the forward without the pass.
  models::LlamaConfig c{8, 16, 64, 2, 4, 2, 32, 96};
  const Graph forward = models::llama(c);
  const Compiled with = compile(forward, true), without = compile(forward, false);
  ASSERT_EQ(with.notes.size(), 1u);
  EXPECT_NE(with.notes[0].find("2 mul, 2 silu"), std::string::npos) << with.notes[0];
  EXPECT_LT(with.peak, without.peak);
  // At least one such value per block no longer lives across the peak.
  EXPECT_LE(with.peak + 2 * 8 * 16 * 96 * 2, without.peak);
}

TEST(Recompute, NeverRaisesThePeak) {
  const Graph gpt = models::gpt({4, 16, 64, 2, 4, 32});
  const Graph mlp = models::mlp({8, 12, {10}, 4});
  for (const Graph* g : {&gpt, &mlp})
    for (const char* amp : {"off", "bf16"}) {
      SCOPED_TRACE(amp);
      EXPECT_LE(compile(*g, true, amp).peak, compile(*g, false, amp).peak);
    }
}

TEST(Recompute, AForwardGraphHasNothingToRecompute) {
  Graph g = models::llama(models::LlamaConfig{2, 8, 16, 1, 4, 2, 16, 24});
  RecomputePass pass;
  EXPECT_FALSE(pass.run(g));
  EXPECT_TRUE(pass.notes().empty());
}

}  // namespace
}  // namespace kiln

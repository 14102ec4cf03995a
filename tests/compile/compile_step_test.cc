// compile_step: a training step is the training graph through the default pipeline, bound to
// kernels; a forward step is the graph as given, under mixed precision, through the same
// pipeline, and computes what the raw graph computes; the program's input roles, the phases, the
// options (no binding, disabled passes, printing) and the errors.
#include "compile/compile_step.h"

#include <gtest/gtest.h>

#include "ir/text.h"
#include "models/models.h"
#include "passes/pipeline.h"
#include "passes/simplify/simplify_test_util.h"
#include "test_util.h"

namespace kiln {
namespace {

Graph small_mlp() { return models::mlp(models::MlpConfig{4, 12, {16}, 5}); }

std::vector<std::string> phase_names(const CompiledStep& step) {
  std::vector<std::string> names;
  for (const auto& [name, seconds] : step.phase_seconds) {
    names.push_back(name);
    EXPECT_GE(seconds, 0) << name;
  }
  return names;
}

TEST(CompileStep, TrainingStepIsTheTrainingGraphThroughThePipeline) {
  const Graph forward = small_mlp();
  CompileOptions options;
  options.optimizer.name = "sgd";
  const CompiledStep step = compile_step(forward, options);

  StepProgram expected = build_training_graph(forward, options.optimizer);
  const size_t nodes_before = expected.graph.nodes.size();
  std::vector<PassRecord> records = default_pipeline().run(expected.graph);
  EXPECT_EQ(print(step.program.graph), print(expected.graph));
  EXPECT_EQ(step.program.param_inputs, expected.param_inputs);
  EXPECT_EQ(step.program.state_inputs, expected.state_inputs);
  EXPECT_EQ(step.program.data_inputs, expected.data_inputs);
  EXPECT_EQ(step.program.lr_input, expected.lr_input);
  EXPECT_EQ(step.nodes_before_passes, nodes_before);
  ASSERT_EQ(step.pass_records.size(), records.size());
  for (size_t i = 0; i < records.size(); ++i) EXPECT_EQ(step.pass_records[i].name, records[i].name);
  ASSERT_NE(step.executor, nullptr);
  EXPECT_EQ(print(step.executor->graph()), print(step.program.graph));
  EXPECT_EQ(phase_names(step),
            (std::vector<std::string>{"forward passes", "training graph", "passes", "kernel choice",
                                      "kernels prepared", "memory plan"}));
  // The forward pipeline ran on the forward graph first (an MLP of kiln's own: nothing to change).
  ASSERT_EQ(step.forward_pass_records.size(), 1u);
  EXPECT_EQ(step.forward_pass_records[0].name, "recognize");
  EXPECT_TRUE(step.forward_pass_records[0].ran);
  EXPECT_FALSE(step.forward_pass_records[0].changed);
}

TEST(CompileStep, ForwardStepComputesWhatTheRawGraphComputes) {
  // Under the reference dialect fusion changes no bit (a fused node runs its body's reference
  // kernels), so the compiled forward and the raw forward agree exactly.
  for (const char* model : {"mlp", "gpt2-tiny"}) {
    SCOPED_TRACE(model);
    const Graph forward = models::by_name(model, 2, 8);
    CompileOptions options;
    options.kind = StepKind::kForward;
    options.executor.dialects = {"reference"};
    const CompiledStep step = compile_step(forward, options);
    EXPECT_LT(step.program.graph.nodes.size(), forward.nodes.size());  // the pipeline did run
    EXPECT_EQ(step.program.lr_input, -1);
    EXPECT_EQ(phase_names(step).at(1), "forward graph");
    const std::vector<Tensor> inputs = testing::random_inputs(forward, 7, 0, 10);
    const std::vector<Tensor> compiled = step.executor->run(inputs);
    EXPECT_EQ(compiled.size(), forward.outputs.size());
    EXPECT_TRUE(testing::bitwise_equal(compiled, testing::run_step(forward, inputs)));
  }
}

TEST(CompileStep, ForwardStepKeepsTheForwardInputsThatATrainingStepStartsWith) {
  // What lets a forward step bind the training step's params and state (trainer.h).
  const Graph forward = models::by_name("gpt2-tiny", 2, 8);
  CompileOptions training, forward_only;
  forward_only.kind = StepKind::kForward;
  training.bind_kernels = forward_only.bind_kernels = false;
  const CompiledStep train = compile_step(forward, training), eval = compile_step(forward, forward_only);
  ASSERT_EQ(eval.program.graph.inputs.size(), forward.inputs.size());
  ASSERT_GT(train.program.graph.inputs.size(), forward.inputs.size());
  for (size_t i = 0; i < forward.inputs.size(); ++i) {
    const Value& f = forward.value(forward.inputs[i].value);
    for (const Graph* g : {&eval.program.graph, &train.program.graph}) {
      EXPECT_EQ(g->inputs[i].role, forward.inputs[i].role) << i;
      EXPECT_EQ(g->value(g->inputs[i].value).name, f.name) << i;
      EXPECT_EQ(g->type(g->inputs[i].value), f.type) << i;
    }
  }
  EXPECT_EQ(eval.program.param_inputs, train.program.param_inputs);
  EXPECT_EQ(eval.program.data_inputs, train.program.data_inputs);
  // The forward's state (a dropout counter, where the model has one) leads the training step's.
  ASSERT_LE(eval.program.state_inputs.size(), train.program.state_inputs.size());
  for (size_t i = 0; i < eval.program.state_inputs.size(); ++i)
    EXPECT_EQ(eval.program.state_inputs[i], train.program.state_inputs[i]);
}

TEST(CompileStep, ForwardStepRunsUnderMixedPrecision) {
  const Graph forward = small_mlp();
  CompileOptions options;
  options.kind = StepKind::kForward;
  options.optimizer.amp = "bf16";
  options.bind_kernels = false;
  const std::string text = print(compile_step(forward, options).program.graph);
  EXPECT_NE(text.find("bf16"), std::string::npos) << text;
  options.optimizer.amp = "off";
  EXPECT_EQ(print(compile_step(forward, options).program.graph).find("bf16"), std::string::npos);
}

TEST(CompileStep, WithoutBindingThereIsNoExecutorAndNoGpuIsNeeded) {
  CompileOptions options;
  options.bind_kernels = false;
  options.executor.device = Device::kCuda;  // the pipeline for a GPU, on any machine
  const CompiledStep step = compile_step(models::by_name("gpt2-tiny", 2, 8), options);
  EXPECT_EQ(step.executor, nullptr);
  EXPECT_EQ(phase_names(step), (std::vector<std::string>{"forward passes", "training graph", "passes"}));
  // The CUDA pipeline: training-rewrites off, ones-column on.
  bool training_rewrites_ran = true, ones_column = false;
  for (const PassRecord& r : step.pass_records) {
    if (r.name == "training-rewrites") training_rewrites_ran = r.ran;
    ones_column = ones_column || r.name == "ones-column";
  }
  EXPECT_FALSE(training_rewrites_ran);
  EXPECT_TRUE(ones_column);
}

TEST(CompileStep, PassOptionsReachThePipeline) {
  const Graph forward = small_mlp();
  CompileOptions options;
  options.bind_kernels = false;
  options.passes.disabled = {"all"};
  const CompiledStep untouched = compile_step(forward, options);
  EXPECT_EQ(print(untouched.program.graph), print(build_training_graph(forward, options.optimizer).graph));
  for (const PassRecord& r : untouched.pass_records) EXPECT_FALSE(r.ran) << r.name;
  for (const PassRecord& r : untouched.forward_pass_records) EXPECT_FALSE(r.ran) << r.name;

  options.passes.disabled.clear();
  std::vector<std::string> printed;
  options.passes.print_after = {"fusion", "recognize"};  // one of each pipeline
  options.passes.printer = [&](const std::string& pass, const Graph&) { printed.push_back(pass); };
  compile_step(forward, options);
  EXPECT_EQ(printed, (std::vector<std::string>{"recognize", "fusion"}));
}

TEST(CompileStep, ErrorsNameTheProblem) {
  Graph no_params = parse("graph @g(%x: f32[3] data) {\n  %0 = sum(%x) : f32[]\n  return %0\n}\n");
  EXPECT_NE(testing::error_of([&] { compile_step(no_params, {}); }).find("no param inputs"), std::string::npos);
  // The same graph runs as a forward step.
  CompileOptions forward_only;
  forward_only.kind = StepKind::kForward;
  EXPECT_NE(compile_step(no_params, forward_only).executor, nullptr);
  CompileOptions bad_pass;
  bad_pass.passes.disabled = {"no-such-pass"};
  EXPECT_NE(testing::error_of([&] { compile_step(small_mlp(), bad_pass); }).find("unknown pass 'no-such-pass'"),
            std::string::npos);
}

}  // namespace
}  // namespace kiln
